"""How much of an eager prefill step the host takes (issue 8): v2-lite with random weights, one
prefill chunk through the runtime's ``execute`` (plan in, sampled id out), wall time against
the sum of the step's kernel times (torch.profiler). A ratio well above 1 means the GPU waits
for Python: launchers, the compiled steps' wrappers, host copies, or a sync.

    python3 benchmarks/gpu/prefill_host.py [--json] [--syncs] [--cprofile]

Prefill steps of up to 4,096 tokens replay as CUDA graphs between their attention cores
(``prefill_graphs.PrefillGraphs``); --no-prefill-graphs runs them wholly eagerly, as before.
--syncs lists the operations that synchronize the host with the device during one 2,048-token
chunk (torch's sync debug mode; the sampled id's read-back is the one expected). --cprofile
prints the host's cumulative profile of one 256-token chunk. Reference (H200, 2026-11-30): a
256-token chunk on a 512-token prefix took 74 ms of wall for 12 ms of kernels before the
prefix positions were built once a forward and the alignment's bincount sync went; 32.6 ms
after.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import emit  # noqa: E402

from lockstep.profile_cli import _chunk_plan  # noqa: E402
from lockstep.runtime.base import NewRequests, RuntimeSpec  # noqa: E402
from lockstep.runtime.torch_runtime import TorchRuntime  # noqa: E402

BS = 16
CASES = ((512, 256), (512, 2048), (512, 4096), (8192, 8192))  # (cached prefix, new tokens)


def kernels_ms(rt, plan) -> tuple[float, int]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rt.execute(plan)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    return sum(e.device_time_total for e in events) / 1e3, sum(e.count for e in events)


def syncs(rt, plan) -> Counter:
    """Where one execute synchronizes (lockstep frames of each warning's stack)."""
    seen: list[str] = []

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack() if "lockstep" in f.filename]
        seen.append(" <- ".join(f"{f.filename.split('lockstep/')[-1]}:{f.lineno}" for f in frames[-3:]) or "(outside lockstep)")

    old = warnings.showwarning
    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                rt.execute(plan)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        warnings.showwarning = old
    return Counter(seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--syncs", action="store_true")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="the small steps uncompiled (an A/B)")
    ap.add_argument("--no-prefill-graphs", action="store_true",
                    help="prefill steps wholly eager, not replayed piecewise (an A/B)")
    ap.add_argument("--router-split", action="store_true",
                    help="runtime option router_split on: the split-gate router GEMM (an A/B)")
    ap.add_argument("--sizes", default=None,
                    help="comma-separated prefill graph sizes (default: the runtime's), e.g. adding 6144,8192")
    args = ap.parse_args()
    if args.sizes is not None and args.no_prefill_graphs:
        ap.error("--sizes and --no-prefill-graphs exclude each other")
    sizes = [] if args.no_prefill_graphs else (
        [int(x) for x in args.sizes.split(",") if x.strip()] if args.sizes is not None else None)
    rt = TorchRuntime()
    rt.load(RuntimeSpec(model="v2-lite", device="cuda", dtype="bfloat16", num_blocks=1200, block_size=BS,
                        max_num_seqs=8, max_model_len=16384 + 64, seed=0,
                        options={"init_on_device": True, "capture_len": 0, "compile": not args.no_compile,
                                 "router_split": args.router_split,
                                 **({} if sizes is None else {"prefill_graph_sizes": sizes})}))
    gb = 1024 ** 3
    print(f"# after load: {torch.cuda.memory_allocated() / gb:.2f} GiB allocated, "
          f"{torch.cuda.memory_reserved() / gb:.2f} GiB reserved", flush=True)
    with torch.no_grad():
        rt.kv_pool.normal_(0.0, 1.0)
    rng = np.random.default_rng(0)
    rows, req = [], 1 << 40
    for ctx, t_new in CASES:
        table = np.arange(-(-(ctx + t_new) // BS), dtype=np.int32)
        tokens = rng.integers(3, 1000, t_new).astype(np.int32)
        rt.add_requests(NewRequests([req], [0.0], [1.0], [-1], [-1]))
        walls = []
        for i in range(7):  # the first two warm up (compiles a new shape)
            plan = _chunk_plan(i, req, ctx, tokens, table)
            torch.cuda.synchronize()
            t = time.perf_counter()
            rt.execute(plan)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t)
        wall = 1e3 * statistics.median(walls[2:])
        dev, launches = kernels_ms(rt, _chunk_plan(7, req, ctx, tokens, table))
        rows.append({"prefix": ctx, "chunk": t_new, "prefill_graphs": not args.no_prefill_graphs,
                     "sizes": "default" if sizes is None else ",".join(map(str, sizes)) or "none",
                     "router_split": args.router_split,
                     "wall_ms": wall, "kernels_ms": dev, "launches": launches,
                     "wall_over_kernels": wall / dev, "tokens_per_s": t_new / (wall / 1e3)})
        if args.syncs and t_new == 2048:
            for where, n in syncs(rt, _chunk_plan(8, req, ctx, tokens, table)).most_common(8):
                print(f"# sync {n}x {where}", flush=True)
        if args.cprofile and t_new == 256:
            pr = cProfile.Profile()
            pr.enable()
            rt.execute(_chunk_plan(9, req, ctx, tokens, table))
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(40)
            print("\n".join("# " + line for line in s.getvalue().splitlines()), flush=True)
        rt.forget([req])
        req += 1
    print(f"# runner {rt.runner.statistics()}", flush=True)
    print(f"# max allocated {torch.cuda.max_memory_allocated() / gb:.2f} GiB, "
          f"reserved {torch.cuda.memory_reserved() / gb:.2f} GiB", flush=True)
    rt.shutdown()
    first = rows[0]
    emit("prefill_host", rows, {
        "metric": "eager prefill wall over kernel time, 256-token chunk on a 512-token prefix", "unit": "x",
        "value": first["wall_over_kernels"],
        "baseline": {"name": "the same before this session's fixes (74 ms over 12 ms, 2026-11-30)", "value": 6.2},
        "ratio": 6.2 / first["wall_over_kernels"], "target": "none (diagnostic)", "meets_target": True,
    }, args.json)


if __name__ == "__main__":
    main()
