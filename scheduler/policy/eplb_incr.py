"""Incremental EPLB: repair the current placement for a new window with few expert moves.

After loads drift, a GPU is over its goal mostly because some of its experts grew, and an
expert's replicas sit on several GPUs that all grew with it. So the repair measures each
change by how much it takes off the excess over the goal summed over *all* GPUs, per slot it
newly rewrites (a slot that already differs from where the repair started costs a fraction:
rewriting it again moves no more weights); each round every one of a layer's few heaviest
GPUs picks its best change, and those touching disjoint GPUs and experts are made:
- split (one slot): an expert held by a heavy GPU gets one more replica, over a replica of an
  expert that can spare one (relieving every holder of the first at once);
- swap (two slots): a replica of a heavy GPU trades places with one of a light GPU;
- rotation (three slots; with few slots per GPU, where a swap is a coarse step): a heavy
  GPU's replica goes to a light GPU, whose replica goes to a second heavy GPU, whose replica
  goes to the first: two heavy GPUs relieved for three slots.
Splits are also offered for the coldest experts onto heavy GPUs (the count moves back where
a hot expert cooled). When no change lowers a layer's excess and its heaviest GPU is still
over the goal, the planner's own search (frugal mode) works on that GPU alone.
"""

from __future__ import annotations

import numpy as np

from .eplb_moves import partners, pinned
from .eplb_pack import Shape
from .eplb_pairs import MAX_K
from .eplb_search import SearchState, apply_swap, apply_transfer, search
from .eplb_split import replica_slots

HEAVY = 4  # heavy GPUs per layer whose experts and slots are candidates each round
COLD = 4  # coldest experts offered as new replicas on heavy GPUs
ROTATION_BUDGET = 128  # as PAIR_BUDGET for the light GPUs of a rotation: half, as it has a third slot
FREE_REWRITE = 0.25  # what rewriting an already rewritten slot costs, in slots (it is work, not a move)
FRUGAL_STALL = 2e-4  # the repair works every last gain out of a layer: a fallback costs far more moves


def repair(w: np.ndarray, p2l: np.ndarray, shape: Shape, goal: np.ndarray, max_rounds: int | None = None,
           start: np.ndarray | None = None) -> SearchState:
    """The placement ``p2l`` changed until each layer's heaviest GPU is <= goal, or no single
    change lowers the layer's excess. Moves are counted against ``start`` (default: p2l,
    the current placement): a slot that already differs from it costs a fraction to rewrite."""
    st = SearchState.build(p2l, w, shape)
    start = np.array(p2l if start is None else start)
    active = np.arange(w.shape[0])
    for _ in range(max_rounds if max_rounds is not None else 2 * shape.slots):
        active = active[st.load[active].max(1) > goal[active]]
        if active.size == 0:
            break
        active = active[_repair_round(st, shape, active, goal[active], start)]
    return search(st, shape, goal, frugal=True, stall=FRUGAL_STALL)  # what excess cannot see: the heaviest alone


def _excess(load: np.ndarray, goal: np.ndarray) -> np.ndarray:
    return np.maximum(load - goal.reshape((-1,) + (1,) * (load.ndim - 1)), 0.0)


