"""Exact top-k over long rows (k up to a few thousand of 32K-128K candidates), as a
sparse-attention indexer needs: three launches, each row read from HBM once, by many programs.

Floats map to uint32 keys whose unsigned order is the float order (`_key`).
0. floor (one program a row): the row's floor T from a sample of it: the (e + Z sqrt(e) +
   1)-th largest of SAMPLE sampled keys, e = k * SAMPLE / n being how many are expected above
   the k-th largest key, its low 17 bits cleared; and the row's histogram zeroed. T keeps a
   few thousand elements, and fewer than k only if the sample is off by Z standard deviations.
1. scan (programs over chunks of every row, none waiting on another): each program copies
   its chunk's keys >= T, with their indices, in index order, to the chunk's region of a
   scratch buffer, writes how many, and counts them (relaxed atomics, ~4% of the elements)
   into a histogram of BINS bins of equal key width spanning [T, the sample's largest key].
2. select (one program per row): the histogram names the bin holding the k-th largest key,
   with c keys above it. The candidates are read into registers in index order (as one
   [chunks, CAND / chunks] tile, or, when one chunk holds most of them, by a binary search of
   each position in the chunk counts); the k-th key is found among the bin's few keys (walking
   its distinct keys down, or bisecting its span when it holds many: ties, a cluster); then
   every key above it and the lowest-index ties at it are written in index order.
   With more than CAND candidates (heavy ties, -inf padding) or fewer than k (a misleading
   sample), the program does the same over tiles of the candidates or of the row, re-read per
   pass: slower, never wrong.
The earlier four-launch design (topk_threshold.py) stays as a fallback: for k > CAND / 2, or
when a config says {"ALGO": "threshold"}.

Result: values and int32 indices in ascending index order (not sorted by value). Ties at the
threshold go to the lowest indices. Keys are bit patterns, so -0.0 ranks below +0.0, and a
NaN ranks above +inf (or below -inf, with its sign bit set), as in torch.topk for NaN.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._util import check, count_where, hopper_or_later, next_pow2, nvidia_ptx, st_where, st_where16
from .topk_threshold import _key, _unkey, carve, sm_count, threshold_config, topk_threshold

# Tuned on an H200 by benchmarks/gpu/bench_kernels.py: (row bucket, row length) -> config.
# CHUNK: elements per scan program (None: PROGRAMS_PER_SM programs per SM over all rows);
# TILE: elements per scan step; SAMPLE: sampled keys per row (in PIECES runs); Z: the floor's
# margin in standard deviations; BINS: histogram bins per row (4096: ~2.5 candidates a bin
# at the k-th key of a Gaussian row of 128K); CAND: the select program's register tile (a
# floor with Z = 6 keeps ~5,300 of 128K, ~3,600 of 32K); WAYS: thresholds per bisection round;
# WALK (optional, default the module's): the largest k-th bin resolved by walking its keys
# (two reductions a key) rather than by bisection (one reduction a round of WAYS);
# SCAN_STAGES (optional, 0 by default): > 0 lets the compiler pipeline the scan's loads, that
# many tiles deep, instead of the one-tile prefetch written out; PDL (optional, True by
# default): on Hopper and later, the scan and the select are launched as programmatic
# dependents of the launch before them (see `_pdl`); ASM_STORES (optional, False by default;
# NVIDIA only): the scan's compaction stores and histogram counts, and the select's output
# stores, as predicated inline PTX in the tile's own layout (`_util.st_where`): compiled for
# sm_90 offline, the scan loop's PTX went from 353 instructions and 23 barriers a tile to 268
# and 9; on the H200, with PDL, 64 rows of 131,072 took 40.3 us against 56 with neither (43 with
# the stores alone; session 17).
TOPK_CONFIGS: dict[tuple[int, int], dict] = {
    (1, 131072): {'ALGO': 'select', 'CHUNK': None, 'PROGRAMS_PER_SM': 8, 'TILE': 2048, 'num_warps': 8, 'SAMPLE': 1024, 'PIECES': 64, 'Z': 6.0, 'BINS': 4096, 'CAND': 8192, 'WAYS': 4, 'select_warps': 16, 'ASM_STORES': True},
    (64, 32768): {'ALGO': 'select', 'CHUNK': None, 'PROGRAMS_PER_SM': 4, 'TILE': 1024, 'num_warps': 4, 'SAMPLE': 2048, 'PIECES': 64, 'Z': 5.0, 'BINS': 4096, 'CAND': 4096, 'WAYS': 4, 'select_warps': 8, 'PDL': True, 'ASM_STORES': True},
    (64, 131072): {'ALGO': 'select', 'CHUNK': None, 'PROGRAMS_PER_SM': 8, 'TILE': 1024, 'num_warps': 4, 'SAMPLE': 1024, 'PIECES': 64, 'Z': 6.0, 'BINS': 4096, 'CAND': 8192, 'WAYS': 4, 'select_warps': 16, 'PDL': True, 'ASM_STORES': True},
}
DEFAULT_CONFIG = {"ALGO": "select", "CHUNK": None, "PROGRAMS_PER_SM": 4, "TILE": 2048,
                  "num_warps": 4, "SAMPLE": 1024, "PIECES": 64, "Z": 6.0, "BINS": 4096,
                  "CAND": 8192, "WAYS": 4, "select_warps": 16}
ROW_BUCKETS = (1, 8, 64, 256)
N_BUCKETS = (32768, 131072)  # row lengths tuned for: a config is keyed (row bucket, length bucket)
MAX_CHUNKS = 1024  # the select program's chunk-count vector
WALK = 16  # a bin of at most this many keys is resolved by walking its distinct keys
SMALL = 128  # over tiles: a bin of at most this many keys is stashed and ranked pairwise


def topk_config(rows: int, n: int = 131072) -> dict:
    """The tuned config for ``rows`` rows of ``n``: the largest row bucket and the nearest
    length bucket (on a log scale) with an entry, else the row bucket's entry at another
    length, else the defaults."""
    bucket = max([b for b in ROW_BUCKETS if b <= rows], default=1)
    # nearest first; a tie goes to the longer rows (their larger candidate tile holds more)
    lengths = sorted(N_BUCKETS, key=lambda b: (abs(math.log2(max(n, 1) / b)), -b))
    entry = next((TOPK_CONFIGS[(bucket, nb)] for nb in lengths if (bucket, nb) in TOPK_CONFIGS), {})
    return {**DEFAULT_CONFIG, **entry}


@triton.jit
def _sample_floor(x_ptr, row, s_xr, n, k, SAMPLE: tl.constexpr, PIECES: tl.constexpr,
                  Z: tl.constexpr, LOG_NB: tl.constexpr):
    """(floor, shift): the top 15 bits of the key with e + Z sqrt(e) + 1 of the SAMPLE sampled
    keys at or above it (the k-th largest when the sample is the whole row), by radix select
    over the sample, 5 bits a round; and the fewest bits to drop from (key - floor) so that
    the keys up to the sample's largest fall into 2**LOG_NB bins (larger keys go to the last).
    The sample: PIECES runs of contiguous elements, evenly spaced."""
    piece_len: tl.constexpr = SAMPLE // PIECES
    stride = tl.maximum(n // PIECES, piece_len)  # a short row is sampled whole
    j = tl.arange(0, SAMPLE)
    offs = (j // piece_len) * stride + j % piece_len
    m = offs < n
    keys = tl.where(m, _key(tl.load(x_ptr + row * s_xr + offs, mask=m, other=0.0)), 0)
    n_s = tl.sum(m.to(tl.int32), 0)
    e = (k * 1.0) * n_s.to(tl.float32) / (n * 1.0)  # `* 1.0`: k or n may be a constexpr 1
    want = tl.minimum((e + Z * tl.sqrt(e) + 1.0).to(tl.int32), n_s)
    want = tl.where(n_s >= n, k, want)  # the whole row: its k-th largest is exact
    d = tl.arange(0, 32)
    floor = tl.full([], 0, tl.uint32)
    above = 0  # sampled keys whose leading bits exceed the floor's
    for r in tl.static_range(3):  # digits at bits 27.., 22.., 17..
        match = m
        if r > 0:
            match = m & ((keys >> (32 - 5 * r)) == (floor >> (32 - 5 * r)))
        hist = tl.histogram(((keys >> (27 - 5 * r)) & 31).to(tl.int32), 32, mask=match)
        at_least = above + tl.cumsum(hist, 0, reverse=True)
        best = tl.max(tl.where(at_least >= want, d, 0), 0)
        above += tl.sum(tl.where(d > best, hist, 0), 0)
        floor = floor | (best.to(tl.uint32) << (27 - 5 * r))
    # bit length of the span, through the float exponent (rounding up only widens the bins)
    span = (tl.max(keys, 0) - floor).to(tl.float32)
    bits = ((span.to(tl.int32, bitcast=True) >> 23) & 255) - 126
    return floor, tl.maximum(bits - LOG_NB, 0).to(tl.uint32)


@triton.jit
def _prefix(flags, N: tl.constexpr):
    """Inclusive prefix sums of int32 flags [N], as a scan within runs of 16 plus a scan over
    the runs' totals. A flat cumsum feeding scattered stores is laid out one element per
    thread and costs a warp-wide shuffle scan per element; this costs about a third."""
    runs = tl.reshape(flags, [N // 16, 16])
    per_run = tl.sum(runs, 1)
    return tl.reshape((tl.cumsum(per_run, 0) - per_run)[:, None] + tl.cumsum(runs, 1), [N])


@triton.jit
def _compact(x, offs, m, floor, shift, ckey_ptr, cidx_ptr, hist_ptr, region, kept,
             LOG_NB: tl.constexpr, TILE: tl.constexpr, ASM: tl.constexpr):
    """Append the keys >= floor of one tile (and their indices) to the chunk's region, in
    index order, and count them into the row's histogram; returns the new count. ASM: the
    stores and counts as predicated PTX in the tile's own layout (``_util.st_where``)."""
    key = _key(x)
    keep = (key >= floor) & m
    pos = kept + _prefix(keep.to(tl.int32), TILE) - 1
    b = tl.minimum((key - floor) >> shift, (1 << LOG_NB) - 1)
    if ASM:
        st_where(ckey_ptr + region + pos, key.to(tl.int32, bitcast=True), keep)
        st_where(cidx_ptr + region + pos, offs, keep)
        count_where(hist_ptr + b, keep)
    else:
        tl.store(ckey_ptr + region + pos, key.to(tl.int32, bitcast=True), mask=keep)
        tl.store(cidx_ptr + region + pos, offs, mask=keep)
        tl.atomic_add(hist_ptr + b, 1, mask=keep, sem="relaxed")
    return kept + tl.sum(keep.to(tl.int32), 0)


