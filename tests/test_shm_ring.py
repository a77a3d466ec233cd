"""The shared-memory ring between two real processes: round trips, wraps, errors, no leaks."""

import multiprocessing as mp
from multiprocessing import resource_tracker
import socket
import threading
import time

import numpy as np
import pytest

from lockstep.policy.step import StepPlan
from lockstep.transports import echo_worker
from lockstep.transports.shm_ring import _HOT, MessageTooLarge, Ring, send_ring
from lockstep.transports.step_codec import decode, encode
from leaks import leaked_shm, open_fds


def plan(step: int, n: int) -> StepPlan:
    return StepPlan(
        step_id=step, req_ids=np.arange(n, dtype=np.int64), slots=np.arange(n, dtype=np.int32),
        num_new=np.ones(n, np.int32), start_pos=np.arange(n, dtype=np.int32) + step,
        samples=np.arange(n) % 3 != 0, token_ids=np.full(n, -1, np.int32),
        token_offsets=np.arange(n + 1), block_start=np.zeros(n, np.int32),
        block_ids=np.arange(n // 2, dtype=np.int32), block_offsets=np.zeros(n + 1, np.int64),
        num_tokens=n, num_padded_tokens=n,
    )


def test_codec_round_trip_keeps_every_field():
    p = plan(3, 50)
    q = decode(*_one(encode(p)))
    for name in ("req_ids", "slots", "start_pos", "samples", "token_offsets", "block_ids"):
        assert (getattr(q, name) == getattr(p, name)).all() and getattr(q, name).dtype == getattr(p, name).dtype
    assert q.step_id == 3 and q.num_tokens == 50 and not q.is_dummy


def _one(kind_parts):
    kind, parts = kind_parts
    return kind, b"".join(bytes(x) for x in parts)


def test_frames_wrap_around_a_small_ring():
    ring = Ring.create(4096)
    try:
        for i in range(500):
            ring.send(7, bytes([i % 256]) * (i % 300))
            kind, seq, payload = ring.poll()
            assert (kind, seq, payload) == (7, i + 1, bytes([i % 256]) * (i % 300))
        assert ring.poll() is None
    finally:
        ring.close()


def test_a_large_ring_starts_again_at_zero_once_the_consumer_has_caught_up():
    """Past _HOT bytes the producer wraps early when nothing unread lies above the start:
    frames stay in a few cache-hot pages. A consumer that lags (or holds a frame) still gets
    every message, in order, intact."""
    ring = Ring.create(1 << 22)
    try:
        for i in range(400):  # kept up with: offsets stay below _HOT + one frame
            ring.send(3, bytes([i % 256]) * 5000)
            kind, seq, start, end = ring.poll_frame()
            assert ring.buffer[start:end] == bytes([i % 256]) * 5000 and start < _HOT + 5200
        for lap in range(4):  # lagging by up to ~150 KB, across early wraps: all of it, in order
            sent = [bytes([(lap + i) % 256]) * (1000 + 97 * i) for i in range(40)]
            for m in sent:
                ring.send(4, m)
            assert [ring.poll()[2] for _ in sent] == sent
        assert ring.poll() is None
    finally:
        ring.close()


def test_a_message_larger_than_the_ring_fails_clearly():
    ring = Ring.create(4096)
    try:
        with pytest.raises(MessageTooLarge, match="raise the ring size"):
            ring.send(1, b"x" * 4096)
        with pytest.raises(MessageTooLarge, match="at most 1344"):
            ring.send(1, b"x" * 1300, b"y" * 45)
        ring.send(2, b"x" * 1344)  # the largest that fits: a third of the ring, less the frame header
        assert ring.poll() == (2, 1, b"x" * 1344)
    finally:
        ring.close()


def test_parts_are_concatenated():
    ring = Ring.create(4096)
    try:
        ring.send(3, b"ab", memoryview(b"cde"), b"", bytearray(b"f"), np.arange(2, dtype=np.uint8))
        ring.send(4)
        ring.send(5, np.arange(2, dtype=np.int32))  # bytes, not items
        assert ring.poll() == (3, 1, b"abcdef\x00\x01")
        assert ring.poll() == (4, 2, b"")
        assert ring.poll() == (5, 3, np.arange(2, dtype=np.int32).tobytes())
        assert ring.poll() is None
    finally:
        ring.close()


def test_a_held_frame_is_not_overwritten_until_the_consumer_takes_the_next_message():
    ring = Ring.create(4096)
    try:
        for i in range(300):  # many laps: frames wrap at every offset
            ring.send(1, bytes([i % 256]) * (i % 500))
            kind, seq, start, end = ring.poll_frame()
            assert (kind, seq, end - start) == (1, 4 * i + 1, i % 500)
            held = ring.buffer[start:end]
            sent = []
            for j in range(3):  # as much as fits beside the held frame, which must not move
                m = bytes([(i + j + 1) % 256]) * 400
                ring.send(2, m)
                sent.append(m)
            assert held == bytes([i % 256]) * (i % 500)
            assert [ring.poll()[2] for _ in sent] == sent  # poll gives the held frame back first
        assert ring.poll_frame() is None
    finally:
        ring.close()


def test_release_gives_a_held_frame_back_to_a_waiting_producer():
    """A consumer holding a frame keeps the producer out of those bytes, and only of those:
    a message is at most a third of the ring, so the next one fits beside a held frame."""
    ring = Ring.create(4096)
    big = b"x" * 1344  # the largest message
    try:
        ring.send(1, big)
        ring.poll_frame()  # held
        ring.send(2, big)  # these fit beside it without waiting
        ring.send(3, big)
        done = threading.Event()
        producer = threading.Thread(target=lambda: (ring.send(4, big), done.set()))
        producer.start()
        time.sleep(0.05)
        assert not done.is_set()  # no room for a fourth until the held frame goes back
        ring.release()
        producer.join(10)
        assert done.is_set()
        assert [ring.poll() for _ in range(3)] == [(k, k, big) for k in (2, 3, 4)]
    finally:
        ring.close()


def test_typed_views_are_read_only_and_closing_under_them_is_safe():
    ring = Ring.create(4096)
    ring.send(1, np.arange(4, dtype=np.int64).tobytes())
    _, _, start, end = ring.poll_frame()
    arr = ring.view(np.dtype(np.int64))[start // 8 : end // 8]
    assert arr.tolist() == [0, 1, 2, 3] and not arr.flags.writeable
    with pytest.raises(ValueError):
        arr[0] = 5
    ring.close()  # the mapping outlives the ring while an array views it
    assert arr.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("capacity, sizes", [(4096, [100 + 31 * i for i in range(40)]),  # ~28 kB through 4 kB
                                             (1 << 20, [9000 + 997 * i for i in range(120)])],  # 8 MB, early wraps
                         ids=["small", "early-wraps"])
def test_a_full_ring_blocks_the_producer_until_the_consumer_catches_up(capacity, sizes):
    ring = Ring.create(capacity)
    sent = [bytes([i % 256]) * n for i, n in enumerate(sizes)]
    producer = threading.Thread(target=lambda: [ring.send(9, m) for m in sent])
    try:
        producer.start()
        got = []
        for _ in sent:
            time.sleep(0.0005)  # a slow consumer: the producer must wait, and wrap
            got.append(ring.recv(timeout=10))
        producer.join(10)
        assert [(k, s) for k, s, _ in got] == [(9, i + 1) for i in range(len(sent))]
        assert [p for _, _, p in got] == sent
    finally:
        producer.join(10)
        ring.close()




def test_round_trips_with_a_real_process_and_nothing_leaks():
    resource_tracker.ensure_running()  # multiprocessing's own helper keeps a pipe open
    fds_before = open_fds()
    ctx = mp.get_context("spawn")
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = ctx.Process(target=echo_worker.serve, args=(child,), daemon=True)
    proc.start()
    child.close()
    to_rt, from_rt = Ring.create(1 << 16), Ring.create(1 << 16)
    try:
        send_ring(parent, to_rt)
        send_ring(parent, from_rt)
        for step in range(1, 200):
            p = plan(step, 1 + step % 256)
            kind, parts = encode(p)
            to_rt.send(kind, *parts)
            kind_r, _, payload = from_rt.recv(timeout=10)
            result = decode(kind_r, payload)
            assert result.step_id == step
            assert (result.num_sampled == p.samples).all()
            assert len(result.token_ids) == int(p.samples.sum())
        to_rt.send(0)
        proc.join(10)
        assert proc.exitcode == 0
    finally:
        to_rt.close()
        from_rt.close()
        parent.close()
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        proc.close()  # its sentinel fd
    leaked = open_fds() - fds_before
    assert not leaked, leaked
    assert not leaked_shm(set())


def test_a_killed_peer_leaves_no_segment_behind():
    ctx = mp.get_context("spawn")
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = ctx.Process(target=echo_worker.serve, args=(child,), daemon=True)
    proc.start()
    child.close()
    to_rt, from_rt = Ring.create(), Ring.create()
    send_ring(parent, to_rt)
    send_ring(parent, from_rt)
    proc.kill()
    proc.join(10)
    with pytest.raises(TimeoutError):
        from_rt.recv(timeout=0.05)
    for r in (to_rt, from_rt):
        r.close()
    parent.close()
    assert not leaked_shm(set())  # memfd: never named
