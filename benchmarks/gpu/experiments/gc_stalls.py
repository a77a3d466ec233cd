"""Experiment (session 27): the gaps between a decode run's step results on the H200, to see
the runtime process's full garbage collections. Since session 27 the runtime process freezes
what exists after its load (``gc.freeze`` in runtime/main.py), so a full collection no longer
walks everything torch and the model allocated; run this against a copy of lockstep with those
two lines removed for the before (the device command does: PYTHONPATH to each copy in turn).

Prints one JSON line: steps, the median / p99 / max gap between consecutive step results (ms),
and how many gaps exceed 20 ms, over ROUNDS rounds of BATCH requests decoding OUTPUT tokens
each (v2-lite cut to LAYERS layers, bf16, the fast path with CUDA graphs).

Run: python3 benchmarks/gpu/experiments/gc_stalls.py [--layers 8] [--batch 64] [--output 256]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import trio


async def main(args) -> None:
    from lockstep.api import open_engine
    from lockstep.engine.config import EngineConfig
    from lockstep.policy.config import SchedulerConfig
    from lockstep.policy.request import SamplingParams

    sched = SchedulerConfig(num_blocks=8192, max_num_seqs=args.batch, max_num_batched_tokens=8192,
                            max_model_len=args.prompt + args.output + 64)
    if args.device == "cpu":  # checks the script (the tiny preset, the reference path)
        cfg = EngineConfig(model="tiny", device="cpu", dtype="float32", tokenizer=None, scheduler=sched)
    else:
        cfg = EngineConfig(model="v2-lite", device="cuda", dtype="bfloat16", tokenizer=None, scheduler=sched,
                           runtime_options={"init_on_device": True, "capture_len": args.prompt + args.output + 64,
                                            "preset_overrides": {"num_hidden_layers": args.layers}})
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    gaps = []
    async with open_engine(cfg) as engine:
        stamps = []
        engine.scheduler.on_result = lambda plan, result: stamps.append(time.perf_counter())
        await engine.complete(np.arange(10, 26, dtype=np.int32), SamplingParams(max_tokens=4))  # warm
        for r in range(args.rounds):
            stamps.clear()
            prompts = [np.random.default_rng([r, i]).integers(10, 500, args.prompt).astype(np.int32)
                       for i in range(args.batch)]
            async with trio.open_nursery() as n:
                for p in prompts:
                    n.start_soon(engine.complete, p, params)
            gaps += np.diff(stamps)[2:].tolist()  # (past the prefill)
    g = np.array(gaps) * 1e3
    print(json.dumps({"steps": len(g), "median_ms": float(np.median(g)), "p99_ms": float(np.percentile(g, 99)),
                      "max_ms": float(g.max()), "gaps_over_20ms": int((g > 20).sum())}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    trio.run(main, ap.parse_args())
