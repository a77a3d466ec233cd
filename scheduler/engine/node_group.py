"""A DEP instance spread over several engine processes (nodes), each hosting some of its ranks.

Within a node the ranks meet in the in-process barrier of ``LocalGroup``; the last local rank
to arrive carries the node's values into the recursive-doubling all-reduce over TCP with the
other nodes (``lockstep.transports.collective_tcp``), and everyone gets the result. Ranks are
numbered node by node: node i hosts ranks [i * local, (i + 1) * local), and its runtimes join
one torch.distributed group (the expert all-to-alls) at the shared ``dist_init`` address.

Waking: a node whose ranks are all idle watches its links. A request reaching another node
makes that node start a round, and the round's first frame arriving here is the wake-up (the
schedule reaches every node, directly or through a woken peer), so no rank ever waits in
the all-reduce for a node parked on its mailbox. The watch never reads: it waits for the
sockets to turn readable and leaves the bytes to the all-reduce.

Failure ends the instance: a dead peer node shows as a closed connection (``RankFailed``
naming its first rank), a dead local runtime closes this node's links so the peers learn at
once, and every node then fails its requests and stops with that error; restarting the set
is the job of whatever supervises the node processes.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

import numpy as np
import trio

from lockstep.policy.allreduce import RankFailed
from lockstep.transports.collective_tcp import TcpCollective, open_listener

from .group import LocalGroup


class InstanceLost(RuntimeError):
    """A node of this DEP instance failed; the instance cannot go on without it."""


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"node address must look like HOST:PORT, got {text!r}")
    return host, int(port)


class NodeGroup(LocalGroup):
    def __init__(self, local_size: int, node: int, addresses: Sequence[tuple[str, int]], dist_init: str):
        super().__init__(local_size, lambda: dist_init)
        self.node, self.nodes = node, len(addresses)
        self.addresses = list(addresses)
        self.link: TcpCollective | None = None
        self._idle = 0  # local ranks parked in wait_woken
        self._all_idle = trio.Event()
        self._watch: trio.CancelScope | None = None

    def global_rank(self, local: int) -> int:
        return self.node * self.size + local

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Connect to the other nodes, then watch the links while every local rank idles."""
        listener, _ = await open_listener(*self.addresses[self.node])
        try:
            self.link = await TcpCollective.connect(self.node, self.nodes, self.addresses, listener)
        finally:
            await listener.aclose()
        task_status.started()
        try:
            while True:
                await self._all_idle.wait()
                with trio.CancelScope() as self._watch:
                    await self._any_readable()
                    if self._idle == self.size:
                        self.wake()  # a peer node began a round
                self._watch = None
                await trio.sleep(0)
        finally:
            self.link.close()

    async def _any_readable(self) -> None:
        readers = self.link._readers or {}
        if any(r._buf for r in readers.values()):
            return  # a frame already read ahead
        async with trio.open_nursery() as nursery:
            async def one(sock):
                await trio.lowlevel.wait_readable(sock)
                nursery.cancel_scope.cancel()
            for r in readers.values():
                nursery.start_soon(one, r.stream.socket)

    # -- the LocalGroup interface, across nodes -------------------------------------------------
    async def _reduce(self, local: np.ndarray) -> np.ndarray:
        """This node's ranks' maximum, all-reduced with the other nodes' over TCP."""
        try:
            return await self.link.allreduce_async(local, "max")
        except RankFailed as e:
            self.fail(InstanceLost(f"DEP node {self.node}: node(s) [{e.rank}] gone ({e})"))
            await trio.sleep_forever()  # cancel_on_failure takes every local rank down

    def wake(self) -> None:
        if self._watch is not None:
            self._watch.cancel()  # stop watching before any rank reads the links
        super().wake()

    async def wait_woken(self, seen: int) -> None:
        self._idle += 1
        if self._idle == self.size:
            self._all_idle.set()
        try:
            await super().wait_woken(seen)
        finally:
            self._idle -= 1
            if self._all_idle.is_set():
                self._all_idle = trio.Event()
                if self._watch is not None:
                    self._watch.cancel()

    def fail(self, error: BaseException) -> None:
        if self.failure is None and self.link is not None:
            gone = self._closed_peers()
            if gone and not isinstance(error, InstanceLost):  # say which node, not the symptom
                error = InstanceLost(f"DEP node {self.node}: node(s) {gone} gone (link closed); here: "
                                     f"{str(error).splitlines()[0]}")
            super().fail(error)
            self.link.close()  # the peers see EOF now, not at their next timeout
        else:
            super().fail(error)

    def _closed_peers(self) -> list[int]:
        """Peer nodes whose link has reached EOF (they died): a peek, nothing consumed."""
        out = []
        for node, r in (self.link._readers or {}).items():
            try:
                with socket.fromfd(r.stream.socket.fileno(), socket.AF_INET, socket.SOCK_STREAM) as dup:
                    if dup.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                        out.append(node)
            except BlockingIOError:
                pass
            except OSError:
                out.append(node)
        return sorted(out)

    def restarted(self) -> None:
        raise InstanceLost(f"the DEP instance lost a node and stops: {self.failure}") from self.failure

    @staticmethod
    def local_size(dep: int, nodes: int) -> int:
        if nodes < 1 or dep % nodes:
            raise ValueError(f"dep ({dep}) must split evenly over {nodes} nodes")
        return dep // nodes


