"""Incremental EPLB: level a node's GPUs by pair re-splits that count their moves, and put
replicas back where they were while a plan stays within its cap.

With few slots per GPU (k <= RESPLIT_K) the fresh plan levels each node by re-splitting
every pair of its GPUs (``eplb_pack.resplit``), which gets its heaviest GPU well below what
single swaps reach; the repair from the current placement (``eplb_incr``) works by single
changes and then ends just above the fresh plan's cap on most layers. ``level_pairs`` runs
the same re-split from a repaired placement and weighs what it rewrites: each pair whose
heavier GPU is above the goal takes the split with the most relief of the pair's excess
over the goal per slot it newly rewrites (a GPU's replica that it held at the start keeps
its slot). Replicas stay on their node and counts do not change, so the rules hold.

Every route to an incremental plan aims below the cap (the fresh plan's heaviest GPU plus
eps) and so moves more than the cap needs. ``settle`` takes back what it can: each round,
per layer, the swap (or transfer: a replica count changes back) that puts the most replicas
back in the slots they had while no GPU goes above the cap, until none does.
"""

from __future__ import annotations

import numpy as np

from .eplb_align import align_slots
from .eplb_pack import Shape, round_robin
from .eplb_pairs import _splits
from .eplb_search import SearchState, apply_swap, apply_transfer
from .eplb_split import replica_counts, replica_slots

LEVEL_PASSES = 2  # round-robin passes over a node's pairs; a third finds little
FREE_REWRITE = 0.25  # as eplb_incr: a re-split that rewrites nothing new still costs a little
RESTORE_ROUNDS = 256  # restoring changes per layer at most (one a round); a layer takes a few dozen


def level_pairs(items: np.ndarray, load: np.ndarray, start: np.ndarray, side: np.ndarray, goal: np.ndarray,
                passes: int = LEVEL_PASSES) -> np.ndarray:
    """Re-split the pairs of GPUs of each row (a node) whose heavier GPU is above ``goal``
    (rows,), every pair in round-robin order. ``items``, ``load``, ``start`` (rows, m, k):
    the node's replicas, their loads, and the layout moves are counted against; the first
    two are changed in place. ``side`` (splits, 2k): ``eplb_pairs``' pair splits. Returns
    how many pairs of each row were re-split."""
    n, m, k = items.shape
    mine = side > 0
    both = np.concatenate([mine, ~mine])  # each split either way round: which GPU keeps what matters
    order = np.argsort(~both, axis=1, kind="stable")  # the first GPU's k replicas, then the other's
    count = np.zeros(n, dtype=np.int64)
    live = np.arange(n)
    for _ in range(passes):
        before = count.copy()
        for pairs in round_robin(m):
            _level_round(items, load, start, live, pairs, goal, both, order, count)
        live = np.flatnonzero(count > before)
        if live.size == 0:
            break
    return count


def _level_round(items, load, start, live, pairs, goal, both, order, count) -> None:
    """One round of disjoint ``pairs`` (p, 2) on rows ``live``, those pairs only whose
    heavier GPU is above the row's ``goal``; adds to ``count`` the pairs re-split."""
    k = items.shape[2]
    gpu = load[live].sum(2)
    ri, pi = np.nonzero(np.maximum(gpu[:, pairs[:, 0]], gpu[:, pairs[:, 1]]) > goal[live, None])
    if ri.size == 0:
        return
    rows, gpus, c = live[ri], pairs[pi], ri.size
    it = items[rows[:, None], gpus].reshape(c, 2 * k)
    ld = load[rows[:, None], gpus].reshape(c, 2 * k)
    was = start[rows[:, None], gpus]  # (c, 2, k)
    g = goal[rows, None]
    first = ld @ both.T.astype(np.float64)  # (c, 2 * splits): the first GPU's load
    after = np.maximum(first - g, 0) + np.maximum(ld.sum(1, keepdims=True) - first - g, 0)
    before = np.maximum(gpu[ri, gpus[:, 0]] - g[:, 0], 0) + np.maximum(gpu[ri, gpus[:, 1]] - g[:, 0], 0)
    held = (it[:, None, :, None] == was[:, :, None, :]).any(3)  # (c, 2, 2k): GPU g held replica i at the start
    kept = held[:, 0].astype(np.int64) @ both.T + held[:, 1].astype(np.int64) @ ~both.T
    kept_now = held[:, 0, :k].sum(1) + held[:, 1, k:].sum(1)
    rewrites = np.maximum(kept_now[:, None] - kept, 0) + FREE_REWRITE  # slots newly rewritten
    score = np.where(_clashes(it, both), -np.inf, (before[:, None] - after) / rewrites)
    best = score.argmax(1)
    sel = np.flatnonzero(score[np.arange(c), best] > 1e-12 * g[:, 0])
    if sel.size == 0:
        return
    o = order[best[sel]]
    new_it = np.take_along_axis(it[sel], o, 1).reshape(-1, 2, k)
    new_ld = np.take_along_axis(ld[sel], o, 1).reshape(-1, 2, k)
    pos = _keep_slots(new_it, was[sel])
    r, gg = rows[sel, None, None], gpus[sel, :, None]
    items[r, gg, pos], load[r, gg, pos] = new_it, new_ld
    np.add.at(count, rows[sel], 1)


