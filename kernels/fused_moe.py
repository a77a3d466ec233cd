"""Fused MoE for the routed experts: align, gate/up GEMM with SiLU·mul, down GEMM with the
routing weight, and the sum over each token's top-k.

1. align (``moe_align``, its own module): the T*k (token, slot) pairs are grouped by expert
   into blocks of BLOCK_M rows, each expert's rows padded to a whole block, so every block of
   the grouped GEMMs reads one expert's weights; padding rows hold the sentinel T*k. At one token
   (PAIR_BLOCKS_MAX_TOKENS) there is no align: each pair is a block, in pair order.
2. up: per (block, tile of I) program, act = silu(x W_gate^T) * (x W_up^T) from the fused
   gate_up weight [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up, the layout of the model's
   `Experts`); act stays bf16 in a [T*k, I] buffer.
3. down: y = weight * (act W_down^T) from [E, H, I], into a [T*k, H] buffer.
4. sum: out[t] = sum over the k slots, in slot order (deterministic, no atomics); with
   ``reduce=False`` left to the caller (``moe_sum_reference``, fused into its next step).

At decode sizes the expert weights dominate the bytes: every block streams its expert's
weights once, so the grid puts blocks of one expert side by side (they share tiles in L2).
FP8 weights (e4m3fn with one float32 scale per 128x128 block, DeepSeek's layout) are
widened in registers and the activations keep 16 bits (W8A16): the bytes halve and nothing is
lost on the activation side. In the gate/up GEMM both operands are float16: e4m3 widens to
float16 in one instruction per pair (to bfloat16 in about four, which left that loop
issue-bound at half the bandwidth), and its input, the normed hidden state, is far inside
float16's range. The down GEMM keeps bfloat16: SiLU(gate)*up can reach beyond 65504. Expert ids outside [0, E) (experts held by another
rank) contribute nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._util import DOT, DOT16, FP8, FP8_MAX, INTERPRET, check, check_shape, hopper_or_later, next_pow2, to_dtype
from .moe_align import moe_align

QBLOCK = 128  # FP8 weight scale block (rows and columns)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)

# Tuned on an H200 by benchmarks/gpu/bench_kernels.py (2026-11-29 run; v2-lite's layer):
# (E, H, I, "bf16" | "fp8", token bucket) -> {"BLOCK_M": .., "up": {..}, "down": {..}}. The
# two GEMMs have different shapes (up: N = 2I, K = H; down: N = H, K = I); bench_kernels.py now
# tunes their tiles apart (64 tokens and up) once BLOCK_M (the alignment both read) is chosen,
# but only the bf16 256-token entry below comes from such a run so far (and the bf16 one-token
# entry, tuned apart for the pair blocks by a probe in session 11).
# TMA (optional, False by default; untimed, session 17): the weight tiles as tensor-descriptor
# bulk copies (Hopper and later) instead of per-thread async copies; compiled for sm_90 the up
# GEMM's weight loads become cp.async.bulk.tensor, pipelined num_stages deep.
def _tiles(bm: int, bn: int, bk: int, warps: int, stages: int) -> dict:
    t = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
    return {"BLOCK_M": bm, "up": t, "down": dict(t)}


MOE_CONFIGS: dict[tuple, dict] = {
    # one token, a block per pair, up and down tuned apart (2026-11-30, session 11): 44.95 ->
    # 44.07 us a layer, v2-lite's step 2.466 -> 2.442 ms at batch 1. The bucket also serves 2-7
    # tokens, through the aligned path, where these tiles were not timed.
    (64, 2048, 1408, 'bf16', 1): {'BLOCK_M': 16, 'up': {'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}, 'down': {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}},
    (64, 2048, 1408, 'fp8', 1): {'BLOCK_M': 16, 'up': {'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}, 'down': {'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}},
    (64, 2048, 1408, 'bf16', 8): {'BLOCK_M': 16, 'up': {'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}, 'down': {'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}},
    (64, 2048, 1408, 'fp8', 8): {'BLOCK_M': 16, 'up': {'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 5}, 'down': {'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 5}},
    (64, 2048, 1408, 'bf16', 64): {'BLOCK_M': 16, 'up': {'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 5}, 'down': {'BLOCK_N': 32, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 5}},
    (64, 2048, 1408, 'fp8', 64): {'BLOCK_M': 16, 'up': {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4}, 'down': {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 4}},
    # up and down tuned apart (2026-11-30, session 10): 308 -> 300 us a layer at 256 tokens
    (64, 2048, 1408, 'bf16', 256): {'BLOCK_M': 32, 'up': {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}, 'down': {'BLOCK_N': 128, 'BLOCK_K': 64, 'num_warps': 4, 'num_stages': 3}},
    (64, 2048, 1408, 'fp8', 256): {'BLOCK_M': 32, 'up': {'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}, 'down': {'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}},
    # A DEP2 rank's half of the experts over the direct exchange's receive rows (one term a
    # row, half of the rows taken; bench_kernels.py --only moe_ep, 2026-11-30, session 14):
    # pads 64 and 256 give 768 and 3,072 rows. 165.6 -> 151.8 and 186.5 -> 164.6 us a layer
    # (with the sum launch and the copy gone).
    (32, 2048, 1408, 'bf16', 512): {'BLOCK_M': 16, 'up': {'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}, 'down': {'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3}},
    (32, 2048, 1408, 'bf16', 1024): {'BLOCK_M': 64, 'up': {'BLOCK_N': 64, 'BLOCK_K': 64, 'num_warps': 4, 'num_stages': 3}, 'down': {'BLOCK_N': 128, 'BLOCK_K': 64, 'num_warps': 4, 'num_stages': 4}},
}


def default_moe_config(tokens: int, top_k: int, experts: int) -> dict:
    per_expert = tokens * top_k / max(experts, 1)
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    if bm == 64:
        up = {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
        down = {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    else:
        up = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
        down = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": bm, "up": up, "down": down}


def moe_config(e: int, h: int, i: int, fp8: bool, tokens: int, top_k: int) -> dict:
    """The tuned config of this shape and token bucket; failing that, one tuned for the same
    expert shape with another expert count (the shared experts fused as extra slots add a
    few: the tiles that suit an expert's weights stay the same); else the default."""
    bucket = max([b for b in TOKEN_BUCKETS if b <= tokens], default=1)
    kind = "fp8" if fp8 else "bf16"
    found = MOE_CONFIGS.get((e, h, i, kind, bucket))
    if found is None:  # within a quarter of the count: a rank's half of the experts is not near
        near = sorted((abs(k[0] - e), k) for k in MOE_CONFIGS
                      if k[1:] == (h, i, kind, bucket) and 4 * abs(k[0] - e) <= max(k[0], e))
        found = MOE_CONFIGS[near[0][1]] if near else None
    return found or default_moe_config(tokens, top_k, e)


# Up to this many tokens the pairs run a block each in pair order, with no alignment launch.
# A token's experts are distinct, so at one token no weight is read twice; at two, the
# experts both tokens pick (the shared ones, at least) would be.
PAIR_BLOCKS_MAX_TOKENS = 1


# -- up: gate/up GEMM, SiLU·mul -------------------------------------------------------------

@triton.jit(do_not_specialize=["n_pairs", "top_k", "experts"])
def _moe_up_kernel(x_ptr, w_ptr, ws_ptr, act_ptr, sorted_ptr, blk_expert_ptr, total_ptr,
                   n_pairs, top_k, inter, hidden, experts,
                   s_xt, s_we, s_wn, s_se, s_sn, s_sk, s_at,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   QUANT: tl.constexpr, EVEN_K: tl.constexpr, PAIRS: tl.constexpr,
                   TMA: tl.constexpr = False):
    # TMA: w_ptr is a tensor descriptor over the weights as [E * 2I, H] rows (``_weight_desc``):
    # each weight tile arrives by bulk copies; rows past an expert's read the next ones (their
    # columns are masked), rows and columns past the tensor read zeros.
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if PAIRS:  # a block per pair, in pair order: blk_expert_ptr is the ids themselves
        e = tl.load(blk_expert_ptr + pid_m).to(tl.int64)
        if (e < 0) | (e >= experts):
            return
        flat = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, n_pairs)
    else:
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        e = tl.load(blk_expert_ptr + pid_m).to(tl.int64)
        flat = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = flat < n_pairs
    tok = (flat // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * s_xt + offs_k[None, :]
    if TMA:
        row_g = (e * (2 * inter) + pid_n * BLOCK_N).to(tl.int32)
    else:
        g_ptrs = w_ptr + e * s_we + offs_n[:, None].to(tl.int64) * s_wn + offs_k[None, :]
        u_ptrs = g_ptrs + inter * s_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
        else:
            km = (k0 + offs_k) < hidden
            a = tl.load(a_ptrs, mask=valid[:, None] & km[None, :], other=0.0)
        if TMA:  # rows past an expert's gate part read its up part: their columns are masked
            wg = w_ptr.load([row_g, k0])
            wu = w_ptr.load([row_g + inter, k0])
        elif EVEN_K:
            wg = tl.load(g_ptrs, mask=nm[:, None], other=0.0)
            wu = tl.load(u_ptrs, mask=nm[:, None], other=0.0)
        else:
            wg = tl.load(g_ptrs, mask=nm[:, None] & km[None, :], other=0.0)
            wu = tl.load(u_ptrs, mask=nm[:, None] & km[None, :], other=0.0)
        if QUANT:  # float16 operands: see the module notes
            a, wg, wu = a.to(DOT16), wg.to(DOT16), wu.to(DOT16)
        else:
            a, wg, wu = a.to(DOT), wg.to(DOT), wu.to(DOT)
        if QUANT:  # BLOCK_K divides 128: one scale column per tile, one scale row per 128 rows
            sp = ws_ptr + e * s_se + (k0 // 128) * s_sk
            sg = tl.load(sp + (offs_n // 128) * s_sn, mask=nm, other=0.0)
            su = tl.load(sp + ((offs_n + inter) // 128) * s_sn, mask=nm, other=0.0)
            acc_g += tl.dot(a, tl.trans(wg)) * sg[None, :]
            acc_u += tl.dot(a, tl.trans(wu)) * su[None, :]
        else:
            acc_g = tl.dot(a, tl.trans(wg), acc_g)
            acc_u = tl.dot(a, tl.trans(wu), acc_u)
        a_ptrs += BLOCK_K
        if not TMA:
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    dst = act_ptr + flat[:, None].to(tl.int64) * s_at + offs_n[None, :]
    tl.store(dst, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & nm[None, :])


# -- down: down GEMM times the routing weight ------------------------------------------------

@triton.jit(do_not_specialize=["n_pairs", "experts"])
def _moe_down_kernel(act_ptr, w_ptr, ws_ptr, y_ptr, topw_ptr, sorted_ptr, blk_expert_ptr,
                     total_ptr, n_pairs, hidden, inter, experts,
                     s_at, s_we, s_wn, s_se, s_sn, s_sk, s_yt,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     QUANT: tl.constexpr, EVEN_K: tl.constexpr, PAIRS: tl.constexpr,
                     TMA: tl.constexpr = False):
    # TMA: w_ptr is a tensor descriptor over the weights as [E * H, I] rows (as in the up kernel)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if PAIRS:  # as in the up kernel
        e = tl.load(blk_expert_ptr + pid_m).to(tl.int64)
        if (e < 0) | (e >= experts):
            return
        flat = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, n_pairs)
    else:
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        e = tl.load(blk_expert_ptr + pid_m).to(tl.int64)
        flat = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = flat < n_pairs
    rows = flat.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * s_at + offs_k[None, :]
    if TMA:
        row_w = (e * hidden + pid_n * BLOCK_N).to(tl.int32)
    else:
        w_ptrs = w_ptr + e * s_we + offs_n[:, None].to(tl.int64) * s_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0).to(DOT)
        else:
            km = (k0 + offs_k) < inter
            a = tl.load(a_ptrs, mask=valid[:, None] & km[None, :], other=0.0).to(DOT)
        if TMA:  # rows past an expert's read the next one's: their columns are masked
            w = w_ptr.load([row_w, k0]).to(DOT)
        elif EVEN_K:
            w = tl.load(w_ptrs, mask=nm[:, None], other=0.0).to(DOT)
        else:
            w = tl.load(w_ptrs, mask=nm[:, None] & km[None, :], other=0.0).to(DOT)
        if QUANT:
            s = tl.load(ws_ptr + e * s_se + (offs_n // 128) * s_sn + (k0 // 128) * s_sk,
                        mask=nm, other=0.0)
            acc += tl.dot(a, tl.trans(w)) * s[None, :]
        else:
            acc = tl.dot(a, tl.trans(w), acc)
        a_ptrs += BLOCK_K
        if not TMA:
            w_ptrs += BLOCK_K
    acc *= tl.load(topw_ptr + rows, mask=valid, other=0.0)[:, None]
    dst = y_ptr + rows[:, None] * s_yt + offs_n[None, :]
    tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & nm[None, :])


# -- sum over the top-k slots ----------------------------------------------------------------

@triton.jit(do_not_specialize=["top_k"])
def _moe_sum_kernel(y_ptr, ids_ptr, out_ptr, top_k, hidden, experts, s_yt, s_ot,
                    BLOCK: tl.constexpr):
    t, c = tl.program_id(0), tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    hm = offs < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(top_k):
        row = t * top_k + j
        e = tl.load(ids_ptr + row)
        ok = (e >= 0) & (e < experts)  # rows of foreign experts were never written
        acc += tl.load(y_ptr + row.to(tl.int64) * s_yt + offs, mask=hm & ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * s_ot + offs, to_dtype(acc, out_ptr.dtype.element_ty), mask=hm)


def _check_moe(x, w13, w2, topk_weights, topk_ids, s13, s2) -> bool:
    dev = x.device
    check(x, "x", dims=2, dtypes=(torch.bfloat16, torch.float16))
    check(w13, "w_gate_up", dims=3, dtypes=(x.dtype, FP8), device=dev)
    check(w2, "w_down", dims=3, dtypes=(w13.dtype,), device=dev)
    check(topk_weights, "topk_weights", dims=2, dtypes=(torch.float32,), device=dev)
    check(topk_ids, "topk_ids", dims=2, dtypes=(torch.int32, torch.int64), device=dev)
    t, h = x.shape
    e, i2 = w13.shape[0], w13.shape[1]
    if i2 % 2:
        raise ValueError(f"w_gate_up must be [E, 2I, H] (gate rows then up rows); got {tuple(w13.shape)}")
    check_shape(w13, "w_gate_up", (e, i2, h))
    check_shape(w2, "w_down", (e, h, i2 // 2))
    check_shape(topk_ids, "topk_ids", (t, None))
    check_shape(topk_weights, "topk_weights", tuple(topk_ids.shape))
    if not (topk_ids.is_contiguous() and topk_weights.is_contiguous()):
        raise ValueError("topk_ids and topk_weights must be contiguous: pass .contiguous() copies")
    quant = w13.dtype == FP8
    for s, w, name in ((s13, w13, "w_gate_up_scale"), (s2, w2, "w_down_scale")):
        if quant:
            if s is None:
                raise ValueError(f"FP8 weights need {name} [E, ceil(N/128), ceil(K/128)] float32")
            check(s, name, dims=3, dtypes=(torch.float32,), device=dev, last_contiguous=False)
            check_shape(s, name, (e, triton.cdiv(w.shape[1], QBLOCK), triton.cdiv(w.shape[2], QBLOCK)))
        elif s is not None:
            raise ValueError(f"{name} is only for FP8 weights; these are {w.dtype}")
    return quant


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              w_gate_up_scale: torch.Tensor | None = None,
              w_down_scale: torch.Tensor | None = None, config: dict | None = None,
              reduce: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, j].

    x [T, H] bf16/fp16; w_gate_up [E, 2I, H] and w_down [E, H, I] in x's dtype, or e4m3fn with
    w_*_scale [E, ceil(N/128), ceil(K/128)] float32 (N, K: the weight's last two dims);
    topk_weights [T, k] float32; topk_ids [T, k] int32/int64. Returns [T, H] in x's dtype.

    ``reduce=False`` returns the weighted terms [T, k, H] unsummed, for a caller that sums
    them in its next step (one launch fewer): the rows of ids outside [0, E) are left
    unwritten, so that sum must mask them (``moe_sum_reference``). ``out`` (with
    ``reduce=False``): where those terms go, [T, k, H] contiguous or, with k = 1, [T, H] rows
    of any stride (an expert-parallel rank's receive area: no copy afterwards); it is what
    is returned then, in its own shape.

    Up to PAIR_BLOCKS_MAX_TOKENS tokens (one) the pairs run a block each, in pair order, with
    no alignment launch: a token's experts are distinct, so no weight is read twice."""
    quant = _check_moe(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale)
    t, h = x.shape
    e, inter = w_gate_up.shape[0], w_down.shape[2]
    k = topk_ids.shape[1]
    if out is not None:
        _check_out(out, t, k, h, x, reduce)
    if t == 0:
        return torch.empty_like(x) if reduce else (out if out is not None else x.new_empty(0, k, h))
    cfg = config or moe_config(e, h, inter, quant, t, k)
    bm, up, down = cfg["BLOCK_M"], cfg["up"], cfg["down"]
    if quant and (QBLOCK % up["BLOCK_K"] or QBLOCK % down["BLOCK_K"]):
        raise ValueError(f"FP8 weights need BLOCK_K dividing {QBLOCK}; config has "
                         f"{up['BLOCK_K']} / {down['BLOCK_K']}")
    n_pairs = t * k
    pairs = t <= PAIR_BLOCKS_MAX_TOKENS
    if pairs:
        sorted_ids = total = blk_expert = topk_ids  # the kernels read the ids as the block table
        blocks = n_pairs
    else:
        sorted_ids, blk_expert, total = moe_align(topk_ids, e, bm)
        blocks = blk_expert.numel()
    act = torch.empty(n_pairs, inter, dtype=x.dtype, device=x.device)
    if out is None:
        y = torch.empty(n_pairs, h, dtype=x.dtype, device=x.device)
    else:
        y = out if out.dim() == 2 else out.view(n_pairs, h)
    s13 = w_gate_up_scale if quant else topk_weights.view(1, 1, -1)  # unused pointer otherwise
    s2 = w_down_scale if quant else topk_weights.view(1, 1, -1)
    tma = bool(cfg.get("TMA", False)) and _tma_ok(w_gate_up) and _tma_ok(w_down)
    w13 = _weight_desc(w_gate_up, up["BLOCK_N"], up["BLOCK_K"]) if tma else w_gate_up
    w2 = _weight_desc(w_down, down["BLOCK_N"], down["BLOCK_K"]) if tma else w_down
    _moe_up_kernel[(blocks, triton.cdiv(inter, up["BLOCK_N"]))](
        x, w13, s13, act, sorted_ids, blk_expert, total, n_pairs, k, inter, h, e,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
        s13.stride(0), s13.stride(1), s13.stride(2), act.stride(0),
        BLOCK_M=bm, BLOCK_N=up["BLOCK_N"], BLOCK_K=up["BLOCK_K"], QUANT=quant,
        EVEN_K=h % up["BLOCK_K"] == 0, PAIRS=pairs, TMA=tma, num_warps=up["num_warps"],
        num_stages=up["num_stages"])
    _moe_down_kernel[(blocks, triton.cdiv(h, down["BLOCK_N"]))](
        act, w2, s2, y, topk_weights, sorted_ids, blk_expert, total, n_pairs, h, inter, e,
        act.stride(0), w_down.stride(0), w_down.stride(1),
        s2.stride(0), s2.stride(1), s2.stride(2), y.stride(0),
        BLOCK_M=bm, BLOCK_N=down["BLOCK_N"], BLOCK_K=down["BLOCK_K"], QUANT=quant,
        EVEN_K=inter % down["BLOCK_K"] == 0, PAIRS=pairs, TMA=tma, num_warps=down["num_warps"],
        num_stages=down["num_stages"])
    if not reduce:
        return out if out is not None else y.view(t, k, h)
    out = torch.empty_like(x)
    block = min(1024, next_pow2(h))
    _moe_sum_kernel[(t, triton.cdiv(h, block))](y, topk_ids, out, k, h, e, y.stride(0),
                                                out.stride(0), BLOCK=block, num_warps=4)
    return out


def _tma_ok(w: torch.Tensor) -> bool:
    """Whether the weight tiles can be bulk copies (config TMA): Hopper or later (or the
    interpreter), contiguous weights on 16-byte boundaries."""
    if not INTERPRET and not (w.device.type == "cuda" and hopper_or_later(w.device)):
        return False
    return w.is_contiguous() and w.data_ptr() % 16 == 0 and (w.shape[-1] * w.element_size()) % 16 == 0


def _weight_desc(w: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """A tensor descriptor over ``w`` [E, N, K] as [E * N, K] rows, in [block_n, block_k]
    tiles. Built per call (~2 us; the launcher encodes it at every launch anyway), and with no
    view of ``w``, so it holds nothing longer than the call."""
    e, n, k = w.shape
    return TensorDescriptor(w, [e * n, k], [k, 1], [block_n, block_k])


def _check_out(out: torch.Tensor, t: int, k: int, h: int, x: torch.Tensor, reduce: bool) -> None:
    if reduce:
        raise ValueError("fused_moe: out= takes the unsummed terms; pass reduce=False with it")
    if out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"fused_moe: out must be {x.dtype} on {x.device}, got {out.dtype} on {out.device}")
    if out.dim() == 2:
        if k != 1 or tuple(out.shape) != (t, h) or out.stride(1) != 1 or (t > 1 and out.stride(0) < h):
            raise ValueError(f"fused_moe: a 2-D out needs k = 1 and shape ({t}, {h}) with unit-stride rows "
                             f"that do not overlap; got k = {k}, shape {tuple(out.shape)}, strides {out.stride()}")
    elif tuple(out.shape) != (t, k, h) or not out.is_contiguous():
        raise ValueError(f"fused_moe: out must be a contiguous ({t}, {k}, {h}) tensor (or ({t}, {h}) with "
                         f"k = 1), got shape {tuple(out.shape)}")


# -- references --------------------------------------------------------------------------------

def moe_sum_reference(y: torch.Tensor, topk_ids: torch.Tensor, experts: int) -> torch.Tensor:
    """What the last launch of ``fused_moe`` does to its terms y [T, k, H]: their float32 sum
    in y's dtype, rows of ids outside [0, experts) left out (``reduce=False`` leaves them
    unwritten). Pure torch, for a caller's compiled step to fuse with what follows: the k
    terms are added one by one, in the kernel's order, as elementwise ops (a ``.sum(1)``
    would be a reduction of its own, which the compiler launches apart from a following
    norm's)."""
    ok = (topk_ids >= 0) & (topk_ids < experts)
    acc = torch.where(ok[:, 0, None], y[:, 0].float(), 0.0)
    for j in range(1, y.shape[1]):
        acc = acc + torch.where(ok[:, j, None], y[:, j].float(), 0.0)
    return acc.to(y.dtype)


def quantize_fp8_blockwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (e4m3fn [E, N, K], float32 scale [E, ceil(N/128), ceil(K/128)])."""
    e, n, k = w.shape
    nb, kb = triton.cdiv(n, QBLOCK), triton.cdiv(k, QBLOCK)
    pad = F.pad(w.float(), (0, kb * QBLOCK - k, 0, nb * QBLOCK - n))
    tiles = pad.view(e, nb, QBLOCK, kb, QBLOCK)
    scale = tiles.abs().amax(dim=(2, 4)).clamp_min(1e-12) / FP8_MAX
    q = (tiles / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(e, nb * QBLOCK, kb * QBLOCK)[:, :n, :k].contiguous(), scale


def dequantize_fp8_blockwise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape[1], q.shape[2]
    s = scale.repeat_interleave(QBLOCK, 1).repeat_interleave(QBLOCK, 2)[:, :n, :k]
    return q.float() * s


def fused_moe_reference(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                        w_gate_up_scale: torch.Tensor | None = None,
                        w_down_scale: torch.Tensor | None = None, reduce: bool = True,
                        out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """Per-expert loop in float32; the activation is rounded to x's dtype between the GEMMs,
    as the kernel stores it. ``reduce`` and ``out`` as in ``fused_moe`` (unsummed terms: the
    rows of ids outside [0, E) left as they are, NaN in a new tensor, so that a caller that
    reads them, as it must not, sees it); ``config`` (the kernel's tiles) is not used."""
    if out is not None:
        _check_out(out, x.shape[0], topk_ids.shape[1], x.shape[1], x, reduce)
    if w_gate_up.dtype == FP8:
        w_gate_up = dequantize_fp8_blockwise(w_gate_up, w_gate_up_scale)
        w_down = dequantize_fp8_blockwise(w_down, w_down_scale)
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    terms = None if reduce else torch.full((*topk_ids.shape, x.shape[1]), float("nan"), dtype=x.dtype,
                                           device=x.device)
    for e in topk_ids.unique().tolist():
        if not 0 <= e < w_gate_up.shape[0]:
            continue
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        gate, up = (x[tok].float() @ w_gate_up[e].float().T).chunk(2, dim=-1)
        act = (F.silu(gate) * up).to(x.dtype).float()
        y = act @ w_down[e].float().T * topk_weights[tok, slot, None]
        if reduce:
            acc.index_add_(0, tok, y)
        else:
            terms[tok, slot] = y.to(x.dtype)
    if reduce:
        return acc.to(x.dtype)
    if out is None:
        return terms
    ok = (topk_ids >= 0) & (topk_ids < w_gate_up.shape[0])
    dest = out.view(out.shape[0], 1, -1) if out.dim() == 2 else out
    dest[ok] = terms[ok]
    return out
