"""The DEP all-reduce between hosts: recursive doubling over trio TCP streams.

``lockstep.policy.allreduce`` says who talks to whom in which round; this module moves the
values. Each rank keeps one connection per schedule peer (log2 n of them, plus its fold
partner), the higher rank dialling the lower one. Frames are length-prefixed:
  header  payload length u32, call u64, round u16, kind u8, op u8   (little-endian)
  payload the int64 values (little-endian), or nothing
A ``FAILED`` frame carries a dead rank in its call field: a rank that sees a peer fail tells
its other peers before it closes, so every survivor's ``RankFailed`` names the rank that
died, not the messenger. Errors name ranks by ``names`` (default: their ranks here), so a
group that is part of a larger one (the host leaders of ``collective_mixed``) names the
larger group's ranks, and ``notify_failed`` passes on a death seen elsewhere. A killed process's kernel closes its sockets, so the peer sees EOF
at once; keepalive probes (about 4 s) catch a host that vanished without a FIN. A slow peer
is not a failure: its kernel answers the probes.

An idle rank that must join a round a peer began watches its sockets (``wait_posted``).
The schedule's own frames reach every rank except an extra rank of a non-power-of-two
group, whose partner only waits for it; so that partner first sends it a ``NUDGE`` frame
(no payload), which the extra rank's next receive skips.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

import numpy as np
import trio

from lockstep.policy.allreduce import (OPS, CollectiveError, CollectiveTimeout, Op, RankFailed, Step,
                                       check_values, combine, peers, schedule)

_FRAME = struct.Struct("<IQHBB")
_HELLO = struct.Struct("<QQQ")  # magic, rank, size: the dialling rank introduces itself
_MAGIC = 0x6C6F636B74637031
_DATA, _FAILED, _NUDGE = 0, 1, 2
_LE_I64 = np.dtype("<i8")
_KEEPALIVE = ((socket.TCP_KEEPIDLE, 1), (socket.TCP_KEEPINTVL, 1), (socket.TCP_KEEPCNT, 3))


class _Reader:
    """Buffered exact reads from one peer's stream; EOF or a broken stream is its death."""

    def __init__(self, stream: trio.SocketStream, peer: int):
        self.stream, self.peer, self._buf = stream, peer, bytearray()
        self.name = peer  # the rank errors name (the group's ``names``)

    async def read(self, n: int) -> bytes:
        while len(self._buf) < n:
            try:
                data = await self.stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                raise RankFailed(self.name, f"broke its connection ({e})") from e
            if not data:
                raise RankFailed(self.name, "closed its connection")
            self._buf += data
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out


