"""The dense projections of a decode step, y = x @ W^T for a few rows x [M, K] (M <= 256).

At decode sizes a projection reads its whole weight for a handful of rows, so its bound is
the weight's bytes. cuBLAS's kernels for these shapes (M = 1–256, N and K of a few
thousand) read v2-lite's projections at 30–55% of the H200's copy bandwidth
(benchmarks/gpu/profile_decode.py, 2026-11-29): few, large tiles leave SMs idle. Here each
program owns BLOCK_N rows of W and streams them once for BLOCK_M rows of x; the programs of
one weight tile are adjacent in the grid (M fastest), so a tile read twice comes from L2.

Which one runs is a table: DENSE_CONFIGS maps (N, K, row bucket) to a tile config, to
{"BACKEND": "gemv", ...} (one row: ``gemv``'s matrix-vector tiles), or to {"BACKEND": "cublas"}
where cuBLAS was faster in the tuning run; shapes not in it go to
cuBLAS (F.linear), as do float16 inputs. bf16 operands, float32 accumulation, bf16 output.

At one row, ``gemv`` also serves per-head products (``bmm_row``: the absorbed MLA heads' W_UK
and W_UV, BMM_ROW_CONFIGS), and ``merge_bmm_row`` feeds W_UV's with the merge of MLA
decode's attention splits (``mla_decode.mla_decode_partials``) in the same launch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._util import DOT, check, check_shape, next_pow2, to_dtype
from .mla_decode import merge_reference

ROW_BUCKETS = (1, 8, 16, 32, 64, 128, 256)
MAX_ROWS = 256  # above this a projection is a real GEMM: cuBLAS

# Tuned on an H200 by benchmarks/gpu/bench_kernels.py: (N, K, row bucket) -> config.
DENSE_CONFIGS: dict[tuple, dict] = {
    # one row: gemv (2026-11-30, session 11; 8 weight copies cycled, graph replays): w_in
    # 6.81 -> 6.10 us, o_proj 6.25 -> 4.92 us; v2-lite's batch-1 step, with the heads'
    # products below, 2.43 -> 2.34 ms (raw/2026-11-30-h200-session11-gemv-tune.txt)
    (3648, 2048, 1): {'BACKEND': 'gemv', 'BLOCK_N': 8, 'BLOCK_K': 512, 'num_warps': 8, 'num_stages': 4},
    (3648, 2048, 8): {'BACKEND': 'cublas'},
    (3648, 2048, 16): {'BACKEND': 'cublas'},
    (3648, 2048, 32): {'BACKEND': 'cublas'},
    (3648, 2048, 64): {'BACKEND': 'cublas'},
    (3648, 2048, 128): {'BACKEND': 'cublas'},
    (3648, 2048, 256): {'BACKEND': 'cublas'},
    (2048, 2048, 1): {'BACKEND': 'gemv', 'BLOCK_N': 8, 'BLOCK_K': 512, 'num_warps': 8, 'num_stages': 4},
    (2048, 2048, 8): {'BACKEND': 'cublas'},
    (2048, 2048, 16): {'BACKEND': 'cublas'},
    (2048, 2048, 32): {'BACKEND': 'cublas'},
    (2048, 2048, 64): {'BACKEND': 'cublas'},
    (2048, 2048, 128): {'BACKEND': 'cublas'},
    (2048, 2048, 256): {'BACKEND': 'cublas'},
    (2816, 2048, 1): {'BACKEND': 'cublas'},
    (2816, 2048, 8): {'BACKEND': 'cublas'},
    (2816, 2048, 16): {'BACKEND': 'cublas'},
    (2816, 2048, 32): {'BACKEND': 'cublas'},
    (2816, 2048, 64): {'BACKEND': 'cublas'},
    (2816, 2048, 128): {'BACKEND': 'cublas'},
    (2816, 2048, 256): {'BACKEND': 'cublas'},
    (2048, 2816, 1): {'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 4},
    (2048, 2816, 8): {'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 4},
    (2048, 2816, 16): {'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 4},
    (2048, 2816, 32): {'BACKEND': 'cublas'},
    (2048, 2816, 64): {'BACKEND': 'cublas'},
    (2048, 2816, 128): {'BACKEND': 'cublas'},
    (2048, 2816, 256): {'BACKEND': 'cublas'},
    (102400, 2048, 1): {'BLOCK_M': 16, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4},
    (102400, 2048, 8): {'BLOCK_M': 16, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4},
    (102400, 2048, 16): {'BLOCK_M': 16, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4},
    (102400, 2048, 32): {'BLOCK_M': 32, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4},
    (102400, 2048, 64): {'BACKEND': 'cublas'},
    (102400, 2048, 128): {'BACKEND': 'cublas'},
    (102400, 2048, 256): {'BACKEND': 'cublas'},
    (21888, 2048, 1): {'BLOCK_M': 16, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3},
    (21888, 2048, 8): {'BLOCK_M': 16, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3},
    (21888, 2048, 16): {'BLOCK_M': 16, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3},
    (21888, 2048, 32): {'BLOCK_M': 32, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3},
    (21888, 2048, 64): {'BACKEND': 'cublas'},
    (21888, 2048, 128): {'BACKEND': 'cublas'},
    (21888, 2048, 256): {'BACKEND': 'cublas'},
    (2048, 10944, 1): {'BACKEND': 'cublas'},
    (2048, 10944, 8): {'BACKEND': 'cublas'},
    (2048, 10944, 16): {'BACKEND': 'cublas'},
    (2048, 10944, 32): {'BACKEND': 'cublas'},
    (2048, 10944, 64): {'BACKEND': 'cublas'},
    (2048, 10944, 128): {'BACKEND': 'cublas'},
    (2048, 10944, 256): {'BACKEND': 'cublas'},
}


# Tuned on an H200: (B, K, N) -> gemv config for B products of one row by [K, N] each (the
# absorbed MLA's per-head matrices at one decoding token); shapes not in it go to torch.bmm.
# (2026-11-30, session 11: W_UK 3.37 -> 2.94 us, W_UV 3.66 -> 2.99 us against torch.bmm.)
BMM_ROW_CONFIGS: dict[tuple, dict] = {
    (16, 128, 512): {'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4},
    (16, 512, 128): {'BLOCK_N': 16, 'BLOCK_K': 512, 'num_warps': 4, 'num_stages': 4},
}


def bmm_row(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, K] times w [B, K, N] -> [B, N]: ``gemv`` where BMM_ROW_CONFIGS has the shape
    (and the dtype is bfloat16), else torch.bmm."""
    cfg = BMM_ROW_CONFIGS.get(tuple(w.shape))
    return bmm_row_with(x, w, cfg)