@triton.jit(do_not_specialize=["k"])
def _topk_floor_kernel(x_ptr, hist_ptr, info_ptr, s_xr, n, k, SAMPLE: tl.constexpr,
                       PIECES: tl.constexpr, Z: tl.constexpr, LOG_NB: tl.constexpr,
                       ZERO: tl.constexpr, PDL: tl.constexpr):
    """One program a row: its floor and bin shift from the sample, into info, and its
    histogram zeroed (this launch replaces the histogram's memset). Every scan program of
    the row once derived the same floor itself: ncu counted that as 30% of the scan's
    instructions at 64 rows of 128K."""
    if PDL:  # the scan may start now: it waits for this grid before reading what it writes
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    floor, shift = _sample_floor(x_ptr, row, s_xr, n, k, SAMPLE, PIECES, Z, LOG_NB)
    tl.store(info_ptr + row * 2, floor.to(tl.int32, bitcast=True))
    tl.store(info_ptr + row * 2 + 1, shift.to(tl.int32))
    hist = hist_ptr + row * (1 << LOG_NB)
    for z0 in tl.static_range(0, 1 << LOG_NB, ZERO):
        tl.store(hist + z0 + tl.arange(0, ZERO), tl.zeros([ZERO], tl.int32))


@triton.jit(do_not_specialize=["n_chunks"])
def _topk_scan_kernel(x_ptr, cnt_ptr, ckey_ptr, cidx_ptr, hist_ptr, info_ptr, s_xr, n, chunk,
                      n_chunks, TILE: tl.constexpr, LOG_NB: tl.constexpr, STAGES: tl.constexpr,
                      PDL: tl.constexpr, ASM: tl.constexpr):
    c, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, n)
    region = row * n + lo  # this chunk's region: chunk-length slots
    hist = hist_ptr + row * (1 << LOG_NB)
    x_row = x_ptr + row * s_xr
    kept = 0
    if STAGES > 0:  # the compiler's software pipeline, STAGES tiles in flight (a config key)
        if PDL:
            gdc_wait()
        floor = tl.load(info_ptr + row * 2).to(tl.uint32, bitcast=True)
        shift = tl.load(info_ptr + row * 2 + 1).to(tl.uint32)
        for t0 in tl.range(lo, hi, TILE, num_stages=STAGES):
            offs = t0 + tl.arange(0, TILE)
            x = tl.load(x_row + offs, mask=offs < n, other=0.0)
            kept = _compact(x, offs, offs < n, floor, shift, ckey_ptr, cidx_ptr, hist, region,
                            kept, LOG_NB, TILE, ASM)
    else:
        # The first tile's load is issued before the floor's, and each later tile's load
        # before the tile ahead of it is compacted (without that, ncu found the scan waiting
        # on its loads). A chunk is whole tiles, so only the row's end needs an element mask
        # (`< n`, which the compiler can see is vector-aligned when n is: `< hi` would cost
        # 4-byte loads); the chunk's end masks a whole prefetch at once.
        offs = lo + tl.arange(0, TILE)
        x = tl.load(x_row + offs, mask=offs < n, other=0.0)
        if PDL:  # x was complete before the floor's launch; its info and histogram were not
            gdc_wait()
        floor = tl.load(info_ptr + row * 2).to(tl.uint32, bitcast=True)
        shift = tl.load(info_ptr + row * 2 + 1).to(tl.uint32)
        for t0 in range(lo, hi, TILE):
            offs = t0 + tl.arange(0, TILE)
            ahead = offs + TILE
            x_next = tl.load(x_row + ahead, mask=(ahead < n) & (t0 + TILE < hi), other=0.0)
            kept = _compact(x, offs, offs < n, floor, shift, ckey_ptr, cidx_ptr, hist, region,
                            kept, LOG_NB, TILE, ASM)
            x = x_next
    if PDL:  # the select's programs may be placed as this grid drains
        gdc_launch_dependents()
    tl.store(cnt_ptr + row * n_chunks + c, kept)


