"""Tokens per GPU for a placement: how an expert's tokens are split among its replicas.

``even``: each replica takes load / replicas. This is what the planner optimizes, and what a
router does that picks a replica by token index.

``proportional``: the router splits each replicated expert's tokens so that the GPUs holding
its replicas come out as level as possible, i.e. a replica on a busy GPU takes fewer tokens
(water-filling). Done one expert at a time, heaviest first, for a few sweeps: each step is
the exact minimizer of the sum of squared GPU loads over that expert's split, so the sweeps
converge to the split that minimizes it, which levels the heaviest GPUs. This is the
per-batch split of issue 6 item 3, evaluated here so plans can be judged on a new window.
"""

from __future__ import annotations

import numpy as np

from .eplb_pack import gpu_loads

SPLITS = ("even", "proportional")


def replica_counts(p2l: np.ndarray, experts: int) -> np.ndarray:
    layers = p2l.shape[0]
    flat = (p2l + experts * np.arange(layers)[:, None]).ravel()
    return np.bincount(flat, minlength=layers * experts).reshape(layers, experts)


def replica_slots(p2l: np.ndarray, experts: int) -> np.ndarray:
    """(layers, experts, max replicas) slots of each expert, padded with -1."""
    layers, slots = p2l.shape
    r = replica_counts(p2l, experts)
    order = np.argsort(p2l, axis=1, kind="stable")  # slots grouped by expert, ascending
    expert = np.take_along_axis(p2l, order, 1)
    start = np.cumsum(r, axis=1) - r
    nth = np.arange(slots) - np.take_along_axis(start, expert, 1)  # replica number within its expert
    out = np.full((layers, experts, max(int(r.max()), 1)), -1, dtype=np.int64)
    out[np.arange(layers)[:, None], expert, nth] = order
    return out


def split_loads(p2l: np.ndarray, w: np.ndarray, gpus: int, split: str = "even", sweeps: int = 4) -> np.ndarray:
    """(layers, gpus) tokens per GPU when ``w`` (layers, experts) is split as ``split`` says."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    r = replica_counts(p2l, w.shape[1])
    slot_load = np.take_along_axis(w / np.maximum(r, 1), p2l, 1)
    if split == "even" or r.max() < 2:
        return gpu_loads(slot_load, gpus)
    return _level(p2l, w, r, slot_load, gpus, sweeps)


def _level(p2l, w, r, slot_load, gpus, sweeps):
    """Gauss-Seidel water-filling over the replicated experts, vectorized over layers."""
    layers, slots = p2l.shape
    k, rows = slots // gpus, np.arange(layers)
    where = replica_slots(p2l, w.shape[1])
    order = np.argsort(-np.where(r >= 2, w, -1.0), axis=1, kind="stable")[:, : int((r >= 2).sum(1).max())]
    load = np.zeros((layers, gpus + 1))  # the extra column (and slot) absorbs padding
    load[:, :gpus] = gpu_loads(slot_load, gpus)
    share = np.concatenate([slot_load, np.zeros((layers, 1))], axis=1)
    for _ in range(sweeps):
        for e in order.T:
            live = (where[rows, e] >= 0) & (r[rows, e] >= 2)[:, None]
            s = np.where(live, where[rows, e], slots)
            g = np.where(live, s // k, gpus)
            x = share[rows[:, None], s]
            new = _water_fill(np.where(live, load[rows[:, None], g] - x, np.inf), w[rows, e])
            np.add.at(load, (rows[:, None], g), new - x)  # a GPU may hold two (foreign plans)
            share[rows[:, None], s] = new
    return load[:, :gpus]


def _water_fill(base: np.ndarray, amount: np.ndarray) -> np.ndarray:
    """Pour ``amount`` onto levels ``base`` (n, m; inf = no replica): x = max(0, lam - base)
    with sum x = amount."""
    b = np.sort(base, axis=1)
    finite = np.isfinite(b)
    csum = np.cumsum(np.where(finite, b, 0.0), axis=1)
    m = np.arange(1, b.shape[1] + 1)
    lam = (amount[:, None] + csum) / m
    wet = finite & (lam >= b)
    top = np.maximum(wet.sum(1), 1) - 1  # wet levels form a prefix
    level = lam[np.arange(b.shape[0]), top]
    return np.where(np.isfinite(base), np.maximum(level[:, None] - base, 0.0), 0.0)