def bmm_row_with(x: torch.Tensor, w: torch.Tensor, cfg: dict | None) -> torch.Tensor:
    """``bmm_row`` with a given table entry (None or {"BACKEND": "torch"}: torch.bmm)."""
    if cfg is None or cfg.get("BACKEND") == "torch" or x.dtype != torch.bfloat16 or x.stride(-1) != 1:
        return torch.bmm(x[:, None], w)[:, 0]
    return gemv(x, w, cfg)


def dense_config(n: int, k: int, rows: int) -> dict | None:
    """The tuned config for y [rows, n] = x @ W [n, k]^T, or None: cuBLAS."""
    if rows > MAX_ROWS:
        return None
    bucket = min(b for b in ROW_BUCKETS if b >= rows)
    cfg = DENSE_CONFIGS.get((n, k, bucket))
    if cfg is None or cfg.get("BACKEND") == "cublas" or (cfg.get("BACKEND") == "gemv" and rows != 1):
        return None
    return cfg


@triton.jit(do_not_specialize=["M"])  # one compile serves every batch
def _linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, s_xm, s_wn, s_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mm, nm = offs_m < M, offs_n < N
    a_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * s_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * s_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mm[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=nm[:, None], other=0.0)
        else:
            km = (k0 + offs_k) < K
            a = tl.load(a_ptrs, mask=mm[:, None] & km[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=nm[:, None] & km[None, :], other=0.0)
        acc = tl.dot(a.to(DOT), tl.trans(w.to(DOT)), acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dst = y_ptr + offs_m[:, None].to(tl.int64) * s_ym + offs_n[None, :]
    tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


# -- one row: matrix-vector products ------------------------------------------------------------

@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, s_xb, s_wb, s_wk, s_wn, s_yb,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    # y[b, n] = sum_k x[b, k] * w[b, k, n]. Program (n tile, b): BLOCK_N outputs, all of K,
    # float32 FMAs (a tensor-core tile would be 15/16 padding rows). The weight's strides are
    # runtime values; Triton specialises the unit one, so loads vectorize along it whether
    # w is [N, K] row-major (a projection, through w.T) or [K, N] (a head's absorbed matrix).
    pid_n, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    nm = offs_n < N
    x_ptrs = x_ptr + b * s_xb + offs_k
    w_ptrs = w_ptr + b * s_wb + offs_k[:, None] * s_wk + offs_n[None, :].to(tl.int64) * s_wn
    acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:
            xv = tl.load(x_ptrs)
            wv = tl.load(w_ptrs)
        else:
            km = (k0 + offs_k) < K
            xv = tl.load(x_ptrs, mask=km, other=0.0)
            wv = tl.load(w_ptrs, mask=km[:, None] & nm[None, :], other=0.0)
        acc += xv.to(tl.float32)[:, None] * wv.to(tl.float32)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * s_wk
    tl.store(y_ptr + b * s_yb + offs_n, tl.sum(acc, 0).to(y_ptr.dtype.element_ty), mask=nm)


def gemv(x: torch.Tensor, w: torch.Tensor, config: dict) -> torch.Tensor:
    """x [B, K] times w [B, K, N] (any strides; one unit stride reads fastest) -> [B, N] in
    x's dtype, float32 sums: B matrix-vector products in one launch, as ``torch.bmm`` of
    [B, 1, K] by [B, K, N] computes them. ``config``: BLOCK_N, BLOCK_K, num_warps,
    num_stages (tuned per shape by benchmarks/gpu/bench_kernels.py)."""
    check(x, "x", dims=2, dtypes=(torch.bfloat16, torch.float16))
    check(w, "w", dims=3, dtypes=(x.dtype,), device=x.device, last_contiguous=False)
    b, k = x.shape
    n = w.shape[2]
    check_shape(w, "w", (b, k, n))
    y = torch.empty(b, n, dtype=x.dtype, device=x.device)
    if b == 0 or n == 0:
        return y
    bn, bk = config["BLOCK_N"], config["BLOCK_K"]
    _gemv_kernel[(triton.cdiv(n, bn), b)](
        x, w, y, n, k, x.stride(0), w.stride(0), w.stride(1), w.stride(2), y.stride(0),
        BLOCK_N=bn, BLOCK_K=bk, EVEN=k % bk == 0 and n % bn == 0,
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    return y


@triton.jit(do_not_specialize=["S"])
def _merge_gemv_kernel(p_ptr, lse_ptr, w_ptr, y_ptr, N, K, S, s_pb, s_ps, s_lb, s_ls, s_wb, s_wk,
                       s_wn, s_yb, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    # ``_gemv_kernel`` whose row x[b] is the merge of S split partials p[b, s, :] with weights
    # exp2(lse[b, s] - max), computed as mla_decode's merge launch computes it and rounded to
    # y's dtype as that launch stores it. Every program of a row redoes the row's merge from
    # L2: up to 32 splits of 512 (v2-lite's heads) that costs less than the merge's own
    # launch, at 64 and more it costs more (see fast.MERGE_IN_W_UV_MAX_SPLITS).
    pid_n, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    ss = tl.arange(0, BLOCK_S)
    sm = ss < S
    lse = tl.load(lse_ptr + b * s_lb + ss * s_ls, mask=sm, other=float("-inf"))
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # every split empty: a row of zeros
    wt = tl.exp2(lse - mx)
    den = tl.maximum(tl.sum(wt, 0), 1e-30)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    nm = offs_n < N
    p_ptrs = p_ptr + b * s_pb + ss[:, None] * s_ps + offs_k[None, :]
    w_ptrs = w_ptr + b * s_wb + offs_k[:, None] * s_wk + offs_n[None, :].to(tl.int64) * s_wn
    acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:
            pv = tl.load(p_ptrs, mask=sm[:, None], other=0.0)
            wv = tl.load(w_ptrs)
        else:
            km = (k0 + offs_k) < K
            pv = tl.load(p_ptrs, mask=sm[:, None] & km[None, :], other=0.0)
            wv = tl.load(w_ptrs, mask=km[:, None] & nm[None, :], other=0.0)
        xv = to_dtype(tl.sum(pv * wt[:, None], 0) / den, y_ptr.dtype.element_ty).to(tl.float32)
        acc += xv[:, None] * wv.to(tl.float32)
        p_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * s_wk
    tl.store(y_ptr + b * s_yb + offs_n, tl.sum(acc, 0).to(y_ptr.dtype.element_ty), mask=nm)


def merge_fuses(w: torch.Tensor) -> bool:
    """Whether ``merge_bmm_row`` runs as one launch for W_UV weights w (else: torch ops)."""
    cfg = BMM_ROW_CONFIGS.get(tuple(w.shape))
    return cfg is not None and cfg.get("BACKEND") != "torch" and w.dtype == torch.bfloat16


def merge_bmm_row(part: torch.Tensor, lse: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The merge of attention splits, then ``bmm_row``, in one launch where ``merge_fuses(w)``:
    part [B, S, K] float32 (unit-stride K), lse [B, S] float32 (log2-sum-exps; -inf for an
    empty split), w [B, K, N] -> [B, N] in w's dtype. Elsewhere the merge and the product run
    as torch ops, with the merged row rounded to w's dtype as in the fused form."""
    check(part, "part", dims=3, dtypes=(torch.float32,))
    check(lse, "lse", dims=2, dtypes=(torch.float32,), device=part.device, last_contiguous=False)
    check(w, "w", dims=3, dtypes=(torch.bfloat16, torch.float16), device=part.device,
          last_contiguous=False)
    b, s, k = part.shape
    n = w.shape[2]
    check_shape(lse, "lse", (b, s))
    check_shape(w, "w", (b, k, n))
    cfg = BMM_ROW_CONFIGS.get(tuple(w.shape))
    if not merge_fuses(w):
        return bmm_row_with(merge_reference(part, lse).to(w.dtype), w, cfg)
    y = torch.empty(b, n, dtype=w.dtype, device=w.device)
    if b == 0 or n == 0:
        return y
    block_s = next_pow2(s)
    bn, bk = cfg["BLOCK_N"], min(cfg["BLOCK_K"], max(16, 8192 // block_s))  # the partials' tile in registers
    _merge_gemv_kernel[(triton.cdiv(n, bn), b)](
        part, lse, w, y, n, k, s, part.stride(0), part.stride(1), lse.stride(0), lse.stride(1),
        w.stride(0), w.stride(1), w.stride(2), y.stride(0),
        BLOCK_S=block_s, BLOCK_N=bn, BLOCK_K=bk, EVEN=k % bk == 0 and n % bn == 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y


def linear(x: torch.Tensor, w: torch.Tensor, *, config: dict | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype: the tuned kernel where the table (or
    ``config``) names one, else F.linear. A config with "BACKEND": "gemv" (one row) runs
    ``gemv``."""
    cfg = config if config is not None else dense_config(w.shape[0], w.shape[1], x.shape[0])
    if cfg is None or cfg.get("BACKEND") == "cublas" or x.dtype != torch.bfloat16:
        return F.linear(x, w)  # (the tiles were tuned, and multiply, in bfloat16)
    if cfg.get("BACKEND") == "gemv" and x.shape[0] == 1:
        check(x, "x", dims=2, dtypes=(torch.bfloat16,))
        check(w, "w", dims=2, dtypes=(x.dtype,), device=x.device)
        check_shape(w, "w", (None, x.shape[1]))
        return gemv(x, w.t()[None], cfg)
    if cfg.get("BACKEND") == "gemv":
        return F.linear(x, w)
    check(x, "x", dims=2, dtypes=(torch.bfloat16,))
    check(w, "w", dims=2, dtypes=(x.dtype,), device=x.device)
    m, k = x.shape
    n = w.shape[0]
    check_shape(w, "w", (n, k))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    _linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y
