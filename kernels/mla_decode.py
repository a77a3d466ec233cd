"""MLA decode attention over the paged latent KV cache, absorbed-weight form.

With W_UK absorbed into the query, every head attends to the same cached entry
[latent (kv_lora_rank) | k_pe (rope_dim)]: the latent is both key (with q_latent) and value, so
one program loads a tile of entries once and serves a group of heads with two small GEMMs.
The sequence is split over programs (flash-decoding): each split writes its normalised
partial output and log-sum-exp, and a second kernel merges the splits, or the caller merges
them where it reads them (``mla_decode_partials``; ``dense.merge_bmm_row`` does it inside the
W_UV product). The output stays in latent space [B, H, kv_lora_rank]; W_UV is applied by the
caller.

Tiles of BLOCK_N tokens lie within one page of the cache when BLOCK_N divides the block size;
a split then loads the block ids of up to 32 pages at once, so a tile's address needs no load
and the compiler keeps the next tiles' copies in flight (num_stages >= 3) while this one is
computed. (Looking up a block id per tile serialises table load, tile load and math: the
2026-11-29 H200 run read the cache at 1.6 TB/s that way.)

An FP8 cache stores e4m3 entries with one float32 scale per token (see kv_store.py). The
scale factors out of both products: scores are q.k_fp8 * s, and the value sum uses p * s.
The FP8 entries widen to float16 (one instruction per pair; bfloat16 takes four), so q and
the probabilities enter the products as float16 too.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._util import DOT, DOT16, FP8, check, check_cache_scale, check_shape, next_pow2

LOG2E = 1.4426950408889634
# LAZY_RESCALE: the running max moves only past this many log2 units of growth (weights <= 2^8)
LAZY_MARGIN = tl.constexpr(8.0)

# Tuned on an H200 by benchmarks/gpu/bench_kernels.py: (cache dtype, batch bucket) -> config,
# and (cache dtype, batch bucket, context bucket) -> config where the context changes the best
# split (those keys win). BLOCK_N tokens per tile; MIN_SPLIT: fewest tokens a split may get;
# WAVES: programs wanted, in multiples of the SM count (more splits fill the GPU at small batch
# but add partial-output traffic and a merge; one split writes the output directly); HALVES: 2
# splits the latent into two halves, two tensor-core chains a tile; MAX_SPLITS (default 128):
# the most splits a sequence may get (a long context at small batch wants several programs
# per SM; each split adds only a partial row and an lse to write and merge). The table was
# retuned 2026-11-30 with the constant page size and the per-column denominator
# (raw/2026-11-30-h200-session8-*); tiles and splits from the 2026-11-29 run, which timed a
# kernel whose tile loop could not prefetch; num_stages is 3 here because with 2 the compiler
# issues the next tile's copy after this tile's math and waits for it at once. Untimed keys
# (session 16): EARLY_DEQUANT (FP8, default False) dequantizes each tile to bf16 where it is
# loaded (see _fold); PREFETCH (default False; paged tiles) loads each tile while the one
# before it is folded, written out, for the FP8 latent tiles, which the compiler does not
# pipeline on sm_90. RELOAD (session 17; FP8, default False; PREFETCH is off with it)
# loads each latent tile twice, once per product, so that both loads are pipelined (see
# _load_pv; EARLY_DEQUANT takes precedence): on the H200 the whole model at batch 1 went
# 5.09 -> 4.61 ms at 128K and 14.93 -> 13.07 ms at 855K; its 128K entries take 2 stages.
# Session 18, the FP8 cache re-tuned: RELOAD with paged tiles at 64 x 1K and 256 x 1K / 4K,
# BLOCK_N 16 and 4 waves at 64 x 4K, EARLY_DEQUANT and PREFETCH at 8 x 4K. The whole model over
# an FP8 cache, new-old-new-old: batch 64 10.21 against 10.70-10.75 ms at 1K and 14.65-14.90
# against 15.27-15.50 at 4K, batch 256 22.68-22.75 against 24.21-24.46 at 4K (13.57-14.01
# against 13.92-13.96 at 1K: noise), batch 8 at 4K a tie (5% faster alone); the tuner's pick
# at 128 x 1K (faster alone) made the model 4% slower and was not taken.
# LAZY_RESCALE (session 17; default False) rescales the accumulators only where the running
# max grows by more than LAZY_MARGIN (see _fold): offline for sm_90, ~12% of the tile loop's
# instructions were that rescale, but timed on the H200 (session 18, bf16 at 64 / 128 / 256 x
# 1K) it gains nothing (94 against 93 us at 256): the loop waits on memory, not on them.
DECODE_CONFIGS: dict[tuple, dict] = {
    ('bf16', 1): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 64},
    ('fp8', 1): {'BLOCK_N': 64, 'num_warps': 8, 'num_stages': 3, 'MIN_SPLIT': 512},
    ('bf16', 8): {'BLOCK_N': 64, 'num_warps': 8, 'num_stages': 3, 'MIN_SPLIT': 128},
    ('fp8', 8): {'BLOCK_N': 32, 'num_warps': 8, 'num_stages': 3, 'MIN_SPLIT': 64},
    ('bf16', 32): {'BLOCK_N': 16, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 64},
    ('fp8', 32): {'BLOCK_N': 64, 'num_warps': 8, 'num_stages': 2, 'MIN_SPLIT': 512, 'PAGED': False},
    ('bf16', 64): {'BLOCK_N': 64, 'num_warps': 8, 'num_stages': 3, 'MIN_SPLIT': 512},
    ('fp8', 64): {'BLOCK_N': 64, 'num_warps': 8, 'num_stages': 3, 'MIN_SPLIT': 512},
    ('bf16', 128): {'BLOCK_N': 64, 'num_warps': 8, 'num_stages': 3, 'MIN_SPLIT': 512},
    ('fp8', 128): {'BLOCK_N': 64, 'num_warps': 8, 'num_stages': 3, 'MIN_SPLIT': 64},
    ('bf16', 256): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 512},
    ('fp8', 256): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 512},
    ('bf16', 1, 4096): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 64, 'WAVES': 4, 'HALVES': 2},
    ('fp8', 1, 4096): {'BLOCK_N': 64, 'num_warps': 8, 'num_stages': 2, 'MIN_SPLIT': 64, 'WAVES': 2, 'PAGED': False},
    ('bf16', 1, 1024): {'BLOCK_N': 64, 'num_warps': 8, 'num_stages': 2, 'MIN_SPLIT': 64, 'WAVES': 1, 'PAGED': False},
    ('fp8', 1, 1024): {'BLOCK_N': 64, 'num_warps': 8, 'num_stages': 2, 'MIN_SPLIT': 64, 'WAVES': 1, 'PAGED': False},
    ('bf16', 8, 4096): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 4, 'MIN_SPLIT': 256, 'WAVES': 4, 'HALVES': 2},
    ('fp8', 8, 4096): {'BLOCK_N': 64, 'num_warps': 8, 'num_stages': 2, 'MIN_SPLIT': 256, 'WAVES': 1, 'PAGED': True, 'EARLY_DEQUANT': True, 'PREFETCH': True},
    ('bf16', 8, 1024): {'BLOCK_N': 16, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 64, 'WAVES': 4, 'HALVES': 2},
    ('fp8', 8, 1024): {'BLOCK_N': 64, 'num_warps': 8, 'num_stages': 2, 'MIN_SPLIT': 64, 'WAVES': 1, 'PAGED': False},
    ('bf16', 32, 4096): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 512, 'WAVES': 4},
    ('fp8', 32, 4096): {'BLOCK_N': 64, 'num_warps': 8, 'num_stages': 3, 'MIN_SPLIT': 1024, 'WAVES': 2, 'PAGED': False},
    ('bf16', 32, 1024): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 256, 'WAVES': 1, 'HALVES': 2},
    ('fp8', 32, 1024): {'BLOCK_N': 64, 'num_warps': 8, 'num_stages': 3, 'MIN_SPLIT': 256, 'WAVES': 2, 'PAGED': False, 'HALVES': 1},
    ('bf16', 64, 4096): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 1024, 'WAVES': 2, 'HALVES': 2},
    ('fp8', 64, 4096): {'BLOCK_N': 16, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 1024, 'WAVES': 4, 'HALVES': 2},
    ('bf16', 64, 1024): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 512, 'WAVES': 2, 'HALVES': 2},
    ('fp8', 64, 1024): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 512, 'WAVES': 2, 'HALVES': 2, 'PAGED': True, 'RELOAD': True},
    ('bf16', 128, 4096): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 1024, 'WAVES': 1, 'HALVES': 2},
    ('fp8', 128, 4096): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 64, 'WAVES': 1, 'HALVES': 2},
    ('bf16', 128, 1024): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 1024, 'WAVES': 1, 'HALVES': 2},
    ('fp8', 128, 1024): {'BLOCK_N': 64, 'num_warps': 8, 'num_stages': 3, 'MIN_SPLIT': 1024, 'WAVES': 1, 'HALVES': 2, 'EARLY_DEQUANT': True, 'PREFETCH': True, 'PAGED': True},
    ('bf16', 256, 4096): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 64, 'WAVES': 1, 'HALVES': 2},
    ('fp8', 256, 4096): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 64, 'WAVES': 1, 'HALVES': 2, 'PAGED': True, 'RELOAD': True},
    ('bf16', 256, 1024): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 256, 'WAVES': 1, 'HALVES': 2},
    ('fp8', 256, 1024): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 256, 'WAVES': 1, 'HALVES': 2, 'PAGED': True, 'RELOAD': True},
    ('fp8', 1, 131072): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 2, 'MIN_SPLIT': 64, 'WAVES': 8, 'HALVES': 2, 'PAGED': True, 'MAX_SPLITS': 512, 'RELOAD': True},
    ('fp8', 8, 131072): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 2, 'MIN_SPLIT': 64, 'WAVES': 4, 'HALVES': 2, 'PAGED': True, 'MAX_SPLITS': 1024, 'RELOAD': True},
    ('bf16', 8, 131072): {'BLOCK_N': 32, 'num_warps': 4, 'num_stages': 3, 'MIN_SPLIT': 64, 'WAVES': 4, 'HALVES': 2, 'PAGED': True, 'MAX_SPLITS': 2048},
}
DEFAULT_CONFIG = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 3, "MIN_SPLIT": 256, "WAVES": 2}
BATCH_BUCKETS = (1, 8, 32, 64, 128, 256)
LEN_BUCKETS = (1024, 4096, 131072)  # a launch's context bound picks the largest bucket at or below it


def decode_config(kv_dtype: torch.dtype, batch: int, max_seq_len: int | None = None) -> dict:
    name = "fp8" if kv_dtype == FP8 else "bf16"
    bucket = max([b for b in BATCH_BUCKETS if b <= batch], default=BATCH_BUCKETS[0])
    cfg = {**DEFAULT_CONFIG, **DECODE_CONFIGS.get((name, bucket), {})}
    if max_seq_len is not None:  # the largest context bucket at or below the bound with an entry
        for lb in sorted({b for b in LEN_BUCKETS if b <= max_seq_len} | {LEN_BUCKETS[0]}, reverse=True):
            if (name, bucket, lb) in DECODE_CONFIGS:
                cfg.update(DECODE_CONFIGS[(name, bucket, lb)])
                break
    return cfg


def _quant_mode(cfg: dict) -> int:
    """The split kernel's QUANT for an FP8 cache: 2 with EARLY_DEQUANT, 3 with RELOAD, else 1."""
    if cfg.get("EARLY_DEQUANT", False):
        return 2
    return 3 if cfg.get("RELOAD", False) else 1


