"""Expert-parallel dispatch and combine that read and write the peers' memory directly
(the shape of DeepEP's low-latency kernels), for padded dispatch over ``PeerExchange``
areas (``runtime.models.peer_exchange``; symmetric memory over NVLink).

A MoE layer of a DEP rank with padded dispatch, in three launches and two barriers:

1. ``dispatch_rows``: one program per (token, expert) pair with a slot (slot < 0: a padding
   token's pair, nothing to send). It takes the next row of its destination's block for
   this rank (an atomic counter per destination), copies the token's activations there in
   the destination's memory and the pair's slot, local to the destination, into the
   destination's tag area, and remembers the row. Nothing else is written: no send buffer,
   no padding rows.
2. (barrier) ``take_tags``: each received row's storage entry (``none`` for a row no pair
   took), and the tags reset to -1 for the next layer. The local experts then run as one
   fused MoE over the received rows, their outputs copied into this rank's output area.
3. (barrier) ``combine_rows``: one program per token (and slice of the hidden size) reads
   its pairs' outputs from the owners' output areas and sums them, weighted, in float32,
   rounded once to the activations' dtype (float64 activations: summed in float64).

Which row a pair takes depends on the order the programs reach the counter, so the rows'
places vary from run to run; a row's math does not depend on its place, so the outputs do
not. Peer addresses travel as int64 tensors (one per area, a rank each), cast to pointers in
the kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import check

BLOCK_H = 1024
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # activations
# The areas start 16-byte aligned: telling the compiler so (tl.multiple_of on the addresses
# before they become pointers) lets it move a row in 16-byte accesses; off: A/B runs.
ALIGNED = True


@triton.jit
def _peer(base_ptr, d, ty, ALIGNED: tl.constexpr):
    """Rank d's area of ``base_ptr``'s table (int64 addresses) as a pointer to ``ty``."""
    a = tl.load(base_ptr + d)
    if ALIGNED:
        a = tl.multiple_of(a, 16)
    return a.to(tl.pointer_type(ty))


@triton.jit
def _dispatch_kernel(x_ptr, slot_ptr, rows_base, tags_base, count_ptr, pos_ptr, K, k_local, n, rank, H, s_x,
                     BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    i = tl.program_id(0)
    s = tl.load(slot_ptr + i)
    if s >= 0:
        d = s // k_local
        p = tl.atomic_add(count_ptr + d, 1)
        tl.store(pos_ptr + i, p)
        row = (rank * n + p).to(tl.int64)
        dst = _peer(rows_base, d, x_ptr.dtype.element_ty, ALIGNED)
        tags = _peer(tags_base, d, tl.int32, ALIGNED)
        src = x_ptr + (i // K).to(tl.int64) * s_x
        for h0 in range(0, H, BLOCK):
            offs = h0 + tl.arange(0, BLOCK)
            live = offs < H
            tl.store(dst + row * H + offs, tl.load(src + offs, mask=live), mask=live)
        tl.store(tags + row, (s - d * k_local).to(tl.int32))
    else:
        tl.store(pos_ptr + i, -1)


@triton.jit
def _take_tags_kernel(tags_ptr, store_ptr, entry_ptr, R, none, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < R
    tag = tl.load(tags_ptr + offs, mask=live, other=-1)
    entry = tl.load(store_ptr + tl.maximum(tag, 0), mask=live & (tag >= 0), other=none)
    tl.store(entry_ptr + offs, entry, mask=live)
    tl.store(tags_ptr + offs, tl.full([BLOCK], -1, tl.int32), mask=live)


@triton.jit
def _combine_kernel(y_base, slot_ptr, pos_ptr, w_ptr, out_ptr, K, k_local, n, rank, H, s_w, s_out,
                    BLOCK: tl.constexpr, ALIGNED: tl.constexpr, ACC: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = offs < H
    acc = tl.zeros([BLOCK], ACC)
    for j in range(K):
        s = tl.load(slot_ptr + t * K + j)
        if s >= 0:
            d = s // k_local
            row = (rank * n + tl.load(pos_ptr + t * K + j)).to(tl.int64)
            src = _peer(y_base, d, out_ptr.dtype.element_ty, ALIGNED)
            v = tl.load(src + row * H + offs, mask=live, other=0.0).to(ACC)
            acc += v * tl.load(w_ptr + t * s_w + j).to(ACC)
    tl.store(out_ptr + t.to(tl.int64) * s_out + offs, acc.to(out_ptr.dtype.element_ty), mask=live)


def dispatch_rows(x: torch.Tensor, slot: torch.Tensor, top_k: int, k_local: int, n: int, rank: int,
                  rows_base: torch.Tensor, tags_base: torch.Tensor) -> torch.Tensor:
    """Send each pair of ``x`` [T, H]'s tokens (``slot`` [T * top_k] int32/int64: the pair's
    physical slot, < 0 for none) to the rank owning its slot (slot // k_local): row
    rank * n + (its place) of that rank's rows area (addresses ``rows_base`` [world] int64,
    rows of H in x's dtype) and its local slot into the same row of its tags area
    (``tags_base``, int32). Returns each pair's place (int32 [T * top_k], -1 for none)."""
    check(x, "x", dims=2, dtypes=DTYPES)
    t, h = x.shape
    if slot.shape != (t * top_k,):
        raise ValueError(f"slot must be [{t * top_k}] (tokens * top_k), got {tuple(slot.shape)}")
    check(slot, "slot", dims=1, dtypes=(torch.int32, torch.int64), device=x.device)
    world = rows_base.shape[0]
    pos = torch.empty(t * top_k, dtype=torch.int32, device=x.device)
    count = torch.zeros(world, dtype=torch.int32, device=x.device)
    if t:
        _dispatch_kernel[(t * top_k,)](x, slot, rows_base, tags_base, count, pos, top_k, k_local, n, rank, h,
                                       x.stride(0), BLOCK=min(BLOCK_H, triton.next_power_of_2(h)), ALIGNED=ALIGNED)
    return pos


def take_tags(tags: torch.Tensor, store_of: torch.Tensor, none: int) -> torch.Tensor:
    """Each received row's storage entry (``store_of``[its local slot], ``none`` where no pair
    took the row), as int64; ``tags`` (int32) reset to -1."""
    check(tags, "tags", dims=1, dtypes=(torch.int32,))
    check(store_of, "store_of", dims=1, dtypes=(torch.int64,), device=tags.device)
    out = torch.empty(tags.shape[0], dtype=torch.int64, device=tags.device)
    if tags.shape[0]:
        block = 1024
        _take_tags_kernel[(triton.cdiv(tags.shape[0], block),)](tags, store_of, out, tags.shape[0], none,
                                                                 BLOCK=block)
    return out


def combine_rows(y_base: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor,
                 k_local: int, n: int, rank: int, h: int, dtype: torch.dtype) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * (row rank * n + pos of pair (t, j) in the output area of
    the rank owning its slot; addresses ``y_base`` [world] int64, rows of ``h`` ``dtype``),
    over the pairs with a slot, summed in float32 (float64 for float64). Returns [T, h] ``dtype``."""
    t, k = weights.shape
    check(weights, "weights", dims=2, dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64))
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype}")
    out = torch.empty(t, h, dtype=dtype, device=weights.device)
    if t:
        block = min(BLOCK_H, triton.next_power_of_2(h))
        _combine_kernel[(t, triton.cdiv(h, block))](y_base, slot, pos, weights, out, k, k_local, n, rank, h,
                                                   weights.stride(0), out.stride(0), BLOCK=block, ALIGNED=ALIGNED,
                                                   ACC=tl.float64 if dtype == torch.float64 else tl.float32)
    return out
