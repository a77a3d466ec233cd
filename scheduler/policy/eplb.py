"""Expert-parallel load balancing (EPLB) planner: where each MoE layer's expert replicas go.

Input: per-layer per-expert token counts over a window, the machine (``Topology``: experts,
physical expert slots, EP ranks = GPUs, nodes), and optionally the placement now in use.
Output: a ``Plan`` — the new ``Placement``, the expert moves it implies relative to the
current one, and its balancedness. The EPLB actor (runtime side) and the simulator drive this
same function; it is pure numpy.

Rules every placement keeps: each GPU has ``slots / ranks`` slots; no GPU holds two replicas
of one expert; experts split into ``nodes`` contiguous groups and group g's experts each keep
a replica on node g (their home, so token traffic mostly stays inside a node), while redundant
replicas may spill to other nodes.

Fresh plan: replica counts greedily by what bounds the heaviest GPU (``eplb_count``); with
several nodes, each replica's node is dealt and nodes whose own experts are heavy trade pool
replicas for fillers (``eplb_nodes``); each node's replicas go to its GPUs by balanced
largest differencing, replicated experts' spread one per GPU (``eplb_pack``); with few slots
per GPU, paired GPUs re-split their replicas (``eplb_pairs``); then a local search levels the
GPUs and makes every GPU hold a replicated expert, so the per-batch split can relieve it
(``eplb_search``, ``eplb_moves``). With several nodes and k <= RESPLIT_K slots per GPU
(EP64 at 256, EP72 at 288 slots) a node's packing is what limits the heaviest GPU, so the
nodes are dealt by their packing bound (``eplb_nodes.level_nodes``) and every pair of a
node's GPUs re-splits (``eplb_pack.resplit``), before and after a short search, in place of
the heaviest-lightest pairs. Everything works on all layers at once (numpy arrays
with a leading layer axis), which is what keeps 61 layers within the planner's 100 ms
budget on one core. With a current placement, GPUs and
slots are renumbered to keep what stays (``eplb_align``). Incremental plan: the fresh plan
is the reference; the current placement is repaired until each layer is within ``eps`` of
it, with as few moves as it can (``eplb_incr``); where a node's own experts outgrew its GPUs
and the repair gets stuck, the repair starts instead from the current layout given the fresh
plan's replicas node by node (``eplb_adopt``), or from its own result with each node's pairs
re-split counting moves (``eplb_level``); every candidate then puts back what it can of the
current layout while it stays within ``eps`` (``eplb_level.settle``), and the one with the
fewest moves wins, layer by layer.

Balancedness = mean / max of tokens per GPU in a forward pass, averaged over layers (also
given as the sum of means over the sum of maxima).
"""

from __future__ import annotations

import attrs
import numpy as np

from .eplb_adopt import adopt, adopt_fresh_nodes, fewest_moves, heavy_nodes
from .eplb_align import align, moves
from .eplb_count import greedy_counts, hold_terms, home_nodes, node_sums, partition_bound, relaxed_bound, relaxed_value
from .eplb_incr import repair
from .eplb_level import resplit_frugal, settle
from .eplb_nodes import plan_nodes
from .eplb_pairs import MAX_K, _splits, repartition
from .eplb_pack import RESPLIT_K, Shape, balanced_pack, sorted_items
from .eplb_split import SPLITS, replica_counts, replica_slots, split_loads
from .eplb_search import SearchState, cover, resplit_nodes, search

SEARCH_ROUNDS = 16  # a fresh plan's search rounds: the last gains are tiny, the rounds are not
SEARCH_ROUNDS_PAIRED = 6  # the same after pairs were re-split (few slots per GPU)
GOAL_SHARE = 0.5  # the repair aims this far into the eps window (settling then uses the rest)
EXTRA_SHARES = (0.0, 0.25, 0.75, 0.95)  # where the first repair fails, others aim here: each stalls elsewhere
SEARCH_ROUNDS_RESPLIT = 1  # the same after every pair of each node's GPUs was (several nodes, k <= RESPLIT_K)