def page_group(cfg: dict, block_size: int) -> tuple[int, bool]:
    """(pages whose block ids a split loads at once, whether a tile spans several of them).
    0 pages: a block-table entry per token. 32: a vector one warp searches per tile, and one
    compile for every split length. A tile is within one page (BLOCK_N divides the block
    size) or whole pages (the block size divides BLOCK_N, and a group holds whole tiles)."""
    bn, group = cfg["BLOCK_N"], cfg.get("MAX_GROUP", 32)
    if not cfg.get("PAGED", True):
        return 0, False
    if block_size % bn == 0:
        return group, False
    if bn % block_size == 0 and (group * block_size) % bn == 0:
        return group, True
    return 0, False


def num_splits_for(batch: int, head_groups: int, max_seq_len: int, min_split: int,
                   sms: int, waves: float = 2, max_splits: int = 128) -> int:
    """Enough programs for about `waves` waves, but no split shorter than `min_split` tokens
    and no more than `max_splits` splits."""
    want = triton.cdiv(int(waves * sms), batch * head_groups)
    most = max(1, max_seq_len // min_split)
    return max(1, min(want, most, max_splits))


@triton.jit
def _load_tile(cache_ptr, rows, pm, scale_ptr, srows, DL: tl.constexpr, DR: tl.constexpr,
               HALF: tl.constexpr, BLOCK_R: tl.constexpr, HALVES: tl.constexpr, QUANT: tl.constexpr):
    """One tile of cache entries as stored (at row offsets `rows`, live where pm): the latent
    (its second half with HALVES = 2, else the first again), the rope part, and the FP8
    scales (the live mask as floats for a bf16 cache: unused)."""
    oh, orr = tl.arange(0, HALF), tl.arange(0, BLOCK_R)
    kva = tl.load(cache_ptr + rows[:, None] + oh[None, :], mask=pm[:, None] & (oh < DL)[None, :],
                  other=0.0)
    kp = tl.load(cache_ptr + rows[:, None] + DL + orr[None, :],
                 mask=pm[:, None] & (orr < DR)[None, :], other=0.0)
    kvb = kva
    if HALVES == 2:
        kvb = tl.load(cache_ptr + rows[:, None] + HALF + oh[None, :],
                      mask=pm[:, None] & (HALF + oh < DL)[None, :], other=0.0)
    ts = pm.to(tl.float32)
    if QUANT:
        ts = tl.load(scale_ptr + srows, mask=pm, other=0.0)
    return kva, kp, kvb, ts


@triton.jit
def _load_pv(cache_ptr, rows, pm, kva, kvb, DL: tl.constexpr, HALF: tl.constexpr,
             HALVES: tl.constexpr, QUANT: tl.constexpr):
    """The latent tile for the value product: with QUANT 3 (config RELOAD, FP8) loaded again,
    so that each product's tile has one use and the compiler pipelines both loads as async
    copies to shared memory (a tile with two uses in two layouts is loaded synchronously on
    sm_90); the second read is served by L2. Otherwise the tile already loaded."""
    if QUANT == 3:
        oh = tl.arange(0, HALF)
        kva = tl.load(cache_ptr + rows[:, None] + oh[None, :], mask=pm[:, None] & (oh < DL)[None, :],
                      other=0.0, eviction_policy="evict_first")
        if HALVES == 2:
            kvb = tl.load(cache_ptr + rows[:, None] + HALF + oh[None, :],
                          mask=pm[:, None] & (HALF + oh < DL)[None, :], other=0.0,
                          eviction_policy="evict_first")
        else:
            kvb = kva
    return kva, kvb


@triton.jit
def _fold(kva, kp, kvb, ts, pm, qa, qb, qp, m, den, acc_a, acc_b, sm_scale_log2,
          HALVES: tl.constexpr, QUANT: tl.constexpr, va=None, vb=None, LAZY: tl.constexpr = False):
    """Fold one loaded tile (``_load_tile``) into a head group's running max m, denominator
    den and output acc_a (and acc_b: with HALVES = 2 the latent is two halves, two
    independent tensor-core chains, not one). QUANT 0: a bf16 cache. 1: FP8, widened to
    float16 for the products, its scales applied to the scores and the probabilities. 2
    (config EARLY_DEQUANT): FP8 dequantized to bf16 where loaded, then as a bf16 cache (one
    widening a tile; compiled for sm_90 the first form widens each tile twice, once per
    product, and shuffles it between layouts). 3 (config RELOAD): as 1, the value product on
    ``va`` / ``vb``, the latent loaded again (``_load_pv``). LAZY (config LAZY_RESCALE): the
    running max moves only when some head's grows by more than LAZY_MARGIN (log2 units), as
    FlashAttention-4 does, so most tiles skip rescaling the accumulators; the weights are
    then at most 2 ** LAZY_MARGIN, and the output (acc / den) and lse (m + log2 den) are the
    same."""
    if QUANT == 2:  # dequantized to bf16 where loaded: both products as with a bf16 cache
        kva = (kva.to(tl.float32) * ts[:, None]).to(DOT)
        kp = (kp.to(tl.float32) * ts[:, None]).to(DOT)
        if HALVES == 2:
            kvb = (kvb.to(tl.float32) * ts[:, None]).to(DOT)
    elif QUANT:
        kva, kp, kvb = kva.to(DOT16), kp.to(DOT16), kvb.to(DOT16)
    else:
        kva, kp, kvb = kva.to(DOT), kp.to(DOT), kvb.to(DOT)
    if QUANT == 3:
        va, vb = va.to(DOT16), vb.to(DOT16)
    else:
        va, vb = kva, kvb
    s = tl.dot(qa, tl.trans(kva)) + tl.dot(qp, tl.trans(kp))
    if HALVES == 2:
        s += tl.dot(qb, tl.trans(kvb))
    if QUANT == 1 or QUANT == 3:
        s = s * ts[None, :]
    s = tl.where(pm[None, :], s * sm_scale_log2, float("-inf"))
    if LAZY:
        m_tile = tl.max(s, 1)
        if tl.max(m_tile - m, 0) > LAZY_MARGIN:  # one branch for the program: rescale all heads
            m_new = tl.maximum(m, m_tile)
            alpha = tl.exp2(m - m_new)
            den = den * alpha[:, None]
            acc_a = acc_a * alpha[:, None]
            if HALVES == 2:
                acc_b = acc_b * alpha[:, None]
            m = m_new
        p = tl.exp2(s - m[:, None])
        den = den + p
    else:
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        # The denominator stays per column and is summed once at the end: a row sum here would
        # cost a cross-warp reduction (shared memory and a barrier) per tile.
        den = den * alpha[:, None] + p
        m = m_new
    if QUANT == 1 or QUANT == 3:
        # The value sum weighs token t by p * scale_t. float16 holds p * scale_t / max(scale)
        # in [0, 2 ** LAZY_MARGIN] precisely (p * scale_t itself underflows for a cache of
        # small values).
        tmax = tl.maximum(tl.max(ts, 0), 1e-30)
        pw = (p * (ts / tmax)[None, :]).to(DOT16)
        if LAZY:
            acc_a = acc_a + tl.dot(pw, va) * tmax
            if HALVES == 2:
                acc_b = acc_b + tl.dot(pw, vb) * tmax
        else:
            acc_a = acc_a * alpha[:, None] + tl.dot(pw, va) * tmax
            if HALVES == 2:
                acc_b = acc_b * alpha[:, None] + tl.dot(pw, vb) * tmax
    else:
        pw = p.to(DOT)
        if LAZY:  # accumulated in the tensor-core product itself: nothing to rescale first
            acc_a = tl.dot(pw, va, acc_a)
            if HALVES == 2:
                acc_b = tl.dot(pw, vb, acc_b)
        else:
            acc_a = acc_a * alpha[:, None] + tl.dot(pw, va)
            if HALVES == 2:
                acc_b = acc_b * alpha[:, None] + tl.dot(pw, vb)
    return m, den, acc_a, acc_b


@triton.jit
def _page_rows(n0, p0, pages, g, toks, s_cblk, s_ctok, s_sblk, s_stok, BLOCK_SIZE: tl.constexpr,
               MULTI: tl.constexpr):
    """(cache row offsets, scale offsets) of the tile at token n0 of the page group from p0,
    whose block ids are `pages`. A tile lies in one page (or in whole pages, MULTI); a tile
    past the group reads block 0 (callers mask it)."""
    if MULTI:  # each token's page, picked from the group's ids in registers
        pidx = (n0 + toks) // BLOCK_SIZE - p0
        blk = tl.sum(tl.where(g[None, :] == pidx[:, None], pages[None, :], 0), 1).to(tl.int64)
        slot = (n0 + toks) % BLOCK_SIZE
    else:
        blk = tl.sum(tl.where(g == n0 // BLOCK_SIZE - p0, pages, 0), 0).to(tl.int64)
        slot = n0 % BLOCK_SIZE + toks
    return blk * s_cblk + slot * s_ctok, blk * s_sblk + slot * s_stok


@triton.jit(do_not_specialize=["num_splits"])  # one compile for every split count
def _mla_decode_split_kernel(
        ql_ptr, qpe_ptr, cache_ptr, scale_ptr, bt_ptr, len_ptr, op_ptr, lse_ptr, sm_scale_log2,
        s_qlb, s_qlh, s_qpb, s_qph, s_cblk, s_ctok, s_sblk, s_stok, s_btb,
        s_ob, s_oh, s_os, s_lb, s_lh, num_heads, num_splits,
        DL: tl.constexpr, DR: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        QUANT: tl.constexpr, GROUP: tl.constexpr, MULTI: tl.constexpr, DIRECT: tl.constexpr,
        HALVES: tl.constexpr, PREFETCH: tl.constexpr, LAZY: tl.constexpr = False):
    # DIRECT (one split): op_ptr is the output [B, H, DL] itself (s_os unused), no lse.
    # BLOCK_SIZE (the cache's page size) is a constant: a token's page and slot are a shift and
    # a mask, not a signed division (which was most of the tile loop's instructions).
    HALF: tl.constexpr = BLOCK_L // HALVES
    b, sp, hg = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(len_ptr + b)
    per = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = sp * per
    end = tl.minimum(start + per, seq_len)
    heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = heads < num_heads
    oh, orr = tl.arange(0, HALF), tl.arange(0, BLOCK_R)
    qa = tl.load(ql_ptr + b * s_qlb + heads[:, None] * s_qlh + oh[None, :],
                 mask=hm[:, None] & (oh < DL)[None, :], other=0.0)
    qp = tl.load(qpe_ptr + b * s_qpb + heads[:, None] * s_qph + orr[None, :],
                 mask=hm[:, None] & (orr < DR)[None, :], other=0.0)
    if QUANT == 1 or QUANT == 3:
        qa, qp = qa.to(DOT16), qp.to(DOT16)
    else:
        qa, qp = qa.to(DOT), qp.to(DOT)
    acc_a = tl.zeros([BLOCK_H, HALF], tl.float32)
    if HALVES == 2:
        qb = tl.load(ql_ptr + b * s_qlb + heads[:, None] * s_qlh + HALF + oh[None, :],
                     mask=hm[:, None] & (HALF + oh < DL)[None, :], other=0.0).to(qa.dtype)
        acc_b = tl.zeros([BLOCK_H, HALF], tl.float32)
    else:
        qb, acc_b = qa, 0.0  # unused
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
    toks = tl.arange(0, BLOCK_N)
    if GROUP > 0:
        # A tile lies in one page (or in whole pages, MULTI). The block ids of GROUP pages
        # are loaded together, so a tile's address needs no load of its own and the compiler
        # prefetches the next tiles while this one is computed (a per-tile block-table load
        # would serialise: table load, then tile load, then compute).
        g = tl.arange(0, GROUP)
        last_page = tl.cdiv(end, BLOCK_SIZE)
        for p0 in range(start // BLOCK_SIZE, last_page, GROUP):
            pages = tl.load(bt_ptr + b * s_btb + p0 + g, mask=p0 + g < last_page, other=0)
            lo = tl.maximum(start, p0 * BLOCK_SIZE)
            hi = tl.minimum(end, (p0 + GROUP) * BLOCK_SIZE)
            if PREFETCH:  # each tile's load issued before the tile ahead of it is folded
                rows, srows = _page_rows(lo, p0, pages, g, toks, s_cblk, s_ctok, s_sblk, s_stok,
                                         BLOCK_SIZE, MULTI)
                kva, kp, kvb, ts = _load_tile(cache_ptr, rows, lo + toks < end, scale_ptr, srows,
                                              DL, DR, HALF, BLOCK_R, HALVES, QUANT)
                for n0 in range(lo, hi, BLOCK_N):
                    n1 = n0 + BLOCK_N
                    rows, srows = _page_rows(n1, p0, pages, g, toks, s_cblk, s_ctok, s_sblk, s_stok,
                                             BLOCK_SIZE, MULTI)
                    nkva, nkp, nkvb, nts = _load_tile(cache_ptr, rows, (n1 + toks < end) & (n1 < hi),
                                                      scale_ptr, srows, DL, DR, HALF, BLOCK_R, HALVES, QUANT)
                    m, den, acc_a, acc_b = _fold(kva, kp, kvb, ts, n0 + toks < end, qa, qb, qp, m, den,
                                                 acc_a, acc_b, sm_scale_log2, HALVES, QUANT, LAZY=LAZY)
                    kva, kp, kvb, ts = nkva, nkp, nkvb, nts
            else:  # the compiler's pipelining (which the FP8 latent tiles do not get on sm_90)
                for n0 in range(lo, hi, BLOCK_N):
                    rows, srows = _page_rows(n0, p0, pages, g, toks, s_cblk, s_ctok, s_sblk, s_stok,
                                             BLOCK_SIZE, MULTI)
                    pm = n0 + toks < end
                    kva, kp, kvb, ts = _load_tile(cache_ptr, rows, pm, scale_ptr, srows, DL, DR, HALF,
                                                  BLOCK_R, HALVES, QUANT)
                    va, vb = _load_pv(cache_ptr, rows, pm, kva, kvb, DL, HALF, HALVES, QUANT)
                    m, den, acc_a, acc_b = _fold(kva, kp, kvb, ts, pm, qa, qb, qp, m, den, acc_a, acc_b,
                                                 sm_scale_log2, HALVES, QUANT, va, vb, LAZY)
    else:  # tiles span pages: a block-table entry per token
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + toks
            pm = pos < end
            blk = tl.load(bt_ptr + b * s_btb + pos // BLOCK_SIZE, mask=pm, other=0).to(tl.int64)
            slot = pos % BLOCK_SIZE
            rows = blk * s_cblk + slot * s_ctok
            kva, kp, kvb, ts = _load_tile(cache_ptr, rows, pm, scale_ptr,
                                          blk * s_sblk + slot * s_stok, DL, DR, HALF, BLOCK_R, HALVES, QUANT)
            va, vb = _load_pv(cache_ptr, rows, pm, kva, kvb, DL, HALF, HALVES, QUANT)
            m, den, acc_a, acc_b = _fold(kva, kp, kvb, ts, pm, qa, qb, qp, m, den, acc_a, acc_b,
                                         sm_scale_log2, HALVES, QUANT, va, vb, LAZY)
    total = tl.sum(den, 1)
    some = total > 0.0  # false for an empty split (seq_len shorter than this split's start)
    inv = 1.0 / tl.where(some, total, 1.0)
    out_ptrs = op_ptr + b * s_ob + heads[:, None] * s_oh + oh[None, :]
    if not DIRECT:
        out_ptrs += sp * s_os
    out_ty = op_ptr.dtype.element_ty
    tl.store(out_ptrs, (acc_a * inv[:, None]).to(out_ty), mask=hm[:, None] & (oh < DL)[None, :])
    if HALVES == 2:
        tl.store(out_ptrs + HALF, (acc_b * inv[:, None]).to(out_ty),
                 mask=hm[:, None] & (HALF + oh < DL)[None, :])
    if not DIRECT:
        lse = tl.where(some, m + tl.log2(tl.where(some, total, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * s_lb + heads * s_lh + sp, lse, mask=hm)


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
               scale: torch.Tensor | None = None, *, max_seq_len: int | None = None,
               num_splits: int | None = None, config: dict | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its cached entries.

    q_latent [B, H, DL] and q_pe [B, H, DR] (bf16/fp16); cache [num_blocks, block_size, DL + DR]
    bf16 or e4m3fn (then `scale` [num_blocks, block_size] float32); block_tables [B, max_blocks]
    int32; seq_lens [B] int32 (tokens to attend to, the new one included; 0 gives zeros).
    Returns [B, H, DL] in q's dtype. `max_seq_len` (host-known bound) and `num_splits` only
    shape the launch; fix num_splits when capturing a CUDA graph."""
    out, part, lse = _decode(q_latent, q_pe, cache, block_tables, seq_lens, sm_scale, scale,
                             max_seq_len, num_splits, config)
    if lse is not None:
        _merge(part, lse, out)
    return out


def mla_decode_partials(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                        scale: torch.Tensor | None = None, *, max_seq_len: int | None = None,
                        num_splits: int | None = None, config: dict | None = None,
                        merge_above: int = 128) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``mla_decode`` without its merge launch, for a caller that merges the splits where it
    reads the output (``dense.merge_bmm_row``): (partials [B, H, S, DL] float32, their
    log2-sum-exps [B, H, S]), or (the output [B, H, DL], None) where one split per sequence
    wrote the output directly, there are more than ``merge_above`` splits (merged here: each
    of a reader's programs would redo a merge that large), or B is 0. An empty split has lse -inf;
    merged, a sequence's splits give the sum of partial * exp2(lse - max) over the sum of
    exp2(lse - max)."""
    out, part, lse = _decode(q_latent, q_pe, cache, block_tables, seq_lens, sm_scale, scale,
                             max_seq_len, num_splits, config)
    if lse is not None and part.shape[2] > merge_above:
        _merge(part, lse, out)
        lse = None
    return (out, None) if lse is None else (part, lse)


def _decode(q_latent, q_pe, cache, block_tables, seq_lens, sm_scale, scale, max_seq_len,
            num_splits, config):
    """Check and launch the split kernel: (output, partials, lse), lse None where the split
    kernel wrote the output itself or there is no sequence (partials None then too)."""
    dev = q_latent.device
    check(q_latent, "q_latent", dims=3, dtypes=(torch.bfloat16, torch.float16))
    check(q_pe, "q_pe", dims=3, dtypes=(q_latent.dtype,), device=dev)
    check(cache, "cache", dims=3, dtypes=(torch.bfloat16, torch.float16, FP8), device=dev)
    check(block_tables, "block_tables", dims=2, dtypes=(torch.int32, torch.int64), device=dev)
    check(seq_lens, "seq_lens", dims=1, dtypes=(torch.int32, torch.int64), device=dev,
          last_contiguous=False)
    b, h, dl = q_latent.shape
    dr = q_pe.shape[2]
    check_shape(q_pe, "q_pe", (b, h, None))
    check_shape(cache, "cache", (None, None, dl + dr))
    check_shape(block_tables, "block_tables", (b, None))
    check_shape(seq_lens, "seq_lens", (b,))
    quant = check_cache_scale(cache, scale)
    bound = max_seq_len or block_tables.shape[1] * cache.shape[1]
    cfg = {**decode_config(cache.dtype, b, bound), **(config or {})}
    block_h = min(64, max(16, next_pow2(h)))
    groups = triton.cdiv(h, block_h)
    if num_splits is None:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
        num_splits = num_splits_for(b, groups, bound, cfg["MIN_SPLIT"], sms, cfg.get("WAVES", 2),
                                    cfg.get("MAX_SPLITS", 128))
    out = torch.empty(b, h, dl, dtype=q_latent.dtype, device=dev)
    if b == 0:
        return out, None, None
    direct = num_splits == 1  # the split kernel writes the output: no partials, no merge
    if direct:
        part, lse = out.unsqueeze(2), out  # lse: an unused pointer
    else:
        part = torch.empty(b, h, num_splits, dl, dtype=torch.float32, device=dev)
        lse = torch.empty(b, h, num_splits, dtype=torch.float32, device=dev)
    sc = scale if quant else seq_lens.view(1, -1)  # unused pointer when not quantized
    group, multi = page_group(cfg, cache.shape[1])
    # two latent halves only where each is a whole tensor-core step (16 columns) or more
    halves = 2 if cfg.get("HALVES", 1) == 2 and next_pow2(dl) >= 32 else 1
    qmode = _quant_mode(cfg) if quant else 0
    _mla_decode_split_kernel[(b, num_splits, groups)](
        q_latent, q_pe, cache, sc, block_tables, seq_lens, part, lse, sm_scale * LOG2E,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.stride(0), cache.stride(1), sc.stride(0), sc.stride(1), block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        h, num_splits,
        DL=dl, DR=dr, BLOCK_L=next_pow2(dl), BLOCK_R=next_pow2(dr), BLOCK_H=block_h,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_SIZE=cache.shape[1],
        QUANT=qmode, GROUP=group, MULTI=multi, DIRECT=direct, HALVES=halves,
        PREFETCH=bool(cfg.get("PREFETCH", False)) and group > 0 and qmode != 3,  # RELOAD: not both
        LAZY=bool(cfg.get("LAZY_RESCALE", False)),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return (out, part, None) if direct else (out, part, lse)


@triton.jit(do_not_specialize=["num_splits"])
def _mla_decode_merge_kernel(op_ptr, lse_ptr, out_ptr, s_ob, s_oh, s_os, s_lb, s_lh,
                             s_outb, s_outh, num_splits,
                             DL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b, h, dc = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    ss = tl.arange(0, BLOCK_S)
    od = dc * BLOCK_D + tl.arange(0, BLOCK_D)
    # Partials and lse load together (an empty split's partial is zeros, its weight 0): one
    # memory round trip, not two.
    o = tl.load(op_ptr + b * s_ob + h * s_oh + ss[:, None] * s_os + od[None, :],
                mask=(ss < num_splits)[:, None] & (od < DL)[None, :], other=0.0)
    lse = tl.load(lse_ptr + b * s_lb + h * s_lh + ss, mask=ss < num_splits, other=float("-inf"))
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # every split empty: output zeros
    w = tl.exp2(lse - mx)
    out = tl.sum(o * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(out_ptr + b * s_outb + h * s_outh + od, out.to(out_ptr.dtype.element_ty),
             mask=od < DL)


def _merge(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    b, h, num_splits, dl = part.shape
    # A program merges a whole head row where its tile stays within 8K values (registers):
    # with many splits, a narrower column slice (down to 4 values, 16 bytes a split's row).
    block_s = next_pow2(num_splits)
    block_d = min(next_pow2(dl), max(4, 8192 // block_s))
    _mla_decode_merge_kernel[(b, h, triton.cdiv(dl, block_d))](
        part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0),
        lse.stride(1), out.stride(0), out.stride(1), num_splits,
        DL=dl, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4 if block_s * block_d <= 8192 else 8)


def merge_reference(part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The splits' merge in torch, float32: part [..., S, D] and lse [..., S] -> [..., D]."""
    mx = lse.amax(-1, keepdim=True)
    mx = torch.where(mx == float("-inf"), torch.zeros_like(mx), mx)
    w = torch.exp2(lse - mx)
    return (part * w[..., None]).sum(-2) / w.sum(-1, keepdim=True).clamp_min(1e-30)


def gather_entries(cache: torch.Tensor, block_tables: torch.Tensor, length: int,
                   scale: torch.Tensor | None = None, dtype=torch.float32) -> torch.Tensor:
    """[B, length, D] of each sequence's first `length` cache entries, dequantized."""
    bs = cache.shape[1]
    nb = triton.cdiv(length, bs)
    idx = block_tables[:, :nb].long()
    ent = cache[idx].reshape(idx.shape[0], nb * bs, cache.shape[-1])[:, :length].to(dtype)
    if scale is not None:
        ent = ent * scale[idx].reshape(idx.shape[0], nb * bs)[:, :length, None].to(dtype)
    return ent


def mla_decode_reference(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                         scale: torch.Tensor | None = None,
                         compute_dtype: torch.dtype = torch.float32,
                         max_len: int | None = None) -> torch.Tensor:
    """Plain torch: gather every sequence's entries, then softmax(q.k) @ latent. With
    compute_dtype=bfloat16 it is the unfused torch baseline the benchmark times (pass
    max_len, a bound on seq_lens, to keep it free of host syncs)."""
    dl = q_latent.shape[2]
    length = max_len or max(int(seq_lens.max()), 1)
    ent = gather_entries(cache, block_tables, length, scale, compute_dtype)
    kv, kp = ent[..., :dl], ent[..., dl:]
    s = (torch.einsum("bhd,bld->bhl", q_latent.to(compute_dtype), kv)
         + torch.einsum("bhr,blr->bhl", q_pe.to(compute_dtype), kp)).float() * sm_scale
    live = torch.arange(length, device=s.device)[None, :] < seq_lens[:, None]
    s = s.masked_fill(~live[:, None, :], float("-inf"))
    p = torch.nan_to_num(s.softmax(-1), nan=0.0)  # rows with seq_len 0 give zeros
    return torch.einsum("bhl,bld->bhd", p.to(compute_dtype), kv).to(q_latent.dtype)


def default_sm_scale(qk_head_dim: int) -> float:
    return 1.0 / math.sqrt(qk_head_dim)
