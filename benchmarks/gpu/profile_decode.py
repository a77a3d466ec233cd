"""Where a v2-lite decode step's GPU time goes (issue 8): the fast path's kernels by name and
by kind, per step, next to each kind's share of the step's roofline bytes.

For each batch (default 1, 64, 256) at context 1K: warm up through CUDA graphs, then run
``--steps`` eager steps (graphs off: the same kernels, launched one by one) under
torch.profiler, and sum the device time of every kernel. A graph replay is profiled too, to
say whether the profiler sees kernels inside graphs (its total should match the events' time).
Prints a table of kinds and the top kernels; with --json the house JSON line (headline: the
share of batch 256's step time outside the routed experts).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as bd  # noqa: E402
from _common import emit  # noqa: E402

KINDS = (  # first match wins
    ("moe up", r"_moe_up_kernel"),
    ("moe down", r"_moe_down_kernel"),
    ("moe sum", r"_moe_sum_kernel"),
    ("moe align", r"_moe_align_kernel"),
    ("mla decode", r"_mla_decode|mla_decode|_decode_.*kernel|_combine"),
    ("kv store", r"kv_store"),
    ("router", r"_moe_route_kernel"),
    ("dense projections (Triton)", r"_linear_kernel"),
    ("sampling", r"sample|argmax|topk|sort|softmax|exponential|cumsum"),
    ("fused elementwise (inductor)", r"^triton_"),
    ("gemm/bmm (cuBLAS)", r"gemm|gemv|nvjet|cutlass|sm90|xmma|cublas|splitK"),
    ("copies/fills", r"copy|Memcpy|Memset|fill|elementwise|vectorized|index|scatter|gather|where|cat"),
)


def kind(name: str) -> str:
    for k, pat in KINDS:
        if re.search(pat, name, re.IGNORECASE):
            return k
    return "other"


def kernels(prof) -> dict[str, tuple[float, int]]:
    """name -> (device µs, launches) over the profiled region."""
    out: dict[str, list] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = getattr(e, "device_time", None)
        if t is None:
            t = e.cuda_time
        acc = out.setdefault(e.name, [0.0, 0])
        acc[0] += t
        acc[1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def profile_batch(rt, batch: int, ctx: int, first_req: int, steps: int, rows: list, top: int) -> dict:
    per = -(-(ctx + steps + 12) // bd.BS)
    tables = np.arange(batch * per, dtype=np.int64).reshape(batch, per)
    req_ids = np.arange(first_req, first_req + batch)
    bd.add_requests(rt, req_ids)
    step = 0
    try:
        for _ in range(3):  # graphs: warm
            rt.execute(bd.decode_plan(step, req_ids, ctx + step, tables if step == 0 else None))
            step += 1
        torch.cuda.synchronize()
        graph = rt.runner.graph_for(batch, ctx + steps + 8)
        graph_ms = bd.events_ms(graph.replay, 10) if graph is not None else float("nan")
        graph_seen = float("nan")
        if graph is not None:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    graph.replay()
                torch.cuda.synchronize()
            graph_seen = sum(t for t, _ in kernels(prof).values()) / 2 / 1e3
        mode, rt.runner.mode = rt.runner.mode, "off"
        try:
            rt.execute(bd.decode_plan(step, req_ids, ctx + step, None))  # eager warm-up
            step += 1
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    rt.execute(bd.decode_plan(step, req_ids, ctx + step, None))
                    step += 1
                torch.cuda.synchronize()
        finally:
            rt.runner.mode = mode
    finally:
        rt.forget([int(r) for r in req_ids])
    ks = kernels(prof)
    total = sum(t for t, _ in ks.values()) / steps / 1e3
    by_kind: dict[str, list] = {}
    for name, (t, n) in ks.items():
        acc = by_kind.setdefault(kind(name), [0.0, 0])
        acc[0] += t / steps / 1e3
        acc[1] += n / steps
    print(f"\n## batch {batch}, ctx {ctx}: kernels sum {total:.3f} ms/step (eager), graph replay {graph_ms:.3f} ms, "
          f"profiler inside the graph {graph_seen:.3f} ms", flush=True)
    for k, (ms, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        rows.append({"batch": batch, "ctx": ctx, "kind": k, "ms_per_step": ms, "launches_per_step": n,
                     "share": ms / total, "kernel": ""})
        print(f"  {k:32s} {ms:8.3f} ms  {n:6.0f} launches  {ms / total:6.1%}", flush=True)
    print("  top kernels:")
    for name, (t, n) in sorted(ks.items(), key=lambda kv: -kv[1][0])[:top]:
        ms = t / steps / 1e3
        print(f"    {ms:8.3f} ms {n / steps:6.0f}x  {kind(name):20s} {name[:150]}", flush=True)
        rows.append({"batch": batch, "ctx": ctx, "kind": kind(name), "ms_per_step": ms,
                     "launches_per_step": n / steps, "share": ms / total, "kernel": name[:150]})
    return {"batch": batch, "eager_kernels_ms": total, "graph_ms": graph_ms, "graph_profiled_ms": graph_seen,
            "kinds": {k: v[0] for k, v in by_kind.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--layers", type=int, default=0, help="cut v2-lite to this many layers (0: all 27)")
    args = ap.parse_args()
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    max_ctx = args.ctx + args.steps + 16
    per = -(-(max_ctx + 2) // bd.BS)
    b = max(args.batches)
    rt = bd.runtime("v2-lite", "cuda", blocks=b * per + 8, max_seqs=b, max_len=max_ctx + bd.BS, overrides=overrides,
                    fast=True, cuda_graphs="on", compile=True, capture_len=max_ctx)
    rows, found = [], []
    try:
        bd.fill_kv(rt)
        req = 0
        for batch in args.batches:
            found.append(profile_batch(rt, batch, args.ctx, req, args.steps, rows, args.top))
            req += batch
    finally:
        bd.free(rt)
    last = found[-1]
    moe = sum(v for k, v in last["kinds"].items() if k.startswith("moe"))
    emit("profile_decode_h200", rows,
         {"metric": f"share of batch {last['batch']}'s eager kernel time outside the routed experts",
          "unit": "fraction", "value": 1 - moe / last["eager_kernels_ms"],
          "baseline": {"name": "graph replay ms", "value": last["graph_ms"]}, "ratio": 1.0,
          "target": "(diagnostic)", "meets_target": None, "batches": found}, args.json)


if __name__ == "__main__":
    main()
