"""Checks on the H200 that ``overlap_shared`` (the shared MLP of steps beyond the fused limit
on a side stream) changes no token when decode steps replay CUDA graphs, and times it: v2-lite
with random weights and a random cache, greedy decode at batch 128 and 256, with the option
and without, the same plans and the same seed; then ``bench_decode``'s decode timing at 64,
128 and 256 (ctx 1024) for each, in two interleaved rounds. Prints the timing rows and one
JSON line.

    python benchmarks/gpu/check_overlap_shared.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import BS, Run, add_requests, decode_plan, fill_kv, free, runtime, time_decode  # noqa: E402

CTX, STEPS, BATCHES, TIMED = 1024, 4, (128, 256), (64, 128, 256)


def one_runtime(overlap: bool, timings: dict) -> tuple[dict, dict]:
    per = -(-(CTX + STEPS + 2) // BS)
    rt = runtime("v2-lite", "cuda", blocks=max(BATCHES) * per + 8, max_seqs=max(BATCHES), max_len=CTX + 2 * BS,
                 fast=True, cuda_graphs="on", compile=True, overlap_shared=overlap, capture_len=CTX + STEPS + 2)
    try:
        torch.manual_seed(0)
        fill_kv(rt)
        got, first = {}, 0
        for b in BATCHES:
            req_ids = np.arange(first, first + b)
            tables = np.arange(b * per, dtype=np.int64).reshape(b, per)
            add_requests(rt, req_ids)
            got[b] = [rt.execute(decode_plan(i, req_ids, CTX + i, tables if i == 0 else None)).token_ids.tolist()
                      for i in range(STEPS)]
            rt.forget([int(r) for r in req_ids])
            first += b
        run = Run(120.0)
        for b in TIMED:
            row = time_decode(run, rt, b, CTX, first, steps=30, warmup=3)
            first += b
            timings.setdefault(f"{'side' if overlap else 'plain'} b{b}", []).append(
                {"ahead_ms": row["ahead_ms"], "graph_ms": row["gpu_ms"], "step_ms": row["step_ms"]})
            print(f"  overlap_shared={overlap} batch {b}: launched ahead {row['ahead_ms']:.3f} ms, "
                  f"graph replay {row['gpu_ms']:.3f} ms, one at a time {row['step_ms']:.3f} ms", flush=True)
        return got, {"overlap_shared": rt.runner.fast.overlap_shared, **rt.runner.statistics()}
    finally:
        free(rt)


def main() -> None:
    timings: dict = {}
    with_side, stats_side = one_runtime(True, timings)
    plain, stats_plain = one_runtime(False, timings)
    one_runtime(True, timings)  # a second round, interleaved: the GPU's clocks drift
    one_runtime(False, timings)
    out = {"timings": timings, "batches": list(BATCHES), "steps": STEPS,
           "equal": {b: with_side[b] == plain[b] for b in BATCHES},
           "mismatches": {b: int(sum(x != y for s, t in zip(with_side[b], plain[b]) for x, y in zip(s, t)))
                          for b in BATCHES},
           "runner_side": stats_side, "runner_plain": stats_plain}
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
