"""Exact top-k by sampled thresholds, in four launches: the first design, kept as the fallback
that `topk.topk` takes when k is too large for its register tile, or when a config asks for it
with {"ALGO": "threshold"}.

Floats map to uint32 keys whose unsigned order is the float order (`_key` here, shared with
topk.py).
1. sample (one program per row): sort a 2K-element sample of the row and read NT candidate
   thresholds off it, each expected to keep a bit more of the row than the one before
   (about 1.4x k, 1.8x k, ... with the last threshold keeping everything);
2. count (programs over chunks of the row): exact count per chunk of the elements at or above
   every threshold, and each chunk's elements at or above the SAFE threshold copied, in index
   order, to a per-chunk region of a scratch buffer;
3. gather: the tightest threshold that keeps >= k elements in the row is now known exactly;
   each chunk copies its survivors to its offset in one per-row list, in index order, from
   its region (or, if even the SAFE threshold kept fewer than k, from the row itself);
4. finish (one program per row): radix select (8-bit digits, 4 levels) over the few thousand
   survivors for the exact k-th largest key T, then writes every survivor above T and the
   lowest-index ties at T.
On an H200 this took 86 us for one row of 131,072 and 157 us for 64 (torch.topk: 60 and 155):
the sample sort and the one-program radix select are long serial chains.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import next_pow2

NT = 8  # candidate thresholds per row
SAFE = 4  # the count pass copies survivors of this threshold (about 4x k)
RADIX_BITS = 8

# Tuned on an H200 (2026-11-29 run of benchmarks/gpu/bench_kernels.py): row bucket -> config.
# CHUNK: elements per count/gather program; TILE: elements per loop step.
THRESHOLD_CONFIGS: dict[int, dict] = {
    1: {"TILE": 2048, "num_warps": 4, "PROGRAMS_PER_SM": 8},  # 115 us tuning, 86 us graph
    64: {"TILE": 2048, "num_warps": 8, "PROGRAMS_PER_SM": 4},  # n=131072: 160 us, 157 us graph
}
THRESHOLD_DEFAULT = {"CHUNK": None, "TILE": 4096, "num_warps": 8, "SAMPLE": 2048,
                     "FINISH_TILE": 4096, "finish_warps": 8, "PROGRAMS_PER_SM": 4}
ROW_BUCKETS = (1, 8, 64, 256)


def threshold_config(rows: int) -> dict:
    bucket = max([b for b in ROW_BUCKETS if b <= rows], default=1)
    return {**THRESHOLD_DEFAULT, **THRESHOLD_CONFIGS.get(bucket, {})}


@triton.jit
def _key(x):
    """float -> uint32 whose unsigned order is the float order."""
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    return bits ^ tl.where((bits >> 31) != 0, 0xFFFFFFFF, 0x80000000).to(tl.uint32)


@triton.jit
def _unkey(key):
    bits = key ^ tl.where((key >> 31) != 0, 0x80000000, 0xFFFFFFFF).to(tl.uint32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["k"])
def _topk_sample_kernel(x_ptr, thr_ptr, s_xr, n, k,
                        SAMPLE: tl.constexpr, PIECES: tl.constexpr, NT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    piece_len: tl.constexpr = SAMPLE // PIECES
    stride = tl.maximum(n // PIECES, piece_len)  # a short row is sampled whole
    j = tl.arange(0, SAMPLE)
    offs = (j // piece_len) * stride + j % piece_len
    m = offs < n
    keys = tl.where(m, _key(tl.load(x_ptr + row * s_xr + offs, mask=m, other=0.0)), 0)
    ordered = tl.sort(keys, descending=True)  # masked entries (key 0) sort last
    n_s = tl.sum(m.to(tl.int32), 0)
    expect = (k * 1.0) * n_s.to(tl.float32) / (n * 1.0)  # `* 1.0`: k or n may be a constexpr 1
    i = tl.arange(0, NT)
    rank = expect * tl.exp2(i.to(tl.float32) * 0.5) + 2.0 * tl.sqrt(expect) + 1.0
    rank = tl.minimum(rank.to(tl.int32), n_s - 1)
    thr = tl.sum(tl.where(j[None, :] == rank[:, None], ordered[None, :], 0), 1)
    thr = tl.where(i == NT - 1, 0, thr)  # the last keeps every element: some threshold works
    tl.store(thr_ptr + row * NT + i, thr.to(tl.int32, bitcast=True))


@triton.jit(do_not_specialize=["n_chunks"])
def _topk_count_kernel(x_ptr, thr_ptr, cnt_ptr, rkey_ptr, ridx_ptr, s_xr, n, chunk, n_chunks,
                       NT: tl.constexpr, SAFE: tl.constexpr, TILE: tl.constexpr):
    row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i = tl.arange(0, NT)
    thr = tl.load(thr_ptr + row * NT + i).to(tl.uint32, bitcast=True)
    safe = tl.sum(tl.where(i == SAFE, thr, 0), 0)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, n)
    counts = tl.zeros([NT], tl.int32)
    kept = 0
    base = row * n + lo  # this chunk's region: chunk-length slots
    for t0 in range(lo, hi, TILE):
        offs = t0 + tl.arange(0, TILE)
        m = offs < hi
        key = _key(tl.load(x_ptr + row * s_xr + offs, mask=m, other=0.0))
        # One scalar threshold at a time: a [TILE, NT] comparison would hold NT registers per
        # element and leave too few threads per SM to keep the loads in flight.
        for j in tl.static_range(NT - 1):  # the last threshold (0) keeps every element
            tj = tl.load(thr_ptr + row * NT + j).to(tl.uint32, bitcast=True)
            counts += tl.where(i == j, tl.sum(((key >= tj) & m).to(tl.int32), 0), 0)
        counts += tl.where(i == NT - 1, tl.sum(m.to(tl.int32), 0), 0)
        keep = (key >= safe) & m
        pos = kept + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(rkey_ptr + base + pos, key.to(tl.int32, bitcast=True), mask=keep)
        tl.store(ridx_ptr + base + pos, offs, mask=keep)
        kept += tl.sum(keep.to(tl.int32), 0)
    tl.store(cnt_ptr + (row * n_chunks + c) * NT + i, counts)


@triton.jit
def _pick_threshold(thr_ptr, cnt_ptr, row, k, n_chunks, c, NT: tl.constexpr, CB: tl.constexpr):
    """(index of the tightest threshold keeping >= k of the row, that threshold, how many it
    keeps in chunks before c). Loops over the chunk counts CB at a time, so the chunk count
    is not a compile-time constant."""
    i = tl.arange(0, NT)
    totals = tl.zeros([NT], tl.int32)
    for c0 in range(0, n_chunks, CB):
        cs = c0 + tl.arange(0, CB)
        cnt = tl.load(cnt_ptr + (row * n_chunks + cs[:, None]) * NT + i[None, :],
                      mask=(cs < n_chunks)[:, None], other=0)
        totals += tl.sum(cnt, 0)
    best = tl.min(tl.where(totals >= k, i, NT - 1), 0)
    thr = tl.load(thr_ptr + row * NT + best).to(tl.uint32, bitcast=True)
    before = 0
    for c0 in range(0, c, CB):
        cs = c0 + tl.arange(0, CB)
        before += tl.sum(tl.load(cnt_ptr + (row * n_chunks + cs) * NT + best, mask=cs < c, other=0), 0)
    return best, thr, before


@triton.jit(do_not_specialize=["k", "n_chunks"])
def _topk_gather_kernel(x_ptr, thr_ptr, cnt_ptr, rkey_ptr, ridx_ptr, skey_ptr, sidx_ptr,
                        s_xr, n, k, chunk, n_chunks,
                        NT: tl.constexpr, SAFE: tl.constexpr, CB: tl.constexpr,
                        TILE: tl.constexpr):
    row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    best, t, before = _pick_threshold(thr_ptr, cnt_ptr, row, k, n_chunks, c, NT, CB)
    out = row * n + before
    lo = c * chunk
    done = 0
    if best <= SAFE:  # this chunk's survivors are all in its region
        in_region = tl.load(cnt_ptr + (row * n_chunks + c) * NT + SAFE)
        for t0 in range(0, in_region, TILE):
            offs = t0 + tl.arange(0, TILE)
            m = offs < in_region
            key = tl.load(rkey_ptr + row * n + lo + offs, mask=m, other=0).to(tl.uint32, bitcast=True)
            idx = tl.load(ridx_ptr + row * n + lo + offs, mask=m, other=0)
            keep = (key >= t) & m
            pos = done + tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(skey_ptr + out + pos, key.to(tl.int32, bitcast=True), mask=keep)
            tl.store(sidx_ptr + out + pos, idx, mask=keep)
            done += tl.sum(keep.to(tl.int32), 0)
    else:  # the sample misled the SAFE threshold: read the row again
        hi = tl.minimum(lo + chunk, n)
        for t0 in range(lo, hi, TILE):
            offs = t0 + tl.arange(0, TILE)
            m = offs < hi
            key = _key(tl.load(x_ptr + row * s_xr + offs, mask=m, other=0.0))
            keep = (key >= t) & m
            pos = done + tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(skey_ptr + out + pos, key.to(tl.int32, bitcast=True), mask=keep)
            tl.store(sidx_ptr + out + pos, offs, mask=keep)
            done += tl.sum(keep.to(tl.int32), 0)


@triton.jit
def _radix_select(key_ptr, idx_ptr, count, k, match,
                  BY_INDEX: tl.constexpr, TILE: tl.constexpr, BITS: tl.constexpr):
    """The k-th largest of `count` list entries, BITS per level: returns (value, how many
    entries equal to it the top k takes, how many entries equal it). BY_INDEX ranks the
    entries whose key == match by 0x7FFFFFFF - index instead, so the k-th largest is the
    k-th lowest index."""
    NB: tl.constexpr = 1 << BITS
    d = tl.arange(0, NB)
    prefix = tl.full([], 0, tl.uint32)
    k_rem = k + tl.full([], 0, tl.int32)
    for level in tl.static_range(32 // BITS):
        shift = 32 - BITS * (level + 1)  # a constexpr: level and BITS are
        hist = tl.zeros([NB], tl.int32)
        for t0 in range(0, count, TILE):
            offs = t0 + tl.arange(0, TILE)
            m = offs < count
            key = tl.load(key_ptr + offs, mask=m, other=0).to(tl.uint32, bitcast=True)
            if BY_INDEX:
                m = m & (key == match)
                v = (0x7FFFFFFF - tl.load(idx_ptr + offs, mask=m, other=0)).to(tl.uint32)
            else:
                v = key
            if level > 0:
                m = m & ((v >> (shift + BITS)) == (prefix >> (shift + BITS)))
            hist += tl.histogram(((v >> shift) & (NB - 1)).to(tl.int32), NB, mask=m)
        at_least = tl.cumsum(hist, 0, reverse=True)
        digit = tl.max(tl.where(at_least >= k_rem, d, 0), 0)
        k_rem -= tl.sum(tl.where(d == digit, at_least - hist, 0), 0)
        equal = tl.sum(tl.where(d == digit, hist, 0), 0)
        prefix = prefix | (digit.to(tl.uint32) << shift)
    return prefix, k_rem, equal


@triton.jit(do_not_specialize=["k", "n_chunks"])
def _topk_finish_kernel(thr_ptr, cnt_ptr, skey_ptr, sidx_ptr, val_ptr, ind_ptr, n, k, n_chunks,
                        NT: tl.constexpr, CB: tl.constexpr, TILE: tl.constexpr,
                        BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    best, t, count = _pick_threshold(thr_ptr, cnt_ptr, row, k, n_chunks, n_chunks, NT, CB)
    keys, idxs = skey_ptr + row * n, sidx_ptr + row * n
    kth, take, ties = _radix_select(keys, idxs, count, k, 0, False, TILE, BITS)
    # Ties at the k-th key: keep the `take` lowest indices, i.e. those <= last_idx.
    last_idx = take * 0 + n
    if take < ties:
        v, one, also_one = _radix_select(keys, idxs, count, take, kth, True, TILE, BITS)
        last_idx = 0x7FFFFFFF - v.to(tl.int32)
    written = 0
    for t0 in range(0, count, TILE):
        offs = t0 + tl.arange(0, TILE)
        m = offs < count
        key = tl.load(keys + offs, mask=m, other=0).to(tl.uint32, bitcast=True)
        idx = tl.load(idxs + offs, mask=m, other=0)
        keep = m & ((key > kth) | ((key == kth) & (idx <= last_idx)))
        pos = written + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(val_ptr + row * k + pos, _unkey(key).to(val_ptr.dtype.element_ty), mask=keep)
        tl.store(ind_ptr + row * k + pos, idx, mask=keep)
        written += tl.sum(keep.to(tl.int32), 0)


def topk_threshold(x: torch.Tensor, k: int, cfg: dict, vals: torch.Tensor,
                   inds: torch.Tensor) -> None:
    """Fill vals/inds [R, k] with the top k of each row of x [R, N] (checked by topk.topk)."""
    r, n = x.shape
    dev = x.device
    tile = min(cfg["TILE"], next_pow2(n))
    chunk = cfg["CHUNK"]
    if chunk is None:  # enough programs to keep every SM's loads in flight
        chunk = triton.cdiv(r * n, cfg["PROGRAMS_PER_SM"] * sm_count(dev))
    chunk = max(tile, triton.cdiv(min(chunk, n), tile) * tile)
    n_chunks = triton.cdiv(n, chunk)
    # One allocation: thresholds, chunk counts, regions (key, index), survivors (key, index),
    # each part starting 128-byte aligned so the kernels' loads vectorise.
    sizes = [r * NT, r * n_chunks * NT] + [r * n] * 4
    thr, cnt, rkey, ridx, skey, sidx = carve(sizes, dev)
    _topk_sample_kernel[(r,)](x, thr, x.stride(0), n, k, SAMPLE=cfg["SAMPLE"], PIECES=16,
                              NT=NT, num_warps=4)
    _topk_count_kernel[(r, n_chunks)](x, thr, cnt, rkey, ridx, x.stride(0), n, chunk, n_chunks,
                                      NT=NT, SAFE=SAFE, TILE=tile, num_warps=cfg["num_warps"])
    _topk_gather_kernel[(r, n_chunks)](x, thr, cnt, rkey, ridx, skey, sidx, x.stride(0), n, k,
                                       chunk, n_chunks, NT=NT, SAFE=SAFE, CB=64,
                                       TILE=tile, num_warps=cfg["num_warps"])
    _topk_finish_kernel[(r,)](thr, cnt, skey, sidx, vals, inds, n, k, n_chunks, NT=NT, CB=64,
                              TILE=min(cfg["FINISH_TILE"], next_pow2(n)),
                              BITS=RADIX_BITS, num_warps=cfg["finish_warps"])


def sm_count(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4


def carve(sizes: list[int], dev: torch.device) -> list[torch.Tensor]:
    """int32 buffers of the given sizes cut from one allocation, each 128-byte aligned."""
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + triton.cdiv(size, 32) * 32)
    work = torch.empty(starts[-1], dtype=torch.int32, device=dev)
    return [work[a:a + size] for a, size in zip(starts, sizes)]
