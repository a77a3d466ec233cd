"""The shared-memory ring between two real processes: round trips, wraps, errors, no leaks."""

import multiprocessing as mp
from multiprocessing import resource_tracker
import os
import socket
import threading
import time

import numpy as np
import pytest

from lockstep.policy.step import StepPlan
from lockstep.transports import echo_worker
from lockstep.transports.shm_ring import MessageTooLarge, Ring, send_ring
from lockstep.transports.step_codec import decode, encode
from leaks import open_fds


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


def test_a_message_larger_than_the_ring_fails_clearly():
    ring = Ring.create(4096)
    try:
        with pytest.raises(MessageTooLarge, match="raise the ring size"):
            ring.send(1, b"x" * 4096)
        with pytest.raises(MessageTooLarge, match="at most 2032"):
            ring.send(1, b"x" * 2000, b"y" * 33)
        ring.send(2, b"x" * 2032)  # the largest that fits: half the ring, less the frame header
        assert ring.poll() == (2, 1, b"x" * 2032)
    finally:
        ring.close()


def test_parts_are_concatenated():
    ring = Ring.create(4096)
    try:
        ring.send(3, b"ab", memoryview(b"cde"), b"", bytearray(b"f"), np.arange(2, dtype=np.uint8))
        ring.send(4)
        assert ring.poll() == (3, 1, b"abcdef\x00\x01")
        assert ring.poll() == (4, 2, b"")
        assert ring.poll() is None
    finally:
        ring.close()


def test_a_full_ring_blocks_the_producer_until_the_consumer_catches_up():
    ring = Ring.create(4096)
    sent = [bytes([i]) * (100 + 37 * i) for i in range(40)]  # ~40 kB through 4 kB
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
    assert not [f for f in os.listdir("/dev/shm") if "lockstep" in f]


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
    assert not [f for f in os.listdir("/dev/shm") if "lockstep" in f]  # memfd: never named