def _repair_round(st: SearchState, shape: Shape, layers: np.ndarray, goal: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Per heavy GPU of each layer, its best change by gain per slot it newly rewrites (a
    slot ``start`` already lost costs a fraction); those that touch disjoint GPUs and
    experts are made together. Returns which layers moved."""
    n, t = layers.size, min(HEAVY, shape.gpus)
    heavy = np.argsort(-st.load[layers], axis=1)[:, :t]
    rows, h, g_rows = np.repeat(layers, t), heavy.ravel(), np.repeat(goal, t)
    where = replica_slots(st.p2l[layers], st.w.shape[1])
    w, r = st.w[layers], st.r[layers]
    per_row = np.repeat(np.arange(n), t)
    relief = _holder_change(st, shape, layers, goal, where, -w / (r * (r + 1.0)))[per_row]
    burden = _holder_change(st, shape, layers, goal, where, w / np.maximum(r * (r - 1.0), 1.0))[per_row]
    sp_gain, sp_slot, sp_c = _best_split(st, shape, rows, g_rows, h, relief, burden, start[rows])
    sw_gain, sa, sb = _best_swap(st, shape, rows, g_rows, h, start[rows])
    if shape.k <= MAX_K:  # with more slots per GPU swaps are fine enough, and rotations many
        others = np.repeat(heavy, t, axis=0)  # (rows, t): the layer's heavy GPUs, h among them
        rot_gain, ra, rb, rc = _best_rotation(st, shape, rows, g_rows, h, others, start[rows])
    else:
        rot_gain, ra, rb, rc = np.full(rows.size, -np.inf), sa, sa, sa
    best = np.maximum(np.maximum(sp_gain, sw_gain), rot_gain)
    use_split = sp_gain >= best
    use_rotation = ~use_split & (rot_gain >= best)
    gain = best > 1e-12 * g_rows
    gpus, experts = _touched(st, shape, rows, where, per_row, use_split, sp_slot, sp_c, sa, sb)
    gpus[use_rotation] = False
    for slot in (ra, rb, rc):
        gpus[np.arange(rows.size), slot // shape.k] |= use_rotation
    rotated = st.p2l[rows[:, None], np.stack([ra, rb, rc], axis=1)]
    experts = np.where(use_rotation[:, None], rotated, np.concatenate([experts, experts[:, :1]], axis=1))
    keep = _independent(np.where(gain, best, -np.inf).reshape(n, t),
                        gpus.reshape(n, t, -1), experts.reshape(n, t, -1)).ravel()
    sp, ro = keep & use_split, keep & use_rotation
    sw = keep & ~use_split & ~use_rotation
    apply_transfer(st, shape, rows[sp], sp_slot[sp], sp_c[sp], count=False)
    st.splits += int(sp.sum())
    apply_swap(st, shape, rows[sw], sa[sw], sb[sw])
    apply_swap(st, shape, rows[ro], ra[ro], rb[ro])  # h takes b's replica, g takes h's
    apply_swap(st, shape, rows[ro], ra[ro], rc[ro])  # then h and h2 trade: h2 ends with b's
    return keep.reshape(n, t).any(1)


def _best_rotation(st, shape: Shape, layers, goal, h, others, start):
    """Per row: (gain per newly rewritten slot, slot a on h, slot b on a light GPU g, slot c
    on another heavy GPU h2) of the best rotation a -> g, b -> h2, c -> h: three slots for
    two heavy GPUs relieved at once, where a swap relieves one for two slots. ``others``
    (rows, t): candidates for h2. Arrays below are (rows, a, b, c)."""
    k, n = shape.k, layers.size
    lr, col = np.arange(n), layers[:, None]
    a = h[:, None] * k + np.arange(k)
    light = partners(st.load[layers], shape, False, h, budget=ROTATION_BUDGET)
    b = (light[:, :, None] * k + np.arange(k)).reshape(n, -1)
    c = (others[:, :, None] * k + np.arange(k)).reshape(n, -1)
    A, B, C = (lambda x: x[:, :, None, None]), (lambda x: x[:, None, :, None]), (lambda x: x[:, None, None, :])
    (ea, eb, ec), (la, lb, lc) = ((st.p2l[col, x] for x in (a, b, c)), (st.slot_load[col, x] for x in (a, b, c)))
    ga, gb, gc = a // k, b // k, c // k
    lh, lg, lh2 = st.load[layers, h][:, None, None, None], B(st.load[col, gb]), C(st.load[col, gc])
    change = (_excess(lh - A(la) + C(lc), goal) - _excess(lh, goal) + _excess(lg + A(la) - B(lb), goal)
              - _excess(lg, goal) + _excess(lh2 + B(lb) - C(lc), goal) - _excess(lh2, goal))
    layer, hh = layers[:, None, None, None], h[:, None, None, None]
    ok = (B(gb) != hh) & (C(gc) != hh) & (B(gb) != C(gc))
    ok = ok & ~st.has[layer, B(gb), A(ea)] & ~st.has[layer, C(gc), B(eb)] & ~st.has[layer, hh, C(ec)]
    ok &= ~st.has[layer, hh, B(eb)]  # h holds b's replica between the two swaps that make the rotation
    if shape.nodes > 1:  # a home replica's last copy stays on its node
        node = shape.gpu_node
        ok &= ~(A(pinned(st, shape, col, ea, ga)) & (A(node[ga]) != B(node[gb])))
        ok &= ~(B(pinned(st, shape, col, eb, gb)) & (B(node[gb]) != C(node[gc])))
        ok &= ~(C(pinned(st, shape, col, ec, gc)) & (C(node[gc]) != A(node[ga])))
    sa, sb, sc = (np.take_along_axis(start, x, 1) for x in (a, b, c))
    rewrites = ((C(ec) != A(sa)).astype(np.float64) - A(ea != sa) + (A(ea) != B(sb)) - B(eb != sb)
                + (B(eb) != C(sc)) - C(ec != sc))
    gain = np.where(ok, -change / (np.maximum(rewrites, 0.0) + FREE_REWRITE), -np.inf).reshape(n, -1)
    best = gain.argmax(1)
    i, j, q = np.unravel_index(best, (a.shape[1], b.shape[1], c.shape[1]))
    return gain[lr, best], a[lr, i], b[lr, j], c[lr, q]


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


def _best_split(st, shape: Shape, layers, goal, h, relief, burden, start):
    """Per row: (gain per newly rewritten slot, slot, expert) of the best split: expert c
    gets a replica over slot s; c is one of h's experts or one of the coldest.
    ``relief``/``burden`` (rows, experts): the excess change on an expert's holders if it
    gains/loses a replica; ``start`` as in ``_best_swap``."""
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
    was = np.take_along_axis(start, slot, 1)[:, None, :]
    rewrites = (c[:, :, None] != was).astype(np.float64) - (d[:, None, :] != was)
    gain = np.where(ok, -change / (np.maximum(rewrites, 0.0) + FREE_REWRITE), -np.inf).reshape(n, -1)
    best = gain.argmax(1)
    i, j = np.divmod(best, slot.shape[1])
    return gain[lr, best], slot[lr, j], c[lr, i]


def _best_swap(st, shape: Shape, layers, goal, h, start):
    """Per row: (gain per newly rewritten slot, slot a, slot b) of the best swap off GPU h;
    ``start`` (rows, slots) is the layout moves are counted against."""
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
    sa, sb = np.take_along_axis(start, a, 1)[:, :, None], np.take_along_axis(start, b, 1)[:, None, :]
    was_a, was_b = (ea != sa[..., 0])[:, :, None], (eb != sb[:, 0])[:, None, :]  # already rewritten
    rewrites = (eb[:, None, :] != sa).astype(np.float64) + (ea[:, :, None] != sb) - was_a - was_b
    gain = np.where(ok, -change / (np.maximum(rewrites, 0.0) + FREE_REWRITE), -np.inf).reshape(n, -1)
    best = gain.argmax(1)
    i, j = np.divmod(best, b.shape[1])
    return gain[lr, best], a[lr, i], b[lr, j]
