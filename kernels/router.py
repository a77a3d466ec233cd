"""The MoE router after its GEMM, in one launch: sigmoid scores, the correction bias, optional
group-limited routing, the top-k experts by biased score and their (normalized, scaled)
unbiased scores as weights. And the GEMM before it (``router_logits``): bf16 activations
times the float32 gate in float32 arithmetic, in one launch. (``x.float() @ W^T`` through
torch is a conversion copy and cuBLAS's float32 GEMM, which at these shapes is a SIMT or
gemv kernel plus a split-K reduction: three or four launches, 4-6 us a layer on an H200 at
batch 1; at batch 256 cuBLAS's ~10 us beat float32 tiles without tensor cores.) For many
tokens (prefill), ``router_logits_split`` runs that GEMM on tensor cores: the gate split into
three bf16 pieces that sum to it exactly, products exact in float32, sums float32 (3.3x
cuBLAS's float32 GEMM at 4,096 tokens on an H200, within 1e-5 of the largest logit; through
the whole model no gain was measured, so the fast path uses it only when asked).

torch.topk at these sizes launches a gather-top-k and a bitonic sort per layer (~10 us on an
H200 at batch 1); here one program holds a few whole rows in registers and takes the top k
by k arg-max reductions, so nothing leaves the chip between the GEMM and the experts.

A row is held as [groups, experts per group] (one group when routing is not group-limited),
so each group's top two are one reduction over the last axis; the top k are taken over the
row flattened. Ties go to the lowest expert (or group) index; a NaN ranks above every
number, as in torch.topk. On the GPU the sigmoid is computed as torch's CUDA kernel computes
it (precise exp, correctly rounded division), so ids match the eager reference bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._util import DOT, INTERPRET, check, check_shape, next_pow2

MAX_EXPERTS = 1024  # a row lives in registers
MAX_TOP_K = 32  # the arg-max loop is unrolled
_PRECISE = tl.constexpr(not INTERPRET)  # the interpreter has no libdevice


@triton.jit
def _sigmoid(x, PRECISE: tl.constexpr):
    if PRECISE:
        return tl.div_rn(1.0, 1.0 + libdevice.exp(-x))
    else:
        return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _first_at(x, top, idx, NONE: tl.constexpr, AXIS: tl.constexpr):
    """The lowest index along AXIS where x equals its maximum `top` (NONE where nothing does)."""
    return tl.min(tl.where(x == tl.expand_dims(top, AXIS), idx, NONE), AXIS)


@triton.jit
def _moe_route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, T, s_logit, s_w, s_ids, scaling, shared_first,
                      E: tl.constexpr, GS: tl.constexpr, TOP_K: tl.constexpr,
                      TOPK_GROUP: tl.constexpr, GROUPED: tl.constexpr, NORM: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GS: tl.constexpr,
                      BLOCK_K: tl.constexpr, SHARED: tl.constexpr):
    # SHARED > 0: columns TOP_K .. TOP_K + SHARED - 1 are every token's pick of the shared
    # experts fused as slots shared_first.., with weight 1 (see models.fast's fuse_shared).
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    g, s = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_GS)
    expert = g[:, None] * GS + s[None, :]  # [BLOCK_G, BLOCK_GS]
    real_g = g * GS < E
    real = real_g[:, None] & (s[None, :] < GS)
    row_ok = rows < T
    ok = row_ok[:, None, None] & real[None, :, :]
    logit = tl.load(logits_ptr + rows.to(tl.int64)[:, None, None] * s_logit + expert[None, :, :],
                    mask=ok, other=0.0)
    scores = _sigmoid(logit, _PRECISE)
    choice = scores + tl.load(bias_ptr + expert, mask=real, other=0.0)[None, :, :]
    choice = tl.where(choice != choice, float("inf"), choice)  # NaN first, as torch.topk
    choice = tl.where(ok, choice, float("-inf"))
    if GROUPED:
        # Keep the TOPK_GROUP groups with the best sums of their top two.
        top1 = tl.max(choice, 2)
        arg1 = _first_at(choice, top1, s[None, None, :], BLOCK_GS, 2)
        top2 = tl.max(tl.where(s[None, None, :] == arg1[:, :, None], float("-inf"), choice), 2)
        group = tl.where(real_g[None, :], top1 + top2, float("-inf"))
        kept = tl.zeros([BLOCK_T, BLOCK_G], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            best = _first_at(group, tl.max(group, 1), g[None, :], BLOCK_G, 1)
            hit = g[None, :] == best[:, None]
            kept = tl.where(hit, 1, kept)
            group = tl.where(hit, float("-inf"), group)
        choice = tl.where(kept[:, :, None] != 0, choice, float("-inf"))
    flat = tl.reshape(choice, [BLOCK_T, BLOCK_G * BLOCK_GS])
    flat_scores = tl.reshape(scores, [BLOCK_T, BLOCK_G * BLOCK_GS])
    pos = tl.arange(0, BLOCK_G * BLOCK_GS)
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        p = _first_at(flat, tl.max(flat, 1), pos[None, :], BLOCK_G * BLOCK_GS, 1)
        taken = pos[None, :] == p[:, None]
        flat = tl.where(taken, float("-inf"), flat)
        # A sum over one non-zero: exactly the chosen score, off the arg-max chain.
        score = tl.sum(tl.where(taken, flat_scores, 0.0), 1)
        ids = tl.where(kk[None, :] == j, ((p // BLOCK_GS) * GS + p % BLOCK_GS)[:, None], ids)
        w = tl.where(kk[None, :] == j, score[:, None], w)
    if NORM:
        w = tl.div_rn(w, tl.sum(w, 1)[:, None] + 1e-20)
    w = w * scaling
    ids = ids.to(tl.int64)
    if SHARED > 0:
        extra = (kk[None, :] >= TOP_K) & (kk[None, :] < TOP_K + SHARED)
        w = tl.where(extra, 1.0, w)
        ids = tl.where(extra, (shared_first + kk - TOP_K).to(tl.int64)[None, :], ids)
    out = row_ok[:, None] & (kk[None, :] < TOP_K + SHARED)
    r = rows.to(tl.int64)[:, None]
    tl.store(w_ptr + r * s_w + kk[None, :], w, mask=out)
    tl.store(ids_ptr + r * s_ids + kk[None, :], ids, mask=out)


@triton.jit
def _router_gemm_kernel(x_ptr, w_ptr, out_ptr, T, H, s_x, s_w, s_o, E,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT: tl.constexpr):
    """out[t, e] = sum_k float(x[t, k]) * w[e, k], float32 FMAs (no tensor cores: tf32 would
    round the operands). A program: BLOCK_T tokens by BLOCK_E experts; DOT: through tl.dot's
    IEEE path (tiles of 16 and up), else a broadcast product summed over k (a token or a few:
    small tiles, so that many programs share the gate's read)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    rm, cm = rows < T, cols < E
    x_row = x_ptr + rows.to(tl.int64)[:, None] * s_x
    w_row = w_ptr + cols.to(tl.int64)[:, None] * s_w
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < H
        x = tl.load(x_row + k[None, :], mask=rm[:, None] & km[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_row + k[None, :], mask=cm[:, None] & km[None, :], other=0.0)
        if DOT:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.sum(x[:, None, :] * w[None, :, :], 2)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * s_o + cols[None, :], acc, mask=rm[:, None] & cm[None, :])


def router_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Router logits (T, E) float32 of activations x (T, H) bf16/fp16/fp32 and the gate's
    weight w (E, H) float32: ``x.float() @ w.T``, summed in float32 in another order than
    cuBLAS (the two differ by rounding)."""
    check(x, "x", dims=2, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    check(w, "w", dims=2, dtypes=(torch.float32,), device=x.device)
    t, h = x.shape
    e = w.shape[0]
    check_shape(w, "w", (e, h))
    out = torch.empty(t, e, dtype=torch.float32, device=x.device)
    if t == 0 or e == 0:
        return out
    # Few tokens: the gate's read is the cost, spread over many programs (4 experts each,
    # 2.4 us a layer for v2-lite at batch 1 on an H200). More: 16 x 16 tiles through tl.dot
    # (the broadcast form took 65 us at batch 256, this 44 us: cuBLAS does better there, and
    # the fast path calls this only for a few tokens).
    dot = t > 8
    block_t, block_e = (16, 16) if dot else (next_pow2(t), 4)
    block_k = 64 if dot else min(2048 // (block_t * block_e) * 4, next_pow2(h))
    _router_gemm_kernel[(triton.cdiv(t, block_t), triton.cdiv(e, block_e))](
        x, w, out, t, h, x.stride(0), w.stride(0), out.stride(0), e,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=max(16, block_k), DOT=dot, num_warps=4)
    return out


def split_gate(w: torch.Tensor) -> torch.Tensor | None:
    """The float32 gate w (E, H) as three bf16 pieces [3, E, H] (hi, mid, lo) whose float32
    sum is w exactly (8 significand bits each: 24 in all; only subnormal residues are lost),
    for ``router_logits_split``; None where a piece would not be finite (values near the
    float32 maximum)."""
    check(w, "w", dims=2, dtypes=(torch.float32,))
    hi = w.to(torch.bfloat16)
    r = w - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    out = torch.stack([hi, mid, lo])
    return out if bool(torch.isfinite(out).all()) else None


@triton.jit
def _router_gemm_split_kernel(x_ptr, w_ptr, out_ptr, T, H, E, s_x, s_wp, s_we, s_o,
                              BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[t, e] = sum_k x[t, k] * (hi + mid + lo)[e, k] on tensor cores: each product of two
    bf16 values is exact in float32, and the sums are float32 (hi's apart from the smaller
    pieces', which are added last)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    rm, cm = rows < T, cols < E
    x_row = x_ptr + rows.to(tl.int64)[:, None] * s_x
    w_row = w_ptr + cols.to(tl.int64)[:, None] * s_we
    acc_hi = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    acc_lo = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < H
        x = tl.load(x_row + k[None, :], mask=rm[:, None] & km[None, :], other=0.0).to(DOT)
        wm = cm[:, None] & km[None, :]
        w0 = tl.load(w_row + k[None, :], mask=wm, other=0.0).to(DOT)
        w1 = tl.load(w_row + s_wp + k[None, :], mask=wm, other=0.0).to(DOT)
        w2 = tl.load(w_row + 2 * s_wp + k[None, :], mask=wm, other=0.0).to(DOT)
        acc_hi = tl.dot(x, tl.trans(w0), acc_hi)
        acc_lo = tl.dot(x, tl.trans(w1), acc_lo)
        acc_lo = tl.dot(x, tl.trans(w2), acc_lo)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * s_o + cols[None, :], acc_hi + acc_lo,
             mask=rm[:, None] & cm[None, :])


# Tiles of router_logits_split by token bucket (the largest at or below T wins); BLOCK_E is
# min(64, the experts' power of two). Tuned on an H200 by benchmarks/gpu/bench_kernels.py.
ROUTER_SPLIT_CONFIGS: dict[int, dict] = {
    16: {'BLOCK_T': 16, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4},
    64: {'BLOCK_T': 16, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4},
    256: {'BLOCK_T': 16, 'BLOCK_K': 256, 'num_warps': 8, 'num_stages': 3},
    1024: {'BLOCK_T': 16, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4},
    4096: {'BLOCK_T': 32, 'BLOCK_K': 64, 'num_warps': 4, 'num_stages': 4},
}
ROUTER_SPLIT_DEFAULT = {"BLOCK_T": 16, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}


def router_split_config(t: int) -> dict:
    bucket = max([b for b in ROUTER_SPLIT_CONFIGS if b <= t], default=None)
    return {**ROUTER_SPLIT_DEFAULT, **ROUTER_SPLIT_CONFIGS.get(bucket, {})}


def router_logits_split(x: torch.Tensor, w3: torch.Tensor, *, config: dict | None = None) -> torch.Tensor:
    """Router logits (T, E) float32 of bf16 activations x (T, H) and a gate split by
    ``split_gate`` (w3 [3, E, H] bf16): the float32 GEMM ``x.float() @ w.T`` in one launch on
    tensor cores, with no float32 copy of x (summed in another order than cuBLAS: the two
    differ by rounding)."""
    check(x, "x", dims=2, dtypes=(torch.bfloat16,))
    check(w3, "w3", dims=3, dtypes=(torch.bfloat16,), device=x.device)
    t, h = x.shape
    e = w3.shape[1]
    check_shape(w3, "w3", (3, e, h))
    if w3.stride(2) != 1:
        raise ValueError(f"w3 must have unit stride along H, got strides {tuple(w3.stride())}")
    out = torch.empty(t, e, dtype=torch.float32, device=x.device)
    if t == 0 or e == 0:
        return out
    cfg = {**router_split_config(t), **(config or {})}
    block_e = min(64, max(16, next_pow2(e)))
    block_t, block_k = cfg["BLOCK_T"], min(cfg["BLOCK_K"], max(16, next_pow2(h)))
    _router_gemm_split_kernel[(triton.cdiv(t, block_t), triton.cdiv(e, block_e))](
        x, w3, out, t, h, e, x.stride(0), w3.stride(0), w3.stride(1), out.stride(0),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def moe_route_unsupported(num_experts: int, top_k: int, n_group: int, topk_group: int) -> str | None:
    """Why `moe_route` cannot route with these settings, or None when it can."""
    e = num_experts
    if not 1 <= e <= MAX_EXPERTS:
        return f"the router kernel takes 1 to {MAX_EXPERTS} experts, not {e}"
    if not 1 <= top_k <= min(e, MAX_TOP_K):
        return f"top_k must be in [1, {min(e, MAX_TOP_K)}] for {e} experts, got {top_k}"
    if n_group < 1 or topk_group < 1:
        return f"n_group and topk_group must be positive, got {n_group} and {topk_group}"
    if topk_group < n_group:
        if e % n_group or e // n_group < 2:
            return (f"group-limited routing needs the {e} experts in n_group={n_group} equal "
                    "groups of at least two")
        if top_k > topk_group * (e // n_group):
            return (f"top_k={top_k} exceeds the {topk_group * (e // n_group)} experts of the "
                    f"topk_group={topk_group} groups kept")
    return None


def _launch(t: int, block_e: int) -> tuple[int, int]:
    """(tokens per program, warps). Untuned: one token a program, one warp per 256 experts
    (several tokens a program gave wrong group-limited ids on the H200, 2026-11-29, though
    not in the interpreter). The interpreter runs programs one after another, so it gets
    many rows each."""
    if INTERPRET:
        return min(next_pow2(t), 64), 1
    return 1, max(1, min(8, block_e // 256))


def moe_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
              topk_group: int, norm_topk_prob: bool,
              scaling: float, shared: tuple[int, int] = (0, 0)) -> tuple[torch.Tensor, torch.Tensor]:
    """Route tokens from their router logits (T, E) float32 (x.float() @ W^T) and the
    correction bias (E,) float32: (weights (T, top_k) float32, ids (T, top_k) int64), ids in
    descending order of biased score. Group-limited when topk_group < n_group.

    ``shared`` = (first, count): append ``count`` columns holding ids first.. and weight 1,
    every token's pick of shared experts fused as expert slots (two concatenations fewer a
    layer than adding them afterwards)."""
    check(logits, "logits", dims=2, dtypes=(torch.float32,))
    check(bias, "bias", dims=1, dtypes=(torch.float32,), device=logits.device)
    t, e = logits.shape
    check_shape(bias, "bias", (e,))
    why = moe_route_unsupported(e, top_k, n_group, topk_group)
    if why is not None:
        raise ValueError(why)
    first, count = shared
    if count < 0 or (count and first < e):
        raise ValueError(f"shared=(first, count) must name {count} slots at or after the {e} routed "
                         f"experts, got first={first}")
    weights = torch.empty(t, top_k + count, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k + count, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    grouped = topk_group < n_group
    groups = n_group if grouped else 1
    gs = e // groups
    block_g, block_gs = next_pow2(groups), next_pow2(gs)
    block_t, warps = _launch(t, block_g * block_gs)
    _moe_route_kernel[(triton.cdiv(t, block_t),)](
        logits, bias, weights, ids, t, logits.stride(0), weights.stride(0), ids.stride(0),
        float(scaling), first, E=e, GS=gs, TOP_K=top_k, TOPK_GROUP=topk_group, GROUPED=grouped,
        NORM=bool(norm_topk_prob), BLOCK_T=block_t, BLOCK_G=block_g, BLOCK_GS=block_gs,
        BLOCK_K=next_pow2(top_k + count), SHARED=count, num_warps=warps)
    return weights, ids


def moe_route_reference(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                        topk_group: int, norm_topk_prob: bool,
                        scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's `route` after its GEMM, in plain torch."""
    scores = logits.sigmoid()
    choice = scores + bias
    if topk_group < n_group:
        grouped = choice.view(logits.shape[0], n_group, -1)
        keep = grouped.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
        mask = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=logits.device)
        choice = grouped.masked_fill(~mask.scatter_(1, keep, True)[..., None], float("-inf")).flatten(1)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids
