"""KV quantize-and-store: write the new tokens' MLA cache entries (normed latent, then roped
k_pe) into the paged latent cache at their slots, as bf16 or as FP8 e4m3 with one float32
scale per token.

The scale is per token, not per block, because a block fills over many steps: a block scale
would have to grow when a later token is larger and re-quantize the tokens already stored.
One scale covers the whole entry (latent and rope parts): the decode kernel then applies it
once per score and once per probability instead of per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import FP8, FP8_MAX, check, check_cache_scale, check_shape, next_pow2, to_dtype, to_fp8


@triton.jit
def _kv_store_kernel(lat_ptr, pe_ptr, slot_ptr, cache_ptr, scale_ptr,
                     s_lat, s_pe, s_cblk, s_ctok, s_sblk, s_stok, block_size,
                     DL: tl.constexpr, DR: tl.constexpr, BLOCK_L: tl.constexpr,
                     BLOCK_R: tl.constexpr, QUANT: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    blk, off = slot // block_size, slot % block_size
    ol, orr = tl.arange(0, BLOCK_L), tl.arange(0, BLOCK_R)
    lat = tl.load(lat_ptr + t * s_lat + ol, mask=ol < DL, other=0.0).to(tl.float32)
    pe = tl.load(pe_ptr + t * s_pe + orr, mask=orr < DR, other=0.0).to(tl.float32)
    dst = cache_ptr + blk * s_cblk + off * s_ctok
    if QUANT:
        amax = tl.maximum(tl.max(tl.abs(lat), 0), tl.max(tl.abs(pe), 0))
        # Correctly rounded divisions (plain `/` is approximate on the GPU), so the stored
        # bytes equal torch's `(x / scale).to(float8_e4m3fn)` exactly.
        scale = tl.div_rn(tl.maximum(amax, 1e-12), 448.0)
        lat = tl.clamp(tl.div_rn(lat, scale), -448.0, 448.0)
        pe = tl.clamp(tl.div_rn(pe, scale), -448.0, 448.0)
        tl.store(dst + ol, to_fp8(lat), mask=ol < DL)
        tl.store(dst + DL + orr, to_fp8(pe), mask=orr < DR)
        tl.store(scale_ptr + blk * s_sblk + off * s_stok, scale)
    else:
        tl.store(dst + ol, lat.to(cache_ptr.dtype.element_ty), mask=ol < DL)
        tl.store(dst + DL + orr, pe.to(cache_ptr.dtype.element_ty), mask=orr < DR)


def kv_store(cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
             slot_mapping: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """Write `latent` [T, DL] and `k_pe` [T, DR] (bf16/fp16/fp32) into `cache`
    [num_blocks, block_size, DL + DR] at `slot_mapping` [T] (slot = block * block_size + offset;
    negative slots are skipped). An FP8 (e4m3fn) cache needs `scale` [num_blocks, block_size]
    float32, which receives amax / 448 of each stored token."""
    dev = cache.device
    check(cache, "cache", dims=3, dtypes=(torch.bfloat16, torch.float16, torch.float32, FP8))
    check(latent, "latent", dims=2, dtypes=(torch.bfloat16, torch.float16, torch.float32), device=dev)
    check(k_pe, "k_pe", dims=2, dtypes=(torch.bfloat16, torch.float16, torch.float32), device=dev)
    check(slot_mapping, "slot_mapping", dims=1, dtypes=(torch.int32, torch.int64), device=dev)
    t, dl = latent.shape
    check_shape(k_pe, "k_pe", (t, None))
    check_shape(slot_mapping, "slot_mapping", (t,))
    if cache.shape[2] != dl + k_pe.shape[1]:
        raise ValueError(f"cache entries hold {cache.shape[2]} values but latent + k_pe give "
                         f"{dl} + {k_pe.shape[1]}")
    quant = check_cache_scale(cache, scale)
    if t == 0:
        return
    sc = scale if quant else cache  # any pointer: the kernel never touches it
    _kv_store_kernel[(t,)](
        latent, k_pe, slot_mapping, cache, sc, latent.stride(0), k_pe.stride(0),
        cache.stride(0), cache.stride(1), sc.stride(0), sc.stride(1), cache.shape[1],
        DL=dl, DR=k_pe.shape[1], BLOCK_L=next_pow2(dl), BLOCK_R=next_pow2(k_pe.shape[1]),
        QUANT=quant, num_warps=4 if dl >= 256 else 1)


# -- norm, rope and store in one launch -------------------------------------------------------

@triton.jit
def _rope_half(x_ptr, oi, c, s, HALF: tl.constexpr, INTERLEAVED: tl.constexpr, mask):
    """(rotated first half, rotated second half) of rope vectors at x_ptr (broadcast over a
    leading axis of x_ptr), in float32: transformers' [x1 c - x2 s | x2 c + x1 s], x1/x2 the
    even/odd dims (interleaved) or the two halves."""
    if INTERLEAVED:
        i1, i2 = 2 * oi, 2 * oi + 1
    else:
        i1, i2 = oi, oi + HALF
    x1 = tl.load(x_ptr + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + i2, mask=mask, other=0.0).to(tl.float32)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _mla_prep_store_kernel(qpe_ptr, tail_ptr, cos_ptr, sin_ptr, w_ptr, slot_ptr, cache_ptr, scale_ptr,
                           qo_ptr, lat_ptr, kpe_ptr, eps, heads,
                           s_qt, s_qh, s_tt, s_ct, s_st, s_qot, s_qoh, s_lt, s_kt,
                           s_cblk, s_ctok, s_sblk, s_stok, block_size,
                           DL: tl.constexpr, HALF: tl.constexpr, BLOCK_L: tl.constexpr,
                           BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                           INTERLEAVED: tl.constexpr, QUANT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    ty = lat_ptr.dtype.element_ty
    # the latent's RMS norm: float32, cast back, then scaled (rms_norm's order)
    ol = tl.arange(0, BLOCK_L)
    lm = ol < DL
    x = tl.load(tail_ptr + t * s_tt + ol, mask=lm, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / DL + eps)
    w = tl.load(w_ptr + ol, mask=lm, other=0.0).to(tl.float32)
    lat = to_dtype(w * to_dtype(x * r, ty).to(tl.float32), ty)
    tl.store(lat_ptr + t * s_lt + ol, lat, mask=lm)
    # rope of k_pe (after the latent in the same row) and of every head's q_pe
    oi = tl.arange(0, BLOCK_HALF)
    im = oi < HALF
    c = tl.load(cos_ptr + t * s_ct + oi, mask=im, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * s_st + oi, mask=im, other=0.0).to(tl.float32)
    k1, k2 = _rope_half(tail_ptr + t * s_tt + DL, oi, c, s, HALF, INTERLEAVED, im)
    k1, k2 = to_dtype(k1, ty), to_dtype(k2, ty)
    tl.store(kpe_ptr + t * s_kt + oi, k1, mask=im)
    tl.store(kpe_ptr + t * s_kt + HALF + oi, k2, mask=im)
    hh = tl.arange(0, BLOCK_H)
    qm = (hh < heads)[:, None] & im[None, :]
    q1, q2 = _rope_half(qpe_ptr + t * s_qt + hh[:, None] * s_qh, oi[None, :], c[None, :], s[None, :],
                        HALF, INTERLEAVED, qm)
    qo = qo_ptr + t * s_qot + hh[:, None] * s_qoh + oi[None, :]
    tl.store(qo, to_dtype(q1, ty), mask=qm)
    tl.store(qo + HALF, to_dtype(q2, ty), mask=qm)
    # the cache entry [latent | k_pe], as kv_store writes it
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk, off = slot // block_size, slot % block_size
        dst = cache_ptr + blk * s_cblk + off * s_ctok
        latf, k1f, k2f = lat.to(tl.float32), k1.to(tl.float32), k2.to(tl.float32)
        if QUANT:
            amax = tl.maximum(tl.max(tl.abs(latf), 0), tl.maximum(tl.max(tl.abs(k1f), 0), tl.max(tl.abs(k2f), 0)))
            scale = tl.div_rn(tl.maximum(amax, 1e-12), 448.0)
            tl.store(dst + ol, to_fp8(tl.clamp(tl.div_rn(latf, scale), -448.0, 448.0)), mask=lm)
            tl.store(dst + DL + oi, to_fp8(tl.clamp(tl.div_rn(k1f, scale), -448.0, 448.0)), mask=im)
            tl.store(dst + DL + HALF + oi, to_fp8(tl.clamp(tl.div_rn(k2f, scale), -448.0, 448.0)), mask=im)
            tl.store(scale_ptr + blk * s_sblk + off * s_stok, scale)
        else:
            ct = cache_ptr.dtype.element_ty
            tl.store(dst + ol, latf.to(ct), mask=lm)
            tl.store(dst + DL + oi, k1f.to(ct), mask=im)
            tl.store(dst + DL + HALF + oi, k2f.to(ct), mask=im)


def mla_prep_store(q_pe: torch.Tensor, tail: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv_norm: torch.Tensor, eps: float, cache: torch.Tensor, slot_mapping: torch.Tensor,
                   scale: torch.Tensor | None = None, *, interleaved: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The new tokens' MLA prologue in one launch: ``rms_norm`` of the latent tail[:, :DL]
    with ``kv_norm``, rope (``apply_rope``: float32 cos/sin, interleaved or halves) of
    tail[:, DL:] (k_pe) and of every head's q_pe [T, H, DR], and the entry [latent | k_pe]
    stored as ``kv_store`` stores it (bf16, or FP8 with ``scale``; negative slots skipped).
    Returns (rotated q_pe [T, H, DR], latent [T, DL], rotated k_pe [T, DR]) in tail's dtype."""
    dev = tail.device
    check(tail, "tail", dims=2, dtypes=(torch.bfloat16, torch.float16))
    check(q_pe, "q_pe", dims=3, dtypes=(tail.dtype,), device=dev)
    check(cos, "cos", dims=2, dtypes=(torch.float32,), device=dev)
    check(sin, "sin", dims=2, dtypes=(torch.float32,), device=dev)
    check(kv_norm, "kv_norm", dims=1, dtypes=(tail.dtype,), device=dev)
    check(slot_mapping, "slot_mapping", dims=1, dtypes=(torch.int32, torch.int64), device=dev)
    check(cache, "cache", dims=3, dtypes=(torch.bfloat16, torch.float16, torch.float32, FP8), device=dev)
    t, heads, dr = q_pe.shape
    dl = tail.shape[1] - dr
    if dr % 2 or dl <= 0:
        raise ValueError(f"tail [T, DL + DR] must end with q_pe's DR = {dr} (even) rope dims; got {tuple(tail.shape)}")
    check_shape(tail, "tail", (t, dl + dr))
    check_shape(cos, "cos", (t, dr // 2))
    check_shape(sin, "sin", (t, dr // 2))
    check_shape(kv_norm, "kv_norm", (dl,))
    check_shape(slot_mapping, "slot_mapping", (t,))
    check_shape(cache, "cache", (None, None, dl + dr))
    quant = check_cache_scale(cache, scale)
    qo = torch.empty(t, heads, dr, dtype=tail.dtype, device=dev)
    lat = torch.empty(t, dl, dtype=tail.dtype, device=dev)
    kpe = torch.empty(t, dr, dtype=tail.dtype, device=dev)
    if t == 0:
        return qo, lat, kpe
    sc = scale if quant else cache  # any pointer: the kernel never touches it
    _mla_prep_store_kernel[(t,)](
        q_pe, tail, cos, sin, kv_norm, slot_mapping, cache, sc, qo, lat, kpe, float(eps), heads,
        q_pe.stride(0), q_pe.stride(1), tail.stride(0), cos.stride(0), sin.stride(0),
        qo.stride(0), qo.stride(1), lat.stride(0), kpe.stride(0),
        cache.stride(0), cache.stride(1), sc.stride(0), sc.stride(1), cache.shape[1],
        DL=dl, HALF=dr // 2, BLOCK_L=next_pow2(dl), BLOCK_HALF=next_pow2(dr // 2),
        BLOCK_H=next_pow2(heads), INTERLEAVED=bool(interleaved), QUANT=quant,
        num_warps=4 if dl >= 256 else 1)
    return qo, lat, kpe


def quantize_per_token(entry: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] float -> (e4m3fn [..., D], float32 scale [...]): the reference for the kernel."""
    x = entry.float()
    scale = x.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    return (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def kv_store_reference(cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                       slot_mapping: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    entry = torch.cat([latent[keep], k_pe[keep]], dim=-1)
    flat = cache.view(-1, cache.shape[-1])
    if cache.dtype == FP8:
        q, s = quantize_per_token(entry)
        flat[slots] = q
        scale.view(-1)[slots] = s
    else:
        flat[slots] = entry.to(cache.dtype)