class TcpCollective:
    """Rank ``rank`` of a TCP group; make it with ``connect``. Async only: every wait is a
    socket read. ``timeout_s`` (off by default) turns a peer silent that long into
    ``CollectiveTimeout``. ``names``: what errors call each rank (default: its rank)."""

    def __init__(self, rank: int, size: int, readers: dict[int, _Reader], *, timeout_s: float | None = None,
                 names: Sequence[int] | None = None):
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.names = list(range(size)) if names is None else [int(n) for n in names]
        if len(self.names) != size:
            raise ValueError(f"{len(self.names)} names for a group of {size} ranks")
        for p, reader in readers.items():
            reader.name = self.names[p]
        self._plan = schedule(rank, size)
        first = self._plan[0] if self._plan else None  # a fold partner waits first: nudge it
        self._nudge = first.peer if first is not None and not first.send else None
        self._readers = readers
        self._calls = 0
        self._failed: CollectiveError | None = None
        self._left_for: int | None = None  # the rank whose death this rank left the link for

    @classmethod
    async def connect(cls, rank: int, size: int, addresses: Sequence[tuple[str, int]],
                      listener: trio.SocketListener | None = None, *, timeout_s: float | None = None,
                      connect_timeout_s: float = 60.0, names: Sequence[int] | None = None) -> TcpCollective:
        """Dial the lower-ranked peers at ``addresses[peer]`` (retrying while they start)
        and accept the higher-ranked ones on ``listener`` (a rank with no higher peer,
        such as the highest, needs none)."""
        if len(addresses) != size:
            raise ValueError(f"{len(addresses)} addresses for a group of {size} ranks")
        mine = peers(rank, size)
        higher = {p for p in mine if p > rank}
        if higher and listener is None:
            raise ValueError(f"rank {rank} must accept ranks {sorted(higher)}: pass its listener")
        readers: dict[int, _Reader] = {}
        try:
            with trio.fail_after(connect_timeout_s):
                async with trio.open_nursery() as nursery:
                    for p in mine - higher:
                        nursery.start_soon(_dial, rank, size, p, addresses[p], readers)
                    if higher:
                        nursery.start_soon(_accept_all, size, higher, listener, readers)
        except trio.TooSlowError:
            missing = min(mine - set(readers))
            _close_all(readers)
            raise CollectiveTimeout(missing if names is None else names[missing], connect_timeout_s) from None
        except BaseException:
            _close_all(readers)
            raise
        return cls(rank, size, readers, timeout_s=timeout_s, names=names)

    async def allreduce_async(self, values: np.ndarray, op: Op) -> np.ndarray:
        if self._failed is not None:
            raise self._failed
        if self._readers is None:
            raise RuntimeError(f"rank {self.rank}'s all-reduce link is closed")
        acc = check_values(values, op).copy()  # never hand back the caller's array (size 1)
        self._calls += 1
        try:
            if self._nudge is not None:
                await self._send(self._nudge, _frame(self._calls, 0, _NUDGE, op, acc[:0]))
            for s in self._plan:
                if s.send:
                    await self._send(s.peer, _frame(self._calls, s.round, _DATA, op, acc))
                if s.recv:
                    acc = combine(acc, await self._recv(s, op, len(acc)), op, s)
        except RankFailed as e:
            await self._fail(e)
            raise
        except BaseException:
            # cancelled mid-call: peers may hold half of this call, so no later call is safe
            self._failed = CollectiveError(f"rank {self.rank} left an all-reduce half done")
            raise
        return acc

    async def _send(self, peer: int, frame: bytes) -> None:
        try:
            await self._reader(peer).stream.send_all(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise RankFailed(self.names[peer], f"broke its connection ({e})") from e

    def _reader(self, peer: int) -> _Reader:
        """The connection to ``peer``; a round whose link another task closed under it (this
        rank left the group) fails as the rank it left for, or as the peer."""
        readers = self._readers
        if readers is None:
            name = self._left_for if self._left_for is not None else self.names[peer]
            raise RankFailed(name, "is gone: this rank left the link during the round")
        return readers[peer]

    async def _recv(self, s: Step, op: Op, n: int) -> np.ndarray:
        reader = self._reader(s.peer)
        with trio.move_on_after(self.timeout_s if self.timeout_s is not None else float("inf")) as scope:
            length, call, rnd, kind, got_op = _FRAME.unpack(await reader.read(_FRAME.size))
            while kind == _NUDGE:  # the partner woke us for this call; its values come next
                length, call, rnd, kind, got_op = _FRAME.unpack(await reader.read(_FRAME.size))
            if kind == _FAILED:
                raise RankFailed(call, f"failed (rank {self.names[s.peer]} saw it)")
            if (call, rnd, got_op, length) != (self._calls, s.round, OPS.index(op), 8 * n):
                raise ValueError(
                    f"rank {self.names[s.peer]} sent call {call} round {rnd} with {length // 8} values and "
                    f"{OPS[got_op]!r}; rank {self.names[self.rank]} expected call {self._calls} round {s.round} "
                    f"with {n} and {op!r}: every rank must make the same calls")
            payload = await reader.read(length)
        if scope.cancelled_caught:
            raise CollectiveTimeout(self.names[s.peer], self.timeout_s)
        return np.frombuffer(payload, _LE_I64).astype(np.int64, copy=False)

    async def notify_failed(self, err: RankFailed) -> None:
        """A death seen elsewhere (``err.rank`` by name): tell the peers, then drop the links;
        every later call raises ``err``."""
        if self._readers is not None and self._failed is None:
            await self._fail(err)

    async def _fail(self, err: RankFailed) -> None:
        """Tell every other peer who failed (best effort, briefly), then drop all links."""
        self._failed = err
        if self._readers is None:  # closed meanwhile (this rank left the group): nothing to tell
            return
        notice = _frame(err.rank, 0, _FAILED, "sum", np.zeros(0, np.int64))
        with trio.move_on_after(0.5):
            for p, reader in list(self._readers.items()):  # (another task may close it meanwhile)
                if self.names[p] != err.rank:
                    try:
                        await reader.stream.send_all(notice)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
        self.close()

    async def wait_posted(self) -> None:
        """Return once a peer's socket turns readable (its first frame of the next call, a
        nudge, a failure notice, or EOF): what an idle rank watches to know it must join a
        round. Reads nothing; the call that follows reads it all."""
        readers = self._readers or {}
        if self._failed is not None or not readers or any(r._buf for r in readers.values()):
            return  # the next call raises, or a frame was already read ahead
        async with trio.open_nursery() as nursery:
            async def one(sock):
                await trio.lowlevel.checkpoint_if_cancelled()
                try:
                    await trio.lowlevel.wait_readable(sock)
                except (trio.ClosedResourceError, OSError):
                    pass  # closed under us (this rank failed): the next call says so
                nursery.cancel_scope.cancel()
            for r in readers.values():
                nursery.start_soon(one, r.stream.socket)

    def notice(self) -> int | None:
        """A failure notice is a frame the next call reads (``dead_peers`` sees a peer that
        sent one as alive until it closes): none to report here."""
        return None

    def dead_peers(self) -> list[int]:
        """Peers whose connection reached EOF or broke (they died): a peek, nothing consumed."""
        out = []
        for peer, r in (self._readers or {}).items():
            try:  # trio's socket reads only async: peek through a plain duplicate
                with socket.fromfd(r.stream.socket.fileno(), socket.AF_INET, socket.SOCK_STREAM) as dup:
                    if dup.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                        out.append(self.names[peer])
            except BlockingIOError:
                pass
            except OSError:
                out.append(self.names[peer])
        return sorted(out)

    def leave(self, dead: int | None = None) -> None:
        """What a rank that fails does: close (trio's close wakes any task of ours blocked on
        a socket, and the peers see EOF). ``dead`` (a name): the rank whose death this rank
        leaves for; the peers are told first (``FAILED`` frames, sent without waiting), so
        they name it rather than this rank."""
        if dead is not None:
            self._left_for = dead
        if dead is not None and self._readers:
            notice = _frame(dead, 0, _FAILED, "sum", np.zeros(0, np.int64))
            for p, r in self._readers.items():
                if self.names[p] != dead:
                    try:
                        with socket.fromfd(r.stream.socket.fileno(), socket.AF_INET, socket.SOCK_STREAM) as dup:
                            dup.send(notice, socket.MSG_DONTWAIT)
                    except OSError:
                        pass  # a full or broken socket: that peer sees EOF instead
        self.close()

    def close(self) -> None:
        """Drop every connection: peers waiting on this rank get ``RankFailed``."""
        if self._readers is not None:
            _close_all(self._readers)
            self._readers = None


def _frame(call: int, rnd: int, kind: int, op: Op, values: np.ndarray) -> bytes:
    body = values.astype(_LE_I64, copy=False).tobytes()
    return _FRAME.pack(len(body), call, rnd, kind, OPS.index(op)) + body


def _close_all(readers: dict[int, _Reader]) -> None:
    for reader in readers.values():
        reader.stream.socket.close()  # trio's close wakes any task blocked on the socket
    readers.clear()


def _tune(stream: trio.SocketStream) -> None:
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in _KEEPALIVE:
        stream.socket.setsockopt(socket.IPPROTO_TCP, opt, value)


async def _dial(rank: int, size: int, peer: int, address: tuple[str, int], readers: dict) -> None:
    """Connect to a lower-ranked peer, retrying while it is still starting."""
    while True:
        try:
            stream = await trio.open_tcp_stream(*address)
            break
        except OSError:
            await trio.sleep(0.05)
    readers[peer] = _Reader(stream, peer)  # from here on, ``connect`` closes it on failure
    _tune(stream)
    await stream.send_all(_HELLO.pack(_MAGIC, rank, size))


async def _accept_all(size: int, expected: set[int], listener: trio.SocketListener,
                      readers: dict) -> None:
    while not expected <= set(readers):
        stream = await listener.accept()
        reader = _Reader(stream, -1)  # keeps what the dialler sent after its hello
        try:
            peer = await _hello(reader, size, expected - set(readers))
        except BaseException:
            stream.socket.close()
            raise
        if peer is None:
            stream.socket.close()  # a stray or misconfigured dialler: not one of ours
            continue
        _tune(stream)
        reader.peer = peer
        readers[peer] = reader


async def _hello(reader: _Reader, size: int, expected: set[int]) -> int | None:
    """The dialler's rank, or None when it is not one we wait for."""
    try:
        magic, peer, their_size = _HELLO.unpack(await reader.read(_HELLO.size))
    except RankFailed:  # hung up before saying who it is
        return None
    return peer if magic == _MAGIC and their_size == size and peer in expected else None


async def open_listener(host: str = "127.0.0.1", port: int = 0) -> tuple[trio.SocketListener, tuple[str, int]]:
    """A listener for ``connect`` and the address the other ranks should dial."""
    (listener,) = await trio.open_tcp_listeners(port, host=host)
    return listener, listener.socket.getsockname()[:2]
