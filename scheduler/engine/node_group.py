"""A DEP instance spread over several engine processes (nodes), each hosting some of its ranks.

Within a node the ranks meet in the in-process barrier of ``LocalGroup``; the last local rank
to arrive carries the node's values into the recursive-doubling all-reduce with the other
nodes, and everyone gets the result. Ranks are numbered node by node: node i hosts ranks
[i * local, (i + 1) * local), and its runtimes join one torch.distributed group (the expert
all-to-alls) at the shared ``dist_init`` address.

Links (``node_link``): shared memory when every node is on this host
(``lockstep.transports.collective_shm``; the group's memfd and eventfds reach the nodes over
an abstract Unix socket named after node 0's address, ``shm_rendezvous``), TCP between
hosts (``lockstep.transports.collective_tcp``, listening at each node's address), or both
("mixed", ``lockstep.transports.collective_mixed``: shared memory among each host's nodes,
TCP between the hosts' first nodes). "auto" takes shared memory when the node addresses all
name one host (all loopback, or all the same host string), mixed when the nodes span hosts
and some host has several, TCP when every node is on a host of its own.

Waking: a node whose ranks are all idle watches its link (``wait_posted``). A request
reaching another node makes that node start a round, and the round's first message arriving
here is the wake-up (the schedule reaches every node, directly, through a woken peer, or by
a nudge from its fold partner), so no rank ever waits in the all-reduce for a node parked on
its mailbox. The watch never reads: it leaves the values to the all-reduce.

Failure restarts the instance: a dead peer node shows as a closed connection or a dead
process (``RankFailed`` naming it; outside the rounds a sentry polls the link for dead
peers, so ranks restarting their runtimes do not wait on one), a dead local runtime makes
this node leave the link so the peers learn at once (told whom to name), and every node then fails its requests, tears its ranks down and
joins a fresh link with all the nodes (a new epoch). A lost node rejoins once whatever
supervises the node processes restarts it; the others wait for it up to
``rejoin_timeout_s`` and then stop with the error (0: stop at once). A local runtime often dies
*because* a peer node died (its expert all-to-all lost the peer's runtime), a moment before
that node's own link shows it; so a local failure waits up to ``_NAME_GRACE_S`` for a dead
peer to show, and names it if one does.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

import numpy as np
import structlog
import trio

from lockstep.policy.allreduce import CollectiveError, CollectiveTimeout, RankFailed
from lockstep.transports import shm_rendezvous
from lockstep.transports.collective_mixed import MixedCollective
from lockstep.transports.collective_shm import ShmCollective
from lockstep.transports.collective_tcp import TcpCollective, open_listener

from .group import LocalGroup

log = structlog.get_logger("lockstep.nodes")
_NAME_GRACE_S = 1.0  # well inside the 5 s in which a lost node must be reported
_SENTRY_S = 0.25  # how often a node looks for dead peers outside the rounds


class InstanceLost(RuntimeError):
    """A node of this DEP instance failed; the instance cannot go on without it (until it
    rejoins). ``dead``: the nodes known dead, if any."""

    def __init__(self, message: str, dead: Sequence[int] = ()):
        super().__init__(message)
        self.dead = list(dead)


NODE_LINKS = ("auto", "tcp", "shm", "mixed")


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"node address must look like HOST:PORT, PORT in [1, 65535], got {text!r}")
    return host, int(port)


def choose_link(setting: str, addresses: Sequence[tuple[str, int]]) -> str:
    """The link ``setting`` ("auto", "tcp", "shm" or "mixed") means for nodes at ``addresses``."""
    if setting not in NODE_LINKS:
        raise ValueError(f"node_link must be one of {NODE_LINKS}, got {setting!r}")
    if setting != "auto":
        return setting
    hosts = [host for host, _ in addresses]
    if len(set(hosts)) == 1 or all(_is_loopback(h) for h in hosts):
        return "shm"
    return "mixed" if len(set(hosts)) < len(hosts) else "tcp"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: not resolved here (no I/O in a config decision)


class NodeGroup(LocalGroup):
    def __init__(self, local_size: int, node: int, addresses: Sequence[tuple[str, int]], dist_init: str,
                 link: str = "auto", rejoin_timeout_s: float = 60.0, join_timeout_s: float = 60.0,
                 digest: int = 0):
        super().__init__(local_size, lambda: dist_init)
        self.rejoin_timeout_s, self.join_timeout_s = rejoin_timeout_s, join_timeout_s
        self.digest = digest  # of the settings every node must share (``settings_digest``)
        self._rejoin = trio.Event()  # set by ``restarted``: the run task makes a fresh link
        self._rejoined = trio.Event()
        self._cause: BaseException | None = None  # the failure being recovered from
        self._lost: InstanceLost | None = None  # set when the nodes did not all rejoin
        self.node, self.nodes = node, len(addresses)
        self.addresses = list(addresses)
        self.link_kind = choose_link(link, self.addresses)
        self.link: TcpCollective | ShmCollective | MixedCollective | None = None
        self._idle = 0  # local ranks parked in wait_woken
        self._all_idle = trio.Event()
        self._watch: trio.CancelScope | None = None
        self._suspect: BaseException | None = None  # a local failure, not yet committed
        self._suspected = trio.Event()

    def global_rank(self, local: int) -> int:
        return self.node * self.size + local

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Connect to the other nodes, then watch the link while every local rank idles; after
        a failure, once every local rank is down, join a fresh link with all the nodes."""
        try:
            with trio.fail_after(self.join_timeout_s):
                self.link = await self._connect(timeout_s=self.join_timeout_s)
                await self._check_settings()
        except (CollectiveTimeout, trio.TooSlowError):
            self._drop_link()
            others = [f"{h}:{p}" for n, (h, p) in enumerate(self.addresses) if n != self.node]
            raise InstanceLost(f"DEP node {self.node}: the other nodes ({', '.join(others)}) did not all join within "
                               f"{self.join_timeout_s:g} s (--start-timeout): start every node with the same "
                               "--nodes, --node-addresses and --dist-init") from None
        except CollectiveError as e:  # a node that joined, then went (before the first step)
            self._drop_link()
            raise InstanceLost(f"DEP node {self.node}: a node left while the nodes joined: {e}") from None
        log.info("DEP nodes joined", node=self.node, nodes=self.nodes, link=self.link_kind)
        task_status.started()
        try:
            while True:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._judge)
                    nursery.start_soon(self._sentry)
                    nursery.start_soon(self._watch_while_idle)
                    await self._rejoin.wait()
                    nursery.cancel_scope.cancel()
                self._rejoin = trio.Event()
                self.link.close()
                await self._relink()
                self._rejoined.set()
                if self.link is None:  # the ranks stop with ``_lost``
                    return
        finally:
            if self.link is not None:
                self.link.close()

    def _drop_link(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None

    async def _check_settings(self) -> None:
        """Every node runs the same model, dtype, scheduler, ... (a node started with another
        dtype joined, then its runtimes crashed on every step): one round of the link carries
        each node's digest of them, and its negation, maximized."""
        got = await self.link.allreduce_async(np.array([self.digest, -self.digest], np.int64), "max")
        if int(got[0]) != -int(got[1]):
            self.link.close()
            self.link = None
            raise InstanceLost(f"DEP node {self.node}: the nodes were started with different settings (model, "
                               "runtime, device, dtype, dep, scheduler, KV cache, runtime options, ...): start "
                               "every node with the same flags or deployment, only --node-rank differing")

    async def _relink(self) -> None:
        """A fresh link with every node, or (none within the timeout) the instance's end. A
        join that fails early (a node dying again mid-rendezvous, a port not free yet) is
        tried again while time is left."""
        log.warning("DEP instance restarting: waiting for every node to rejoin", node=self.node,
                    epoch=self.epoch, timeout_s=self.rejoin_timeout_s)
        self.link = None
        deadline = trio.current_time() + self.rejoin_timeout_s
        last: BaseException | None = None
        while (left := deadline - trio.current_time()) > 0:
            try:
                with trio.fail_after(left):
                    self.link = await self._connect(timeout_s=left)
            except (CollectiveError, OSError, trio.TooSlowError) as e:
                last = e
                await trio.sleep(min(0.2, max(deadline - trio.current_time(), 0)))
                continue
            try:
                await self._check_settings()
            except InstanceLost as e:  # a node restarted with other settings: the instance stops
                self._lost = e
                return
            except CollectiveError as e:  # a node that rejoined went again: wait for it while time is left
                self.link.close()
                self.link, last = None, e
                continue
            log.info("DEP nodes joined", node=self.node, nodes=self.nodes, link=self.link_kind, epoch=self.epoch)
            return
        why = f" (last: {last})" if last is not None and not isinstance(last, trio.TooSlowError) else ""
        self._lost = InstanceLost(f"DEP node {self.node}: the nodes did not all rejoin within "
                                  f"{self.rejoin_timeout_s:g} s after {self._cause}{why}")

    async def _watch_while_idle(self) -> None:
        while True:
            await self._all_idle.wait()
            if self._idle < self.size:
                continue  # a rank left idle while we waited on the old event: no watch now
            # no checkpoint from the check to here, so a rank that leaves idle cancels the watch
            with trio.CancelScope() as self._watch:
                await self.link.wait_posted()
                if self._idle == self.size:
                    self.wake()  # a peer node began a round
            self._watch = None
            await trio.sleep(0)

    async def _sentry(self) -> None:
        """A peer node's death, noticed outside any round: while the ranks restart their
        runtimes (which would wait in their process group's rendezvous for the dead node's)
        or work without all-reducing. A round or an idle watch notices it first otherwise."""
        while self.failure is None:
            gone = self._dead() if self._suspect is None else []  # else: ``_judge`` names it
            if gone:
                self.fail(InstanceLost(f"DEP node {self.node}: node(s) {gone} gone (link closed)", gone))
                return
            await trio.sleep(_SENTRY_S)

    def _dead(self) -> list[int]:
        """The nodes to name as dead: the one a peer already named on the link (a node that
        left for another's death leaves too, and is not the one to name), else those whose
        link closed or whose process is gone."""
        named = self.link.notice()
        return [named] if named is not None else self.link.dead_peers()

    async def _judge(self) -> None:
        """Commit a local failure once a dead peer shows, or after the grace without one."""
        await self._suspected.wait()
        with trio.move_on_after(_NAME_GRACE_S):
            while self.failure is None and not self._dead():
                await trio.sleep(0.01)
        self._commit(self._suspect)

    async def _connect(self, timeout_s: float = 60.0) -> TcpCollective | ShmCollective | MixedCollective:
        if self.link_kind == "mixed":
            return await MixedCollective.connect(self.node, self.addresses, connect_timeout_s=timeout_s)
        if self.link_kind == "shm":
            host, port = self.addresses[0]
            return await shm_rendezvous.join(self.node, self.nodes, shm_rendezvous.abstract_name(f"{host}:{port}"),
                                             timeout_s=timeout_s)
        try:
            listener, _ = await open_listener(*self.addresses[self.node])
        except OSError as e:  # this node's own address: not one of this host's, or in use
            host, port = self.addresses[self.node]
            raise OSError(e.errno, f"node {self.node} cannot listen on {host}:{port}, its entry in --node-addresses "
                                   f"(engine.node_addresses): {e.strerror or e}") from None
        try:
            return await TcpCollective.connect(self.node, self.nodes, self.addresses, listener,
                                               connect_timeout_s=timeout_s)
        finally:
            listener.socket.close()  # no checkpoint here: a made link is never dropped unclosed

    # -- the LocalGroup interface, across nodes -------------------------------------------------
    async def _reduce(self, local: np.ndarray) -> np.ndarray:
        """This node's ranks' maximum, all-reduced with the other nodes' over the link."""
        try:
            return await self.link.allreduce_async(local, "max")
        except RankFailed as e:
            self.fail(InstanceLost(f"DEP node {self.node}: node(s) [{e.rank}] gone ({e})", [e.rank]))
        except CollectiveError as e:  # this node left the link (a local runtime died) mid-call
            self.fail(InstanceLost(f"DEP node {self.node}: {e}"))
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
        if self.failure is not None or self.link is None:
            return super().fail(error)
        if isinstance(error, InstanceLost) or self._dead():
            return self._commit(error)
        if self._suspect is None:  # a local cause: give a dying peer node a moment to show
            self._suspect = error
            self._suspected.set()

    def _commit(self, error: BaseException) -> None:
        if self.failure is not None:
            return
        gone = self._dead()
        if gone and not isinstance(error, InstanceLost):  # say which node, not the symptom
            error = InstanceLost(f"DEP node {self.node}: node(s) {gone} gone (link closed); here: "
                                 f"{str(error).splitlines()[0]}", gone)
        super().fail(error)
        dead = error.dead if isinstance(error, InstanceLost) else []
        # The peers learn now, not at their next timeout, and (across hosts) whom to name.
        self.link.leave(dead[0] if dead else None)

    def restarted(self) -> None:
        """Every local rank is down: a new epoch, and the run task joins a fresh link (or,
        with no rejoin timeout, the instance stops)."""
        self._cause = self.failure
        if self.rejoin_timeout_s <= 0:
            raise InstanceLost(f"the DEP instance lost a node and stops: {self.failure}") from self.failure
        super().restarted()
        self._suspect = None
        self._suspected = trio.Event()
        self._lost = None
        self._rejoined = trio.Event()
        self._rejoin.set()

    async def rejoined(self) -> None:
        await self._rejoined.wait()
        if self._lost is not None:  # a fresh error for each rank that raises it
            raise InstanceLost(str(self._lost), self._lost.dead) from self._cause

    @staticmethod
    def local_size(dep: int, nodes: int) -> int:
        if nodes < 1 or dep % nodes:
            raise ValueError(f"dep ({dep}) must split evenly over {nodes} nodes")
        return dep // nodes