@triton.jit
def _region_tile(ckey_ptr, cidx_ptr, cnt, row, n, chunk, n_chunks, LOG_C: tl.constexpr,
                 CAND: tl.constexpr):
    """(key, index, live) [CAND] of every chunk's region read as a [chunks, CAND / chunks]
    tile, flattened in index order; valid when no chunk kept more than CAND / chunks. Reads
    past a region's count (the buffers are padded by CAND) and masks afterwards, so the loads
    are whole vectors."""
    c = tl.arange(0, 1 << LOG_C)
    j = tl.arange(0, CAND >> LOG_C)
    live = j[None, :] < cnt[:, None]
    src = row * n + c[:, None].to(tl.int64) * chunk + j[None, :]
    real = (c < n_chunks)[:, None]  # constant along a row: the loads stay vectors
    key = tl.where(live, tl.load(ckey_ptr + src, mask=real, other=0), 0).to(tl.uint32,
                                                                           bitcast=True)
    idx = tl.load(cidx_ptr + src, mask=real, other=0)
    return tl.reshape(key, [CAND]), tl.reshape(idx, [CAND]), tl.reshape(live, [CAND])


@triton.jit
def _candidates(q, from_row, x_ptr, ckey_ptr, cidx_ptr, incl, excl, row, s_xr, n, total, chunk,
                LOG_C: tl.constexpr):
    """(key, index, live) at dense candidate positions q, in index order: the row's own
    elements when from_row, else the chunk regions, found by a binary search of q in the
    inclusive chunk counts `incl` (`excl`: the exclusive ones)."""
    if from_row:
        live = q < n
        key = _key(tl.load(x_ptr + row * s_xr + q, mask=live, other=0.0))
        idx = q
    else:
        live = q < total
        ch = tl.zeros(q.shape, tl.int32)  # how many chunks end at or before q
        for s in tl.static_range(LOG_C):  # binary lifting, steps C_PAD/2 .. 1
            ahead = tl.gather(incl, ch + ((1 << (LOG_C - 1 - s)) - 1), 0) <= q
            ch = tl.where(ahead, ch + (1 << (LOG_C - 1 - s)), ch)
        src = row * n + ch.to(tl.int64) * chunk + (q - tl.gather(excl, ch, 0))
        key = tl.load(ckey_ptr + src, mask=live, other=0).to(tl.uint32, bitcast=True)
        idx = tl.load(cidx_ptr + src, mask=live, other=0)
    return key, idx, live


