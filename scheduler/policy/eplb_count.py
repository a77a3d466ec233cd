"""Replica counts for the EPLB planner, and the lower bound on the heaviest GPU they imply.

Both work on one relaxation of the placement problem. Under an even token split, whatever the
packing, the heaviest GPU of a layer carries at least

    T(r) = max( W / G,                                   the mean GPU load,
                max_e w_e / r_e,                         some GPU holds each replica,
                max_n P_n(r) / (G / nodes) )             node n holds a copy of each of its
                                                         experts: P_n = sum over them of w_e / r_e

with r_e >= 1 replicas of expert e, at most one per GPU (r_e <= G), sum r_e = S. The planner
picks r greedily (``greedy_counts``); ``relaxed_bound`` solves min over r of T(r) exactly, so
it is a valid lower bound on the best plan under the same constraints, slots and home nodes
included. Everything is vectorized over layers: arrays are (layers, experts).

``hold_terms`` is a bound of another kind, for ``eplb.absorb_bound``: what a node's GPUs can
carry when they hold k replicas each and its coldest experts must share GPUs with the rest.
"""

from __future__ import annotations

import numpy as np


def home_nodes(experts: int, nodes: int) -> np.ndarray:
    """Home node of each expert: experts split into ``nodes`` contiguous groups (sizes differ by
    at most one, so 256 experts on 9 nodes works)."""
    return (np.arange(experts) * nodes // experts).astype(np.int64)


def node_sums(x: np.ndarray, home: np.ndarray, nodes: int) -> np.ndarray:
    """(layers, nodes) sums of x over each node's experts (groups are contiguous)."""
    starts = np.searchsorted(home, np.arange(nodes))
    return np.add.reduceat(x, starts, axis=1)


def relaxed_value(w: np.ndarray, r: np.ndarray, home: np.ndarray, nodes: int, gpus: int) -> np.ndarray:
    """T(r) per layer: the relaxation's lower bound on the heaviest GPU for these counts."""
    per = w / r
    node_term = node_sums(per, home, nodes).max(1) * nodes / gpus
    return np.maximum(np.maximum(w.sum(1) / gpus, per.max(1)), node_term)


def greedy_counts(w: np.ndarray, slots: int, home: np.ndarray, nodes: int, gpus: int,
                  companions: np.ndarray | float = 0.0) -> np.ndarray:
    """Replica counts: one extra slot at a time, each to the current bottleneck expert.

    Normally that is the expert with the largest load per replica (greedy by max(w / r) is
    optimal for the largest per-replica load). When a node's primaries alone would overload
    its GPUs, it is the expert of that node whose next replica takes the most load off the
    node, w / (r (r + 1)); that replica may live on another node (or, at its floor, the
    largest load per replica, which makes the items easier to pack). A node counts as
    overloaded only above the largest load per replica plus ``companions`` (per layer): the
    GPU holding that replica also holds k - 1 others. Each step changes one expert per
    layer, so the state is updated in place, not recomputed.
    """
    layers, experts = w.shape
    rows = np.arange(layers)
    r = np.ones(w.shape, dtype=np.int64)
    per = np.where(r < gpus, w, -1.0)  # load per replica; -1 once on every GPU
    mean = w.sum(1) / gpus
    if nodes > 1:
        starts = np.searchsorted(home, np.arange(nodes))
        pos = np.arange(experts) - starts[home]  # place of each expert in its node's group
        size = int(np.bincount(home, minlength=nodes).max())
        node_load = node_sums(w, home, nodes) * (nodes / gpus)
        gain = np.full((layers, nodes, size), -1.0)  # w / (r (r + 1)) laid out by node
        gain[:, home, pos] = np.where(gpus > 1, w / 2.0, -1.0)
    for _ in range(slots - experts):
        e = per.argmax(1)
        if nodes > 1:
            worst = node_load.argmax(1)
            g = gain[rows, worst]
            j = g.argmax(1)
            floor = np.maximum(per[rows, e] + companions, mean)
            use = (node_load[rows, worst] > floor) & (g[rows, j] > 0)
            e = np.where(use, starts[worst] + j, e)
        old = r[rows, e]
        r[rows, e] = new = old + 1
        we = w[rows, e]
        per[rows, e] = np.where(new < gpus, we / new, -1.0)
        if nodes > 1:
            node_load[rows, home[e]] += (we / new - we / old) * (nodes / gpus)
            gain[rows, home[e], pos[e]] = np.where(new < gpus, we / (new * (new + 1.0)), -1.0)
    return r


def _min_count_for(w: np.ndarray, t: np.ndarray, home: np.ndarray, nodes: int, gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """(fewest replicas any r with T(r) <= t can have, feasible), per layer.

    The count never exceeds the true minimum (see ``_node_extra``), so bisection on it
    gives a valid bound.
    """
    with np.errstate(divide="ignore", invalid="ignore"):  # an idle layer has t = 0
        base = np.maximum(np.nan_to_num(np.ceil(w / t[:, None] * (1 - 1e-12)), nan=1.0), 1.0)
    feasible = (base <= gpus).all(1) & (w.sum(1) / gpus <= t)
    base = np.minimum(base, gpus)
    if nodes == 1:
        return base.sum(1), feasible
    extra, node_ok = _node_extra(w, base, t * gpus / nodes, home, nodes, gpus)
    return base.sum(1) + extra, feasible & node_ok


def _counts_at(w: np.ndarray, base: np.ndarray, lam: np.ndarray, gpus: int) -> np.ndarray:
    """Counts after adding every replica whose marginal relief w / (j (j + 1)) is >= lam."""
    j = np.floor((np.sqrt(1.0 + 4.0 * w / lam) - 1.0) / 2.0)
    return np.clip(np.maximum(base, 1.0 + j), 1.0, gpus)


def _node_extra(w, base, cap, home, nodes, gpus, iters: int = 40):
    """Fewest extra replicas so each node's primaries fit its GPUs: sum w / r <= cap.

    Within a node the reliefs w / (j (j + 1)) shrink with j, so the greedy prefix of the
    largest reliefs is optimal for every budget; a threshold lam selects such a prefix.
    Bisection brackets the largest sufficient lam; the count just above the insufficient
    side, plus one, is a lower bound on the minimum (and equal to it for distinct reliefs).
    """
    need = node_sums(w / base, home, nodes) > cap[:, None] * (1 + 1e-12)
    full = np.full_like(base, float(gpus))
    ok = (node_sums(w / full, home, nodes) <= cap[:, None] * (1 + 1e-9)) | ~need
    hi = np.full(need.shape, np.log(max(float(w.max()), 1e-300)) + 1.0)  # no additions above
    lo = np.full(need.shape, np.log(max(float(w[w > 0].min(initial=1.0)), 1e-300)) - 2 * np.log(gpus) - 2.0)
    for _ in range(iters):
        mid = (hi + lo) / 2
        r = _counts_at(w, base, np.exp(mid[:, home]), gpus)
        enough = node_sums(w / r, home, nodes) <= cap[:, None]
        lo = np.where(enough, mid, lo)
        hi = np.where(enough, hi, mid)
    short = _counts_at(w, base, np.exp(hi[:, home]), gpus)  # not enough: the minimum exceeds it
    added = node_sums(short - base, home, nodes) + 1.0
    return np.where(need, added, 0.0).sum(1), ok.all(1)


def relaxed_bound(w: np.ndarray, slots: int, home: np.ndarray, nodes: int, gpus: int, iters: int = 32) -> np.ndarray:
    """min over valid r of T(r), per layer, from below (bisection keeps the infeasible side)."""
    w = np.asarray(w, dtype=np.float64)
    lo = np.maximum(w.sum(1) / gpus, w.max(1) / gpus) * (1 - 1e-9)
    hi = relaxed_value(w, np.ones_like(w), home, nodes, gpus)  # one replica each: feasible
    for _ in range(iters):
        mid = (lo + hi) / 2
        count, feasible = _min_count_for(w, mid, home, nodes, gpus)
        fits = feasible & (count <= slots)
        hi = np.where(fits, mid, hi)
        lo = np.where(fits, lo, mid)
    return lo


def partition_bound(w: np.ndarray, slots: int, nodes: int, gpus: int) -> np.ndarray:
    """Lower bound on the heaviest GPU when there are no redundant slots (slots == experts):
    then every node holds exactly its own experts, k to a GPU. Among a node's j * g + 1
    heaviest experts (g GPUs per node) some GPU holds j + 1; it also holds k - j - 1 more,
    each at least as heavy as the node's lightest. Per layer, the largest such sum."""
    layers, experts = w.shape
    if slots != experts:
        raise ValueError("partition_bound needs slots == experts")
    k, per_node = slots // gpus, gpus // nodes
    items = -np.sort(-w.reshape(layers, nodes, experts // nodes), axis=2)  # heaviest first
    size = items.shape[2]
    best = np.zeros((layers, nodes))
    for j in range(k):
        top = j * per_node + 1
        if top > size:
            break
        tail = items[:, :, size - (k - j - 1) :].sum(2) if k - j - 1 > 0 else 0.0
        best = np.maximum(best, items[:, :, top - j - 1 : top].sum(2) + tail)
    return best.max(1)


def hold_terms(w: np.ndarray, home: np.ndarray, nodes: int, per: int, k: int, spare: np.ndarray) -> np.ndarray:
    """Constants A (layers, nodes, x, b): node n's GPUs carry at most
    min over x of max over b of b T + A[n, x, b], T the layer's heaviest GPU (-inf where b
    is out of range; +inf where x is not tried).

    Why, for any x. Let X be the node's x hottest experts and R the rest of its c own
    experts. Call a replica on the node big if its expert is in X or has another home, and
    let B be the node's GPUs that hold a big one, b = |B|.
    - The node's per k slots hold one replica of each own expert, q replicas of other
      nodes' experts and D more of its own (D_X of X, D_R of R): q + D = spare. The big ones
      number q + x + D_X <= spare + x, so b <= min(per, spare + x); B carries at most b T.
    - Outside B sit only replicas of R. B holds b k - q - x - D_X of them. Expert e of R with
      a_e of its r_e replicas on the node, m_e of them on B, leaves outside B at most
      w_e (a_e - m_e) / r_e <= w_e - w_e m_e / a_e: nothing when m_e = a_e. Summing
      m_e - a_e + 1 (at most 1, and 1 only when m_e = a_e) over R's experts on B gives at
      least b k - q - x - D_X - D_R = b k - spare - x, so as many of R's experts have all
      their node's replicas on B: outside B sits at most own(R) less R's (the node's) that
      many coldest experts.
    x = 0: the GPUs holding another node's replica also hold the node's coldest experts; x > 0:
    a node that must split hot experts into replicas it has too few slots to keep at home.
    With spare + x >= per, b = per gives per T, no better than the plain cap: not tried."""
    layers = w.shape[0]
    size = int(np.bincount(home, minlength=nodes).max())
    out = np.full((layers, nodes, size + 1, per + 1), np.inf)
    b = np.arange(per + 1)
    for n in range(nodes):
        c, s = int((home == n).sum()), int(spare[n])
        cold = np.zeros((layers, c + 1))
        np.cumsum(np.sort(w[:, home == n], axis=1), axis=1, out=cold[:, 1:])  # the j coldest
        for x in range(max(min(per - s, c + 1), 0)):  # spare + x >= per: b = per, only per T
            take = np.clip(b * k - s - x, 0, c - x)
            out[:, n, x] = np.where(b <= s + x, cold[:, c - x, None] - cold[:, take], -np.inf)
    return out
