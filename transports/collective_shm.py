"""The DEP all-reduce between processes on one host, over one anonymous shared segment.

``lockstep.policy.allreduce`` says who talks to whom in which round; this module moves the
values. One ``memfd`` segment holds a mailbox per (sender, round, call parity); nothing is
named, so nothing leaks when a rank is SIGKILLed. A mailbox is a sequence number (the call
number that last wrote it), a word naming the length and op, and the values; a receiver
waits until the sequence number equals the current call, so no reset is needed between
calls. Two mailboxes per round (by call parity) suffice: every rank's result depends on every
rank's input, so no rank can start call c + 2 before all ranks finished call c.

Waiting spins, then ``sched_yield``s, then sleeps on the rank's eventfd (a sender writes it
only when the receiver's ``sleeping`` word is set). A slow peer is not a failure; a dead one
is: its pidfd becomes readable, the waiter raises ``RankFailed`` and writes the dead rank
into the segment's ``failed`` word and every eventfd, so the ranks waiting on live peers
fail too. Counters are read and written as aligned native u64s (one load or store each).
Store order is x86's (as in ``shm_ring``).

Errors name ranks by ``names`` (default: their ranks here; the segment's ``failed`` word
holds a name), so a group that is part of a larger one (one host's nodes in
``collective_mixed``) names the larger group's ranks, and ``notify_failed`` passes on a
death seen elsewhere.

An idle rank that must join a round a peer began (a DEP node parked on its mailbox) watches
with ``wait_posted``. Every rank is reached by the schedule's own messages except an extra
rank of a non-power-of-two group, whose partner only waits for it: so the partner first
``nudges`` it (writes the call number into its ``nudge`` word).
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import struct
import time

import attrs
import numpy as np
import trio

from lockstep.policy.allreduce import (OPS, CollectiveError, CollectiveTimeout, Op, RankFailed, Step, check_values,
                                       combine, schedule)

_MAGIC = 0x6C6F636B53544550
_LINE_WORDS = 8  # u64 words per 64-byte cache line
_MAGIC_W, _SIZE_W, _MAXV_W, _FAILED_W = 0, 1, 2, 3
_SPIN = range(32)  # loads between clock reads while spinning
_ASYNC_SPIN_S = 10e-6  # the most an async wait holds the trio loop before yielding to it
_CHECK_S = 1e-3  # how often a spinning rank looks at its peer's pidfd
# Growing naps while asleep. Without a store-load fence a sender can miss our ``sleeping``
# flag just as we set it (and we its message); the first short nap's re-check catches that.
# Later wake-ups come from the eventfd: messages, failures and closes all write it.
_SLEEP_MS = (1, 2, 5, 10, 20, 50)
_GROUP_HDR = struct.Struct("<QQ")  # size, max_values, sent ahead of the fds


def _lines(words: int) -> int:
    return -(-words // _LINE_WORDS) * _LINE_WORDS


@attrs.frozen
class _Layout:
    """Word offsets in the segment: header line, pids, gone flags, nudges, sleeping flags
    (a line each: written on every long wait), then the mailboxes (whole lines each)."""

    size: int
    max_values: int

    @property
    def rounds(self) -> int:
        return self.size.bit_length() + 1  # >= the last round number of any schedule, + 1

    @property
    def slot_words(self) -> int:
        return _lines(2 + self.max_values)

    def pid(self, r: int) -> int:
        return _LINE_WORDS + r

    def gone(self, r: int) -> int:
        return _LINE_WORDS + _lines(self.size) + r

    def nudge(self, r: int) -> int:
        return _LINE_WORDS + 2 * _lines(self.size) + r

    def sleeping(self, r: int) -> int:
        return _LINE_WORDS + 3 * _lines(self.size) + _LINE_WORDS * r

    def slot(self, sender: int, rnd: int) -> int:
        """Parity 0's mailbox; parity 1's is ``slot_words`` further."""
        base = self.sleeping(self.size)
        return base + (sender * self.rounds + rnd) * 2 * self.slot_words

    @property
    def nbytes(self) -> int:
        return 8 * self.slot(self.size, 0)


class ShmGroup:
    """The segment and eventfds of one group, before a rank attaches. Made once by the
    launcher (``create``), handed to each rank process (``send_group``/``recv_group``, or
    inherited over fork); ``ShmCollective`` takes ownership of the fds. The launcher should
    ``register`` each rank's pid as soon as its process exists: until a rank is registered
    or attached, its death cannot be told from a slow start."""

    def __init__(self, mem_fd: int, event_fds: list[int], size: int, max_values: int):
        self.mem_fd, self.event_fds = mem_fd, event_fds
        self.layout = _Layout(size, max_values)

    @classmethod
    def create(cls, size: int, max_values: int = 16) -> ShmGroup:
        if size < 1 or max_values < 1:
            raise ValueError(f"a group needs >= 1 rank and >= 1 value, got {size} and {max_values}")
        layout = _Layout(size, max_values)
        fd = os.memfd_create("lockstep-allreduce", os.MFD_CLOEXEC)
        os.ftruncate(fd, layout.nbytes)
        efds = [os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK) for _ in range(size)]
        group = cls(fd, efds, size, max_values)
        with group._mapped() as q:
            q[_SIZE_W], q[_MAXV_W], q[_MAGIC_W] = size, max_values, _MAGIC
        return group

    def register(self, rank: int, pid: int) -> None:
        """Name the process of ``rank`` before it attaches, so that its death is noticed
        even if it dies on the way (a rank also registers itself when it attaches)."""
        with self._mapped() as q:
            q[self.layout.pid(rank)] = pid

    def close(self) -> None:
        for fd in [self.mem_fd, *self.event_fds]:
            os.close(fd)
        self.event_fds = []

    def _mapped(self):
        return _Mapping(self.mem_fd, self.layout.nbytes)


class _Mapping:
    """The segment mapped, as u64 words, for the ``with`` block."""

    def __init__(self, fd: int, nbytes: int):
        self.map = mmap.mmap(fd, nbytes)
        self.q = memoryview(self.map).cast("Q")

    def __enter__(self):
        return self.q

    def __exit__(self, *exc) -> None:
        self.q.release()
        self.map.close()


def send_group(sock: socket.socket, group: ShmGroup) -> None:
    hdr = _GROUP_HDR.pack(group.layout.size, group.layout.max_values)
    socket.send_fds(sock, [hdr], [group.mem_fd, *group.event_fds])


def recv_group(sock: socket.socket, max_size: int = 252) -> ShmGroup:
    msg, fds, _, _ = socket.recv_fds(sock, _GROUP_HDR.size, max_size + 1)
    return unpack_group(msg, fds)


def unpack_group(msg: bytes, fds: list[int]) -> ShmGroup:
    """The group from what ``send_group`` sent; closes the fds if it is not one."""
    size, max_values = _GROUP_HDR.unpack(msg) if len(msg) == _GROUP_HDR.size else (-1, 0)
    if len(fds) != size + 1:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected an all-reduce group ({_GROUP_HDR.size} bytes and size + 1 fds), "
                         f"got {len(msg)} bytes and {len(fds)} fds")
    return ShmGroup(fds[0], fds[1:], size, max_values)


@attrs.frozen
class _Leg:
    """One step of this rank's schedule with its word offsets worked out."""

    step: Step
    out: int  # my mailbox for the round (parity 0)
    inbox: int  # the peer's mailbox for the round (parity 0)
    peer_sleeping: int


