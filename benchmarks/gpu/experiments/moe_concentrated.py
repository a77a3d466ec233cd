"""Experiment (session 26): how much of a decode step's time is the spread of its routing? The
engine's v2-lite plain decode step took 6.06 ms of device time at 8 requests against 3.21 ms
when a regex held every request to letters (whose outputs repeat a few letters); 8.76 against
3.98 ms at 32. Times fused_moe on one v2-lite layer's shape with the ids of T tokens spread
at random, and all T tokens on the same 6 experts (a CUDA graph of the call, replayed: median
of 50 samples of 20 back-to-back replays, L2 warm, unlike kbench's ``Bench.graph_us``, which
flushes it before each replay: 6 experts' 104 MB of weights partly stay in the 50 MB L2,
which flatters the concentrated case a little; spread routing's ~640 MB do not).

Run from the repository root: python3 benchmarks/gpu/experiments/moe_concentrated.py
Result on one H200 (2026-12-02, raw/2026-12-02-h200-session26-moe-concentrated.txt): 50.6
against 174.7 us at 8 tokens, 50.5 against 257.4 at 32: over 26 MoE layers, the whole
difference between the two engine runs."""
import statistics
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import lockstep.kernels.fused_moe as fm  # noqa: E402


def timed(fn, n=50, reps=20):
    """Median over n samples of the time per replay of a CUDA graph of ``fn`` (reps a sample)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def main():
    e, h, inter, k = 64, 2048, 1408, 6
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(e, 2 * inter, h, generator=g, device="cuda") * h ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, inter, generator=g, device="cuda") * inter ** -0.5).to(torch.bfloat16)
    print("tokens | routing | distinct experts | us")
    for t in (1, 8, 32, 64, 256):
        gt = torch.Generator(device="cuda").manual_seed(100 + t)
        x = torch.randn(t, h, generator=gt, device="cuda").to(torch.bfloat16)
        scores = torch.randn(t, e, generator=gt, device="cuda")
        top, spread = scores.topk(k, dim=-1)
        w = top.softmax(-1).float().contiguous()
        same = spread[:1].expand(t, k).contiguous()
        for name, ids in (("spread", spread), ("same", same)):
            us = timed(lambda: fm.fused_moe(x, w13, w2, w, ids))
            print(f"{t} | {name} | {ids.unique().numel()} | {us:.1f}", flush=True)


if __name__ == "__main__":
    main()
