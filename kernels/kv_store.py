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

from ._util import FP8, FP8_MAX, check, check_shape, next_pow2, to_fp8


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
    quant = cache.dtype == FP8
    if quant:
        if scale is None:
            raise ValueError("an FP8 cache needs scale [num_blocks, block_size] float32")
        check(scale, "scale", dims=2, dtypes=(torch.float32,), device=dev, last_contiguous=False)
        check_shape(scale, "scale", tuple(cache.shape[:2]))
    elif scale is not None:
        raise ValueError(f"scale is only for an FP8 cache; this cache is {cache.dtype}")
    if t == 0:
        return
    sc = scale if quant else cache  # any pointer: the kernel never touches it
    _kv_store_kernel[(t,)](
        latent, k_pe, slot_mapping, cache, sc, latent.stride(0), k_pe.stride(0),
        cache.stride(0), cache.stride(1), sc.stride(0), sc.stride(1), cache.shape[1],
        DL=dl, DR=k_pe.shape[1], BLOCK_L=next_pow2(dl), BLOCK_R=next_pow2(k_pe.shape[1]),
        QUANT=quant, num_warps=4 if dl >= 256 else 1)


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
