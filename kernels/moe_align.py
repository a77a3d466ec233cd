"""The fused MoE's alignment: a step's (token, expert) pairs sorted by expert, each expert's
run padded to whole blocks of BLOCK_M rows, and the expert of each block: what the grouped
GEMMs (``fused_moe``) read as their block table. One launch up to ALIGN_KERNEL_MAX_PAIRS
pairs, torch ops (without a host sync) above."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import next_pow2


def max_padded_rows(n_pairs: int, experts: int, block_m: int) -> int:
    """Upper bound of the aligned length: each expert in use adds at most block_m - 1 rows."""
    return n_pairs + min(experts, n_pairs) * (block_m - 1)


# -- align --------------------------------------------------------------------------------

# Sizes that change with the batch are not specialised on: one compile serves every batch.
@triton.jit(do_not_specialize=["n", "max_blocks"])
def _moe_align_kernel(ids_ptr, n, sorted_ptr, blk_expert_ptr, total_ptr, max_blocks,
                      E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                      CHUNK: tl.constexpr, HCHUNK: tl.constexpr, BCHUNK: tl.constexpr):
    # Program p places pairs [p*CHUNK, (p+1)*CHUNK). The ids (n <= 8192 ints, in L2) are cheap
    # to re-read, so every program recounts them instead of waiting on the others: the
    # histogram of all pairs gives the experts' padded starts, the one of the pairs before
    # its chunk its running offsets. One launch, no inter-program sync.
    pid, progs = tl.program_id(0), tl.num_programs(0)
    c0 = pid * CHUNK
    er = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], tl.int32)
    before = tl.zeros([E_PAD], tl.int32)
    for h0 in range(0, n, HCHUNK):
        offs = h0 + tl.arange(0, HCHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1)
        mine = (ids >= 0) & (ids < E)
        bins = tl.where(mine, ids, 0).to(tl.int32)
        counts += tl.histogram(bins, E_PAD, mask=mine)
        before += tl.histogram(bins, E_PAD, mask=mine & (offs < c0))
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded, 0)
    tl.store(total_ptr, total, mask=pid == 0)
    # Block table and the sentinel in padding rows of live blocks, blocks spread over programs.
    jm = tl.arange(0, BLOCK_M)
    for b0 in range(pid * BCHUNK, max_blocks, progs * BCHUNK):
        blocks = b0 + tl.arange(0, BCHUNK)
        first = blocks * BLOCK_M
        live = first < total
        expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), 1)
        tl.store(blk_expert_ptr + blocks, tl.where(live, expert, -1), mask=blocks < max_blocks)
        hit = er[None, :] == expert[:, None]
        start = tl.sum(tl.where(hit, starts[None, :], 0), 1)
        count = tl.sum(tl.where(hit, counts[None, :], 0), 1)
        pos = first[:, None] + jm[None, :]
        pad = (pos - start[:, None] >= count[:, None]) & live[:, None]
        tl.store(sorted_ptr + pos, tl.zeros([BCHUNK, BLOCK_M], tl.int32) + n, mask=pad)
    # Real rows (disjoint from the padding rows): rank among earlier pairs of the same expert
    # in this chunk by a one-hot cumsum, which keeps index order within an expert.
    offs = c0 + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1)
    hit = ((ids[:, None] == er[None, :]) & (ids[:, None] < E)).to(tl.int32)
    rank = tl.cumsum(hit, 0) - hit
    pos = tl.sum(hit * ((starts + before)[None, :] + rank), 1)
    tl.store(sorted_ptr + pos, offs, mask=(offs < n) & (tl.sum(hit, 1) > 0))


# Above this every program's recount of all the ids outweighs torch's sort.
ALIGN_KERNEL_MAX_PAIRS = 8192
def moe_align(topk_ids: torch.Tensor, experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted pair ids [max_blocks * block_m] int32, expert of each block [max_blocks] int32
    (-1 past the end), aligned length [1] int32). Pairs keep index order within an expert.
    Rows past the aligned length are left unwritten. One launch of cdiv(n, CHUNK) programs."""
    n = topk_ids.numel()
    if n > ALIGN_KERNEL_MAX_PAIRS:
        return moe_align_reference(topk_ids, experts, block_m)
    dev = topk_ids.device
    max_blocks = triton.cdiv(max_padded_rows(n, experts, block_m), block_m)
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    blk_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    e_pad = max(32, next_pow2(experts))  # histogram bins: a multiple of the warp size
    chunk = max(16, min(64, 4096 // e_pad))  # one-hot of CHUNK x E_PAD: <= 4K cells
    _moe_align_kernel[(max(1, triton.cdiv(n, chunk)),)](
        topk_ids, n, sorted_ids, blk_expert, total, max_blocks,
        E=experts, E_PAD=e_pad, BLOCK_M=block_m, CHUNK=chunk, HCHUNK=1024, BCHUNK=16,
        num_warps=4)
    return sorted_ids, blk_expert, total


def moe_align_reference(topk_ids: torch.Tensor, experts: int, block_m: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same in torch ops, without a host sync (also the path for large prefills)."""
    flat = topk_ids.flatten().long()
    n, dev = flat.numel(), flat.device
    key = torch.where((flat >= 0) & (flat < experts), flat, experts)  # foreign experts last
    # Not torch.bincount: on CUDA it reads the largest key back to the host (a sync per MoE
    # layer of every large prefill, found on the H200: 3 ms a layer waiting at 8K tokens).
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=dev).scatter_add_(
        0, key, torch.ones_like(key))[:experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(key, stable=True)
    ko = key[order]
    live = ko < experts
    kc = ko.clamp(max=experts - 1)
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[kc]
    max_blocks = triton.cdiv(max_padded_rows(n, experts, block_m), block_m)
    sorted_ids = torch.full((max_blocks * block_m + 1,), n, dtype=torch.int32, device=dev)
    dest = torch.where(live, ends[kc] - padded[kc] + rank, max_blocks * block_m)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    firsts = torch.arange(max_blocks, device=dev) * block_m
    blk = torch.searchsorted(ends, firsts, right=True)
    blk_expert = torch.where(firsts < ends[-1], blk, -1).to(torch.int32)
    return sorted_ids[:-1], blk_expert, ends[-1:].to(torch.int32)
