"""Packing replicas onto GPUs for the EPLB planner: balanced differencing within each node.

A placement is ``phy2log`` (layers, slots); slot s lives on GPU s // k (k slots per GPU).
Rules every function here keeps: no GPU holds two replicas of one expert, and every expert
keeps at least one replica on its home node (``home``); redundant replicas may sit anywhere.
The differencing loops k - 1 times; each step works on every (layer, node) at once, which is
what keeps a 61-layer plan inside the planner's time budget.
"""

from __future__ import annotations

import attrs
import numpy as np


@attrs.frozen
class Shape:
    """The machine as the packer sees it."""

    slots: int
    gpus: int
    nodes: int
    home: np.ndarray = attrs.field(eq=False)  # (experts,) home node of each expert

    @property
    def k(self) -> int:
        return self.slots // self.gpus

    @property
    def gpu_node(self) -> np.ndarray:
        return np.arange(self.gpus) // (self.gpus // self.nodes)

    def spare(self) -> np.ndarray:
        """Slots per node left for redundant replicas once its own experts have one each."""
        groups = np.bincount(self.home, minlength=self.nodes)
        return self.slots // self.nodes - groups


def gpu_loads(slot_load: np.ndarray, gpus: int) -> np.ndarray:
    layers, slots = slot_load.shape
    return slot_load.reshape(layers, gpus, slots // gpus).sum(2)


def sorted_items(per: np.ndarray, r: np.ndarray):
    """Replicas heaviest first, those of one expert adjacent; first of each is its primary.
    Returns (items, load, first), each (layers, slots)."""
    layers, experts = per.shape
    items = np.repeat(np.tile(np.arange(experts), layers), r.ravel()).reshape(layers, -1)
    load = np.take_along_axis(per, items, 1)
    order = np.argsort(-load, axis=1, kind="stable")  # stable keeps an expert's replicas together
    items, load = np.take_along_axis(items, order, 1), np.take_along_axis(load, order, 1)
    first = np.ones_like(items, dtype=bool)
    first[:, 1:] = items[:, 1:] != items[:, :-1]
    return items, load, first


def balanced_pack(items: np.ndarray, load_of: np.ndarray, item_node: np.ndarray, shape: Shape,
                  lead: np.ndarray | None = None) -> np.ndarray:
    """Each node's replicas onto its GPUs, k to a GPU, by balanced largest differencing;
    then undo the few pairings that gave a GPU a second replica of one expert.

    ``lead`` (bool, like ``items``) marks replicas to spread one per GPU where there are
    enough: each node's largest such replicas form the first group of the differencing, and
    every GPU gets one item of each group. Used for replicas of replicated experts, so that
    each GPU holds one (the per-batch split can then relieve it).
    """
    layers, nodes = items.shape[0], shape.nodes
    per_node, k = shape.gpus // nodes, shape.k
    order = np.argsort(item_node, axis=1, kind="stable")  # by node, heaviest first within
    it = np.take_along_axis(items, order, 1).reshape(layers * nodes, k * per_node)
    ld = np.take_along_axis(load_of, order, 1).reshape(layers * nodes, k * per_node)
    if lead is not None:
        first = np.take_along_axis(lead, order, 1).reshape(it.shape)
        first &= np.cumsum(first, axis=1) <= per_node
        front = np.argsort(~first, axis=1, kind="stable")
        it, ld = np.take_along_axis(it, front, 1), np.take_along_axis(ld, front, 1)
    gpu = differencing(ld, per_node)
    by_gpu = np.argsort(gpu, axis=1, kind="stable")
    out = np.take_along_axis(it, by_gpu, 1).reshape(layers, nodes, per_node, k)
    _fix_duplicates(out, np.take_along_axis(ld, by_gpu, 1).reshape(out.shape))
    return out.reshape(layers, shape.slots)


def differencing(load: np.ndarray, m: int) -> np.ndarray:
    """(rows, n) bin of each item, n = m k items sorted heaviest first into m bins of k.

    Balanced largest differencing (Karmarkar-Karp with equal counts): k partial
    partitions of m consecutive items, one item per bin each; repeatedly the two whose
    bins differ most are merged, the heaviest bins of one with the lightest of the other.
    Every bin ends with exactly one item from each of the k starting groups.
    """
    rows_n, n = load.shape
    k = n // m
    rows = np.arange(rows_n)
    sums = load.reshape(rows_n, k, m).copy()  # per partial partition, per bin position
    spread = sums.max(2) - sums.min(2)  # -1 once merged away
    owner = np.repeat(np.arange(k), m)[None].repeat(rows_n, 0)  # partial partition of each item
    pos = np.tile(np.arange(m), (rows_n, k))  # bin position of each item within it
    cols = np.arange(k)
    for _ in range(k - 1):
        a = spread.argmax(1)
        b = np.where(cols == a[:, None], -np.inf, spread).argmax(1)
        sa, sb = sums[rows, a], sums[rows, b]
        ia, ib = np.argsort(-sa, axis=1, kind="stable"), np.argsort(sb, axis=1, kind="stable")
        dest = np.empty_like(ib)
        dest[rows[:, None], ib] = ia  # b's position ib[j] joins a's position ia[j]
        merged = np.take_along_axis(sa, ia, 1) + np.take_along_axis(sb, ib, 1)
        sums[rows[:, None], a[:, None], ia] = merged
        spread[rows, a] = merged.max(1) - merged.min(1)
        spread[rows, b] = -1.0
        moved = owner == b[:, None]
        pos = np.where(moved, np.take_along_axis(dest, pos, 1), pos)
        owner = np.where(moved, a[:, None], owner)
    return pos


def _fix_duplicates(out: np.ndarray, load: np.ndarray | None = None) -> None:
    """Where a GPU got two replicas of one expert (an expert whose replicas straddle two
    groups), trade one of them with the replica of another GPU of the node, closest in
    load, that neither GPU holds. ``out`` is (layers, nodes, gpus per node, k), changed in
    place; ``load`` (same shape, optional) the replicas' loads, traded along."""
    shape = out.shape
    flat = out.reshape(-1, *shape[2:])
    _trade_duplicates(flat, None if load is None else load.reshape(flat.shape).copy())
    if not np.shares_memory(flat, out):
        out[...] = flat.reshape(shape)


def _trade_duplicates(out: np.ndarray, load: np.ndarray | None) -> None:
    """``out`` (rows, gpus, k): one trade per row per pass, each removing a repeat without
    making one (the GPU lacked what it gets), so a row needs at most as many passes as it
    has slots."""
    k = out.shape[2]
    later = np.triu(np.ones((k, k), dtype=bool), 1)
    for _ in range(out.shape[1] * k + 1):
        srt = np.sort(out, axis=2)
        bad = (srt[..., 1:] == srt[..., :-1]).any(2)  # (rows, gpus)
        rows = np.flatnonzero(bad.any(1))
        if rows.size == 0:
            return
        g = bad[rows].argmax(1)  # one GPU per row per pass
        mine = out[rows, g]  # (n, k)
        i = ((mine[:, :, None] == mine[:, None, :]) & later).any(1).argmax(1)  # a repeated slot
        e = mine[np.arange(rows.size), i]
        cand = out[rows]  # (n, gpus, k)
        ok = ~(cand[..., None] == mine[:, None, None, :]).any(3)  # g lacks it
        ok &= ~(cand == e[:, None, None]).any(2)[:, :, None]  # its GPU lacks e
        ok[np.arange(rows.size), g] = False
        cost = np.ones(cand.shape) if load is None else np.abs(load[rows] - load[rows, g, i][:, None, None])
        flat = np.where(ok, cost, np.inf).reshape(rows.size, -1)
        best = flat.argmin(1)
        found = np.isfinite(flat[np.arange(rows.size), best])
        for r in rows[~found]:  # no trade in the node: lay it out anew (rare)
            _column_major(out[r])
        rows, g, i, e, best = rows[found], g[found], i[found], e[found], best[found]
        h, j = np.divmod(best, k)
        out[rows, g, i], out[rows, h, j] = out[rows, h, j], e
        if load is not None:
            load[rows, g, i], load[rows, h, j] = load[rows, h, j], load[rows, g, i]
    raise AssertionError("a repeated replica survived every trade")


def _column_major(gpus: np.ndarray) -> None:
    """Re-lay one node's replicas so that each expert's are on consecutive GPUs: valid as
    long as no expert has more replicas than the node has GPUs (the node deal sees to it)."""
    items = np.sort(gpus.ravel())
    n = gpus.shape[0]
    gpus[np.arange(items.size) % n, np.arange(items.size) // n] = items
