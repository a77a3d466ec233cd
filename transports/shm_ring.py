"""Single-producer/single-consumer rings in anonymous shared memory, woken by eventfds.

This is how the scheduler talks to its runtime process (DESIGN.md): one ``Ring`` per
direction, its memory from ``memfd_create`` and its wake-ups from an ``eventfd``. Nothing is
named, so nothing can leak when either process is killed; the fds travel to the other
process over a Unix socket (``send_ring`` / ``recv_ring``, SCM_RIGHTS).

Layout of one ring: a 192-byte header, then ``capacity`` bytes of frames.
  [0:8)     head: bytes ever written (the producer's)
  [64:72)   tail: bytes ever read (the consumer's), on its own cache line
  [128:136) sleeping: 1 while the consumer blocks on the eventfd
A frame is a 16-byte header (payload length, sequence number, message kind, pad) and the
payload, padded to 16 bytes (so a WRAP marker always fits before the end). A frame never
wraps: one that does not fit before the end is preceded by a WRAP marker and starts again
at offset 0; so does one written past _HOT bytes once the consumer has read everything
before it, which keeps a large ring's frames in a few cache-hot pages. The consumer spins briefly, then yields, then sets ``sleeping`` and blocks on
the eventfd; the producer writes the eventfd only then.
Python has no store-load fence, so the consumer's block has a short timeout and re-checks:
a wake-up lost to reordering costs at most ``_SAFETY_S``.

Two ways to consume: ``poll``/``recv`` copy the payload out and free the frame at once;
``poll_frame``/``recv_frame`` copy nothing and leave the frame the consumer's (its bytes
are ``buffer[start:end]``, typed views of them come from ``view``) until the consumer takes
its next message or calls ``release``. A message is at most a third of the ring, so one held
frame never keeps the producer from writing the next message once the rest is consumed.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import struct
import time

import numpy as np

_HEAD, _TAIL, _SLEEP = 0, 64, 128
_QHEAD, _QTAIL, _QSLEEP = _HEAD // 8, _TAIL // 8, _SLEEP // 8  # indexes in the header's u64 view
_HDR = 192
_FRAME = struct.Struct("<IIII")  # length, seq, kind, pad
_FRAME_SIZE = _FRAME.size
_WRAP = 0xFFFFFFFF
_SAFETY_S = 0.001
# ``recv`` spins only this long before it starts yielding the core between polls: on a
# loaded machine the peer often shares this core, and every microsecond spent spinning is
# one it cannot run (a 50 us spin made the 8-byte ping-pong 130 us there instead of ~25 us).
# Yielding when nothing else wants the core costs one cheap syscall.
_SPIN_S = 5e-6
_SPIN_CHECKS = range(32)  # loads of ``head`` between clock reads (~1-2 us)
# Past _HOT bytes the producer starts again at offset 0 (a WRAP marker, as at the ring's end)
# when the consumer has caught up: at most _BEHIND bytes unread (a held frame, a message in
# flight), all below the start. A consumer that keeps up then reads frames from the same
# cache-warm pages: cycling through a 4 MB ring, a 256-request plan's round trip took 40-42 us
# here; through a 64-256 KB one, 30-35 (bench_dispatch's ring, medians of five or six runs
# on a noisy machine). After such a wrap the producer has at least _HOT - _BEHIND bytes
# before it reaches unread frames (the skipped end is free again once the consumer passes
# the marker, at its next message); beyond that it waits for the consumer, as at any full
# ring.
_HOT = 1 << 18
_BEHIND = 1 << 16


class RingError(RuntimeError):
    pass


class MessageTooLarge(RingError):
    pass


class Ring:
    """One direction. Make it with ``Ring.create``; the other process gets it with
    ``recv_ring``. A ring has exactly one producer and one consumer."""

    def __init__(self, mem_fd: int, event_fd: int, capacity: int):
        self.mem_fd, self.event_fd, self.capacity = mem_fd, event_fd, capacity
        self._map = mmap.mmap(mem_fd, _HDR + capacity)
        self._buf = self.buffer = memoryview(self._map)  # a frame's payload is buffer[start:end]
        # Counters are read and written as whole aligned native u64s (one load or store
        # each): struct's "<Q" goes byte by byte, and a torn read of ``head`` would make the
        # consumer read a frame that is not written yet.
        self._ctr = self._buf[:_HDR].cast("Q")
        # Each side keeps its own counter in a local (only it writes that one) and the other
        # side's as last seen: the hot paths then load one shared counter, not three.
        self._head = self._ctr[_QHEAD]  # the producer's
        self._tail_seen = self._ctr[_QTAIL]  # the producer's view of ``tail``
        self._tail = self._ctr[_QTAIL]  # the consumer's: past the held frame, if any
        self._held = False  # a frame taken by poll_frame and not yet given back
        self._seq = 0
        # A third: a held frame (<= 1/3), the end skipped by a WRAP (< 1/3) and the next
        # frame (<= 1/3) fit together, so a consumer holding one frame never blocks the producer.
        self._max_frame = capacity // 3 & ~15
        self.views: dict[np.dtype, np.ndarray] = {}  # what ``view`` made, for a faster look-up

    def view(self, dtype: np.dtype) -> np.ndarray:
        """The whole mapping as a read-only array of ``dtype`` (index = byte offset //
        itemsize): the zero-copy decoder slices a frame's arrays out of it."""
        v = self.views.get(dtype)
        if v is None:
            dtype = np.dtype(dtype)
            v = self.views[dtype] = np.frombuffer(self._map, dtype, len(self._map) // dtype.itemsize)
            v.setflags(write=False)
        return v

    @classmethod
    def create(cls, capacity: int = 1 << 22) -> Ring:
        if capacity < 4096 or capacity % 16:
            raise ValueError(f"ring capacity must be a multiple of 16 and >= 4096 bytes, got {capacity}")
        fd = os.memfd_create("lockstep-ring", os.MFD_CLOEXEC)
        os.ftruncate(fd, _HDR + capacity)
        efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        return cls(fd, efd, capacity)

    def close(self) -> None:
        """Close the fds. Arrays still viewing a frame keep the mapping alive (the last one
        unmaps it): closing under them would leave them pointing at nothing."""
        if self._map is None:
            return
        self.views.clear()
        self._ctr.release()
        self._buf.release()
        try:
            self._map.close()
        except BufferError:
            pass
        os.close(self.mem_fd)
        os.close(self.event_fd)
        self._map = None

    def fileno(self) -> int:
        """The eventfd: readable when the producer woke a sleeping consumer (for trio's
        ``wait_readable``)."""
        return self.event_fd

    # -- producer ------------------------------------------------------------------------
    def send(self, kind: int, *parts: bytes | memoryview) -> None:
        """Write one message made of ``parts`` (bytes-like, concatenated); blocks while the
        ring is full. ``step_codec.encode`` hands over one joined part: a join and one copy
        into the ring cost less than a copy per array."""
        payload = parts[0] if len(parts) == 1 else b"".join(parts) if parts else b""
        if payload.__class__ is not bytes:  # (len() of an int32 array counts items, not bytes)
            payload = memoryview(payload).cast("B")
        length = len(payload)
        size = (length + _FRAME_SIZE + 15) & ~15
        if size > self._max_frame:
            raise MessageTooLarge(
                f"message of {length} bytes does not fit a ring of {self.capacity} bytes "
                f"(at most {self._max_frame - _FRAME_SIZE}); raise the ring size"
            )
        head, cap = self._head, self.capacity
        off = head % cap
        mem, ctr = self._map, self._ctr
        if off + size > cap or head + size - self._tail_seen > cap or off >= _HOT:
            head, off = self._make_room(head, off, size)
        self._seq = seq = (self._seq + 1) & 0xFFFFFFFF
        pos = _HDR + off
        _FRAME.pack_into(mem, pos, length, seq, kind, 0)
        pos += _FRAME_SIZE
        mem[pos : pos + length] = payload
        self._head = head = head + size
        ctr[_QHEAD] = head  # publish after the payload (x86 keeps store order)
        if ctr[_QSLEEP]:
            os.eventfd_write(self.event_fd, 1)

    def _make_room(self, head: int, off: int, size: int) -> tuple[int, int]:
        """The slow path of ``send``: wrap early (past _HOT, when the consumer has caught up),
        wait for the consumer, and wrap at the end."""
        cap, ctr = self.capacity, self._ctr
        if off >= _HOT and off + size <= cap:
            tail = self._tail_seen = ctr[_QTAIL]
            if head - tail <= _BEHIND and head - tail + size <= off:  # caught up; [0, size) free
                _FRAME.pack_into(self._map, _HDR + off, 0, 0, _WRAP, 0)
                return head + cap - off, 0
            if head + size - tail <= cap:
                return head, off
        wrap = cap - off if off + size > cap else 0
        while head + wrap + size - ctr[_QTAIL] > cap:
            time.sleep(0)  # the consumer is behind: yield the core to it
        self._tail_seen = ctr[_QTAIL]
        if wrap:
            _FRAME.pack_into(self._map, _HDR + off, 0, 0, _WRAP, 0)
            return head + wrap, 0
        return head, off

    # -- consumer ------------------------------------------------------------------------
    # poll and poll_frame repeat a few lines rather than share a helper: each is on the
    # path of every message, and a call costs more than those lines.
    def poll(self) -> tuple[int, int, bytes] | None:
        """The next message as (kind, seq, payload), or None when the ring is empty. The
        payload is a copy: the frame's bytes are the producer's again once this returns."""
        ctr, tail = self._ctr, self._tail
        if self._held:
            ctr[_QTAIL] = tail
            self._held = False
        if tail == ctr[_QHEAD]:
            return None
        off = tail % self.capacity
        length, seq, kind, _ = _FRAME.unpack_from(self._map, _HDR + off)
        if kind == _WRAP:  # never published alone: a frame follows at offset 0
            tail += self.capacity - off
            length, seq, kind, _ = _FRAME.unpack_from(self._map, _HDR)
            off = 0
        start = _HDR + _FRAME_SIZE + off
        payload = self._map[start : start + length]  # one copy, straight into bytes
        ctr[_QTAIL] = self._tail = tail + ((length + _FRAME_SIZE + 15) & ~15)
        return kind, seq, payload

    def poll_frame(self) -> tuple[int, int, int, int] | None:
        """The next message as (kind, seq, start, end) without a copy, or None when the ring
        is empty: the payload is ``buffer[start:end]`` and stays valid, and the consumer's,
        until the next ``poll``/``poll_frame``/``recv``/``recv_frame`` or ``release``."""
        ctr, tail = self._ctr, self._tail
        if self._held:
            ctr[_QTAIL] = tail
            self._held = False
        if tail == ctr[_QHEAD]:
            return None
        off = tail % self.capacity
        length, seq, kind, _ = _FRAME.unpack_from(self._map, _HDR + off)
        if kind == _WRAP:
            tail += self.capacity - off
            ctr[_QTAIL] = tail  # the skipped end is the producer's again
            length, seq, kind, _ = _FRAME.unpack_from(self._map, _HDR)
            off = 0
        start = _HDR + _FRAME_SIZE + off
        self._tail = tail + ((length + _FRAME_SIZE + 15) & ~15)
        self._held = True
        return kind, seq, start, start + length

    def release(self) -> None:
        """Give the held frame (``poll_frame``) back to the producer."""
        if self._held:
            self._ctr[_QTAIL] = self._tail
            self._held = False

    def set_sleeping(self, flag: bool) -> None:
        """Ask the producer to write the eventfd on its next send (a consumer that blocks
        elsewhere, such as trio's ``wait_readable``, sets this before waiting)."""
        self._ctr[_QSLEEP] = 1 if flag else 0

    def clear_wakeup(self) -> None:
        try:
            os.eventfd_read(self.event_fd)
        except BlockingIOError:
            pass

    def recv(self, timeout: float | None = None, *, spin_s: float = _SPIN_S,
             yield_s: float = 2e-3) -> tuple[int, int, bytes]:
        """Block until a message arrives: poll for ``spin_s``, then poll with
        ``sched_yield`` (which lets a peer sharing this core run) for ``yield_s``, then
        sleep on the eventfd."""
        msg = self.poll()
        if msg is not None:
            return msg
        return self._wait(self.poll, timeout, spin_s, yield_s)

    def recv_frame(self, timeout: float | None = None, *, spin_s: float = _SPIN_S,
                   yield_s: float = 2e-3) -> tuple[int, int, int, int]:
        """``recv``, but the message as ``poll_frame`` gives it (no copy; the frame held)."""
        msg = self.poll_frame()
        if msg is not None:
            return msg
        return self._wait(self.poll_frame, timeout, spin_s, yield_s)

    def _wait(self, poll, timeout: float | None, spin_s: float, yield_s: float):
        # Only this consumer moves ``tail`` (and ``poll`` gave back any held frame), so while
        # spinning it is enough to watch ``head``; the clock is read once per _SPIN_CHECKS
        # loads, not once per load.
        ctr, tail = self._ctr, self._tail
        clock = time.perf_counter
        now = clock()
        spin_end, yield_end = now + spin_s, now + spin_s + yield_s
        while now < yield_end:
            for _ in _SPIN_CHECKS:
                if ctr[_QHEAD] != tail:
                    msg = poll()
                    if msg is not None:
                        return msg
                    tail = self._tail  # defensive: poll found nothing after all
            now = clock()
            if now >= spin_end:
                os.sched_yield()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ctr[_QSLEEP] = 1
            msg = poll()
            if msg is not None:
                ctr[_QSLEEP] = 0
                return msg
            wait = _SAFETY_S if deadline is None else min(_SAFETY_S, deadline - time.monotonic())
            if wait <= 0:
                ctr[_QSLEEP] = 0
                raise TimeoutError(f"no message within {timeout} s")
            select.select([self.event_fd], [], [], wait)
            ctr[_QSLEEP] = 0
            try:
                os.eventfd_read(self.event_fd)
            except BlockingIOError:
                pass


# -- handing rings to another process -----------------------------------------------------------
def send_ring(sock: socket.socket, ring: Ring) -> None:
    socket.send_fds(sock, [struct.pack("<Q", ring.capacity)], [ring.mem_fd, ring.event_fd])


def recv_ring(sock: socket.socket) -> Ring:
    msg, fds, _, _ = socket.recv_fds(sock, 8, 2)
    if len(fds) != 2 or len(msg) != 8:
        raise RingError(f"expected a ring (8 bytes and 2 fds), got {len(msg)} bytes and {len(fds)} fds")
    return Ring(fds[0], fds[1], struct.unpack("<Q", msg)[0])