@triton.jit
def _stash(key, mask, scr_ptr, stashed, N: tl.constexpr):
    """Append the masked keys [N] to the row's scratch list; returns its new length."""
    pos = stashed + _prefix(mask.to(tl.int32), N) - 1
    tl.store(scr_ptr + pos, key.to(tl.int32, bitcast=True), mask=mask)
    return stashed + tl.sum(mask.to(tl.int32), 0)


@triton.jit
def _kth_of_stash(scr_ptr, count, need, SMALL: tl.constexpr):
    """(the need-th largest of the `count` <= SMALL stashed keys, how many stashed keys exceed
    it, how many equal it), by counting for each key how many are larger."""
    s = tl.arange(0, SMALL)
    sm = s < count
    v = tl.load(scr_ptr + s, mask=sm, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
    larger = tl.sum(((v[None, :] > v[:, None]) & sm[None, :]).to(tl.int32), 1)
    kth = tl.min(tl.where(sm & (larger < need), v, 0xFFFFFFFF), 0)
    return (kth.to(tl.int64), tl.sum((sm & (v > kth)).to(tl.int32), 0),
            tl.sum((sm & (v == kth)).to(tl.int32), 0))


@triton.jit
def _bounds(lo, hi, WAYS: tl.constexpr):
    """WAYS thresholds splitting [lo, hi) (int64): lo, then evenly up to below hi."""
    i = tl.arange(0, WAYS)
    return lo + ((hi - lo) * i) // WAYS


@triton.jit
def _count_ge(key, live, t):
    """How many live keys are >= each threshold t [WAYS] (t < 2**32)."""
    ge = (key[:, None] >= t.to(tl.uint32)[None, :]) & live[:, None]
    return tl.sum(ge.to(tl.int32), 0)


@triton.jit
def _narrow(t, counts, lo, hi, c_hi, k, WAYS: tl.constexpr):
    """Keep the sub-range whose lower bound still has >= k keys at or above it. Invariant:
    count(>= lo) >= k > count(>= hi) = c_hi. (counts[0] is count(>= lo) >= k.)"""
    i = tl.arange(0, WAYS)
    best = tl.max(tl.where(counts >= k, i, 0), 0)
    last = best == WAYS - 1
    new_lo = tl.sum(tl.where(i == best, t, 0), 0)
    new_hi = tl.where(last, hi, tl.sum(tl.where(i == best + 1, t, 0), 0))
    new_c_hi = tl.where(last, c_hi, tl.sum(tl.where(i == best + 1, counts, 0), 0))
    return new_lo, new_hi, new_c_hi


@triton.jit
def _resolve(key, live, in_bin, m_bin, c_hi, k, WALK: tl.constexpr, WAYS: tl.constexpr):
    """(k-th largest key, how many exceed it, how many equal it) among keys held in registers,
    of which c_hi lie above the bin and m_bin in it (in_bin)."""
    need = k - c_hi
    if m_bin <= WALK:  # walk the bin's distinct keys down from its largest
        bound = tl.full([], 0xFFFFFFFF, tl.uint32)  # the next key is the largest <= bound
        kth = bound
        n_eq = 0
        taken = 0
        while taken < need:
            kth = tl.max(tl.where(in_bin & (key <= bound), key, 0), 0)
            n_eq = tl.sum((in_bin & (key == kth)).to(tl.int32), 0)
            c_hi += tl.where(taken + n_eq >= need, taken, 0)
            taken = tl.where(n_eq > 0, taken + n_eq, need)  # (n_eq is never 0: need <= m_bin)
            bound = kth - 1
        kth = kth.to(tl.int64)
    else:  # many keys in the bin (ties, a cluster): bisect their span
        lo = tl.min(tl.where(in_bin, key, 0xFFFFFFFF), 0).to(tl.int64)
        hi = tl.max(tl.where(in_bin, key, 0), 0).to(tl.int64) + 1
        while hi - lo > 1:
            t = _bounds(lo, hi, WAYS)
            lo, hi, c_hi = _narrow(t, _count_ge(key, live, t), lo, hi, c_hi, k, WAYS)
        kth = lo
        n_eq = tl.sum((live & (key.to(tl.int64) == kth)).to(tl.int32), 0)
    return kth, c_hi, n_eq


@triton.jit
def _emit(key, idx, live, kth, need, n_eq, written, ties, val_ptr, ind_ptr, row, k,
          N: tl.constexpr, ASM: tl.constexpr = False):
    """Write the selected among candidates [N] in index order: keys above kth, and ties at
    kth while fewer than `need` earlier ties were taken (n_eq: how many ties there are in
    all; when they all fit, no tie ranks are needed). Returns the running (written, ties)."""
    eq = live & (key == kth)
    if n_eq <= need:
        sel = live & (key >= kth)
    else:
        sel = (live & (key > kth)) | (eq & (ties + _prefix(eq.to(tl.int32), N) - 1 < need))
    pos = written + _prefix(sel.to(tl.int32), N) - 1
    ok = sel & (pos < k)  # (always, unless the counts were inconsistent: never write past k)
    val = _unkey(key).to(val_ptr.dtype.element_ty)
    if ASM:  # predicated PTX stores in the candidates' own layout (see _util.st_where)
        if val_ptr.dtype.element_ty.primitive_bitwidth == 32:
            st_where(val_ptr + row * k + pos, val.to(tl.int32, bitcast=True), ok)
        else:
            st_where16(val_ptr + row * k + pos, val.to(tl.int16, bitcast=True), ok)
        st_where(ind_ptr + row * k + pos, idx, ok)
    else:
        tl.store(val_ptr + row * k + pos, val, mask=ok)
        tl.store(ind_ptr + row * k + pos, idx, mask=ok)
    return written + tl.sum(sel.to(tl.int32), 0), ties + tl.sum(eq.to(tl.int32), 0)


@triton.jit(do_not_specialize=["k", "n_chunks"])
def _topk_select_kernel(x_ptr, cnt_ptr, ckey_ptr, cidx_ptr, hist_ptr, info_ptr, scr_ptr,
                        val_ptr, ind_ptr, s_xr, n, k, chunk, n_chunks,
                        LOG_C: tl.constexpr, LOG_NB: tl.constexpr, CAND: tl.constexpr,
                        WALK: tl.constexpr, SMALL: tl.constexpr, WAYS: tl.constexpr,
                        PDL: tl.constexpr, ASM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if PDL:  # everything below reads the scan's output
        gdc_wait()
    cs = tl.arange(0, 1 << LOG_C)
    cnt = tl.load(cnt_ptr + row * n_chunks + cs, mask=cs < n_chunks, other=0)
    incl = tl.cumsum(cnt, 0)
    excl = incl - cnt
    total = tl.sum(cnt, 0)
    floor = tl.load(info_ptr + row * 2).to(tl.uint32, bitcast=True)
    shift = tl.load(info_ptr + row * 2 + 1).to(tl.uint32)
    # The bin holding the k-th largest key: `best`, with c_hi keys above it and m_bin in it.
    b = tl.arange(0, 1 << LOG_NB)
    hist = tl.load(hist_ptr + row * (1 << LOG_NB) + b)
    at_least = tl.sum(hist, 0) - _prefix(hist, 1 << LOG_NB) + hist  # keys in bins >= b
    best = tl.max(tl.where(at_least >= k, b, 0), 0)
    m_bin = tl.sum(tl.where(b == best, hist, 0), 0)
    c_hi = tl.sum(tl.where(b > best, hist, 0), 0)
    scr = scr_ptr + row * SMALL
    q = tl.arange(0, CAND)
    if (total >= k) & (total <= CAND):  # the candidates fit in registers: one read
        if tl.max(cnt, 0) <= (CAND >> LOG_C):  # as a [chunks, CAND / chunks] tile
            key, idx, live = _region_tile(ckey_ptr, cidx_ptr, cnt, row, n, chunk, n_chunks,
                                          LOG_C, CAND)
        else:  # one chunk holds most of them (a sorted row): search each position's chunk
            key, idx, live = _candidates(q, False, x_ptr, ckey_ptr, cidx_ptr, incl, excl, row,
                                         s_xr, n, total, chunk, LOG_C)
        in_bin = live & (tl.minimum((key - floor) >> shift, (1 << LOG_NB) - 1) == best)
        kth, c_hi, n_eq = _resolve(key, live, in_bin, m_bin, c_hi, k, WALK, WAYS)
        _emit(key, idx, live, kth.to(tl.uint32), k - c_hi, n_eq, 0, 0, val_ptr, ind_ptr, row,
              k, CAND, ASM)
    else:  # too many candidates, or too few: the same over tiles, re-read each round
        from_row = total < k  # the floor was too high: the k-th largest is below it
        size = tl.where(from_row, n, total)
        # the keys to select among: the bin's, or those of the whole row below the floor
        lo_key = tl.where(from_row, 0, floor.to(tl.int64) + (best.to(tl.int64) << shift))
        hi_key = tl.where(best == (1 << LOG_NB) - 1, 1 << 32,
                          floor.to(tl.int64) + ((best + 1).to(tl.int64) << shift))
        hi_key = tl.where(from_row, floor.to(tl.int64), hi_key)
        c_hi = tl.where(from_row, total, c_hi)
        if (m_bin <= SMALL) & (total >= k):
            stashed = 0
            for q0 in range(0, size, CAND):
                key, idx, live = _candidates(q0 + q, from_row, x_ptr, ckey_ptr, cidx_ptr, incl,
                                             excl, row, s_xr, n, total, chunk, LOG_C)
                kk = key.to(tl.int64)
                stashed = _stash(key, live & (kk >= lo_key) & (kk < hi_key), scr, stashed, CAND)
            tl.debug_barrier()
            kth, more, n_eq = _kth_of_stash(scr, m_bin, k - c_hi, SMALL)
            c_hi += more
        else:
            lo = tl.full([], 0xFFFFFFFF, tl.int64)
            hi = tl.full([], 0, tl.int64)
            for q0 in range(0, size, CAND):
                key, idx, live = _candidates(q0 + q, from_row, x_ptr, ckey_ptr, cidx_ptr, incl,
                                             excl, row, s_xr, n, total, chunk, LOG_C)
                kk = key.to(tl.int64)
                in_range = live & (kk >= lo_key) & (kk < hi_key)
                lo = tl.minimum(lo, tl.min(tl.where(in_range, key, 0xFFFFFFFF), 0).to(tl.int64))
                hi = tl.maximum(hi, tl.max(tl.where(in_range, key, 0), 0).to(tl.int64) + 1)
            while hi - lo > 1:
                t = _bounds(lo, hi, WAYS)
                counts = tl.zeros([WAYS], tl.int32)
                for q0 in range(0, size, CAND):
                    key, idx, live = _candidates(q0 + q, from_row, x_ptr, ckey_ptr, cidx_ptr,
                                                 incl, excl, row, s_xr, n, total, chunk, LOG_C)
                    counts += _count_ge(key, live, t)
                lo, hi, c_hi = _narrow(t, counts, lo, hi, c_hi, k, WAYS)
            kth = lo
        written = 0
        ties = 0
        for q0 in range(0, size, CAND):
            key, idx, live = _candidates(q0 + q, from_row, x_ptr, ckey_ptr, cidx_ptr, incl, excl,
                                         row, s_xr, n, total, chunk, LOG_C)
            written, ties = _emit(key, idx, live, kth.to(tl.uint32), k - c_hi, n, written, ties,
                                  val_ptr, ind_ptr, row, k, CAND)


def topk(x: torch.Tensor, k: int, *, config: dict | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row of x [R, N] (float32/bf16/fp16, unit-stride rows):
    (values [R, k] in x's dtype, indices [R, k] int32), in ascending index order; ties at
    the k-th value go to the lowest indices."""
    check(x, "x", dims=2, dtypes=(torch.float32, torch.bfloat16, torch.float16))
    r, n = x.shape
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}] for rows of {n}; got {k}")
    if n >= 2**31 - 1:
        raise ValueError(f"rows of {n} elements do not fit int32 indices")
    vals = torch.empty(r, k, dtype=x.dtype, device=x.device)
    inds = torch.empty(r, k, dtype=torch.int32, device=x.device)
    if r == 0:
        return vals, inds
    cfg = {**topk_config(r, n), **(config or {})}
    # k > CAND / 2: the select program's tile would rarely hold the candidates
    if cfg["ALGO"] == "threshold" or 2 * k > cfg["CAND"]:
        tcfg = threshold_config(r)  # (with the keys both paths name, such as TILE)
        topk_threshold(x, k, {**tcfg, **{a: v for a, v in (config or {}).items() if a in tcfg}},
                       vals, inds)
    else:
        _topk_select(x, k, cfg, vals, inds)
    return vals, inds


def _pdl(x: torch.Tensor, cfg: dict) -> bool:
    """Whether to launch the scan and the select as programmatic dependent launches: their
    programs are placed while the grid before them drains, and wait (griddepcontrol.wait)
    only where they read its output; a normal launch starts only after the grid before it
    has finished. NVIDIA Hopper and later, not under the interpreter."""
    return bool(cfg.get("PDL", True)) and hopper_or_later(x.device)


def _scan(x: torch.Tensor, k: int, cfg: dict, pdl: bool = False) -> tuple:
    """Launch the floor and the scan (the scan as a programmatic dependent where ``pdl``):
    (chunk, n_chunks, log_nb, cnt, info, scr, ckey, cidx, hist)."""
    r, n = x.shape
    tile = max(16, min(cfg["TILE"], next_pow2(n)))  # whole runs of 16 (see _prefix)
    chunk = cfg["CHUNK"] or triton.cdiv(r * n, cfg["PROGRAMS_PER_SM"] * sm_count(x.device))
    # at most MAX_CHUNKS chunks, and rows of >= 16 in the select program's [chunks, ...] tile
    chunk = max(chunk, triton.cdiv(n, min(MAX_CHUNKS, cfg["CAND"] // 16)))
    chunk = triton.cdiv(min(chunk, n), tile) * tile  # whole tiles: only the row's end is masked
    n_chunks = triton.cdiv(n, chunk)
    # The regions are padded by CAND: the select program reads whole [chunks, CAND / chunks] tiles.
    log_nb = (cfg["BINS"] - 1).bit_length()
    cnt, info, scr, ckey, cidx, hist = carve([r * n_chunks, r * 2, r * SMALL, r * n + cfg["CAND"],
                                              r * n + cfg["CAND"], r << log_nb], x.device)
    sample = max(32, min(cfg["SAMPLE"], next_pow2(n)))
    _topk_floor_kernel[(r,)](x, hist, info, x.stride(0), n, k, SAMPLE=sample,
                             PIECES=min(cfg["PIECES"], sample), Z=cfg["Z"], LOG_NB=log_nb,
                             ZERO=min(1024, 1 << log_nb), PDL=pdl, num_warps=4)
    _topk_scan_kernel[(n_chunks, r)](x, cnt, ckey, cidx, hist, info, x.stride(0), n, chunk,
                                     n_chunks, TILE=tile, LOG_NB=log_nb, STAGES=cfg.get("SCAN_STAGES", 0),
                                     PDL=pdl, ASM=bool(cfg.get("ASM_STORES", False)) and nvidia_ptx(x.device),
                                     num_warps=cfg["num_warps"], **({"launch_pdl": True} if pdl else {}))
    return chunk, n_chunks, log_nb, cnt, info, scr, ckey, cidx, hist


def select_paths(x: torch.Tensor, k: int, config: dict | None = None) -> dict:
    """Which way each row goes through the select program (for benchmarks: a row off the
    register path costs several times more): counts of "tile" (candidates in registers as a
    chunk tile), "search" (in registers, positions searched), "tiled" (too many
    candidates), "row" (fewer than k); and the candidates and k-th bin's keys per row."""
    cfg = {**topk_config(*x.shape), **(config or {})}
    _, n_chunks, log_nb, cnt, *_, hist = _scan(x, k, cfg, _pdl(x, cfg))
    per = cnt.view(x.shape[0], n_chunks).long()
    total, hist = per.sum(1), hist.view(x.shape[0], -1).long()
    at_least = hist.flip(1).cumsum(1).flip(1)
    m_bin = hist.gather(1, ((at_least >= k).sum(1, keepdim=True) - 1).clamp(min=0)).squeeze(1)
    fits = (total >= k) & (total <= cfg["CAND"])
    tile = fits & (per.max(1).values <= cfg["CAND"] // next_pow2(n_chunks))
    paths = {"tile": tile, "search": fits & ~tile, "tiled": total > cfg["CAND"], "row": total < k}
    return {**{p: int(m.sum()) for p, m in paths.items()},
            "candidates": (int(total.min()), int(total.max())), "bin_keys_max": int(m_bin.max())}


def _topk_select(x: torch.Tensor, k: int, cfg: dict, vals: torch.Tensor,
                 inds: torch.Tensor) -> None:
    r, n = x.shape
    pdl = _pdl(x, cfg)
    chunk, n_chunks, log_nb, cnt, info, scr, ckey, cidx, hist = _scan(x, k, cfg, pdl)
    _topk_select_kernel[(r,)](x, cnt, ckey, cidx, hist, info, scr, vals, inds, x.stride(0), n, k,
                              chunk, n_chunks, LOG_C=(next_pow2(n_chunks) - 1).bit_length(),
                              LOG_NB=log_nb, CAND=cfg["CAND"], WALK=cfg.get("WALK", WALK), SMALL=SMALL,
                              WAYS=cfg["WAYS"], PDL=pdl, ASM=bool(cfg.get("ASM_STORES", False)) and nvidia_ptx(x.device),
                              num_warps=cfg["select_warps"], **({"launch_pdl": True} if pdl else {}))


def topk_reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract in torch: a stable descending sort (lowest index first among equals),
    the first k, back in index order."""
    keys = x.float().view(torch.int32).long() & 0xFFFFFFFF
    keys = torch.where(keys >= 2**31, keys ^ 0xFFFFFFFF, keys | 2**31)  # the kernels' key
    order = torch.sort(keys, dim=1, descending=True, stable=True).indices[:, :k]
    idx = order.sort(dim=1).values
    return x.gather(1, idx), idx.to(torch.int32)
