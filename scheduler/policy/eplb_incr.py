"""Incremental EPLB: repair the current placement for a new window with few expert moves.

After loads drift, a GPU is over its goal mostly because some of its experts grew, and an
expert's replicas sit on several GPUs that all grew with it. So the repair measures each
change by how much it takes off the excess over the goal summed over *all* GPUs, per slot it
rewrites; each round every one of a layer's few heaviest GPUs picks its best change, and
those touching disjoint GPUs and experts are made:
- split (one slot): an expert held by a heavy GPU gets one more replica, over a replica of an
  expert that can spare one (relieving every holder of the first at once);
- swap (two slots): a replica of a heavy GPU trades places with one of a light GPU.
Splits are also offered for the coldest experts onto heavy GPUs (the count moves back where
a hot expert cooled). When no change lowers a layer's excess and its heaviest GPU is still
over the goal, the planner's own search (frugal mode) works on that GPU alone.
"""

from __future__ import annotations

import numpy as np

from .eplb_moves import partners, pinned
from .eplb_pack import Shape
from .eplb_search import SearchState, apply_swap, apply_transfer, search
from .eplb_split import replica_slots

HEAVY = 4  # heavy GPUs per layer whose experts and slots are candidates each round
COLD = 4  # coldest experts offered as new replicas on heavy GPUs
FRUGAL_STALL = 2e-4  # the repair works every last gain out of a layer: a fallback costs far more moves


def repair(w: np.ndarray, p2l: np.ndarray, shape: Shape, goal: np.ndarray, max_rounds: int | None = None) -> SearchState:
    """The current placement ``p2l`` changed until each layer's heaviest GPU is <= goal, or
    no single change lowers the layer's excess."""
    st = SearchState.build(p2l, w, shape)
    active = np.arange(w.shape[0])
    for _ in range(max_rounds if max_rounds is not None else 2 * shape.slots):
        active = active[st.load[active].max(1) > goal[active]]
        if active.size == 0:
            break
        active = active[_repair_round(st, shape, active, goal[active])]
    return search(st, shape, goal, frugal=True, stall=FRUGAL_STALL)  # what excess cannot see: the heaviest alone


def _excess(load: np.ndarray, goal: np.ndarray) -> np.ndarray:
    return np.maximum(load - goal.reshape((-1,) + (1,) * (load.ndim - 1)), 0.0)


def _repair_round(st: SearchState, shape: Shape, layers: np.ndarray, goal: np.ndarray) -> np.ndarray:
    """Per heavy GPU of each layer, its best change by gain per rewritten slot; those that
    touch disjoint GPUs and experts are made together. Returns which layers moved."""
    n, t = layers.size, min(HEAVY, shape.gpus)
    heavy = np.argsort(-st.load[layers], axis=1)[:, :t]
    rows, h, g_rows = np.repeat(layers, t), heavy.ravel(), np.repeat(goal, t)
    where = replica_slots(st.p2l[layers], st.w.shape[1])
    w, r = st.w[layers], st.r[layers]
    per_row = np.repeat(np.arange(n), t)
    relief = _holder_change(st, shape, layers, goal, where, -w / (r * (r + 1.0)))[per_row]
    burden = _holder_change(st, shape, layers, goal, where, w / np.maximum(r * (r - 1.0), 1.0))[per_row]
    sp_gain, sp_slot, sp_c = _best_split(st, shape, rows, g_rows, h, relief, burden)
    sw_gain, sa, sb = _best_swap(st, shape, rows, g_rows, h)
    use_split = sp_gain >= sw_gain / 2
    gain = np.where(use_split, sp_gain, sw_gain / 2) > 1e-12 * g_rows
    gpus, experts = _touched(st, shape, rows, where, per_row, use_split, sp_slot, sp_c, sa, sb)
    keep = _independent(np.where(gain, np.maximum(sp_gain, sw_gain / 2), -np.inf).reshape(n, t),
                        gpus.reshape(n, t, -1), experts.reshape(n, t, -1)).ravel()
    sp, sw = keep & use_split, keep & ~use_split
    apply_transfer(st, shape, rows[sp], sp_slot[sp], sp_c[sp], count=False)
    st.splits += int(sp.sum())
    apply_swap(st, shape, rows[sw], sa[sw], sb[sw])
    return keep.reshape(n, t).any(1)


