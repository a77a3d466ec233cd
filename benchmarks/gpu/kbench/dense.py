"""Dense decode projections and the per-head products."""

from __future__ import annotations

import traceback

import torch
import torch.nn.functional as F

from lockstep.kernels import dense as dense_mod

from .core import Bench

# -- 4b. dense decode projections ------------------------------------------------------------

# v2-lite's projections (N, K), those of every layer first: q and kv_a fused, o_proj, the
# shared experts' gate_up and down; then the LM head and the dense first layer's gate_up and down.
DENSE_SHAPES = ((3648, 2048), (2048, 2048), (2816, 2048), (2048, 2816), (102400, 2048), (21888, 2048),
                (2048, 10944))


def dense_candidates(rows: int, smoke: bool) -> list[dict]:
    """cuBLAS first (the table's default), then tiles of the Triton kernel."""
    out = [{"BACKEND": "cublas"}]
    if smoke:
        gemv = [{"BACKEND": "gemv", "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}] if rows == 1 else []
        return out + gemv + [{"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}]
    if rows == 1:  # one row: the matrix-vector kernel too
        out += [{"BACKEND": "gemv", **c} for c in gemv_candidates()]
    bms = [min(64, max(16, 1 << (rows - 1).bit_length()))] + ([128] if rows >= 128 else [])
    for bm in bms:
        for bn in (16, 32, 64, 128):
            for bk in (128, 256):
                for stages in (3, 4):
                    out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": 4, "num_stages": stages})
    return out


def gemv_candidates() -> list[dict]:
    """Tiles of ``dense.gemv``: the session-11 sweep's winners and their neighbours."""
    return [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": 4}
            for bn in (8, 16, 32) for bk in (128, 256, 512) for w in (4, 8)]


# The absorbed MLA's per-head matrices (heads, K, N): W_UK and W_UV of v2-lite.
HEAD_SHAPES = ((16, 128, 512), (16, 512, 128))


def bench_heads(b: Bench, bw: float) -> None:
    """One decoding token's per-head products (``dense.bmm_row``): torch.bmm or gemv tiles,
    the faster in BMM_ROW_CONFIGS; timed as bench_dense times projections."""
    g = torch.Generator(device=b.dev).manual_seed(6)
    for h, k, n in HEAD_SHAPES if not b.smoke else ((3, 40, 72),):
        name = f"heads H={h} K={k} N={n}"
        try:
            copies = 1 if b.smoke else max(1, -(-(96 << 20) // (2 * h * k * n)))
            ws = [(torch.randn(h, k, n, generator=g, device=b.dev) * 0.05).to(torch.bfloat16) for _ in range(copies)]
            x = torch.randn(h, k + 64, generator=g, device=b.dev).to(torch.bfloat16)[:, :k]  # strided, as q's slice
            cands = [{"BACKEND": "torch"}] + (gemv_candidates() if not b.smoke else
                                              [{"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}])
            cfg, _ = b.autotune(f"dense.BMM_ROW_CONFIGS[{(h, k, n)}]", cands,
                                lambda c: [dense_mod.bmm_row_with(x, w, c) for w in ws],
                                committed_first=False)  # torch first, not the committed
            check = b.check(name, dense_mod.bmm_row_with(x, ws[0], cfg), torch.bmm(x.float()[:, None], ws[0].float())[:, 0])
            us = b.graph_us(lambda: [dense_mod.bmm_row_with(x, w, cfg) for w in ws]) / len(ws)
            base_us = b.graph_us(lambda: [torch.bmm(x[:, None], w) for w in ws]) / len(ws)
            nbytes = 2 * h * k * n
            b.row("dense", name, us=us, baseline="torch.bmm", baseline_us=base_us, speedup=base_us / us,
                  bytes_mb=nbytes / 1e6, frac_roofline=1e6 * nbytes / bw / us, check=check, note=f"config {cfg}")
        except Exception:  # noqa: BLE001
            b.errors[name] = traceback.format_exc()[-1500:]
            print(b.errors[name], flush=True)


def bench_dense(b: Bench, bw: float) -> None:
    """Each (shape, row bucket): cuBLAS and the Triton tiles, the faster one goes in the table.
    A projection takes 2–30 us, near a graph replay's own start-up: each timing is one graph
    of back-to-back calls over copies of the weight that together overflow L2 (as in a step,
    where each layer's weights are cold), divided by the calls."""
    shapes = DENSE_SHAPES if not b.smoke else ((40, 64),)
    buckets = dense_mod.ROW_BUCKETS if not b.smoke else (1, 8)
    g = torch.Generator(device=b.dev).manual_seed(5)
    for n, k in shapes:
        copies = 1 if b.smoke else max(1, -(-(96 << 20) // (2 * n * k)))  # > the H200's 50 MB L2
        ws = [(torch.randn(n, k, generator=g, device=b.dev) * 0.02).to(torch.bfloat16) for _ in range(copies)]
        calls = len(ws) * max(1, 24 // len(ws))
        order = [ws[i % len(ws)] for i in range(calls)]
        for rows in buckets:
            name = f"dense N={n} K={k} rows={rows}"
            try:
                x = torch.randn(rows, k, generator=g, device=b.dev).to(torch.bfloat16)
                cfg, tried = b.autotune(f"dense.DENSE_CONFIGS[{(n, k, rows)}]", dense_candidates(rows, b.smoke),
                                        lambda c: [dense_mod.linear(x, w, config=c) for w in order],
                                        committed_first=False)  # cuBLAS first, not the committed
                check = b.check(name, dense_mod.linear(x, ws[0], config=cfg), x.float() @ ws[0].float().T)
                nbytes = 2 * (n * k + rows * k + rows * n)
                us = b.graph_us(lambda: [dense_mod.linear(x, w, config=cfg) for w in order]) / calls
                base_us = b.graph_us(lambda: [F.linear(x, w) for w in order]) / calls
                roof_us = 1e6 * nbytes / bw
                b.row("dense", name, us=us, baseline="cuBLAS (F.linear)", baseline_us=base_us,
                      speedup=base_us / us, bytes_mb=nbytes / 1e6, frac_roofline=roof_us / us,
                      baseline_frac=roof_us / base_us, check=check, note=f"config {cfg}")
            except Exception:  # noqa: BLE001
                b.errors[name] = traceback.format_exc()[-1500:]
                print(b.errors[name], flush=True)
