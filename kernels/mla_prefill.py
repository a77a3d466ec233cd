"""MLA prefill for new tokens over a long cached prefix (expanded form, chunked over the
prefix), for agent traffic that re-sends long histories.

The new tokens attend causally to themselves (keys and values from this step's projections),
then the cached prefix is walked in chunks: each chunk's latents are gathered from the paged
cache (dequantized when FP8), expanded by kv_b_proj into per-head k_nope and v with one GEMM,
and attended to without a mask. Each attention pass folds its result into the running output
and log-sum-exp in its epilogue, so a chunk costs one GEMM and one kernel and the expanded
keys of a 128K prefix never exist at once.

Keys are [k_nope (per head) | k_pe (shared by all heads)], as MLA builds them: the kernel takes
k_pe once per token rather than a copy per head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import DOT, FP8, check, check_shape, host_tensor, next_pow2
from .mla_decode import LOG2E, gather_entries

# Tuned on an H200 by benchmarks/gpu/bench_kernels.py. SPLIT: 1 walks the key blocks every row
# sees whole without masks, then the rest masked; 0 masks every block. 2026-11-30 (session 15):
# SPLIT 1 with 3 stages, 4K new tokens on a 32K prefix in 3.41 ms against 4.90 ms for the
# config before it (128, 64, 8 warps, 2 stages, SPLIT 0); the attention kernel alone at 50% of
# the dense bf16 peak against 34%.
PREFILL_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "SPLIT": 1}


@triton.jit
def _load_tile(ptrs, rmask, cmask, MASK_R: tl.constexpr, MASK_C: tl.constexpr):
    """A 2-D load masked only where a mask can be false: a dimension that fills its padded
    width and a key block wholly inside the sequence load without one, so the compiler can
    vectorize them."""
    if MASK_R and MASK_C:
        x = tl.load(ptrs, mask=rmask[:, None] & cmask[None, :], other=0.0)
    elif MASK_R:
        x = tl.load(ptrs, mask=rmask[:, None], other=0.0)
    elif MASK_C:
        x = tl.load(ptrs, mask=cmask[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _attn_block(acc, m, den, qn, qr, kn_ptr, kp_ptr, v_ptr, k0, k_len, n0, last, h,
                s_knt, s_knh, s_kpt, s_vt, s_vh, sm_scale_log2,
                DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, DN_P: tl.constexpr,
                DR_P: tl.constexpr, DV_P: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, MASKED: tl.constexpr):
    """One key block folded into (acc, m, den). MASKED: the block may hold keys past the
    sequence or, causal, past a row's own position; unmasked blocks are seen whole by
    every row, so no score is -inf and no row lacks a key."""
    dn, dr, dv = tl.arange(0, DN_P), tl.arange(0, DR_P), tl.arange(0, DV_P)
    cols = n0 + tl.arange(0, BLOCK_N)
    cm = cols < k_len
    krow = (k0 + cols).to(tl.int64)
    kn = _load_tile(kn_ptr + (krow * s_knt + h * s_knh)[:, None] + dn[None, :], cm, dn < DN,
                    MASKED, DN != DN_P).to(DOT)
    kr = _load_tile(kp_ptr + (krow * s_kpt)[:, None] + dr[None, :], cm, dr < DR,
                    MASKED, DR != DR_P).to(DOT)
    s = (tl.dot(qn, tl.trans(kn)) + tl.dot(qr, tl.trans(kr))) * sm_scale_log2
    if MASKED:
        ok = cm[None, :]
        if CAUSAL:
            ok = ok & (cols[None, :] <= last[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
    else:
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = m_new
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    den = den * alpha + tl.sum(p, 1)
    v = _load_tile(v_ptr + (krow * s_vt + h * s_vh)[:, None] + dv[None, :], cm, dv < DV,
                   MASKED, DV != DV_P).to(DOT)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v)
    return acc, m_new, den


@triton.jit
def _mla_attn_kernel(q_ptr, kn_ptr, kp_ptr, v_ptr, cuq_ptr, cuk_ptr, o_ptr, lse_ptr,
                     sm_scale_log2, s_qt, s_qh, s_knt, s_knh, s_kpt, s_vt, s_vh, s_ot, s_oh,
                     s_lt, DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
                     DN_P: tl.constexpr, DR_P: tl.constexpr, DV_P: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                     MERGE: tl.constexpr, SPLIT: tl.constexpr):
    mt, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q0 = tl.load(cuq_ptr + b)
    q_len = tl.load(cuq_ptr + b + 1) - q0
    if mt * BLOCK_M >= q_len:
        return
    k0 = tl.load(cuk_ptr + b)
    k_len = tl.load(cuk_ptr + b + 1) - k0
    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = rows < q_len
    dn, dr, dv = tl.arange(0, DN_P), tl.arange(0, DR_P), tl.arange(0, DV_P)
    qrow = (q0 + rows).to(tl.int64) * s_qt + h * s_qh
    qn = tl.load(q_ptr + qrow[:, None] + dn[None, :], mask=rm[:, None] & (dn < DN)[None, :],
                 other=0.0).to(DOT)
    qr = tl.load(q_ptr + qrow[:, None] + DN + dr[None, :], mask=rm[:, None] & (dr < DR)[None, :],
                 other=0.0).to(DOT)
    last = k_len - q_len + rows  # a causal query's own position among the keys
    hi = k_len
    full = k_len // BLOCK_N * BLOCK_N  # key blocks wholly inside the sequence
    if CAUSAL:
        hi = tl.minimum(k_len, k_len - q_len + (mt + 1) * BLOCK_M)
        # keys every row of the tile sees: up to its first row's own position (none when
        # that is before the first key: fewer keys than queries)
        full = tl.maximum((k_len - q_len + mt * BLOCK_M) // BLOCK_N * BLOCK_N, 0)
    if not SPLIT:
        full = 0
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_P], tl.float32)
    for n0 in range(0, full, BLOCK_N):
        acc, m, den = _attn_block(acc, m, den, qn, qr, kn_ptr, kp_ptr, v_ptr, k0, k_len, n0, last, h,
                                  s_knt, s_knh, s_kpt, s_vt, s_vh, sm_scale_log2, DN, DR, DV,
                                  DN_P, DR_P, DV_P, BLOCK_N, CAUSAL, False)
    for n0 in range(full, hi, BLOCK_N):
        acc, m, den = _attn_block(acc, m, den, qn, qr, kn_ptr, kp_ptr, v_ptr, k0, k_len, n0, last, h,
                                  s_knt, s_knh, s_kpt, s_vt, s_vh, sm_scale_log2, DN, DR, DV,
                                  DN_P, DR_P, DV_P, BLOCK_N, CAUSAL, True)
    some = den > 0.0
    lse = tl.where(some, m + tl.log2(tl.where(some, den, 1.0)), float("-inf"))
    out = acc / tl.where(some, den, 1.0)[:, None]
    orow = (q0 + rows).to(tl.int64)
    optrs = o_ptr + (orow * s_ot + h * s_oh)[:, None] + dv[None, :]
    omask = rm[:, None] & (dv < DV)[None, :]
    lptrs = lse_ptr + orow * s_lt + h
    if MERGE:  # fold into the running (output, lse) of the passes before
        old_lse = tl.load(lptrs, mask=rm, other=float("-inf"))
        old = tl.load(optrs, mask=omask, other=0.0).to(tl.float32)
        top = tl.maximum(old_lse, lse)
        top = tl.where(top == float("-inf"), 0.0, top)
        w_old, w_new = tl.exp2(old_lse - top), tl.exp2(lse - top)
        tot = w_old + w_new
        out = (old * w_old[:, None] + out * w_new[:, None]) / tl.where(tot > 0, tot, 1.0)[:, None]
        lse = tl.where(tot > 0, top + tl.log2(tl.where(tot > 0, tot, 1.0)), float("-inf"))
    tl.store(optrs, out.to(o_ptr.dtype.element_ty), mask=omask)
    tl.store(lptrs, lse, mask=rm)


def mla_attention(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                  cu_q: torch.Tensor, cu_k: torch.Tensor, max_q_len: int, sm_scale: float, *,
                  causal: bool, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                  merge: bool = False, config: dict | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length attention, sequences packed along dim 0.

    q [Tq, H, DN + DR]; k_nope [Tk, H, DN]; k_pe [Tk, DR]; v [Tk, H, DV] (bf16/fp16; any
    strides with a unit last one); cu_q, cu_k [B + 1] int32 offsets. causal: query i of a
    sequence sits at key position k_len - q_len + i. Returns (out [Tq, H, DV], lse [Tq, H]
    float32, base 2); with merge=True, `out` and `lse` hold earlier passes and are updated in
    place (out may be float32 to keep merges exact)."""
    dev = q.device
    dts = (torch.bfloat16, torch.float16)
    check(q, "q", dims=3, dtypes=dts)
    check(k_nope, "k_nope", dims=3, dtypes=(q.dtype,), device=dev)
    check(k_pe, "k_pe", dims=2, dtypes=(q.dtype,), device=dev)
    check(v, "v", dims=3, dtypes=(q.dtype,), device=dev)
    check(cu_q, "cu_q", dims=1, dtypes=(torch.int32,), device=dev)
    check(cu_k, "cu_k", dims=1, dtypes=(torch.int32,), device=dev)
    tq, h, dqk = q.shape
    tk, dn, dr, dv = k_nope.shape[0], k_nope.shape[2], k_pe.shape[1], v.shape[2]
    if dn + dr != dqk:
        raise ValueError(f"q's last dim {dqk} must equal k_nope's {dn} + k_pe's {dr}")
    check_shape(k_nope, "k_nope", (tk, h, dn))
    check_shape(k_pe, "k_pe", (tk, dr))
    check_shape(v, "v", (tk, h, dv))
    check_shape(cu_k, "cu_k", tuple(cu_q.shape))
    if out is None:
        out = torch.empty(tq, h, dv, dtype=q.dtype, device=dev)
    check(out, "out", dims=3, dtypes=(q.dtype, torch.float32), device=dev)
    check_shape(out, "out", (tq, h, dv))
    if lse is None:
        lse = torch.empty(tq, h, dtype=torch.float32, device=dev)
    check(lse, "lse", dims=2, dtypes=(torch.float32,), device=dev)
    check_shape(lse, "lse", (tq, h))
    batch = cu_q.shape[0] - 1
    if batch <= 0 or max_q_len <= 0:
        return out, lse
    cfg = {**PREFILL_CONFIG, **(config or {})}
    grid = (triton.cdiv(max_q_len, cfg["BLOCK_M"]), batch, h)
    _mla_attn_kernel[grid](
        q, k_nope, k_pe, v, cu_q, cu_k, out, lse, sm_scale * LOG2E,
        q.stride(0), q.stride(1), k_nope.stride(0), k_nope.stride(1), k_pe.stride(0),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        DN=dn, DR=dr, DV=dv, DN_P=next_pow2(dn), DR_P=next_pow2(dr), DV_P=next_pow2(dv),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal, MERGE=merge,
        SPLIT=bool(cfg.get("SPLIT", 0)), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out, lse


def prefix_chunks(block_tables: torch.Tensor, prefix_lens: list[int], block_size: int, *,
                  chunk_tokens: int = 16384) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Where the cached prefixes lie, chunk by chunk of at most ``chunk_tokens`` tokens over all
    sequences: per chunk, (block (sum,) int64, offset (sum,) int64, cu_k [B + 1] int32) of its
    positions, packed by sequence. Every layer of a step reads the same positions (a layer's
    cache is a view of the same pool), so a forward makes these once and hands them to each
    layer's ``mla_prefill`` (``prefix``): ~10 launches and three host copies a layer fewer."""
    dev, batch = block_tables.device, len(prefix_lens)
    step = max(block_size, chunk_tokens // max(batch, 1) // block_size * block_size)
    chunks = []
    for start in range(0, max(prefix_lens, default=0), step):
        lens = [min(max(p - start, 0), step) for p in prefix_lens]
        total = sum(lens)
        seq = torch.repeat_interleave(torch.arange(batch, device=dev), host_tensor(lens, dev), output_size=total)
        first = host_tensor([0] + lens[:-1], dev).cumsum(0)
        pos = torch.arange(total, device=dev) - first[seq] + start
        # (block, offset) indexing, not a flat slot: a layer's view of the block-major pool is
        # strided between blocks (its stride(0) spans every layer's block), so it has no flat view.
        blk = block_tables[seq, pos // block_size].long()
        chunks.append((blk, pos % block_size, host_tensor([0] + lens, dev).cumsum(0).to(torch.int32)))
    return chunks


def mla_prefill(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                cu_seqlens: torch.Tensor, max_new: int, prefix_lens: list[int],
                cache: torch.Tensor, block_tables: torch.Tensor, w_kv_b: torch.Tensor,
                sm_scale: float, scale: torch.Tensor | None = None, *,
                chunk_tokens: int = 16384, config: dict | None = None,
                prefix: list | None = None) -> torch.Tensor:
    """New tokens (q [T, H, DN + DR], k_nope [T, H, DN], k_pe [T, DR], v [T, H, DV], packed by
    cu_seqlens [B + 1] int32, longest `max_new`) attending causally to themselves and to
    their cached prefixes of `prefix_lens` tokens (host ints). cache [blocks, block_size,
    DL + DR] bf16 or e4m3fn (with `scale` [blocks, block_size] float32), any strides with a unit
    last one (a layer's view of the block-major pool); block_tables [B, max_blocks];
    w_kv_b [H * (DN + DV), DL], kv_b_proj's weight. At most `chunk_tokens` prefix tokens
    (over all sequences) are expanded at a time; ``prefix``: ``prefix_chunks`` of these tables
    and lengths, made once for every layer (made here when None; given, it decides the chunks
    and ``chunk_tokens`` is not read). Returns [T, H, DV] in q's dtype."""
    dev = q.device
    check(cache, "cache", dims=3, dtypes=(q.dtype, FP8), device=dev)
    check(block_tables, "block_tables", dims=2, dtypes=(torch.int32, torch.int64), device=dev)
    check(w_kv_b, "w_kv_b", dims=2, dtypes=(q.dtype,), device=dev)
    batch, h, dn, dv = cu_seqlens.shape[0] - 1, q.shape[1], k_nope.shape[2], v.shape[2]
    dl = cache.shape[2] - k_pe.shape[1]
    check_shape(w_kv_b, "w_kv_b", (h * (dn + dv), dl))
    if len(prefix_lens) != batch:
        raise ValueError(f"prefix_lens has {len(prefix_lens)} entries for {batch} sequences")
    if (cache.dtype == FP8) != (scale is not None):
        raise ValueError("scale [num_blocks, block_size] float32 goes with an FP8 cache, only")
    if scale is not None:
        check(scale, "scale", dims=2, dtypes=(torch.float32,), device=dev, last_contiguous=False)
        check_shape(scale, "scale", tuple(cache.shape[:2]))
    out = torch.empty(q.shape[0], h, dv, dtype=torch.float32, device=dev)
    out, lse = mla_attention(q, k_nope, k_pe, v, cu_seqlens, cu_seqlens, max_new, sm_scale,
                             causal=True, out=out, config=config)
    if prefix is None:
        prefix = prefix_chunks(block_tables, prefix_lens, cache.shape[1], chunk_tokens=chunk_tokens)
    elif prefix and prefix[0][2].shape[0] != batch + 1:
        raise ValueError(f"prefix: chunks made for {prefix[0][2].shape[0] - 1} sequences, this call has {batch}")
    for blk, off, cu_k in prefix:
        ent = cache[blk, off]
        ent = (ent.float() * scale[blk, off][:, None]).to(q.dtype) if scale is not None else ent.to(q.dtype)
        kv = (ent[:, :dl] @ w_kv_b.T).view(-1, h, dn + dv)
        mla_attention(q, kv[..., :dn], ent[:, dl:], kv[..., dn:], cu_seqlens, cu_k, max_new,
                      sm_scale, causal=False, out=out, lse=lse, merge=True, config=config)
    return out.to(q.dtype)


def mla_prefill_reference(q, k_nope, k_pe, v, cu_seqlens, prefix_lens, cache, block_tables,
                          w_kv_b, sm_scale, scale=None) -> torch.Tensor:
    """Per sequence in float32: the whole prefix expanded, then causal softmax attention."""
    h, dn = q.shape[1], k_nope.shape[2]
    dl = cache.shape[2] - k_pe.shape[1]
    cu = cu_seqlens.tolist()
    out = torch.empty(q.shape[0], h, v.shape[2], dtype=torch.float32, device=q.device)
    for b, p in enumerate(prefix_lens):
        a, z = cu[b], cu[b + 1]
        ent = gather_entries(cache, block_tables[b:b + 1], p, scale)[0]
        kv = (ent[:, :dl] @ w_kv_b.float().T).view(p, h, dn + v.shape[2])
        kn = torch.cat([kv[..., :dn], k_nope[a:z].float()])
        kr = torch.cat([ent[:, dl:], k_pe[a:z].float()])
        vv = torch.cat([kv[..., dn:], v[a:z].float()])
        keys = torch.cat([kn, kr[:, None, :].expand(-1, h, -1)], dim=-1)
        s = torch.einsum("thd,lhd->htl", q[a:z].float(), keys) * sm_scale
        pos = torch.arange(p + z - a, device=q.device)
        future = pos[None, :] > pos[p:, None]
        s = s.masked_fill(future, float("-inf"))
        out[a:z] = torch.einsum("htl,lhd->thd", s.softmax(-1), vv)
    return out.to(q.dtype)