__all__ = ["SPLITS", "Balancedness", "Placement", "Plan", "Topology", "bound", "evaluate", "naive", "plan"]


@attrs.frozen
class Topology:
    experts: int  # logical experts per MoE layer
    slots: int  # physical expert slots per layer, over all GPUs
    ranks: int  # EP size: GPUs
    nodes: int = 1  # nodes (or NVLink domains); 1 = no home-node rule

    def __attrs_post_init__(self) -> None:
        e, s, g, n = self.experts, self.slots, self.ranks, self.nodes
        if min(e, s, g, n) < 1 or s % g or g % n:
            raise ValueError(f"need slots % ranks == 0 and ranks % nodes == 0, all >= 1; got {self}")
        if s < e or s > e * g:
            raise ValueError(f"slots must be in [experts, experts * ranks] (one replica per GPU); got {self}")
        if (self.shape().spare() < 0).any():
            raise ValueError(f"each node needs a slot for each of its {e}/{n} experts; got {self}")

    @property
    def slots_per_rank(self) -> int:
        return self.slots // self.ranks

    def home(self) -> np.ndarray:
        """(experts,) home node of each expert: contiguous groups, sizes differing by <= 1."""
        return home_nodes(self.experts, self.nodes)

    def shape(self) -> Shape:
        return Shape(self.slots, self.ranks, self.nodes, self.home())


