"""The DEP all-reduce over both links at once: shared memory among the nodes of each host, TCP
between hosts.

The nodes of a host form a shared-memory group (``collective_shm``); the first node of each
host also belongs to a TCP group of the hosts (``collective_tcp``). A call is three
all-reduces, all by recursive doubling:
  1. within each host, over shared memory: the host's result;
  2. between the hosts' first nodes, over TCP: the instance's result;
  3. within each host again: the first node contributes the result, the others the
     identity (0 for sum, INT64_MIN for max), so every node ends with it.
A host with one node skips 1 and 3; an instance on one host has no TCP group. Every node
makes the same calls on its links, so an idle node's watch (``wait_posted``) works as on
either link alone: a round reaches a host's first node over TCP, and its first message
over shared memory wakes the rest.

Errors name nodes (both groups are made with ``names``). A death seen on one link is
passed to the other (``notify_failed``), so a node on another host names the node that
died, not the first node of that host.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import trio

from lockstep.policy.allreduce import CollectiveError, CollectiveTimeout, Op, RankFailed, check_values

from . import shm_rendezvous
from .collective_shm import ShmCollective
from .collective_tcp import TcpCollective, open_listener

_IDENTITY = {"sum": 0, "max": np.iinfo(np.int64).min}


def host_groups(addresses: Sequence[tuple[str, int]]) -> list[list[int]]:
    """The nodes of each host (by host string), hosts in order of their first node."""
    groups: dict[str, list[int]] = {}
    for node, (host, _) in enumerate(addresses):
        groups.setdefault(host, []).append(node)
    return list(groups.values())


class MixedCollective:
    """Node ``node`` of an instance whose nodes sit at ``addresses``; make it with
    ``connect``."""

    def __init__(self, node: int, intra: ShmCollective | None, inter: TcpCollective | None):
        self.node, self.intra, self.inter = node, intra, inter
        self.leader = intra is None or intra.rank == 0

    @classmethod
    async def connect(cls, node: int, addresses: Sequence[tuple[str, int]], *,
                      connect_timeout_s: float = 60.0) -> MixedCollective:
        hosts = host_groups(addresses)
        mine = next(g for g in hosts if node in g)
        intra = inter = None
        try:
            if len(mine) > 1:
                first = addresses[mine[0]]
                intra = await shm_rendezvous.join(mine.index(node), len(mine),
                                                  shm_rendezvous.abstract_name(f"{first[0]}:{first[1]}"),
                                                  timeout_s=connect_timeout_s, names=mine)
            if len(hosts) > 1 and node == mine[0]:
                leaders = [g[0] for g in hosts]
                listener, _ = await open_listener(*addresses[node])
                try:
                    inter = await TcpCollective.connect(leaders.index(node), len(leaders),
                                                        [addresses[n] for n in leaders], listener,
                                                        connect_timeout_s=connect_timeout_s, names=leaders)
                finally:
                    listener.socket.close()  # no checkpoint: a made link is never dropped unclosed
        except CollectiveError as e:  # a rendezvous error names a rank of the host's group
            if intra is not None:
                intra.close()
            if isinstance(e, (RankFailed, CollectiveTimeout)) and intra is None and len(mine) > 1:
                rank = mine[e.rank] if 0 <= e.rank < len(mine) else e.rank
                raise type(e)(rank, e.why if isinstance(e, RankFailed) else e.timeout_s) from e
            raise
        except BaseException:
            if intra is not None:
                intra.close()
            raise
        return cls(node, intra, inter)

    async def allreduce_async(self, values: np.ndarray, op: Op) -> np.ndarray:
        acc = check_values(values, op).copy()
        try:
            if self.intra is not None:
                acc = await self.intra.allreduce_async(acc, op)
            if self.inter is not None:
                acc = await self._across(acc, op)
            if self.intra is not None:
                mine = acc if self.leader else np.full(len(acc), _IDENTITY[op], np.int64)
                acc = await self.intra.allreduce_async(mine, op)
        except RankFailed as e:
            if self.inter is not None:  # seen on shared memory: the other hosts learn who
                await self.inter.notify_failed(e)
            raise
        return acc

    async def _across(self, acc: np.ndarray, op: Op) -> np.ndarray:
        try:
            return await self.inter.allreduce_async(acc, op)
        except RankFailed as e:
            if self.intra is not None:  # seen over TCP: this host's other nodes learn who
                self.intra.notify_failed(e)
            raise

    async def wait_posted(self) -> None:
        """Return once a peer began this node's next call on either link (or one failed)."""
        links = [link for link in (self.intra, self.inter) if link is not None]
        if not links:  # an instance of one node: no peer ever begins a call
            await trio.sleep_forever()
        if len(links) == 1:
            return await links[0].wait_posted()
        async with trio.open_nursery() as nursery:
            async def one(link):
                await link.wait_posted()
                nursery.cancel_scope.cancel()
            for link in links:
                nursery.start_soon(one, link)

    def notice(self) -> int | None:
        """The node a peer on this host reported failed, if any (see ``ShmCollective``)."""
        return None if self.intra is None else self.intra.notice()

    def dead_peers(self) -> list[int]:
        """Nodes this node sees dead: on its host, and the other hosts' first nodes."""
        out = set()
        for link in (self.intra, self.inter):
            if link is not None:
                out.update(link.dead_peers())
        return sorted(out)

    def leave(self, dead: int | None = None) -> None:
        """Leave both links; ``dead``: the node whose death this node leaves for (named to
        the peers on both)."""
        for link in (self.intra, self.inter):
            if link is not None:
                link.leave(dead)

    def close(self) -> None:
        for link in (self.intra, self.inter):
            if link is not None:
                link.close()
