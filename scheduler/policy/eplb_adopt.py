"""Incremental EPLB, second route: the fresh plan's nodes, the current plan's GPUs.

Where the loads drift so that a node's own experts outgrow its GPUs, the repair from the
current placement (``eplb_incr``) gets stuck: most replicas on a node are its experts' last
home copies and cannot leave, so single changes off the heaviest GPU find nothing, while
the fresh plan re-deals counts and pool replicas across nodes. The fresh plan also re-packs
every GPU, though, which is where nearly all of its moves come from. So this route takes
from the fresh plan only *which replicas a node holds* and keeps the current layout inside
the node (``adopt``): the replicas the fresh plan drops leave their slots, the ones it adds
take those slots, heaviest onto the lightest GPU. The repair then levels from there, its
moves counted against the current placement; it is tried with the fresh nodes adopted
where a node's mean GPU is near the goal (``heavy_nodes``) and everywhere.

Last resort, always within the cap (``adopt_fresh_nodes``): with every node adopted (into
the current layout, and into each repair's result), swaps inside each node, the most relief
of its excess over the goal (or the cap) per newly rewritten slot first (``_level``), and
with few slots per GPU pair re-splits after them (``eplb_level``); then per node the layout,
or the fresh plan's node, that rewrites the fewest slots within the cap. Every node then
holds the fresh plan's multiset, so replica counts are the fresh plan's and each node's GPU loads depend on that node's layout alone:
any per-node mix keeps the rules (home copies stay home, no expert twice on a GPU) and
every GPU within the cap, because the fresh plan's nodes are within it.
"""

from __future__ import annotations

import numpy as np

from .eplb_level import resplit_frugal
from .eplb_pack import RESPLIT_K, Shape
from .eplb_split import replica_counts

HEAVY_NODE = 0.99  # a node whose mean GPU is this near the goal rarely levels its few big replicas under it
LEVEL_ROUNDS = 128  # swaps per node at most; a node takes a handful
NEW_SLOT_COST = 1.0  # a swap's price: this per slot it newly rewrites, plus FREE_COST
FREE_COST = 0.25  # what a swap of already rewritten slots costs (not zero: it still runs)


