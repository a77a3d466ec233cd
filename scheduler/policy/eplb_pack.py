"""Packing replicas onto GPUs for the EPLB planner: balanced differencing within each node.

A placement is ``phy2log`` (layers, slots); slot s lives on GPU s // k (k slots per GPU).
Rules every function here keeps: no GPU holds two replicas of one expert, and every expert
keeps at least one replica on its home node (``home``); redundant replicas may sit anywhere.
The differencing loops k - 1 times; each step works on every (layer, node) at once, which is
what keeps a 61-layer plan inside the planner's time budget.

With few slots per GPU (k <= RESPLIT_K) and several nodes, differencing alone leaves a node
well above what its replicas allow (``pack_bound``): then every pair of a node's GPUs
re-splits its 2k replicas as evenly as the rules allow, in round-robin order (``resplit``).
"""

from __future__ import annotations

import attrs
import numpy as np

RESPLIT_K = 4  # slots per GPU up to which a node's pairs of GPUs all re-split: C(7, 3) = 35 splits a pair (k = 5: 126)


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
                  lead: np.ndarray | None = None, splits: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Each node's replicas onto its GPUs, k to a GPU, by balanced largest differencing;
    then undo the few pairings that gave a GPU a second replica of one expert; with
    ``splits`` (``eplb_pairs``' pair splits for k) re-split each node's pairs of GPUs after
    (``resplit``).

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
    out_load = np.take_along_axis(ld, by_gpu, 1).reshape(out.shape)
    _fix_duplicates(out, out_load)
    if splits is not None:
        _resplit_nodes(out, out_load, splits)
    return out.reshape(layers, shape.slots)


def _resplit_nodes(out: np.ndarray, load: np.ndarray, splits) -> None:
    """Re-split the pairs of GPUs of every node (``out``, ``load``: (layers, nodes, gpus per
    node, k), in place), those above the layer's floor only: no packing of these nodes'
    replicas gets the layer's heaviest GPU lower (``pack_bound``)."""
    layers, nodes, per_node, k = out.shape
    desc = -np.sort(-load.reshape(layers, nodes, -1), axis=2)
    top = np.concatenate([np.zeros((layers, nodes, 1)), np.cumsum(desc, axis=2)], axis=2)
    floor = pack_bound(top, k, per_node).max(1)
    resplit(out.reshape(-1, per_node, k), load.reshape(-1, per_node, k), *splits, target=np.repeat(floor, nodes))


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
    place; ``load`` (same shape, optional) the replicas' loads, traded along (in place)."""
    shape = out.shape
    flat = out.reshape(-1, *shape[2:])
    flat_load = None if load is None else load.reshape(flat.shape)
    _trade_duplicates(flat, flat_load)
    if not np.shares_memory(flat, out):
        out[...] = flat.reshape(shape)
    if load is not None and not np.shares_memory(flat_load, load):
        load[...] = flat_load.reshape(shape)


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
            _column_major(out[r], None if load is None else load[r])
        rows, g, i, e, best = rows[found], g[found], i[found], e[found], best[found]
        h, j = np.divmod(best, k)
        out[rows, g, i], out[rows, h, j] = out[rows, h, j], e
        if load is not None:
            load[rows, g, i], load[rows, h, j] = load[rows, h, j], load[rows, g, i]
    raise AssertionError("a repeated replica survived every trade")


def _column_major(gpus: np.ndarray, load: np.ndarray | None = None) -> None:
    """Re-lay one node's replicas so that each expert's are on consecutive GPUs: valid as
    long as no expert has more replicas than the node has GPUs (the node deal sees to it).
    ``load`` (same shape, optional) moves along."""
    order = np.argsort(gpus.ravel(), kind="stable")
    n = gpus.shape[0]
    where = (np.arange(order.size) % n, np.arange(order.size) // n)
    gpus[where] = gpus.ravel()[order]
    if load is not None:
        load[where] = load.ravel()[order]


# --- the packing bound of a node, and all-pairs re-splits (few slots per GPU) -------------------


def pack_bound(top: np.ndarray, k: int, per: int) -> np.ndarray:
    """A lower bound on a node's heaviest GPU (``per`` GPUs of ``k`` slots) from ``top`` (...,
    n + 1): prefix sums of its n = per k items heaviest first. The j GPUs holding its j
    heaviest items (padded to j GPUs) hold (k - 1) j more, at least its lightest; and two of
    its per + 1 heaviest share a GPU with k - 2 more. j = per is the mean."""
    n = top.shape[-1] - 1
    return bound_terms(top[..., bound_positions(n, k, per)], k, per).max(-1)


def bound_positions(n: int, k: int, per: int) -> np.ndarray:
    """Prefix positions ``bound_terms`` reads: top j, all but the (k - 1) j lightest, the
    pair term's three, all but the k - 2 lightest, and all."""
    j = np.arange(1, per + 1)
    return np.concatenate([j, n - (k - 1) * j, [per - 1, per + 1, n - max(k - 2, 0), n]])


def bound_terms(t: np.ndarray, k: int, per: int) -> np.ndarray:
    """The bound's terms (last axis: j = 1 .. per, then the pair term) from the prefix sums
    at ``bound_positions``. An item growing by x raises no order statistic's sum by more than
    x: term j by at most x / j, the pair term by at most x."""
    total = t[..., -1:]
    terms = (t[..., :per] + total - t[..., per : 2 * per]) / np.arange(1, per + 1)
    pair = t[..., 2 * per + 1 : 2 * per + 2] - t[..., 2 * per : 2 * per + 1] + total - t[..., 2 * per + 2 : 2 * per + 3]
    return np.concatenate([terms, pair if k >= 2 else np.full_like(total, -np.inf)], axis=-1)


def round_robin(m: int) -> np.ndarray:
    """(rounds, pairs, 2): every pair of m GPUs once, each round's pairs disjoint (circle
    method; with m odd one GPU sits each round out)."""
    ids = list(range(m + m % 2))
    out = []
    for _ in range(len(ids) - 1):
        out.append([(ids[i], ids[-1 - i]) for i in range(len(ids) // 2) if max(ids[i], ids[-1 - i]) < m])
        ids = [ids[0], ids[-1], *ids[1:-1]]
    return np.array(out, dtype=np.int64).reshape(len(out), -1, 2)


def resplit(items: np.ndarray, load: np.ndarray, side: np.ndarray, together: np.ndarray, passes: int = 2,
            target: np.ndarray | None = None) -> np.ndarray:
    """Re-split pairs of GPUs of each row (a node) as evenly as the rules allow, every pair
    in round-robin order, for ``passes`` passes or until no pair of a row improves. ``items``,
    ``load``: (rows, m, k), changed in place; ``side``, ``together``: the pair splits
    (``eplb_pairs``); ``target`` (rows,): a pair whose heavier GPU is within it is left alone
    (it cannot lower the row's heaviest GPU below it). Returns how many pairs of each row
    were re-split.

    Why all pairs: with few slots per GPU the heaviest-lightest pairing stalls where a
    middle pair could make room, and a node's packing then ends well above its mean."""
    n, m, k = items.shape
    splits = _SplitTable.of(side, together)
    count = np.zeros(n, dtype=np.int64)
    goal = np.zeros(n) if target is None else target
    live = np.arange(n)
    for _ in range(passes):
        before = count.copy()
        for pairs in round_robin(m):
            _resplit_round(items, load, live, pairs, goal, splits, count)
        live = np.flatnonzero(count > before)
        if live.size == 0:
            break
    return count


@attrs.frozen
class _SplitTable:
    """A pair's splits laid out for gathers: a float64 matrix product of this size can go to
    threaded BLAS, which costs far more CPU time than it saves."""

    pair: np.ndarray  # (q, 2): pairs of replicas some split puts on the first GPU
    via: np.ndarray  # (splits,): each split's pair
    rest: np.ndarray  # (splits, k - 2): its other replicas on the first GPU
    order: np.ndarray  # (splits, 2k): the first GPU's replicas, then the other's
    joins: np.ndarray  # (splits, k * k) bool: replica i of one GPU and j of the other end together

    @classmethod
    def of(cls, side: np.ndarray, together: np.ndarray) -> _SplitTable:
        picks = [tuple(np.flatnonzero(row)) for row in side]
        pair = sorted({p[:2] for p in picks})
        via = np.array([pair.index(p[:2]) for p in picks])
        order = np.argsort(side == 0, axis=1, kind="stable")
        return cls(np.array(pair), via, np.array([p[2:] for p in picks]).reshape(len(picks), -1), order, together > 0)


def _resplit_round(items, load, live, pairs, goal, splits: _SplitTable, count) -> None:
    """One round of disjoint ``pairs`` (p, 2) on rows ``live``, those pairs only whose heavier
    GPU is above the row's ``goal``; adds to ``count`` the pairs re-split."""
    k = items.shape[2]
    gpu = load[live].sum(2)  # (rows, m)
    heavy = np.maximum(gpu[:, pairs[:, 0]], gpu[:, pairs[:, 1]])
    ri, pi = np.nonzero(heavy > goal[live, None])
    if ri.size == 0:
        return
    rows, gpus = live[ri], pairs[pi]  # (c,), (c, 2)
    it = items[rows[:, None], gpus].reshape(ri.size, 2 * k)
    ld = load[rows[:, None], gpus].reshape(it.shape)
    total = ld.sum(1)
    first = (ld[:, splits.pair[:, 0]] + ld[:, splits.pair[:, 1]])[:, splits.via]  # (c, splits): the first GPU's load
    for j in range(splits.rest.shape[1]):
        first += ld[:, splits.rest[:, j]]
    score = np.abs(2 * first - total[:, None])  # the heavier side is (total + this) / 2
    same = (it[:, :k, None] == it[:, None, k:]).reshape(ri.size, k * k)
    dup = np.flatnonzero(same.any(1))  # a pair sharing an expert: rule out the splits that join them
    if dup.size:
        score[dup] = np.where((same[dup, None, :] & splits.joins).any(2), np.inf, score[dup])
    best = score.argmin(1)
    better = (total + score[np.arange(ri.size), best]) / 2 < heavy[ri, pi] * (1 - 1e-12)
    c = np.flatnonzero(better)
    if c.size:
        order = splits.order[best[c]]
        items[rows[c, None], gpus[c]] = np.take_along_axis(it[c], order, 1).reshape(-1, 2, k)
        load[rows[c, None], gpus[c]] = np.take_along_axis(ld[c], order, 1).reshape(-1, 2, k)
        np.add.at(count, rows[c], 1)