def _clashes(it: np.ndarray, both: np.ndarray) -> np.ndarray:
    """(c, splits): splits that would put two replicas of one expert on a GPU (a pair of GPUs
    ``it`` (c, 2k) sharing an expert: rare)."""
    k = it.shape[1] // 2
    same = it[:, :k, None] == it[:, None, k:]
    clash = np.zeros((it.shape[0], both.shape[0]), dtype=bool)
    r, a, b = np.nonzero(same)
    np.logical_or.at(clash, r, both[:, a].T == both[:, k + b].T)
    return clash


def _keep_slots(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """(..., k) slot of each of ``new``'s replicas within its GPU: the one it held in
    ``old`` if it was there, else the freed ones in order (as ``eplb_align.align_slots``)."""
    k = new.shape[-1]
    same = new[..., :, None] == old[..., None, :]
    kept, taken = same.any(-1), same.any(-2)
    free_pos = np.argsort(taken, axis=-1, kind="stable")
    nth = np.clip(np.cumsum(~kept, axis=-1) - 1, 0, k - 1)
    return np.where(kept, same.argmax(-1), np.take_along_axis(free_pos, nth, -1))


def settle(w: np.ndarray, p2l: np.ndarray, old: np.ndarray, shape: Shape, cap: np.ndarray) -> np.ndarray:
    """``p2l`` with the replicas each GPU held in ``old`` back in their old slots, then
    restoring swaps while every GPU they touch stays within ``cap`` (``restore``): a plan
    within the cap stays so, with fewer moves."""
    st = SearchState.build(align_slots(p2l, old, shape.k), w, shape)
    restore(st, shape, old, cap)
    return st.p2l


def restore(st, shape: Shape, old: np.ndarray, cap: np.ndarray, rounds: int = RESTORE_ROUNDS) -> None:
    """Swaps anywhere in a layer that put a replica back in a slot it held in ``old`` while
    both GPUs stay within ``cap`` and every expert keeps a home copy, and transfers that do
    so by a replica count (``_restoring_transfers``): per round and layer, the one that
    un-rewrites the most slots, the lighter result first. ``st``: the layers'
    ``SearchState``, changed in place. Every restoring swap takes, for a rewritten slot a,
    a replica of a's old expert from a slot b that holds it."""
    layers, slots = st.p2l.shape
    k, node = shape.k, shape.gpu_node
    live = np.arange(layers)
    for _ in range(rounds):
        p, o = st.p2l[live], old[live]
        where = replica_slots(p, st.w.shape[1])  # (n, experts, r)
        col = live[:, None, None]
        a = np.broadcast_to(np.arange(slots)[None, :, None], (live.size, slots, where.shape[2]))
        b = where[np.arange(live.size)[:, None, None], o[:, :, None], np.arange(where.shape[2])]  # slots of a's old expert
        ok = (b >= 0) & (p != o)[:, :, None]
        b = np.where(ok, b, 0)
        lr = np.arange(live.size)[:, None, None]
        ea, eb, oa, ob = p[lr, a], p[lr, b], o[lr, a], o[lr, b]
        saved = (ea != oa).astype(np.int64) + (eb != ob) - (eb != oa) - (ea != ob)
        ga, gb = a // k, b // k
        ok &= (ga != gb) & (saved > 0) & ~st.has[col, gb, ea] & ~st.has[col, ga, eb]
        cross = node[ga] != node[gb]
        pin = lambda e, g: (shape.home[e] == node[g]) & (st.at_home[col, e] < 2)  # noqa: E731
        ok &= ~(cross & (pin(ea, ga) | pin(eb, gb)))
        la, lb = st.slot_load[col, a], st.slot_load[col, b]
        new_a, new_b = st.load[col, ga] - la + lb, st.load[col, gb] + la - lb
        c = cap[live, None, None]
        ok &= (new_a <= c) & (new_b <= c)
        value = np.where(ok, saved - np.maximum(new_a, new_b) / (2 * c), -np.inf).reshape(live.size, -1)
        t_value = _restoring_transfers(st, shape, live, where, p, o, cap[live])
        best, t_best = value.argmax(1), t_value.argmax(1)
        lr = np.arange(live.size)
        v, tv = value[lr, best], t_value[lr, t_best]
        swap, transfer = np.isfinite(v) & (v >= tv), np.isfinite(tv) & (tv > v)
        sb = b.reshape(live.size, -1)[lr, best][swap]
        apply_swap(st, shape, live[swap], best[swap] // where.shape[2], sb, count=False)
        apply_transfer(st, shape, live[transfer], t_best[transfer], o[lr, t_best][transfer], count=False)
        live = live[swap | transfer]
        if live.size == 0:
            return


def _restoring_transfers(st, shape: Shape, live, where, p, o, cap) -> np.ndarray:
    """(n, slots) value (as ``restore``'s) of giving each rewritten slot back its old expert
    c over its replica d, which has another (so replica counts change): -inf where the
    rules or ``cap`` forbid it. d's other holders get heavier, c's lighter (left out)."""
    k, n = shape.k, live.size
    lr, col = np.arange(n)[:, None], live[:, None]
    slot = np.arange(p.shape[1])[None, :]
    g, c, d = slot // k, o, p
    w, r = st.w[live], st.r[live]
    rc, rd, wc, wd = r[lr, c], r[lr, d], w[lr, c], w[lr, d]
    ok = (c != d) & (rd >= 2) & ~st.has[col, g, c]
    ok &= ~((shape.home[d] == shape.gpu_node[g]) & (st.at_home[col, d] < 2))
    new_g = st.load[col, g] - wd / rd + wc / (rc + 1.0)
    grow = wd / np.maximum(rd - 1.0, 1.0) - wd / rd
    holders = where[lr[:, :, None], d[:, :, None], np.arange(where.shape[2])]  # (n, slots, r)
    others = np.where((holders >= 0) & (holders != slot[:, :, None]), st.load[col[:, :, None], np.maximum(holders, 0) // k], -np.inf)
    top = np.maximum(new_g, others.max(2) + grow)
    ok &= top <= cap[:, None]
    return np.where(ok, 1.0 - top / (2 * cap[:, None]), -np.inf)


def resplit_frugal(w: np.ndarray, p2l: np.ndarray, old: np.ndarray, shape: Shape, goal: np.ndarray) -> np.ndarray:
    """``p2l`` with every node's pairs of GPUs re-split toward ``goal`` (``level_pairs``),
    moves counted against ``old``: where the repair by single changes stalled."""
    per, k = shape.gpus // shape.nodes, shape.k
    r = np.maximum(replica_counts(p2l, w.shape[1]), 1)
    items = p2l.reshape(-1, per, k).copy()
    load = np.take_along_axis(w / r, p2l, 1).reshape(-1, per, k)
    level_pairs(items, load, old.reshape(-1, per, k), _splits(k)[0], np.repeat(goal, shape.nodes))
    return items.reshape(p2l.shape)

