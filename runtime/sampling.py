"""Sampling for the torch runtime: greedy, temperature, top-k and top-p, with per-request
seeds.

A seeded request draws each token from a generator seeded by (seed, position), so its
output does not depend on what else shares its batch or on preemptions. Unseeded requests
share the runtime's generator.

``sample`` is the reference path (CPU, and CUDA without the fast path); ``sample_on_device``
is the fast path's: the same choices for greedy rows, the same distributions for sampled
ones, and nothing but the chosen ids ever leaves the device. It draws by an exponential
race (argmax of p_i / E_i with E_i ~ Exp(1) picks i with probability p_i), one noise row
per request, so a seeded row's noise comes from a device generator seeded by (seed,
position) alone: reproducible, but another stream than the reference's CPU draws. On the
GPU one kernel (``kernels.sampling.sample_rows``) runs the race over the top-k tokens' top-p
nucleus without sorting the rows; with the same noise it picks what the sort-based torch ops
pick, but for a nucleus boundary value several tokens share (it keeps all of them).
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch

from .models.batch import to_device

log = logging.getLogger(__name__)

# The kernel's top-k is a radix select, four passes over a row by one program, so its time
# hardly grows with the rows: at one row of 102,400 logits it took 309 us on the H200 against
# the sorting torch ops' 201, at 64 rows 351 against 1,067
# (raw/2026-11-30-h200x2-session13-bench_sampling.txt); the two lines cross near 9 rows (an
# interpolation, not measured). Batches of fewer sampled rows than this with a top-k row
# take the torch ops.
TOP_K_KERNEL_MIN_ROWS = 8

_MIX = 0x9E3779B97F4A7C15
# Batches sample in one kernel launch (False: sort-based torch ops, the form before, kept
# for A/B runs on the GPU).
SAMPLE_KERNEL = True


def sample(logits: torch.Tensor, temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray,
           seeds: np.ndarray, positions: np.ndarray, gen: torch.Generator) -> np.ndarray:
    """One token per row of ``logits`` (S, V); the arrays are per row."""
    out = logits.argmax(dim=-1)
    rand = np.flatnonzero(temperature > 0)
    if len(rand):
        probs = _probs(logits[rand], temperature[rand], top_p[rand], top_k[rand])
        picks = torch.empty(len(rand), dtype=torch.int64, device=logits.device)
        unseeded = np.flatnonzero(seeds[rand] < 0)
        if len(unseeded):
            # On the device, with the runtime's generator there: moving a batch of
            # vocabulary-sized rows to the host each step costs more than the forward.
            picks[unseeded] = torch.multinomial(probs[unseeded], 1, generator=gen).squeeze(1)
        for j in np.flatnonzero(seeds[rand] >= 0).tolist():
            g = torch.Generator().manual_seed(_row_seed(int(seeds[rand[j]]), int(positions[rand[j]])))
            picks[j] = torch.multinomial(probs[j].cpu(), 1, generator=g).item()
        out[rand] = picks
    return out.to(torch.int32).cpu().numpy()


def sample_on_device(logits: torch.Tensor, temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray,
                     seeds: np.ndarray, positions: np.ndarray, gen: torch.Generator) -> torch.Tensor:
    """One token per row of ``logits`` (S, V), as an int64 tensor on logits' device."""
    rand = np.flatnonzero(temperature > 0)
    if not len(rand):
        return logits.argmax(dim=-1)
    kernel = _kernel() if SAMPLE_KERNEL else None
    k = top_k[rand]  # a sampled row's top-k (0 < k < V) makes the kernel select: slow for a few rows
    few_top_k = len(rand) < TOP_K_KERNEL_MIN_ROWS and bool(((k > 0) & (k < logits.shape[-1])).any())
    fused = kernel is not None and not few_top_k and (logits.is_cuda or kernel[1]) and (
        logits.stride(-1) == 1)
    noise = _noise((len(rand), logits.shape[-1]), rand, seeds, positions, gen, logits.device)
    if fused:
        dev, rows = logits.device, np.full(len(logits), -1, np.int64)
        rows[rand] = np.arange(len(rand))
        temp = np.zeros(len(logits), np.float32)
        temp[rand] = temperatures32(temperature[rand])
        k = np.clip(np.asarray(top_k), 0, np.iinfo(np.int32).max).astype(np.int32)  # <= 0: off
        return kernel[0](logits, to_device(temp, dev), to_device(top_ps32(top_p), dev),
                         to_device(k, dev), noise, to_device(rows, dev))
    every = len(rand) == len(logits)
    rows = None if every else to_device(rand, logits.device)  # (a numpy index would copy synchronously)
    probs = _probs(logits if every else logits[rows], temperature[rand], top_p[rand], top_k[rand])
    picks = (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
    if every:
        return picks
    out = logits.argmax(dim=-1)
    out[rows] = picks
    return out


@functools.cache
def _kernel():
    """(the sampling kernel's launcher, whether Triton interprets it), imported at the first
    sampled batch (a runtime that never samples on the device, the reference path, does not
    import triton for it); None without triton (it installs on x86_64 only)."""
    try:
        from lockstep.kernels import _util
        from lockstep.kernels.sampling import sample_rows
    except ImportError:
        return None
    return sample_rows, _util.INTERPRET


def warm_up(vocab_size: int, device) -> None:
    """Compile the sampling kernel for float32 rows of ``vocab_size`` logits (what the fast
    path feeds it) on a CUDA device, so that the first sampled batch does not wait for the
    compile inside a step launched ahead. A failure is logged: that batch compiles it then."""
    kernel = _kernel() if SAMPLE_KERNEL else None
    if kernel is None or torch.device(device).type != "cuda":
        return
    try:
        one = torch.ones(1, device=device)
        kernel[0](torch.zeros(1, vocab_size, device=device), one, one * 0.5,
                  torch.full((1,), 50, dtype=torch.int32, device=device),
                  torch.ones(1, vocab_size, device=device), torch.zeros(1, dtype=torch.int64, device=device))
    except Exception as e:  # noqa: BLE001 - the first sampled batch raises it, if it is real
        log.warning("sampling kernel warm-up failed (%s: %s); the first sampled batch compiles it",
                    type(e).__name__, e)


def _noise(shape: tuple[int, int], rand: np.ndarray, seeds: np.ndarray, positions: np.ndarray,
           gen: torch.Generator, device) -> torch.Tensor:
    """Exp(1) draws, a row per sampled row: from ``gen``, or for a seeded request from a
    generator seeded by (seed, position)."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    seeded = np.flatnonzero(seeds[rand] >= 0)
    if len(seeded) < len(rand):
        # Drawn for every row then overwritten for the seeded ones: one launch, not one per row.
        noise.exponential_(generator=gen)
    for j in seeded.tolist():
        g = torch.Generator(device=device).manual_seed(_row_seed(int(seeds[rand[j]]), int(positions[rand[j]])))
        noise[j].exponential_(generator=g)
    return noise


def temperatures32(temperature: np.ndarray) -> np.ndarray:
    """Sampled rows' temperatures (> 0) in float32, kept inside its normal positive range:
    1e-50 would round to 0 (0 / 0 at the row's max; a subnormal may be flushed to 0 on a
    GPU) and 1e39 to inf (-inf / inf)."""
    f = np.finfo(np.float32)
    return np.clip(np.asarray(temperature, np.float64), f.tiny, f.max).astype(np.float32)


def top_ps32(top_p: np.ndarray) -> np.ndarray:
    """top_p in (0, 1] as float32 kept above 0: 1e-50 would round to 0, a nucleus of nothing."""
    return np.clip(np.asarray(top_p, np.float64), np.finfo(np.float32).tiny, 1.0).astype(np.float32)


def _probs(logits: torch.Tensor, temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray) -> torch.Tensor:
    dev = logits.device
    x = logits.float()  # shifted by the row's max before the division: finite for any temperature > 0
    x = (x - x.max(dim=-1, keepdim=True).values) / to_device(temperatures32(temperature), dev)[:, None]
    if (top_k > 0).any():
        vocab = x.shape[-1]
        k = to_device(np.where(top_k > 0, np.minimum(top_k, vocab), vocab).astype(np.int64), dev)
        kth = x.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    if (top_p < 1).any():
        srt, idx = x.sort(dim=-1, descending=True)
        p = srt.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always the first token).
        drop = (p.cumsum(dim=-1) - p) >= to_device(top_ps32(top_p), dev)[:, None]
        drop[:, 0] = False  # the most likely token always stays (its mass above is 0)
        srt = srt.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(1, idx, srt)
    return x.softmax(dim=-1)


def logprobs(logits: torch.Tensor, tokens: np.ndarray, k: int):
    """Log-probabilities under the model's own distribution (before temperature and
    truncation, as vLLM reports them by default) of ``tokens`` (one per row), and the top k."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.as_tensor(tokens, dtype=torch.int64, device=lp.device)[:, None])[:, 0]
    top = lp.topk(k, dim=-1) if k > 0 else None
    return (chosen.cpu().numpy(),
            None if top is None else top.indices.to(torch.int32).cpu().numpy(),
            None if top is None else top.values.cpu().numpy())


def _row_seed(seed: int, position: int) -> int:
    return ((seed * _MIX) ^ (position * 0xBF58476D1CE4E5B9)) & 0x7FFFFFFFFFFFFFFF
