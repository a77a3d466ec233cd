"""Round trip of a 256-request StepPlan and its StepResult between two processes.

lockstep's shared-memory ring (memfd + eventfd, a fixed struct header + raw arrays, see
transports/step_codec.py) against ``multiprocessing.Pipe`` with pickle and a bare ring
ping-pong of 8 bytes (the floor), all in one run. Target (the engine issue): <= 20 us and
>= 5x the Pipe baseline. On a 2-core machine the numbers depend on what else runs: with a
third busy process the floor alone can move by 10x, so compare runs made back to back.

The plan is what the scheduler sends for 256 decodes, 16 of which start a new block: per-step
arrays for the request ids, slots, positions and block deltas, and the contract's shared
constants (``decode_constants``) for the rest, as ``PlanAssembly`` builds it. A second row
sends the same plan with every array its own (no shared constants), the codec's general case.
The runtime side is ``echo_worker``: it takes each plan without a copy, as the runtime does.

``--pin`` puts each pair of processes on two different CPUs, as one pins a runtime next to
its engine: unpinned on a loaded 2-core machine the two often share a core, and the 8-byte
floor alone can read 25 us instead of 4. ``--components`` also times each step of a round
trip on its own, in one process (CPU cost without the waiting).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

import attrs
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import emit  # noqa: E402

from lockstep.policy.step import StepPlan, StepResult, decode_constants
from lockstep.transports import echo_worker
from lockstep.transports.shm_ring import Ring, send_ring
from lockstep.transports.step_codec import builder, decode, decode_frame, encode

N, ROUNDS = 256, 3000


def make_plan(step: int, *, shared: bool = True) -> StepPlan:
    """256 decodes, every 16th starting a new block; ``shared``: the constants as the
    scheduler shares them, else every array its own."""
    k = decode_constants(N)
    grew = np.arange(N) % 16 == 0
    block_offsets = np.zeros(N + 1, np.int64)
    np.cumsum(grew, out=block_offsets[1:])
    plan = StepPlan(
        step_id=step, req_ids=np.arange(N, dtype=np.int64) + step, slots=np.arange(N, dtype=np.int32),
        num_new=k.ones, start_pos=np.arange(N, dtype=np.int32) + step, samples=k.trues,
        token_ids=k.placeholders, token_offsets=k.arange, block_start=np.full(N, step // 16, np.int32),
        block_ids=np.arange(16, dtype=np.int32) + step, block_offsets=block_offsets,
        num_tokens=N, num_padded_tokens=N,
    )
    if shared:
        return plan
    return attrs.evolve(plan, **{f: np.array(getattr(plan, f)) for f in ("num_new", "samples", "token_ids", "token_offsets")})


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
    """Seconds per call of ``fn(i)``, the first tenth (warm-up) dropped."""
    clock, ts = time.perf_counter_ns, [0] * ROUNDS  # (a list store costs less than numpy's)
    for i in range(ROUNDS):
        t = clock()
        fn(i)
        ts[i] = clock() - t
    return np.array(ts[ROUNDS // 10 :]) / 1e9


def pin(pid: int, cpus: list[int] | None) -> None:
    """Put this process on ``cpus[0]`` and ``pid`` on ``cpus[1]`` (None: leave them be)."""
    if cpus:
        os.sched_setaffinity(0, {cpus[0]})
        os.sched_setaffinity(pid, {cpus[1]})


def ring_pair(target, cpus: list[int] | None):
    ctx = mp.get_context("spawn")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = ctx.Process(target=target, args=(b,), daemon=True)
    proc.start()
    pin(proc.pid, cpus)
    b.close()
    to_rt, from_rt = Ring.create(1 << 20), Ring.create(1 << 20)
    send_ring(a, to_rt)
    send_ring(a, from_rt)
    return proc, a, to_rt, from_rt


def ring_round_trips(target, make_one, cpus: list[int] | None) -> np.ndarray:
    """Time ``make_one(to_rt, from_rt)``'s round trips against a spawned ``target``."""
    proc, sock, to_rt, from_rt = ring_pair(target, cpus)
    try:
        return timed(make_one(to_rt, from_rt))
    finally:
        to_rt.send(0)
        proc.join(10)
        for x in (to_rt, from_rt, sock):
            x.close()


