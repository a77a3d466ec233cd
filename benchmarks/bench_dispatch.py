"""Round trip of a 256-request StepPlan and its StepResult between two processes.

lockstep's shared-memory ring (memfd + eventfd, a fixed struct header + raw arrays, see
transports/step_codec.py) against ``multiprocessing.Pipe`` with pickle and a bare ring
ping-pong of 8 bytes (the floor), all in one run. Target (the engine issue): <= 20 us and
>= 5x the Pipe baseline. On a 2-core machine the numbers depend on what else runs: with a
third busy process the floor alone can move by 10x, so compare runs made back to back.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import emit  # noqa: E402

from lockstep.policy.step import StepPlan, StepResult
from lockstep.transports import echo_worker
from lockstep.transports.shm_ring import Ring, send_ring
from lockstep.transports.step_codec import decode, encode

N, ROUNDS = 256, 3000


def make_plan(step: int) -> StepPlan:
    return StepPlan(
        step_id=step, req_ids=np.arange(N, dtype=np.int64), slots=np.arange(N, dtype=np.int32),
        num_new=np.ones(N, np.int32), start_pos=np.arange(N, dtype=np.int32),
        samples=np.ones(N, bool), token_ids=np.full(N, -1, np.int32),
        token_offsets=np.arange(N + 1), block_start=np.zeros(N, np.int32),
        block_ids=np.arange(16, dtype=np.int32), block_offsets=np.zeros(N + 1, np.int64),
        num_tokens=N, num_padded_tokens=N,
    )


def pipe_worker(conn) -> None:
    while True:
        plan = conn.recv()
        if plan is None:
            return
        conn.send(StepResult(step_id=plan.step_id, num_sampled=plan.samples.astype(np.int32),
                             token_ids=np.arange(int(plan.samples.sum()), dtype=np.int32)))


def ping_worker(sock) -> None:
    inbox, outbox = _recv_two(sock)
    while True:
        kind, _, payload = inbox.recv()
        if kind == 0:
            return
        outbox.send(1, payload)


def _recv_two(sock):
    from lockstep.transports.shm_ring import recv_ring
    return recv_ring(sock), recv_ring(sock)


def timed(fn) -> np.ndarray:
    ts = np.empty(ROUNDS)
    for i in range(ROUNDS):
        t = time.perf_counter()
        fn(i)
        ts[i] = time.perf_counter() - t
    return ts[ROUNDS // 10 :]  # drop warm-up


def ring_pair(target):
    ctx = mp.get_context("spawn")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = ctx.Process(target=target, args=(b,), daemon=True)
    proc.start()
    b.close()
    to_rt, from_rt = Ring.create(1 << 20), Ring.create(1 << 20)
    send_ring(a, to_rt)
    send_ring(a, from_rt)
    return proc, a, to_rt, from_rt


def ring_round_trips(target, make_one) -> np.ndarray:
    """Time ``make_one(to_rt, from_rt)``'s round trips against a spawned ``target``."""
    proc, sock, to_rt, from_rt = ring_pair(target)
    try:
        return timed(make_one(to_rt, from_rt))
    finally:
        to_rt.send(0)
        proc.join(10)
        for x in (to_rt, from_rt, sock):
            x.close()


def bench_ring() -> np.ndarray:
    plans = [make_plan(i) for i in range(8)]

    def make_one(to_rt, from_rt):
        def one(i):
            kind, parts = encode(plans[i % 8])
            to_rt.send(kind, *parts)
            k, _, payload = from_rt.recv()
            decode(k, payload)
        return one

    return ring_round_trips(echo_worker.serve, make_one)


def bench_floor() -> np.ndarray:
    def make_one(to_rt, from_rt):
        def one(i):
            to_rt.send(1, b"12345678")
            from_rt.recv()
        return one

    return ring_round_trips(ping_worker, make_one)


def bench_pipe() -> np.ndarray:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=pipe_worker, args=(b,), daemon=True)
    proc.start()
    plans = [make_plan(i) for i in range(8)]

    def one(i):
        a.send(plans[i % 8])
        a.recv()

    ts = timed(one)
    a.send(None)
    proc.join(10)
    return ts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = {"lockstep ring, StepPlan -> StepResult": bench_ring(),
           "multiprocessing.Pipe + pickle (baseline)": bench_pipe(),
           "bare ring ping-pong, 8 bytes (floor)": bench_floor()}
    rows = [{"method": k, "median_us": float(np.median(v) * 1e6), "p99_us": float(np.percentile(v, 99) * 1e6)}
            for k, v in res.items()]
    ours, base = rows[0]["median_us"], rows[1]["median_us"]
    emit("bench_dispatch", rows, {
        "metric": f"round trip of a {N}-request StepPlan and its StepResult", "unit": "us",
        "value": ours, "baseline": {"name": "multiprocessing.Pipe + pickle, same run", "value": base},
        "ratio": base / ours, "target": "<= 20 us and >= 5x", "meets_target": ours <= 20 and base / ours >= 5,
    }, args.json)


if __name__ == "__main__":
    main()
