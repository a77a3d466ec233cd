"""Experiment (session 18): what the fused MoE's empty M-blocks cost at 256 tokens. The grid's
M dimension is the worst case (every expert's last block partial); the programs past the real
block count exit at once. Time the committed launch against one whose M dimension is the real
count (precomputed for these inputs), graphs with L2 flushed, ABAB x3.

Run from the repository root: python3 benchmarks/gpu/experiments/moe_grid.py
Result on one H200 (2026-11-30, raw/2026-11-30-h200-session18-calld-moe_grid.txt): no
difference (300.7 against 300.6 us at 256 tokens, 65 of 110 blocks real; 290.8 / 290.7 at
128; 283.2 / 283.6 at 64). The empty programs cost nothing measurable, so the launchers keep
the worst-case grid that CUDA graphs need."""
import statistics
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from kbench.core import Bench  # noqa: E402
import lockstep.kernels.fused_moe as fm  # noqa: E402


def main():
    b = Bench(False, 600, False)
    e, h, inter, k = 64, 2048, 1408, 6
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(e, 2 * inter, h, generator=g, device="cuda") * h ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, inter, generator=g, device="cuda") * inter ** -0.5).to(torch.bfloat16)
    orig_align = fm.moe_align
    for t in (256, 128, 64):
        gt = torch.Generator(device="cuda").manual_seed(100 + t)
        x = torch.randn(t, h, generator=gt, device="cuda").to(torch.bfloat16)
        scores = torch.randn(t, e, generator=gt, device="cuda")
        top, ids = scores.topk(k, dim=-1)
        w = top.softmax(-1).float().contiguous()
        cfg = fm.moe_config(e, h, inter, False, t, k)
        bm = cfg["BLOCK_M"]
        s, be, tot = orig_align(ids, e, bm)
        real = -(-int(tot.item()) // bm)
        worst = be.numel()
        ref = fm.fused_moe(x, w13, w2, w, ids)
        def exact_align(ids_, e_, bm_, real=real):
            s_, be_, tot_ = orig_align(ids_, e_, bm_)
            return s_, be_[:real], tot_
        std = lambda: fm.fused_moe(x, w13, w2, w, ids)
        def exact():
            fm.moe_align = exact_align
            try:
                return fm.fused_moe(x, w13, w2, w, ids)
            finally:
                fm.moe_align = orig_align
        assert torch.equal(exact(), ref)
        a, c = [], []
        for _ in range(3):
            a.append(b.graph_us(std)); c.append(b.graph_us(exact))
        print(f"T={t} BLOCK_M={bm} blocks real {real} / grid {worst}: committed {statistics.median(a):.1f} us "
              f"({', '.join(f'{v:.1f}' for v in a)}), exact grid {statistics.median(c):.1f} us "
              f"({', '.join(f'{v:.1f}' for v in c)}), ratio {statistics.median(a)/statistics.median(c):.4f}", flush=True)


if __name__ == "__main__":
    main()