def bench_ring(cpus: list[int] | None, *, shared: bool = True) -> np.ndarray:
    plans = [make_plan(i, shared=shared) for i in range(8)]

    def make_one(to_rt, from_rt):
        def one(i):
            kind, parts = encode(plans[i % 8])
            to_rt.send(kind, *parts)
            k, _, payload = from_rt.recv()
            decode(k, payload)
        return one

    return ring_round_trips(echo_worker.serve, make_one, cpus)


def bench_floor(cpus: list[int] | None) -> np.ndarray:
    def make_one(to_rt, from_rt):
        def one(i):
            to_rt.send(1, b"12345678")
            from_rt.recv()
        return one

    return ring_round_trips(ping_worker, make_one, cpus)


def bench_pipe(cpus: list[int] | None) -> np.ndarray:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=pipe_worker, args=(b,), daemon=True)
    proc.start()
    pin(proc.pid, cpus)
    plans = [make_plan(i) for i in range(8)]

    def one(i):
        a.send(plans[i % 8])
        a.recv()

    ts = timed(one)
    a.send(None)
    proc.join(10)
    return ts


def components(rounds: int = 60, batch: int = 200) -> dict[str, float]:
    """Each step of one round trip on its own, in this process (no peer, no waiting): the
    median over ``rounds`` of the mean of ``batch`` calls, in us, the steps interleaved so
    that a loaded machine slows them alike."""
    plan = make_plan(1)
    a, b = Ring.create(1 << 20), Ring.create(1 << 20)
    kind, parts = encode(plan)
    a.send(kind, *parts)
    frame = a.poll_frame()
    got = decode_frame(a, frame)
    ones, arange, result_of = np.ones(N, np.int32), np.arange(N, dtype=np.int32), builder(StepResult)

    def make_result():  # what echo_worker does
        n, k = len(got.samples), np.count_nonzero(got.samples)
        return result_of(got.step_id, ones[:n] if k == n else got.samples.astype(np.int32), arange[:k])

    result = make_result()
    rkind, rparts = encode(result)
    steps = {"encode plan": lambda: encode(plan),
             "send plan + take it (no copy)": lambda: (a.send(kind, *parts), a.poll_frame()),
             "decode plan (in the ring)": lambda: decode_frame(a, frame),
             "make result (echo_worker)": make_result,
             "encode result": lambda: encode(result),
             "send result + take it (a copy)": lambda: (b.send(rkind, *rparts), b.poll()),
             "decode result": lambda: decode(rkind, rparts[0])}
    means: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            t = time.perf_counter_ns()
            for _ in range(batch):
                fn()
            means[name].append((time.perf_counter_ns() - t) / batch / 1e3)
    return {k: float(np.median(v)) for k, v in means.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--pin", action="store_true", help="pin each pair of processes to two different CPUs")
    ap.add_argument("--components", action="store_true",
                    help="also time each step of a round trip on its own, in this process")
    args = ap.parse_args()
    if args.components:
        steps = components()
        for name, us in steps.items():
            print(f"# component: {name}: {us:.2f} us")
        print(f"# components, sum: {sum(steps.values()):.2f} us")
    allowed = sorted(os.sched_getaffinity(0))
    cpus = allowed[:2] if args.pin and len(allowed) >= 2 else None
    res = {"lockstep ring, StepPlan -> StepResult": bench_ring(cpus),
           "multiprocessing.Pipe + pickle (baseline)": bench_pipe(cpus),
           "bare ring ping-pong, 8 bytes (floor)": bench_floor(cpus),
           "lockstep ring, same plan without shared constants": bench_ring(cpus, shared=False)}
    rows = [{"method": k, "median_us": float(np.median(v) * 1e6), "p99_us": float(np.percentile(v, 99) * 1e6)}
            for k, v in res.items()]
    ours, base = rows[0]["median_us"], rows[1]["median_us"]
    emit("bench_dispatch", rows, {
        "metric": f"round trip of a {N}-request StepPlan and its StepResult", "unit": "us",
        "value": ours, "baseline": {"name": "multiprocessing.Pipe + pickle, same run", "value": base},
        "ratio": base / ours, "target": "<= 20 us and >= 5x", "meets_target": ours <= 20 and base / ours >= 5,
        "processes": f"each pair pinned to CPUs {cpus[0]} and {cpus[1]}" if cpus else "not pinned",
    }, args.json)


if __name__ == "__main__":
    main()