def adopt_fresh_nodes(w: np.ndarray, old: np.ndarray, fresh: np.ndarray, shape: Shape, goal: np.ndarray,
                      cap: np.ndarray, bases: tuple[np.ndarray, ...] = ()) -> np.ndarray:
    """(layers, slots): per node, the old layout (or one of ``bases``) given the fresh plan's
    replicas and levelled to ``goal``, to ``cap`` or halfway, or the fresh plan's node,
    whichever rewrites the fewest slots of ``old`` within ``cap`` (per layer). Levelling less
    far moves less, but more often leaves a node above the cap."""
    per_item = w / np.maximum(replica_counts(fresh, w.shape[1]), 1)
    starts = [adopt(w, base, fresh, shape) for base in (old, *bases)]
    cands = [_level(start, np.take_along_axis(per_item, start, 1), old, shape, aim)[0]
             for start in starts for aim in (goal, (goal + cap) / 2, cap)]
    if 2 <= shape.k <= RESPLIT_K and shape.gpus > shape.nodes:  # the pair re-splits finish what swaps leave
        cands += [resplit_frugal(w, p, old, shape, goal) for p in cands]
    out, rows = fresh, (old.shape[0], shape.nodes, -1)
    moved = (fresh != old).reshape(rows).sum(2)
    for p in cands:
        top = np.take_along_axis(w / np.maximum(replica_counts(p, w.shape[1]), 1), p, 1)
        top = top.reshape(old.shape[0], shape.gpus, -1).sum(2).reshape(rows).max(2)
        m = (p != old).reshape(rows).sum(2)
        better = (top <= cap[:, None]) & (m < moved)
        out = np.where(np.repeat(better, shape.slots // shape.nodes, axis=1), p, out)
        moved = np.where(better, m, moved)
    return out


def fewest_moves(old: np.ndarray, tries: list[np.ndarray], ok: list[np.ndarray],
                 fallback: np.ndarray) -> np.ndarray:
    """Per layer, of the ``tries`` that are ``ok`` there and ``fallback``, the one that
    rewrites the fewest slots of ``old``."""
    cands = np.stack([*tries, fallback])
    moved = (cands != old).sum(2)
    moved[:-1] = np.where(np.stack(ok), moved[:-1], np.iinfo(moved.dtype).max)
    return cands[moved.argmin(0), np.arange(old.shape[0])]


def heavy_nodes(w: np.ndarray, old: np.ndarray, shape: Shape, goal: np.ndarray) -> np.ndarray:
    """(layers, nodes): whether the node's mean GPU under ``old`` is within HEAVY_NODE of
    the goal, or above it (then no layout inside the node brings it under)."""
    r = np.maximum(replica_counts(old, w.shape[1]), 1)
    node_load = np.take_along_axis(w / r, old, 1).reshape(old.shape[0], shape.nodes, -1).sum(2)
    return node_load / (shape.gpus // shape.nodes) > goal[:, None] * HEAVY_NODE


def adopt(w: np.ndarray, old: np.ndarray, fresh: np.ndarray, shape: Shape,
          where: np.ndarray | None = None) -> np.ndarray:
    """Old layout, the multiset of experts of each node ``where`` says (default: all) made
    the fresh plan's with as few slots rewritten as that takes. A node where an added
    replica finds no slot on a GPU without it takes the fresh plan's node."""
    out = old.copy()
    per_item = w / np.maximum(replica_counts(fresh, w.shape[1]), 1)
    size, k = shape.slots // shape.nodes, shape.k
    for layer, node in np.ndindex(old.shape[0], shape.nodes):
        if where is not None and not where[layer, node]:
            continue
        span = slice(node * size, (node + 1) * size)
        got = _adopt_node(old[layer, span], fresh[layer, span], per_item[layer], k)
        out[layer, span] = got if got is not None else fresh[layer, span]
    return out


def _adopt_node(old: np.ndarray, fresh: np.ndarray, per_item: np.ndarray, k: int) -> np.ndarray | None:
    experts = per_item.size
    extra = np.bincount(old, minlength=experts) - np.bincount(fresh, minlength=experts)
    p = old.copy()
    gpu_load = per_item[p].reshape(-1, k).sum(1)
    for e in np.flatnonzero(extra > 0):  # the copies on the heaviest GPUs leave
        at = np.flatnonzero(p == e)
        p[at[np.argsort(-gpu_load[at // k], kind="stable")[: extra[e]]]] = -1
    gpu_load = np.where(p >= 0, per_item[np.maximum(p, 0)], 0.0).reshape(-1, k).sum(1)
    added = np.repeat(np.arange(experts), np.maximum(-extra, 0))
    for e in added[np.argsort(-per_item[added], kind="stable")]:  # heaviest onto the lightest GPU
        held = (p.reshape(-1, k) == e).any(1)
        free = np.flatnonzero((p < 0) & ~held[np.arange(p.size) // k])
        if free.size == 0:
            return None
        s = free[gpu_load[free // k].argmin()]
        p[s] = e
        gpu_load[s // k] += per_item[e]
    return p


def _level(p2l: np.ndarray, per_item: np.ndarray, old: np.ndarray, shape: Shape, goal: np.ndarray):
    """Swaps inside each node while a GPU is above ``goal``: each round, per node, the swap
    that takes the most off the node's summed excess over the goal per slot it newly
    rewrites. Returns (p2l, (layers, nodes) heaviest GPU of each node)."""
    layers, k, per = p2l.shape[0], shape.k, shape.gpus // shape.nodes
    cells = layers * shape.nodes
    p = p2l.reshape(cells, per, k).copy()
    load = per_item.reshape(cells, per, k).copy()
    was = old.reshape(cells, per, k)
    target = np.repeat(goal, shape.nodes)
    for _ in range(LEVEL_ROUNDS):
        rows = np.flatnonzero(load.sum(2).max(1) > target)
        if rows.size == 0:
            break
        ga, i, gb, j, ok = _best_swaps(p[rows], load[rows], was[rows], target[rows])
        rows, ga, i, gb, j = rows[ok], ga[ok], i[ok], gb[ok], j[ok]
        if rows.size == 0:
            break
        p[rows, ga, i], p[rows, gb, j] = p[rows, gb, j], p[rows, ga, i].copy()
        load[rows, ga, i], load[rows, gb, j] = load[rows, gb, j], load[rows, ga, i].copy()
    return p.reshape(p2l.shape), load.sum(2).max(1).reshape(layers, shape.nodes)


def _best_swaps(p, load, was, target):
    """Per node row (p, load, was: (rows, gpus, k)): (GPU a, its slot, GPU b, its slot,
    found) of the swap with the most excess relief per newly rewritten slot. Arrays below
    are (rows, a, slot, b, slot)."""
    n, per, k = p.shape
    gpu = load.sum(2)
    delta = load[:, :, :, None, None] - load[:, None, None, :, :]  # a gives its item, takes b's
    t = target[:, None, None, None, None]
    excess = lambda x: np.maximum(x - t, 0.0)  # noqa: E731
    ga, gb = gpu[:, :, None, None, None], gpu[:, None, None, :, None]
    relief = excess(ga) + excess(gb) - excess(ga - delta) - excess(gb + delta)
    same = p[:, :, :, None, None] == p[:, None, None, :, :]
    bad = same.any(4, keepdims=True) | same.any(2, keepdims=True)  # b holds a's expert, or a b's
    bad |= (np.arange(per)[:, None, None, None] == np.arange(per)[None, None, :, None])[None]
    ea, eb = p[:, :, :, None, None], p[:, None, None, :, :]
    oa, ob = was[:, :, :, None, None], was[:, None, None, :, :]
    rewrites = (eb != oa).astype(np.float64) + (ea != ob) - (ea != oa) - (eb != ob)
    value = relief / (NEW_SLOT_COST * np.maximum(rewrites, 0.0) + FREE_COST)
    value = np.where(bad | (relief <= t * 1e-12), -np.inf, value).reshape(n, -1)
    best = value.argmax(1)
    a, i, b, j = np.unravel_index(best, (per, k, per, k))
    return a, i, b, j, np.isfinite(value[np.arange(n), best])