@attrs.frozen(eq=False)
class Placement:
    phy2log: np.ndarray  # (layers, slots) int64: expert in each slot; slot s on GPU s // k
    log2phy: np.ndarray  # (layers, experts, max replicas) int64: slots of each expert, -1 pad
    replicas: np.ndarray  # (layers, experts) int64

    @classmethod
    def from_phy2log(cls, phy2log: np.ndarray, experts: int) -> Placement:
        p2l = np.array(phy2log, dtype=np.int64)
        if p2l.ndim != 2 or p2l.size and (p2l.min() < 0 or p2l.max() >= experts):
            raise ValueError(f"phy2log must be (layers, slots) with ids in [0, {experts}); got shape {p2l.shape}")
        arrays = (p2l, replica_slots(p2l, experts), replica_counts(p2l, experts))
        for a in arrays:
            a.setflags(write=False)
        return cls(*arrays)

    @property
    def layers(self) -> int:
        return self.phy2log.shape[0]

    def violations(self, topo: Topology) -> list[str]:
        """What breaks the placement rules for ``topo`` (empty if none)."""
        p2l, k = self.phy2log, topo.slots_per_rank
        if p2l.shape[1] != topo.slots or self.replicas.shape[1] != topo.experts:
            return [f"shape {p2l.shape} does not fit {topo}"]
        out = []
        if (self.replicas < 1).any():
            out.append("an expert has no replica")
        per_gpu = np.sort(p2l.reshape(self.layers, topo.ranks, k), axis=2)
        if (per_gpu[..., 1:] == per_gpu[..., :-1]).any():
            out.append("a GPU holds two replicas of one expert")
        node = (np.arange(topo.slots) // k) // (topo.ranks // topo.nodes)
        at_home = np.zeros(self.replicas.shape, dtype=np.int64)
        np.add.at(at_home, (np.arange(self.layers)[:, None], p2l), topo.home()[p2l] == node)
        if (at_home < 1).any():
            out.append("an expert has no replica on its home node")
        return out

    def check_integrity(self, topo: Topology) -> None:
        bad = self.violations(topo)
        assert not bad, "; ".join(bad)


@attrs.frozen(eq=False)
class Balancedness:
    per_layer: np.ndarray  # (layers,) mean / max tokens per GPU
    mean: float  # averaged over layers: the headline figure
    ratio_of_sums: float  # sum of means / sum of maxima over layers

    @classmethod
    def of(cls, gpu_tokens: np.ndarray) -> Balancedness:
        mean, top = gpu_tokens.mean(1), gpu_tokens.max(1)
        return cls.from_max(mean, top)

    @classmethod
    def from_max(cls, mean: np.ndarray, top: np.ndarray) -> Balancedness:
        """From per-layer mean and max GPU load (an idle layer counts as balanced)."""
        per = np.where(top > 0, mean / np.where(top > 0, top, 1.0), 1.0)
        total = float(top.sum())
        return cls(per, float(per.mean()), float(mean.sum()) / total if total > 0 else 1.0)


@attrs.frozen(eq=False)
class Plan:
    placement: Placement
    moves: np.ndarray  # (n, 4) int64: layer, slot, old expert, new expert (none if no current)
    balancedness: Balancedness  # on the planning window, even split
    swaps: int  # swaps the local search made (two moves each)
    transfers: int  # replica transfers it made (one move each)
    fills: int  # fills it made (two moves each)
    splits: int  # splits it made (one move each)


def plan(load: np.ndarray, topo: Topology, current: Placement | None = None, *,
         incremental: bool = False, eps: float = 0.01, tol: float = 0.005) -> Plan:
    """Place each layer's replicas for ``load`` (layers, experts) tokens per expert.

    A fresh plan's search stops within ``tol`` (relative) of what its replica counts allow;
    with ``current`` it is renumbered to keep as much of it as it can. ``incremental`` instead
    repairs ``current`` until each layer's heaviest GPU is within ``eps`` of the fresh plan's
    (which stands in for the bound), with as few moves as it can; a layer it cannot repair
    so is repaired from the fresh plan's replicas node by node, or takes the fresh plan's
    nodes it has to (``_incremental``).
    """
    w = _check_load(load, topo)
    if current is not None:
        _check_current(current, topo, w.shape[0])
    elif incremental:
        raise ValueError("incremental planning needs the current placement")
    shape = topo.shape()
    state = _fresh(w, topo, shape, tol)
    p2l = state.p2l if current is None else align(state.p2l, current.phy2log, shape)
    if incremental:
        state, p2l = _incremental(w, current.phy2log, shape, state.load.max(1), eps, p2l)
    placement = Placement.from_phy2log(p2l, topo.experts)
    moved = moves(current.phy2log, p2l) if current is not None else np.zeros((0, 4), np.int64)
    return Plan(placement, moved, evaluate(placement, w, topo), state.swaps, state.transfers, state.fills, state.splits)


def _incremental(w, old: np.ndarray, shape: Shape, fresh_top: np.ndarray, eps: float, fresh: np.ndarray):
    """Per layer, the fewest moves among: the repair of ``old``; where that ends beyond
    ``eps`` of the fresh plan's heaviest GPU and there are several nodes, the repairs of
    ``old`` aiming at other points of the window (``EXTRA_SHARES``), from ``old`` given the
    fresh plan's replicas on its heavy nodes and on all nodes (``eplb_adopt``), and from the
    first repair with each node's pairs re-split (``eplb_level``); each only if it ends
    within ``eps``. Else the per-node mix of levelled and fresh nodes, which always is (or,
    with one node, the fresh plan). Each then has replicas put back where they were while
    it stays within ``eps`` (``settle``). The state returned (for the plan's change counts)
    is the first repair's."""
    goal, cap = fresh_top * (1 + eps * GOAL_SHARE), fresh_top * (1 + eps)
    state = repair(w, old, shape, goal)
    tries, ok = [state.p2l], [state.load.max(1) <= cap]
    rows = np.flatnonzero(~ok[0])
    fallback = fresh.copy()
    if shape.nodes > 1 and rows.size:
        w_, old_, fresh_, goal_, cap_ = w[rows], old[rows], fresh[rows], goal[rows], cap[rows]
        starts = [(old_, fresh_top[rows] * (1 + eps * share)) for share in EXTRA_SHARES]
        starts += [(adopt(w_, old_, fresh_, shape, where), goal_) for where in (heavy_nodes(w_, old_, shape, goal_), None)]
        if 2 <= shape.k <= RESPLIT_K and shape.gpus > shape.nodes:
            starts.append((resplit_frugal(w_, state.p2l[rows], old_, shape, goal_), goal_))
        for begin, aim in starts:
            st = repair(w_, begin, shape, aim, start=old_)
            p2l, within = state.p2l.copy(), np.zeros(w.shape[0], dtype=bool)
            p2l[rows], within[rows] = st.p2l, st.load.max(1) <= cap_
            tries.append(p2l)
            ok.append(within)
        fallback[rows] = adopt_fresh_nodes(w_, old_, fresh_, shape, goal_, cap_, bases=tuple(t[rows] for t in tries))
    settled = [_settle_where(w, p, old, shape, cap, within) for p, within in zip(tries, ok)]
    fallback = _settle_where(w, fallback, old, shape, cap, np.isin(np.arange(w.shape[0]), rows))
    return state, fewest_moves(old, settled, ok, fallback)


def _settle_where(w, p2l: np.ndarray, old: np.ndarray, shape: Shape, cap: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``p2l`` with the layers ``rows`` (bool) settled (``eplb_level.settle``): the others are
    not in the running."""
    out = p2l.copy()
    if rows.any():
        out[rows] = settle(w[rows], p2l[rows], old[rows], shape, cap[rows])
    return out


def _greedy(w: np.ndarray, topo: Topology) -> np.ndarray:
    # the GPU holding a replica also holds k - 1 others: at least the coldest experts' loads
    k = topo.slots_per_rank
    companions = np.sort(w, axis=1)[:, : k - 1].sum(1) if topo.nodes > 1 else 0.0
    return greedy_counts(w, topo.slots, topo.home(), topo.nodes, topo.ranks, companions)


def _fresh(w: np.ndarray, topo: Topology, shape: Shape, tol: float) -> SearchState:
    r = _greedy(w, topo)
    per_node = shape.gpus // shape.nodes
    splits = _splits(shape.k) if topo.nodes > 1 and 2 <= shape.k <= RESPLIT_K and per_node >= 2 else None
    if topo.nodes > 1:
        r, deal = plan_nodes(w, r, shape, level=splits is not None)
        items, load, node_of = deal.items, deal.load, deal.node_of
    else:
        items, load, _ = sorted_items(w / r, r)
        node_of = np.zeros_like(items)
    lead = np.take_along_axis(r, items, 1) >= 2  # replicas of replicated experts: one per GPU
    state = SearchState.build(balanced_pack(items, load, node_of, shape, lead, splits), w, shape)
    if splits is None:
        repartition(state, shape)
        rounds = SEARCH_ROUNDS_PAIRED if shape.k <= MAX_K else SEARCH_ROUNDS
    else:
        rounds = SEARCH_ROUNDS_RESPLIT
    state = search(state, shape, _floor(w, state.r, topo) * (1 + tol), max_rounds=rounds)
    if splits is not None:  # the re-split evens pairs without regard to cover: cover last
        state = resplit_nodes(state, shape, splits)
    return cover(state, shape)


def _floor(w: np.ndarray, r: np.ndarray, topo: Topology) -> np.ndarray:
    """Per layer, a load the heaviest GPU cannot go below with these replica counts: where
    the search may stop. The GPU holding the largest replica also holds k - 1 others."""
    if topo.slots == topo.experts:
        return np.maximum(relaxed_value(w, r, topo.home(), topo.nodes, topo.ranks),
                          partition_bound(w, topo.slots, topo.nodes, topo.ranks))
    per = np.sort(w / r, axis=1)
    k = topo.slots_per_rank
    return np.maximum(relaxed_value(w, r, topo.home(), topo.nodes, topo.ranks), per[:, -1] + per[:, : k - 1].sum(1))


def evaluate(placement: Placement, load: np.ndarray, topo: Topology, split: str = "even") -> Balancedness:
    """Balancedness of ``placement`` on ``load`` with tokens split among replicas as
    ``split`` says (see ``eplb_split``: "even" or "proportional")."""
    w = _check_load(load, topo)
    if placement.layers != w.shape[0]:
        raise ValueError(f"placement has {placement.layers} layers, load has {w.shape[0]}")
    return Balancedness.of(split_loads(placement.phy2log, w, topo.ranks, split))


def bound(load: np.ndarray, topo: Topology) -> Balancedness:
    """An upper bound on the balancedness of any placement of ``load`` under the rules, with
    an even split: mean over a lower bound on the heaviest GPU that holds for every choice of
    replica counts (see ``eplb_count``: mean GPU load, largest load per replica, each node's
    own experts' share, at most one replica per GPU; with no redundant slots also the
    k-per-GPU partition bound of each node); with several nodes also what the nodes can
    take in, k slots to a GPU (``absorb_bound``)."""
    w = _check_load(load, topo)
    low = relaxed_bound(w, topo.slots, topo.home(), topo.nodes, topo.ranks)
    if topo.slots == topo.experts:
        low = np.maximum(low, partition_bound(w, topo.slots, topo.nodes, topo.ranks))
    return Balancedness.from_max(w.sum(1) / topo.ranks, np.maximum(low, absorb_bound(w, topo)))


def absorb_bound(w: np.ndarray, topo: Topology, iters: int = 50) -> np.ndarray:
    """Per layer, a lower bound on the heaviest GPU T from what each node can take in. Node
    n's g GPUs carry at most g T. Its replicas of its own experts carry at most own_n, their
    tokens; every other slot (``spare``: each own expert keeps one there) holds at most one
    replica of another node's expert f, which has a replica at home too, so carries at most
    min(T, w_f / 2). With few slots per GPU a node carries less still: the GPUs holding a
    replica of another node's expert, or of one of its own hottest x, are at most spare + x
    and each at most T, and the others hold only the node's remaining experts, less the
    coldest that share the first GPUs (``eplb_count.hold_terms``). So W <= sum over n of the
    least of these, half_n the largest w_f / 2 of the other nodes' experts; the right side
    grows with T, and the least T that fits is found from below by bisection. It binds where
    the light nodes have too few spare slots for the load the heavy ones must shed, or a
    node too few to keep its hot experts' small replicas home (EP72 on 9 nodes, 288 slots)."""
    per = topo.ranks // topo.nodes
    home = topo.home()
    own = node_sums(w, home, topo.nodes)
    spare = topo.shape().spare()
    total = w.sum(1)
    others = home[None, :] != np.arange(topo.nodes)[:, None]  # (nodes, experts)
    half = np.where(others[None], w[:, None, :], 0.0).max(2) / 2  # (layers, nodes)
    held = hold_terms(w, home, topo.nodes, per, topo.slots_per_rank, spare)
    b = np.arange(per + 1, dtype=np.float64)
    lo = total / topo.ranks  # the mean: the right side is at most W there
    hi = np.maximum(own.max(1) / per, lo)  # every node holding its own: the right side is W
    for _ in range(iters):
        mid = (lo + hi) / 2
        t = mid[:, None]
        cap = np.minimum(per * t, own + spare * np.minimum(t, half))
        cap = np.minimum(cap, (b * t[..., None, None] + held).max(3).min(2))
        fits = cap.sum(1) >= total
        hi, lo = np.where(fits, mid, hi), np.where(fits, lo, mid)
    return lo


def naive(topo: Topology, layers: int) -> Placement:
    """Slot s holds expert s mod experts, slots contiguous per GPU: the layout with no
    balancing (it ignores home nodes when there are redundant slots)."""
    p2l = np.tile(np.arange(topo.slots) % topo.experts, (layers, 1))
    return Placement.from_phy2log(p2l, topo.experts)


def _check_load(load: np.ndarray, topo: Topology) -> np.ndarray:
    w = np.asarray(load, dtype=np.float64)
    if w.ndim != 2 or w.shape[1] != topo.experts:
        raise ValueError(f"load must be (layers, {topo.experts}) tokens per expert; got shape {w.shape}")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("load must be finite and >= 0")
    return w


def _check_current(current: Placement, topo: Topology, layers: int) -> None:
    if current.layers != layers:
        raise ValueError(f"current placement has {current.layers} layers, load has {layers}")
    bad = current.violations(topo)
    if bad:
        raise ValueError(f"current placement breaks the rules ({'; '.join(bad)}): plan fresh instead")
