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
position) alone: reproducible, but another stream than the reference's CPU draws.
"""

from __future__ import annotations

import numpy as np
import torch

from .models.batch import to_device

_MIX = 0x9E3779B97F4A7C15


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
    out = logits.argmax(dim=-1)
    rand = np.flatnonzero(temperature > 0)
    if not len(rand):
        return out
    every = len(rand) == len(logits)
    rows = None if every else to_device(rand, logits.device)  # (a numpy index would copy synchronously)
    probs = _probs(logits if every else logits[rows], temperature[rand], top_p[rand], top_k[rand])
    noise = torch.empty_like(probs)
    seeded = np.flatnonzero(seeds[rand] >= 0)
    if len(seeded) < len(rand):
        # Drawn for every row then overwritten for the seeded ones: one launch, not one per row.
        noise.exponential_(generator=gen)
    for j in seeded.tolist():
        g = torch.Generator(device=logits.device).manual_seed(_row_seed(int(seeds[rand[j]]), int(positions[rand[j]])))
        noise[j].exponential_(generator=g)
    picks = (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
    if every:
        return picks
    out[rows] = picks
    return out


def _probs(logits: torch.Tensor, temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray) -> torch.Tensor:
    dev = logits.device
    x = logits.float() / to_device(np.asarray(temperature, np.float32), dev)[:, None]
    if (top_k > 0).any():
        vocab = x.shape[-1]
        k = to_device(np.where(top_k > 0, np.minimum(top_k, vocab), vocab).astype(np.int64), dev)
        kth = x.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    if (top_p < 1).any():
        srt, idx = x.sort(dim=-1, descending=True)
        p = srt.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always the first token).
        drop = (p.cumsum(dim=-1) - p) >= to_device(np.asarray(top_p, np.float32), dev)[:, None]
        srt = srt.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(1, idx, srt)
    return x.softmax(dim=-1)


def _row_seed(seed: int, position: int) -> int:
    return ((seed * _MIX) ^ (position * 0xBF58476D1CE4E5B9)) & 0x7FFFFFFFFFFFFFFF