def _touched(st, shape: Shape, rows, where, per_row, use_split, sp_slot, sp_c, sa, sb):
    """(rows, gpus) and (rows, 4) experts each row's change touches (-1 = none)."""
    k, lr = shape.k, np.arange(rows.size)
    d = st.p2l[rows, sp_slot]
    gpus = np.zeros((rows.size, shape.gpus), dtype=bool)
    for e in (sp_c, d):  # a split loads or unloads every holder of both experts
        slots = where[per_row, e]
        gpus[lr[:, None], np.where(slots >= 0, slots // k, sp_slot[:, None] // k)] |= use_split[:, None]
    gpus[lr, sp_slot // k] |= use_split
    gpus[lr, sa // k] |= ~use_split
    gpus[lr, sb // k] |= ~use_split
    ea, eb = st.p2l[rows, sa], st.p2l[rows, sb]
    experts = np.stack([np.where(use_split, sp_c, ea), np.where(use_split, d, eb)], axis=1)
    return gpus, experts


def _independent(gain: np.ndarray, gpus: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """(n, t): best first, keep the changes whose GPUs and experts no kept one touches."""
    n, t = gain.shape
    lr = np.arange(n)
    keep = np.zeros((n, t), dtype=bool)
    used = np.zeros((n, gpus.shape[2]), dtype=bool)
    used_e = np.full((n, t * experts.shape[2]), -1)
    for j, i in enumerate(np.argsort(-gain, axis=1).T):
        g, e = gpus[lr, i], experts[lr, i]
        clash = (used & g).any(1) | (e[:, :, None] == used_e[:, None, :]).any((1, 2))
        ok = np.isfinite(gain[lr, i]) & ~clash
        keep[lr[ok], i[ok]] = True
        used[ok] |= g[ok]
        used_e[ok, j * e.shape[1] : (j + 1) * e.shape[1]] = e[ok]
    return keep


def _holder_change(st, shape: Shape, layers, goal, where, delta) -> np.ndarray:
    """(rows, experts): change of summed excess if every GPU holding the expert moves by
    ``delta`` (rows, experts)."""
    gpu = np.where(where >= 0, where // shape.k, 0)
    held = where >= 0
    load = st.load[layers[:, None, None], gpu]
    change = _excess(load + delta[:, :, None], goal) - _excess(load, goal)
    return np.where(held, change, 0.0).sum(2)


def _targets(st, shape: Shape, layers, h) -> np.ndarray:
    """(rows, m) slots a new replica may overwrite: on the lightest GPUs and on h."""
    k = shape.k
    gpus = np.concatenate([partners(st.load[layers], shape, False, h), h[:, None]], axis=1)
    return (gpus[:, :, None] * k + np.arange(k)).reshape(layers.size, -1)


def _best_split(st, shape: Shape, layers, goal, h, relief, burden):
    """Per row: (gain, slot, expert) of the best split: expert c gets a replica over slot s;
    c is one of h's experts or one of the coldest. ``relief``/``burden`` (rows, experts): the
    excess change on an expert's holders if it gains/loses a replica."""
    k, n = shape.k, layers.size
    lr, col = np.arange(n), layers[:, None]
    w, r = st.w[layers], st.r[layers]
    mine = st.p2l[col, h[:, None] * k + np.arange(k)]
    cold = np.argsort(w / (r + 1.0), axis=1)[:, :COLD]
    c = np.concatenate([mine, cold], axis=1)  # (n, C) candidates to replicate
    rc, wc = r[lr[:, None], c], w[lr[:, None], c]
    relief = relief[lr[:, None], c]
    slot = _targets(st, shape, layers, h)
    d, g = st.p2l[col, slot], slot // k
    rd, wd = r[lr[:, None], d], w[lr[:, None], d]
    grow = wd / np.maximum(rd * (rd - 1.0), 1.0)
    lg = st.load[col, g]
    d_cost = burden[lr[:, None], d]
    d_cost -= _excess(lg + grow, goal) - _excess(lg, goal)  # g loses d instead
    new_g = (lg - wd / rd)[:, None, :] + (wc / (rc + 1.0))[:, :, None]
    change = relief[:, :, None] + d_cost[:, None, :] + _excess(new_g, goal) - _excess(lg, goal)[:, None, :]
    ok = ((rd >= 2) & ~pinned(st, shape, col, d, g))[:, None, :] & (rc < shape.gpus)[:, :, None]
    ok &= (c[:, :, None] != d[:, None, :]) & ~st.has[layers[:, None, None], g[:, None, :], c[:, :, None]]
    gain = np.where(ok, -change, -np.inf).reshape(n, -1)
    best = gain.argmax(1)
    i, j = np.divmod(best, slot.shape[1])
    return gain[lr, best], slot[lr, j], c[lr, i]


def _best_swap(st, shape: Shape, layers, goal, h):
    """Per row: (gain, slot a, slot b) of the best swap off GPU h."""
    k, n = shape.k, layers.size
    lr, col = np.arange(n), layers[:, None]
    a = h[:, None] * k + np.arange(k)
    b = (partners(st.load[layers], shape, False, h)[:, :, None] * k + np.arange(k)).reshape(n, -1)
    ga, gb = a // k, b // k
    ea, eb = st.p2l[col, a], st.p2l[col, b]
    delta = st.slot_load[col, a][:, :, None] - st.slot_load[col, b][:, None, :]
    la, lb = st.load[col, ga][:, :, None], st.load[col, gb][:, None, :]
    change = _excess(la - delta, goal) - _excess(la, goal) + _excess(lb + delta, goal) - _excess(lb, goal)
    ok = (ga[:, :, None] != gb[:, None, :]) & ~st.has[layers[:, None, None], ga[:, :, None], eb[:, None, :]]
    ok &= ~st.has[layers[:, None, None], gb[:, None, :], ea[:, :, None]]
    if shape.nodes > 1:
        cross = shape.gpu_node[ga][:, :, None] != shape.gpu_node[gb][:, None, :]
        ok &= ~(cross & (pinned(st, shape, col, ea, ga)[:, :, None] | pinned(st, shape, col, eb, gb)[:, None, :]))
    gain = np.where(ok, -change, -np.inf).reshape(n, -1)
    best = gain.argmax(1)
    i, j = np.divmod(best, b.shape[1])
    return gain[lr, best], a[lr, i], b[lr, j]