class ShmCollective:
    """Rank ``rank`` of a shared-memory group. ``allreduce`` blocks (spin, yield, sleep);
    ``allreduce_async`` waits the same way without blocking the trio loop. ``spin_s``
    defaults to 50 us, or 0 when the group has more ranks than this process may use cores.
    ``timeout_s`` (off by default) turns a peer silent that long into ``CollectiveTimeout``.
    ``names``: what errors call each rank (default: its rank)."""

    def __init__(self, group: ShmGroup, rank: int, *, spin_s: float | None = None, yield_s: float = 1e-3,
                 timeout_s: float | None = None, names=None):
        lay = self._lay = group.layout
        self.rank, self.size, self.max_values = rank, lay.size, lay.max_values
        self.names = list(range(lay.size)) if names is None else [int(n) for n in names]
        if len(self.names) != lay.size:
            raise ValueError(f"{len(self.names)} names for a group of {lay.size} ranks")
        self._stride = lay.slot_words  # parity 1's mailbox is this far from parity 0's
        self._plan = [_Leg(s, lay.slot(rank, s.round), lay.slot(s.peer, s.round), lay.sleeping(s.peer))
                      for s in schedule(rank, lay.size)]
        first = self._plan[0].step if self._plan else None  # a fold partner waits first: nudge it
        self._nudge = first.peer if first is not None and not first.send else None
        self._group, self._efds = group, group.event_fds
        if spin_s is None:  # ranks that outnumber this host's cores delay each other by spinning
            spin_s = 50e-6 if lay.size <= len(os.sched_getaffinity(0)) else 0.0
        self.spin_s, self.yield_s, self.timeout_s = spin_s, yield_s, timeout_s
        self._calls = 0
        self._failed: CollectiveError | None = None
        self._pidfds: dict[int, int] = {}
        self._views: dict[tuple[int, int], np.ndarray] = {}
        self._map = mmap.mmap(group.mem_fd, lay.nbytes)
        self._q = memoryview(self._map).cast("Q")
        if (self._q[_MAGIC_W], self._q[_SIZE_W], self._q[_MAXV_W]) != (_MAGIC, lay.size, lay.max_values):
            self._q.release()
            self._map.close()
            raise ValueError("this memfd is not an all-reduce group of the size it was sent with")
        self._q[lay.pid(rank)] = os.getpid()
        for leg in self._plan:  # early, so a pid that dies is not reused before we look
            self._pidfd(leg.step.peer)

    # -- the call ------------------------------------------------------------------------------
    def allreduce(self, values: np.ndarray, op: Op) -> np.ndarray:
        acc, call, meta = self._begin(values, op)
        try:
            for leg in self._plan:
                s = leg.step
                if s.send:
                    self._post(leg, acc, call, meta)
                if s.recv:
                    inbox = leg.inbox + (call & 1) * self._stride
                    if self._q[inbox] != call:
                        self._wait(inbox, call, s.peer)
                    acc = combine(acc, self._read(inbox, meta, len(acc), s.peer), op, s)
        except BaseException:
            self._abandon()
            raise
        return acc

    async def allreduce_async(self, values: np.ndarray, op: Op) -> np.ndarray:
        acc, call, meta = self._begin(values, op)
        try:
            for leg in self._plan:
                s = leg.step
                if s.send:
                    self._post(leg, acc, call, meta)
                if s.recv:
                    inbox = leg.inbox + (call & 1) * self._stride
                    if self._q[inbox] != call:
                        await self._wait_async(inbox, call, s.peer)
                    acc = combine(acc, self._read(inbox, meta, len(acc), s.peer), op, s)
        except BaseException:
            self._abandon()
            raise
        return acc

    def _abandon(self) -> None:
        """A call left half done (a failure, a mismatch, a cancellation): peers may hold
        part of it, so no later call on this link is safe."""
        if self._failed is None:
            self._failed = CollectiveError(f"rank {self.rank} left all-reduce call {self._calls} half done")

    def _begin(self, values: np.ndarray, op: Op) -> tuple[np.ndarray, int, int]:
        if self._failed is not None:
            raise self._failed
        if self._map is None:
            raise RuntimeError(f"rank {self.rank}'s all-reduce link is closed")
        acc = np.ascontiguousarray(check_values(values, op, self.max_values))
        if not self._plan:
            acc = acc.copy()  # a group of one: still never hand back the caller's array
        self._calls += 1
        if self._nudge is not None:
            self._poke(self._nudge, self._calls)
        return acc, self._calls, len(acc) | (OPS.index(op) << 32)

    def _poke(self, peer: int, call: int) -> None:
        """Wake ``peer`` for ``call`` if it idles in ``wait_posted``."""
        self._q[self._lay.nudge(peer)] = call
        if self._q[self._lay.sleeping(peer)]:
            os.eventfd_write(self._efds[peer], 1)

    def _post(self, leg: _Leg, acc: np.ndarray, call: int, meta: int) -> None:
        q, box = self._q, leg.out + (call & 1) * self._stride
        start = 8 * (box + 2)
        self._map[start:start + acc.nbytes] = acc
        q[box + 1] = meta
        q[box] = call  # publish last: x86 keeps the values' stores before this one
        if q[leg.peer_sleeping]:
            os.eventfd_write(self._efds[leg.step.peer], 1)

    def _read(self, inbox: int, meta: int, n: int, peer: int) -> np.ndarray:
        """The peer's values as a view into its mailbox (``combine`` copies them out before
        the mailbox can be reused); views are made once per mailbox and length."""
        got = self._q[inbox + 1]
        if got != meta:
            raise ValueError(f"rank {peer} all-reduced {got & 0xFFFFFFFF} values with "
                             f"{OPS[got >> 32]!r}, rank {self.rank} {n} with {OPS[meta >> 32]!r}: "
                             "every rank must make the same calls")
        view = self._views.get((inbox, n))
        if view is None:
            view = self._views[inbox, n] = np.frombuffer(self._map, np.int64, n, 8 * (inbox + 2))
        return view

    # -- waiting -------------------------------------------------------------------------------
    def _wait(self, idx: int, call: int, peer: int) -> None:
        q, clock = self._q, time.perf_counter
        start = now = clock()
        check_at = start + _CHECK_S
        while now - start < self.spin_s + self.yield_s:
            for _ in _SPIN:
                if q[idx] == call:
                    return
            now = clock()
            if now >= check_at:
                self._check(idx, call, peer, now - start)
                check_at = now + _CHECK_S
            if now - start >= self.spin_s:
                os.sched_yield()  # lets a peer that shares this core run
        self._sleep(idx, call, peer, start)

    def _sleep(self, idx: int, call: int, peer: int, start: float) -> None:
        q, me = self._q, self._lay.sleeping(self.rank)
        poller = select.poll()
        poller.register(self._efds[self.rank], select.POLLIN)
        watching, nap = False, 0
        q[me] = 1
        try:
            while q[idx] != call:
                self._check(idx, call, peer, time.perf_counter() - start)
                if not watching and (pidfd := self._pidfd(peer)) is not None:
                    poller.register(pidfd, select.POLLIN)  # its death wakes us at once
                    watching = True
                poller.poll(_SLEEP_MS[nap])
                nap = min(nap + 1, len(_SLEEP_MS) - 1)
                self._drain()
        finally:
            if self._map is not None:
                q[me] = 0

    async def _wait_async(self, idx: int, call: int, peer: int) -> None:
        q, clock = self._q, time.perf_counter
        start = clock()
        while clock() - start < min(self.spin_s, _ASYNC_SPIN_S):  # holds the trio loop
            for _ in _SPIN:
                if q[idx] == call:
                    return
        while (waited := clock() - start) < self.spin_s + self.yield_s:
            await trio.sleep(0)
            if q[idx] == call:
                return
        self._check(idx, call, peer, waited)
        await self._sleep_async(idx, call, peer, start)

    async def _sleep_async(self, idx: int, call: int, peer: int, start: float) -> None:
        q, me, efd = self._q, self._lay.sleeping(self.rank), self._efds[self.rank]
        nap = 0
        q[me] = 1
        try:
            while q[idx] != call:
                self._check(idx, call, peer, time.perf_counter() - start)
                with trio.move_on_after(_SLEEP_MS[nap] / 1000):
                    await trio.lowlevel.wait_readable(efd)
                nap = min(nap + 1, len(_SLEEP_MS) - 1)
                self._drain()
        finally:
            if self._map is not None:  # closed meanwhile (a cancelled waiter unwinding)
                q[me] = 0

    async def wait_posted(self) -> None:
        """Return once a peer began this rank's next call (its first message for it, or a
        nudge, is here) or a peer failed, left or died: what an idle rank watches to know it
        must join a round. Consumes nothing; the call that follows reads it all."""
        if self._failed is not None:
            return  # the next call raises
        if self._map is None:
            raise RuntimeError(f"rank {self.rank}'s all-reduce link is closed")
        q, call, me, efd = self._q, self._calls + 1, self._lay.sleeping(self.rank), self._efds[self.rank]
        boxes = [leg.inbox + (call & 1) * self._stride for leg in self._plan if leg.step.recv]
        nap = 0
        q[me] = 1
        try:
            while not self._stirred(boxes, call):
                with trio.move_on_after(_SLEEP_MS[nap] / 1000):
                    await trio.lowlevel.wait_readable(efd)
                nap = min(nap + 1, len(_SLEEP_MS) - 1)
                self._drain()
        finally:
            if self._map is not None:
                q[me] = 0

    def _stirred(self, boxes: list[int], call: int) -> bool:
        q, lay = self._q, self._lay
        if q[_FAILED_W] or q[lay.nudge(self.rank)] == call or any(q[b] == call for b in boxes):
            return True
        return bool(self._down([leg.step.peer for leg in self._plan]))

    def _down(self, ranks) -> list[int]:
        """Those of ``ranks`` that left the group or whose process is gone."""
        q, out, fds = self._q, [], {}
        for r in ranks:
            if q[self._lay.gone(r)]:
                out.append(r)
            elif (fd := self._pidfd(r)) is not None:
                fds[fd] = r
        if fds:
            out += [fds[fd] for fd in select.select(list(fds), [], [], 0)[0]]
        return sorted(set(out))

    def notice(self) -> int | None:
        """The rank (by name) another rank reported failed in the segment, if any (not this
        one): the rank to name, whoever else has left since."""
        if self._map is None or not (failed := self._q[_FAILED_W]) or failed - 1 == self.names[self.rank]:
            return None
        return int(failed - 1)

    def dead_peers(self) -> list[int]:
        """Ranks that left the group or died (empty once this rank closed its link)."""
        if self._map is None:
            return []
        return [self.names[r] for r in self._down(r for r in range(self.size) if r != self.rank)]

    def _drain(self) -> None:
        try:
            os.eventfd_read(self._efds[self.rank])
        except BlockingIOError:
            pass

    # -- liveness ------------------------------------------------------------------------------
    def _check(self, idx: int, call: int, peer: int, waited: float) -> None:
        """Raise if the group failed, ``peer`` is dead or gone, or the caller's deadline
        passed; a message already there wins (a peer writes all it sends before dying)."""
        if self._failed is not None:  # this rank failed or left meanwhile (``leave``)
            raise self._failed
        q = self._q
        failed = q[_FAILED_W]
        if failed and failed - 1 != self.names[self.rank]:
            self._fail(RankFailed(failed - 1, "failed (noticed by another rank)"), post=False)
        dead = q[self._lay.gone(peer)] and "closed its all-reduce link"
        pidfd = self._pidfd(peer)
        if not dead and pidfd is not None and select.select([pidfd], [], [], 0)[0]:
            dead = "died"
        if dead and q[idx] != call:
            self._fail(RankFailed(self.names[peer], dead), post=True)
        if self.timeout_s is not None and waited > self.timeout_s and q[idx] != call:
            self._fail(CollectiveTimeout(self.names[peer], self.timeout_s), post=False)

    def _pidfd(self, peer: int) -> int | None:
        """The peer's pidfd, once its pid is known (None while it is still starting)."""
        fd = self._pidfds.get(peer)
        if fd is None and (pid := self._q[self._lay.pid(peer)]):
            try:
                fd = self._pidfds[peer] = os.pidfd_open(pid)
            except ProcessLookupError:
                return self._dead_pidfd(peer)
        return fd

    def _dead_pidfd(self, peer: int) -> int:
        """A stand-in that is always readable, for a peer that died before we looked."""
        r, w = os.pipe()
        os.close(w)
        self._pidfds[peer] = r
        return r

    def _fail(self, err: Exception, *, post: bool) -> None:
        """Poison this link, tell the other ranks (failed word + every eventfd), raise."""
        if isinstance(err, RankFailed):
            self._failed = err
            if post and not self._q[_FAILED_W]:
                self._q[_FAILED_W] = err.rank + 1
            self._wake_all()
        raise err

    def notify_failed(self, err: RankFailed) -> None:
        """A death seen elsewhere (``err.rank`` by name): poison this link and tell the other
        ranks, as a death seen here would; every later call raises ``err``."""
        if self._map is None or self._failed is not None:
            return
        self._failed = err
        if not self._q[_FAILED_W]:
            self._q[_FAILED_W] = err.rank + 1
        self._wake_all()

    def _wake_all(self) -> None:
        for fd in self._efds:
            os.eventfd_write(fd, 1)

    def leave(self, dead: int | None = None) -> None:
        """Tell the peers this rank is gone (the ones waiting on it get ``RankFailed`` at
        once) but keep the mapping: tasks of this process may still be parked in a wait,
        and they now raise too. ``dead`` (a name): the rank whose death this rank leaves
        for, which the peers then name. ``close`` releases everything."""
        if self._map is None:
            return
        if dead is not None and not self._q[_FAILED_W]:
            self._q[_FAILED_W] = dead + 1
        if self._failed is None:
            self._failed = CollectiveError(f"rank {self.rank} left the all-reduce group")
        self._q[self._lay.gone(self.rank)] = 1
        self._wake_all()

    def close(self) -> None:
        """Leave the group (peers still waiting on this rank get ``RankFailed``) and release
        the mapping and every fd."""
        if self._map is None:
            return
        self._q[self._lay.gone(self.rank)] = 1
        self._wake_all()
        self._views.clear()
        self._q.release()
        try:
            self._map.close()
        except BufferError:
            pass  # a view kept alive by a traceback: the mapping goes when it does
        self._map = None
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
        self._group.close()
