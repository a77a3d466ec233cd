"""Local search for the EPLB planner: level the GPUs of a placement by small changes.

``search`` works off the heaviest GPUs of every layer still above its target: each round,
each of a layer's few heaviest GPUs makes its best swap with one of the lightest GPUs;
changes made in the same round touch disjoint GPUs and experts, so each one's check stays
true. Only when that finds nothing does the heaviest GPU look at all GPUs and at transfers
and fills (``eplb_moves``). A layer leaves the search when its heaviest GPU is within
target, or when even that finds nothing.
"""

from __future__ import annotations

import attrs
import numpy as np

from .eplb_moves import best_cover_swap, best_fill, best_split, best_swap, best_transfer
from .eplb_pack import Shape, gpu_loads, resplit
from .eplb_split import replica_counts, replica_slots


@attrs.define
class SearchState:
    """Mutable search state; built from a placement, owned by one search."""

    w: np.ndarray  # (layers, experts) tokens per expert
    r: np.ndarray  # (layers, experts) replicas
    p2l: np.ndarray  # (layers, slots) expert in each slot
    slot_load: np.ndarray  # (layers, slots) tokens of the replica in each slot
    load: np.ndarray  # (layers, gpus)
    has: np.ndarray  # (layers, gpus, experts) bool
    at_home: np.ndarray  # (layers, experts) replicas on the expert's home node
    swaps: int = 0
    transfers: int = 0
    fills: int = 0
    splits: int = 0

    @classmethod
    def build(cls, p2l: np.ndarray, w: np.ndarray, shape: Shape) -> SearchState:
        layers, slots = p2l.shape
        r = replica_counts(p2l, w.shape[1])
        has = np.zeros((layers, shape.gpus, w.shape[1]), dtype=bool)
        has[np.arange(layers)[:, None], np.arange(slots)[None, :] // shape.k, p2l] = True
        home_gpu = shape.gpu_node[:, None] == shape.home[None, :]  # (gpus, experts)
        at_home = (has & home_gpu[None]).sum(1)
        slot_load = np.take_along_axis(w / r, p2l, 1)
        return cls(w, r, p2l.copy(), slot_load, gpu_loads(slot_load, shape.gpus), has, at_home)

    def refresh(self, layers: np.ndarray, gpus: int) -> None:
        """Recompute the loads of these layers from scratch (after counts changed)."""
        self.slot_load[layers] = np.take_along_axis(self.w[layers] / self.r[layers], self.p2l[layers], 1)
        self.load[layers] = gpu_loads(self.slot_load[layers], gpus)


def search(st: SearchState, shape: Shape, target: np.ndarray, heavy: int | None = None,
           band: float = 3e-3, stall: float = 3e-3, frugal: bool = False,
           max_rounds: int | None = None) -> SearchState:
    """Improve until every layer's heaviest GPU is <= target (per layer) or nothing helps.

    Narrow rounds swap off up to ``heavy`` GPUs within ``band`` of a layer's heaviest, with
    the lightest GPUs as partners. A layer where none of them found a swap gets a wide round:
    its heaviest GPU alone, all GPUs as partners, transfers and fills allowed; if that finds
    nothing either, the layer is done. So is a layer whose heaviest GPU fell by less than
    ``stall`` (relative) over the last four rounds: the tail of tiny gains is not worth it.
    ``frugal`` (incremental repair) skips the narrow rounds: every change is then the one
    with the most gain per rewritten slot for the heaviest GPU.
    """
    t = heavy if heavy is not None else int(np.clip(shape.gpus // 16, 1, 4))
    active = np.arange(st.p2l.shape[0])
    past = np.repeat(st.load.max(1)[:, None], 4, axis=1) * 2  # maxima of the last 4 rounds
    for i in range(max_rounds if max_rounds is not None else 4 * shape.gpus + 64):
        top = st.load[active].max(1)
        active = active[(top > target[active]) & (top < past[active, i % 4] * (1 - stall))]
        if active.size == 0:
            break
        past[active, i % 4] = st.load[active].max(1)
        moved = np.zeros(active.size, dtype=bool) if frugal else _narrow_round(st, shape, active, t, band)
        stuck = active[~moved]
        if stuck.size:
            done = ~_wide_round(st, shape, stuck)
            active = np.setdiff1d(active, stuck[done], assume_unique=True)
    return st


def _narrow_round(st: SearchState, shape: Shape, layers: np.ndarray, t: int, band: float) -> np.ndarray:
    """Disjoint swaps off the near-heaviest GPUs of each layer; returns which layers moved."""
    n, k = layers.size, shape.k
    order = np.argsort(-st.load[layers], axis=1)[:, :t]
    top = st.load[layers, order[:, 0]]
    near = st.load[layers[:, None], order] >= top[:, None] * (1 - band)
    li, j = np.nonzero(near)  # only rows worth scoring
    rows, h = layers[li], order[li, j]
    score, sa, sb = best_swap(st, shape, rows, h, wide=False)
    ok = np.zeros((n, t), dtype=bool)
    ok[li, j] = score < st.load[rows, h] * (1 - 1e-12)
    gb, ea, eb = (np.full((n, t), -1) for _ in range(3))
    gb[li, j], ea[li, j], eb[li, j] = sb // k, st.p2l[rows, sa], st.p2l[rows, sb]
    keep = _disjoint(ok, order, gb, ea, eb)
    pick = keep[li, j]
    apply_swap(st, shape, rows[pick], sa[pick], sb[pick])
    return keep.any(1)


def _wide_round(st: SearchState, shape: Shape, layers: np.ndarray) -> np.ndarray:
    """The heaviest GPU's best change of any kind against all GPUs; returns which moved.
    Among changes about as good, those that rewrite one slot win over those that rewrite two."""
    h = st.load[layers].argmax(1)
    top = st.load[layers, h]
    s_score, sa, sb = best_swap(st, shape, layers, h, wide=True)
    if shape.slots == st.w.shape[1]:  # no redundant replicas: counts cannot change
        moved = s_score < top * (1 - 1e-12)
        apply_swap(st, shape, layers[moved], sa[moved], sb[moved])
        return moved
    where = replica_slots(st.p2l[layers], st.w.shape[1])
    t_score, t_slot, t_c = best_transfer(st, shape, layers, h, where)
    f_score, f_a, f_b, f_c = best_fill(st, shape, layers, h, where, wide=True)
    p_score, p_slot, p_c = best_split(st, shape, layers, h, where, wide=True)
    one = np.minimum(t_score, p_score)  # one slot rewritten
    two = np.minimum(s_score, f_score)
    single = one <= top - (top - two) * 0.5  # half the gain for half the moves
    best = np.where(single, one, two)
    moved = best < top * (1 - 1e-12)
    tr = moved & single & (t_score <= p_score)
    sp = moved & single & ~tr
    sw = moved & ~single & (s_score <= f_score)
    fi = moved & ~single & ~sw
    apply_swap(st, shape, layers[sw], sa[sw], sb[sw])
    apply_transfer(st, shape, layers[tr], t_slot[tr], t_c[tr])
    apply_transfer(st, shape, layers[sp], p_slot[sp], p_c[sp], count=False)
    apply_swap(st, shape, layers[fi], f_a[fi], f_b[fi], count=False)
    apply_transfer(st, shape, layers[fi], f_a[fi], f_c[fi], count=False)
    st.fills += int(fi.sum())
    st.splits += int(sp.sum())
    return moved


def cover(st: SearchState, shape: Shape, slack: float = 2e-3, heavy: int = 4, rounds: int = 2) -> SearchState:
    """Give every GPU a replica of some replicated expert where the counts allow, by swaps
    that leave the layer's heaviest GPU no heavier than (1 + slack) times what it is now.
    Why: the per-batch token split can only shift load along replicated experts; a GPU
    without one cannot be relieved when its experts grow. Up to ``heavy`` GPUs per layer
    (heaviest first) are served per round, from disjoint partner GPUs."""
    k, layers_all = shape.k, st.p2l.shape[0]
    tried = np.zeros(st.load.shape, dtype=bool)
    for _ in range(rounds):
        rep = (np.take_along_axis(st.r, st.p2l, 1) >= 2).reshape(layers_all, shape.gpus, k).sum(2)
        todo = (rep == 0) & ~tried
        layers = np.flatnonzero(todo.any(1) & (rep >= 2).any(1))
        if layers.size == 0:
            break
        t = min(heavy, shape.gpus)
        h = np.argsort(-np.where(todo[layers], st.load[layers], -np.inf), axis=1)[:, :t]
        rows, hh = np.repeat(layers, t), h.ravel()
        score, sa, sb = best_cover_swap(st, shape, rows, hh, rep[rows] >= 2)
        ok = (score <= st.load[rows].max(1) * (1 + slack)) & todo[rows, hh]
        tried[rows[~ok & todo[rows, hh]], hh[~ok & todo[rows, hh]]] = True
        keep = _disjoint(ok.reshape(-1, t), h, (sb // k).reshape(-1, t), st.p2l[rows, sa].reshape(-1, t),
                         st.p2l[rows, sb].reshape(-1, t)).ravel()
        apply_swap(st, shape, rows[keep], sa[keep], sb[keep])
    return st


def resplit_nodes(st: SearchState, shape: Shape, splits: tuple[np.ndarray, np.ndarray], passes: int = 1,
                  near: float = 3e-3) -> SearchState:
    """Re-split the pairs of GPUs within each node whose heavier GPU is within ``near``
    (relative) of its layer's heaviest (``eplb_pack.resplit``; ``splits`` are ``eplb_pairs``'
    pair splits for k), keeping the state's loads and holdings; the replicas stay on their
    node. After the search: its swaps across nodes leave a node's GPUs less level than its
    packing was."""
    per, k = shape.gpus // shape.nodes, shape.k
    p2l, slot_load = st.p2l.reshape(-1, per, k), st.slot_load.reshape(-1, per, k)
    target = np.repeat(st.load.max(1) * (1 - near), shape.nodes)
    count = resplit(p2l, slot_load, *splits, passes=passes, target=target)
    st.p2l[...], st.slot_load[...] = p2l.reshape(st.p2l.shape), slot_load.reshape(st.slot_load.shape)  # no-op for views
    layers = np.flatnonzero(count.reshape(-1, shape.nodes).any(1))
    if layers.size:
        st.load[layers] = gpu_loads(st.slot_load[layers], shape.gpus)
        st.has[layers] = False
        st.has[layers[:, None], np.arange(shape.slots) // k, st.p2l[layers]] = True
        st.swaps += int(count.sum())
    return st


def _disjoint(ok, h, gb, ea, eb) -> np.ndarray:
    """Keep, heaviest first, the swaps whose partner GPU and experts no kept swap touches."""
    keep = np.zeros_like(ok)
    for j in range(ok.shape[1]):
        clash = (gb[:, j : j + 1] == h).any(1) | ((gb[:, j : j + 1] == gb) & keep).any(1)
        for e in (ea[:, j : j + 1], eb[:, j : j + 1]):
            clash |= (((e == ea) | (e == eb)) & keep).any(1)
        keep[:, j] = ok[:, j] & ~clash
    return keep


def apply_swap(st: SearchState, shape: Shape, layers: np.ndarray, sa: np.ndarray, sb: np.ndarray, count: bool = True) -> None:
    """Exchange the replicas in slots sa and sb (rows touch disjoint GPUs and experts)."""
    ea, eb = st.p2l[layers, sa], st.p2l[layers, sb]
    ga, gb = sa // shape.k, sb // shape.k
    la, lb = st.slot_load[layers, sa], st.slot_load[layers, sb]
    st.p2l[layers, sa], st.p2l[layers, sb] = eb, ea
    st.slot_load[layers, sa], st.slot_load[layers, sb] = lb, la
    st.load[layers, ga] -= la - lb
    st.load[layers, gb] += la - lb
    st.has[layers, ga, ea] = False
    st.has[layers, gb, eb] = False
    st.has[layers, ga, eb] = True
    st.has[layers, gb, ea] = True
    node, home = shape.gpu_node, shape.home
    st.at_home[layers, ea] += (home[ea] == node[gb]).astype(np.int64) - (home[ea] == node[ga])
    st.at_home[layers, eb] += (home[eb] == node[ga]).astype(np.int64) - (home[eb] == node[gb])
    st.swaps += layers.size if count else 0


def apply_transfer(st: SearchState, shape: Shape, layers: np.ndarray, slot: np.ndarray, c: np.ndarray, count: bool = True) -> None:
    """Overwrite each layer's ``slot`` with a replica of expert ``c`` (one per layer)."""
    if layers.size == 0:
        return
    d, g = st.p2l[layers, slot], slot // shape.k
    st.p2l[layers, slot] = c
    st.r[layers, d] -= 1
    st.r[layers, c] += 1
    st.has[layers, g, d] = False
    st.has[layers, g, c] = True
    node, home = shape.gpu_node[g], shape.home
    st.at_home[layers, d] -= home[d] == node
    st.at_home[layers, c] += home[c] == node
    st.refresh(layers, shape.gpus)
    st.transfers += layers.size if count else 0
