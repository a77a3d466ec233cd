"""Sampling a token per row of logits, greedy or with temperature, top-k and top-p, without
sorting.

The fast path draws by an exponential race: with E_i ~ Exp(1) per token, the argmax of
p_i / E_i over a set of tokens picks token i with probability p_i (renormalized over the set).
Top-p restricts the race to the nucleus N, the most likely tokens whose mass reaches top_p:
token i is in N when the tokens strictly more likely than i weigh less than top_p. N is an
upper set of the row's values, so with the noise drawn, argmax over N of p_i / E_i needs no
sort:
- run the race over every token; its winner j beats every token of N;
- if j is in N (one pass: the mass above it) it is the answer;
- else every token of N is more likely than j, and the race runs again over those tokens.

The winner is in N with probability at least top_p, so one round is the norm: four passes
over the row (the max, the normalizer, the race, the mass above its winner; two without
top-p). Each round's winner is strictly more likely than the last, and the most likely token
is always in N.

Top-k first keeps the tokens at or above the row's k-th largest value (ties with it
included), found by a radix select over the values' bits, 8 a pass; the race and the nucleus
then run over those tokens, as a sort would mask the rest before its top-p.

Ties: the tokens of the nucleus' boundary value are all in N or all out of it. A sort-based
nucleus keeps some of them, in whatever order the sort left them.

One program per row. The noise comes from the caller, so its random streams stay the
caller's (torch generators, seeded per request where asked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import check, check_shape
from .topk_threshold import _key, _unkey

# Tuned on the H200 (raw/2026-11-30-h200-session12-sample-kernel-tiles.txt): 8,192 tokens a
# step and 16 warps, against 2,048 and 8 first, took 102,400-token rows from 87 to 51 us at
# one row, 136 to 83 at 64 and 195 to 145 at 256.
BLOCK = 8192  # tokens a program reads per step
NUM_WARPS = 16
MAX_ROUNDS = 64  # a guard: a round's winner only rises, and the most likely token always ends it


@triton.jit
def _kth_largest(x_row, V, c, t, k, BLOCK: tl.constexpr):
    """The k-th largest y = (x - c) / t of the row (counted with repeats): a radix select over the
    values' order-preserving keys, a byte a pass, the histogram of each pass kept to the keys
    that share the bytes found so far."""
    offs = tl.arange(0, BLOCK)
    d = tl.arange(0, 256)
    prefix = tl.full([], 0, tl.uint32)
    above = tl.sum(tl.zeros([256], tl.int32), 0)  # keys above the prefix's range
    for r in tl.static_range(4):
        shift = 24 - 8 * r  # (an annotated constexpr cannot be reassigned in an unrolled loop)
        hist = tl.zeros([256], tl.int32)
        for v0 in range(0, V, BLOCK):
            idx = v0 + offs
            live = idx < V
            key = _key((tl.load(x_row + idx, mask=live, other=0.0).to(tl.float32) - c) / t)
            match = live
            if r > 0:
                match = live & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
            hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
        at_least = above + tl.cumsum(hist, 0, reverse=True)
        best = tl.max(tl.where(at_least >= k, d, 0), 0)
        above += tl.sum(tl.where(d > best, hist, 0), 0)
        prefix = prefix | (best.to(tl.uint32) << shift)
    return _unkey(prefix)


@triton.jit
def _race(x_row, n_row, V, c, t, low, kth, BLOCK: tl.constexpr):
    """(winner, its scaled logit): argmax of exp(y) / E over the tokens with y > low and
    y >= kth, y = (x - c) / t (c the row's max: y <= 0); the first index on ties, as
    torch.argmax."""
    offs = tl.arange(0, BLOCK)
    best_s = tl.full([BLOCK], -1.0, tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    best_y = tl.full([BLOCK], float("-inf"), tl.float32)  # a lane that takes nothing stays out of yj
    for v0 in range(0, V, BLOCK):
        idx = v0 + offs
        live = idx < V
        y = (tl.load(x_row + idx, mask=live, other=float("-inf")).to(tl.float32) - c) / t
        e = tl.load(n_row + idx, mask=live, other=1.0)
        s = tl.exp(y) / tl.maximum(e, 1.1754943508222875e-38)  # the smallest normal float
        s = tl.where(live & (y > low) & (y >= kth), s, -1.0)
        take = s > best_s  # strict: a lane keeps its earliest index on ties
        best_s = tl.where(take, s, best_s)
        best_i = tl.where(take, idx, best_i)
        best_y = tl.where(take, y, best_y)
    top = tl.max(best_s, 0)
    j = tl.min(tl.where(best_s == top, best_i, V), 0)
    yj = tl.max(tl.where(best_i == j, best_y, float("-inf")), 0)
    return j, yj


@triton.jit
def _mass_above(x_row, V, c, t, yj, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        idx = v0 + offs
        y = (tl.load(x_row + idx, mask=idx < V, other=float("-inf")).to(tl.float32) - c) / t
        acc += tl.where(y > yj, tl.exp(y), 0.0)
    return tl.sum(acc, 0)


@triton.jit
def _sample_kernel(x_ptr, noise_ptr, nrow_ptr, temp_ptr, topp_ptr, topk_ptr, out_ptr, V, s_x, s_n,
                   BLOCK: tl.constexpr, MAX_ROUNDS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + r * s_x
    t = tl.load(temp_ptr + r)
    offs = tl.arange(0, BLOCK)
    # the row's max logit and its first index: the greedy answer, and the softmax's shift
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    for v0 in range(0, V, BLOCK):
        idx = v0 + offs
        x = tl.load(x_row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        take = x > best
        best = tl.where(take, x, best)
        best_i = tl.where(take, idx, best_i)
    xmax = tl.max(best, 0)
    ans = tl.min(tl.where(best == xmax, best_i, V), 0)
    if t > 0.0:
        # Scaled logits are (x - xmax) / t: the shift before the division keeps any t > 0
        # finite (x / t alone overflows for a tiny t), and exp of them is at most 1.
        tp = tl.load(topp_ptr + r)
        kk = tl.load(topk_ptr + r)
        n_row = noise_ptr + tl.load(nrow_ptr + r).to(tl.int64) * s_n
        kth = float("-inf")  # top-k: the tokens at or above the k-th largest value
        if (kk > 0) & (kk < V):
            kth = _kth_largest(x_row, V, xmax, t, kk, BLOCK)
        z = tl.sum(tl.zeros([BLOCK], tl.float32), 0)  # the softmax's normalizer over them
        if tp < 1.0:
            acc = tl.zeros([BLOCK], tl.float32)
            for v0 in range(0, V, BLOCK):
                idx = v0 + offs
                y = (tl.load(x_row + idx, mask=idx < V, other=float("-inf")).to(tl.float32) - xmax) / t
                acc += tl.where(y >= kth, tl.exp(y), 0.0)
            z = tl.sum(acc, 0)
        low = float("-inf")
        got = -1
        rounds = 0
        while (got < 0) & (rounds < MAX_ROUNDS):
            j, yj = _race(x_row, n_row, V, xmax, t, low, kth, BLOCK)
            if tp >= 1.0:
                got = j
            elif _mass_above(x_row, V, xmax, t, yj, BLOCK) < tp * z:
                got = j
            else:
                low = yj
            rounds += 1
        ans = tl.where(got >= 0, got, ans)  # past the guard: the most likely token, in N
    tl.store(out_ptr + r, ans.to(tl.int64))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                noise: torch.Tensor, noise_rows: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` [S, V] (float32, bfloat16 or float16; unit-stride V):
    the argmax where ``temperature`` [S] (float32) is 0, else the exponential race over the
    row's top-p nucleus (``top_p`` [S] float32 in (0, 1]) of softmax(logits / temperature) (any
    temperature > 0: the logits are shifted by their max before the division)
    kept to its ``top_k`` [S] (int32; 0 or at least V: every token) largest values, with noise
    row ``noise_rows[i]`` of ``noise`` [R, V] (float32 Exp(1) draws; int ``noise_rows`` [S],
    in [0, R) for sampled rows (not checked: that would wait for the device), unread for
    greedy rows). Returns int64 [S] on the logits' device."""
    check(logits, "logits", dims=2, dtypes=(torch.float32, torch.bfloat16, torch.float16))
    dev = logits.device
    s, v = logits.shape
    check(temperature, "temperature", dims=1, dtypes=(torch.float32,), device=dev)
    check(top_p, "top_p", dims=1, dtypes=(torch.float32,), device=dev)
    check(top_k, "top_k", dims=1, dtypes=(torch.int32,), device=dev)
    check(noise, "noise", dims=2, dtypes=(torch.float32,), device=dev)
    check(noise_rows, "noise_rows", dims=1, dtypes=(torch.int32, torch.int64), device=dev)
    for t, name in ((temperature, "temperature"), (top_p, "top_p"), (top_k, "top_k"), (noise_rows, "noise_rows")):
        check_shape(t, name, (s,))
    check_shape(noise, "noise", (None, v))
    out = torch.empty(s, dtype=torch.int64, device=dev)
    if s == 0:
        return out
    _sample_kernel[(s,)](logits, noise, noise_rows, temperature, top_p, top_k, out, v, logits.stride(0),
                         noise.stride(0), BLOCK=min(BLOCK, triton.next_power_of_2(v)),
                         MAX_ROUNDS=MAX_ROUNDS, num_warps=NUM_WARPS)
    return out


def sample_reference(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                     noise: torch.Tensor, noise_rows: torch.Tensor) -> torch.Tensor:
    """``sample_rows`` in torch, by sorting: the tokens below the k-th largest value masked,
    then a token kept when the tokens of strictly greater value weigh less than top_p (tied
    tokens stand or fall together)."""
    out = logits.float().argmax(-1)
    for i in torch.nonzero(temperature > 0).flatten().tolist():
        x = logits[i].float()
        y = (x - x.max()) / temperature[i]  # shifted first, as the kernel: finite for any t > 0
        k = int(top_k[i])
        if 0 < k < len(y):
            y = y.masked_fill(y < y.sort(descending=True).values[k - 1], float("-inf"))
        srt, idx = y.sort(descending=True)
        p = (srt - srt[0]).exp()
        above = p.cumsum(-1) - p  # the mass before each sorted position...
        first = torch.ones_like(srt, dtype=torch.bool)
        first[1:] = srt[1:] != srt[:-1]
        group = first.cumsum(-1) - 1
        above = above[first][group]  # ...taken at the first of its ties: strictly greater
        keep = torch.zeros_like(y, dtype=torch.bool).scatter(0, idx, (above < top_p[i] * p.sum()) & (srt > float("-inf")))
        score = torch.where(keep, (y - srt[0]).exp(), -1.0) / noise[noise_rows[i]].clamp_min(
            torch.finfo(torch.float32).tiny)
        out[i] = score.argmax()
    return out
