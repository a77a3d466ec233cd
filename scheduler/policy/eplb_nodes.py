"""Node level of the EPLB planner: which node each replica goes to.

Every expert's first replica (its primary) lives on its home node; the others form a pool
that fills the nodes' remaining slots, heaviest first onto the nodes with the least load,
then swaps between the heaviest node and the lightest ones level the nodes.
A node whose own experts are heavy still has to fill its remaining slots, and the pool holds
replicas of hot experts only, so it can end up overloaded however the pool is dealt. The fix
is in the counts: such a node gives up some pool slots to *fillers*, second replicas of its
own coldest experts kept at home (they split load the node carries anyway, so they add
none), and the pool shrinks by as many of its least useful replicas.

With few slots per GPU (``level``: EP64/EP72, k <= 4) equal node loads are not enough: each
large replica needs k - 1 small ones beside it on its GPU, so a node with a few large
replicas and no small ones packs badly whatever its load. There the swaps may move fillers
too (a small replica is what such a node lacks), any node may be the partner, and then the
node with the highest packing bound (``eplb_pack.pack_bound``) swaps with the others while
that bound falls (``level_nodes``).
"""

from __future__ import annotations

import attrs
import numpy as np

from .eplb_count import node_sums
from .eplb_pack import Shape, bound_positions, bound_terms, sorted_items

LIGHT = 3  # nodes whose pool replicas the heaviest node may swap with


@attrs.define
class Deal:
    """Which node each replica goes to; items in packing order (heaviest first, an expert's
    replicas adjacent, its primary first). Arrays are (layers, slots) unless noted."""

    items: np.ndarray  # expert of each item
    load: np.ndarray  # tokens of each item
    node_of: np.ndarray  # node of each item
    pool: np.ndarray  # bool: free to go to any node (not a primary, not a filler)
    mobile: np.ndarray  # bool: not a primary (pool replicas and fillers: the rules let them move)
    node_load: np.ndarray  # (layers, nodes)
    copies: np.ndarray  # (layers, experts, nodes) replicas of each expert on each node
    r: np.ndarray  # (layers, experts) replica counts (the deal may have to change one)


def assign_nodes(w: np.ndarray, r: np.ndarray, stay: np.ndarray, shape: Shape) -> Deal:
    """Deal replicas to nodes: primaries and fillers home, the pool heaviest first in rounds
    onto the nodes with slots left, the heaviest of a round to the lightest node; a node
    left with more replicas of an expert than it has GPUs trades one away after."""
    layers = w.shape[0]
    rows = np.arange(layers)
    items, load, first = sorted_items(w / r, r)
    forced = first | stay[rows[:, None], items]
    node_of = np.where(forced, shape.home[items], 0)
    node_load = _sum_by_node(load * forced, node_of, shape.nodes)
    left = shape.slots // shape.nodes - _sum_by_node(forced.astype(np.int64), node_of, shape.nodes)
    cell = (rows[:, None] * w.shape[1] + items) * shape.nodes + node_of
    copies = np.bincount(cell.ravel(), weights=forced.ravel(), minlength=layers * w.shape[1] * shape.nodes)
    copies = copies.astype(np.int64).reshape(layers, w.shape[1], shape.nodes)
    per_node = shape.gpus // shape.nodes
    _deal_rounds(items, load, forced, node_of, node_load, left, copies)
    deal = Deal(items, load, node_of, ~forced, ~first, node_load, copies, r.copy())
    _repair_copies(deal, w, per_node)
    return deal


def _deal_rounds(items, load, forced, node_of, node_load, left, copies) -> None:
    """The pool (items not ``forced``) in rounds of one per node with a slot left, each
    round's i-th heaviest to the i-th lightest such node (arrays updated in place)."""
    layers, slots = items.shape
    rows = np.arange(layers)[:, None]
    pool = np.argsort(forced, axis=1, kind="stable")  # pool positions first, heaviest first
    count = (~forced).sum(1)
    done = np.zeros(layers, dtype=np.int64)
    j = np.arange(left.shape[1])
    while (done < count).any():
        free = left > 0
        lightest = np.argsort(np.where(free, node_load, np.inf), axis=1, kind="stable")
        take = (j < free.sum(1)[:, None]) & (done[:, None] + j < count[:, None])
        pos = pool[rows, np.minimum(done[:, None] + j, slots - 1)]
        node_of[rows, pos] = np.where(take, lightest, node_of[rows, pos])
        node_load[rows, lightest] += np.where(take, load[rows, pos], 0.0)
        left[rows, lightest] -= take
        copies[rows, items[rows, pos], lightest] += take
        done += take.sum(1)


def _repair_copies(d: Deal, w: np.ndarray, per_node: int) -> None:
    """Where the greedy deal left a node more replicas of an expert than it has GPUs (its
    only slots left were there), trade one with another node's pool replica; if no trade
    fits, make it a replica of the heaviest expert that fits there. Rare: a plain loop."""
    for layer, e, n in zip(*np.nonzero(d.copies > per_node)):
        while d.copies[layer, e, n] > per_node:
            i = np.flatnonzero(d.pool[layer] & (d.items[layer] == e) & (d.node_of[layer] == n))[0]
            other = d.pool[layer] & (d.node_of[layer] != n) & (d.items[layer] != e)
            other &= d.copies[layer, d.items[layer], n] < per_node
            other &= d.copies[layer, e, d.node_of[layer]] < per_node
            j = np.flatnonzero(other)
            if j.size:
                _swap_nodes(d, np.array([layer]), np.array([i]), j[:1])
            else:
                _retarget(d, w, layer, i, n, per_node)


def _retarget(d: Deal, w: np.ndarray, layer: int, i: int, n: int, per_node: int) -> None:
    e = d.items[layer, i]
    fits = (d.copies[layer, :, n] < per_node) & (np.arange(w.shape[1]) != e)
    x = int(np.where(fits, w[layer] / (d.r[layer] + 1.0), -1.0).argmax())
    d.items[layer, i] = x
    d.copies[layer, e, n] -= 1
    d.copies[layer, x, n] += 1
    d.r[layer, e] -= 1
    d.r[layer, x] += 1
    d.load[layer] = w[layer, d.items[layer]] / d.r[layer, d.items[layer]]
    d.node_load[layer] = np.bincount(d.node_of[layer], weights=d.load[layer], minlength=d.node_load.shape[1])


def _sum_by_node(x: np.ndarray, node_of: np.ndarray, nodes: int) -> np.ndarray:
    layers = x.shape[0]
    flat = (node_of + nodes * np.arange(layers)[:, None]).ravel()
    return np.bincount(flat, weights=x.ravel().astype(np.float64), minlength=layers * nodes).reshape(layers, nodes).astype(x.dtype)


def plan_nodes(w: np.ndarray, r: np.ndarray, shape: Shape, slack: float = 1e-3, level: bool = False):
    """Counts with fillers, and the node of every replica, so each node's load fits its GPUs at
    the mean (within ``slack``) where it can. Returns (r, deal).

    Fillers are taken in one round, or two where every node has two spare slots per GPU or
    more: a heavy node then has many pool slots to give up, and one round leaves it over.
    With few spare slots (EP72 on 9 nodes with 288 slots: 3 or 4 for 8 GPUs) the redundant
    replicas that more fillers cost are better spent splitting hot experts.

    ``level`` (few slots per GPU): the swaps that level the nodes may move fillers too and
    pair the heaviest node with any other, and the nodes are then levelled by their packing
    bound (``level_nodes``)."""
    r, stay = r.copy(), np.zeros(r.shape, dtype=bool)
    cap = w.sum(1) / shape.nodes * (1 + slack)  # a node's share of the layer
    passes = 2 if shape.spare().min() >= 2 * (shape.gpus // shape.nodes) else 1
    for _ in range(passes):
        deal = assign_nodes(w, r, stay, shape)
        r = deal.r
        need = _fillers_needed(deal.load, deal.node_of, deal.pool, deal.node_load, cap, shape.nodes)
        need = np.minimum(need, _filler_room(w, r, stay, shape))
        if not need.any():
            break
        _drop_increments(w, r, stay, need.sum(1), shape)
        _add_fillers(w, r, stay, need, shape)
    else:
        deal = assign_nodes(w, r, stay, shape)
    if not level:
        return deal.r, balance_nodes(deal, shape)
    balance_nodes(deal, shape, movable=deal.mobile, light=shape.nodes)
    return deal.r, level_nodes(deal, shape)


def balance_nodes(d: Deal, shape: Shape, rounds: int = 12, width: int = 8, movable: np.ndarray | None = None,
                  light: int = LIGHT) -> Deal:
    """Swap ``movable`` replicas (default: the pool) between each layer's heaviest node and
    its ``light`` lightest others while that lowers it; the heaviest node offers its
    ``width`` largest."""
    per_node = shape.gpus // shape.nodes
    movable = d.pool if movable is None else movable
    size = int(movable.sum(1).max())
    if size == 0 or rounds == 0:
        return d
    pos = np.argsort(~movable, axis=1, kind="stable")[:, :size]  # movable items, heaviest first
    valid = np.take_along_axis(movable, pos, 1)
    active = np.arange(d.items.shape[0])
    for _ in range(rounds):
        if active.size == 0:
            break
        active = active[_balance_round(d, active, pos[active], valid[active], per_node, width, light)]
    return d


def _balance_round(d: Deal, layers, pos, valid, per_node: int, width: int, light: int) -> np.ndarray:
    """One swap per layer between the heaviest node's ``width`` largest movable replicas
    (``pos``, ``valid``) and those of the ``light`` lightest nodes; returns which layers moved."""
    n, col = layers.size, layers[:, None]
    lr = np.arange(n)
    node_of = d.node_of[col, pos]  # (n, movable)
    node_load = d.node_load[layers]
    hn = node_load.argmax(1)
    mine = valid & (node_of == hn[:, None])
    a = np.argsort(~mine, axis=1, kind="stable")[:, :width]
    a, a_ok = pos[lr[:, None], a], np.take_along_axis(mine, a, 1)
    rank = np.argsort(np.argsort(node_load, axis=1), axis=1)  # 0 = lightest
    partner = valid & (rank[lr[:, None], node_of] < light) & (node_of != hn[:, None])
    m = max(int(partner.sum(1).max()), 1)
    pick = np.argsort(~partner, axis=1, kind="stable")[:, :m]
    b, b_ok = pos[lr[:, None], pick], np.take_along_axis(partner, pick, 1)
    ea, la, eb, lb, nb = d.items[col, a], d.load[col, a], d.items[col, b], d.load[col, b], d.node_of[col, b]
    delta = la[:, :, None] - lb[:, None, :]
    top = node_load[lr, hn]
    score = np.maximum(top[:, None, None] - delta, node_load[lr[:, None], nb][:, None, :] + delta)
    ok = a_ok[:, :, None] & b_ok[:, None, :] & (delta > 0) & (ea[:, :, None] != eb[:, None, :])
    ok &= d.copies[layers[:, None, None], ea[:, :, None], nb[:, None, :]] < per_node
    ok &= (d.copies[col, eb, hn[:, None]] < per_node)[:, None, :]
    score = np.where(ok, score, np.inf).reshape(n, -1)
    best = score.argmin(1)
    moved = score[lr, best] < top * (1 - 1e-12)
    i, j = np.divmod(best[moved], m)
    _swap_nodes(d, layers[moved], a[moved, i], b[moved, j])
    return moved


def _swap_nodes(d: Deal, layers: np.ndarray, ia: np.ndarray, ib: np.ndarray) -> None:
    """Exchange the nodes of items ia and ib (one pair per layer)."""
    na, nb = d.node_of[layers, ia], d.node_of[layers, ib]
    ea, eb = d.items[layers, ia], d.items[layers, ib]
    la, lb = d.load[layers, ia], d.load[layers, ib]
    d.node_of[layers, ia], d.node_of[layers, ib] = nb, na
    d.node_load[layers, na] += lb - la
    d.node_load[layers, nb] += la - lb
    d.copies[layers, ea, na] -= 1
    d.copies[layers, ea, nb] += 1
    d.copies[layers, eb, nb] -= 1
    d.copies[layers, eb, na] += 1


def _fillers_needed(load, node_of, pool, node_load, cap, nodes) -> np.ndarray:
    """(layers, nodes): how many of its largest pool replicas each node must give up."""
    layers = load.shape[0]
    group = np.where(pool, node_of, nodes)  # primaries and fillers: a group of their own
    order = np.lexsort((-load, group), axis=1)  # by node, largest first
    g, x = np.take_along_axis(group, order, 1), np.take_along_axis(load, order, 1)
    done = np.cumsum(x, axis=1) - x  # load of the earlier items of the row
    start = np.ones(g.shape, dtype=bool)
    start[:, 1:] = g[:, 1:] != g[:, :-1]
    first = np.maximum.accumulate(np.where(start, np.arange(g.shape[1]), 0), axis=1)
    dropped = done - np.take_along_axis(done, first, 1)  # the node's larger items, dropped first
    before = np.take_along_axis(node_load, np.minimum(g, nodes - 1), 1) - dropped
    count = (before > cap[:, None]) & (x > 0) & (g < nodes)
    flat = (g + (nodes + 1) * np.arange(layers)[:, None]).ravel()
    per = np.bincount(flat, weights=count.ravel(), minlength=layers * (nodes + 1)).reshape(layers, nodes + 1)
    return per[:, :nodes].astype(np.int64)


def _filler_room(w, r, stay, shape: Shape) -> np.ndarray:
    """(layers, nodes): own experts that could become fillers (one replica, not yet one);
    none where a node has one GPU (a filler needs a second GPU at home)."""
    if shape.gpus // shape.nodes < 2:
        return np.zeros((w.shape[0], shape.nodes), dtype=np.int64)
    free = (r == 1) & ~stay
    return np.stack([(free & (shape.home == n)).sum(1) for n in range(shape.nodes)], axis=1)


def _drop_increments(w, r, stay, count, shape: Shape) -> None:
    """Take ``count`` (per layer) replicas back from the experts that miss them least: the
    drop that leaves the smallest of (the expert's load per replica, its home node's
    primaries per GPU). Counting the node matters: the replicas that let a heavy node shed
    load are cheap by load per replica alone."""
    rows = np.arange(w.shape[0])
    per_node = shape.gpus // shape.nodes
    node = node_sums(w / r, shape.home, shape.nodes)
    companions = np.sort(w, axis=1)[:, : shape.k - 1].sum(1, keepdims=True)
    for step in range(int(count.max())):
        live = step < count
        rm = np.maximum(r - 1, 1)
        grow = w / rm - w / r
        cost = np.maximum(w / rm + companions, (node[:, shape.home] + grow) / per_node)
        cost = np.where((r >= 2) & ~stay, cost, np.inf)
        x = cost.argmin(1)
        live &= np.isfinite(cost[rows, x])
        node[rows[live], shape.home[x[live]]] += grow[rows[live], x[live]]
        r[rows[live], x[live]] -= 1


def _add_fillers(w, r, stay, need, shape: Shape) -> None:
    """Give each node ``need`` fillers: its coldest experts that have one replica."""
    cand = np.where((r == 1) & ~stay, w, np.inf)
    order = np.lexsort((cand, np.broadcast_to(shape.home, w.shape)), axis=1)  # by node, coldest first
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(w.shape[1])[None, :].repeat(w.shape[0], 0), axis=1)
    rank -= np.searchsorted(shape.home, shape.home)  # place within the node's group
    pick = (rank < np.take_along_axis(need, np.broadcast_to(shape.home, w.shape), 1)) & np.isfinite(cand)
    stay |= pick
    r += pick


# --- levelling by the per-node packing bound (few slots per GPU) ------------------------------


def level_nodes(d: Deal, shape: Shape, rounds: int = 4) -> Deal:
    """Swap mobile replicas (all but primaries) between the node of each layer with the
    highest packing bound and any other node, the best swap per layer and round, while that
    lowers the bound. The bound, not the node's load: with few slots per GPU a node's large
    replicas each need k - 1 small ones beside them, so equal node loads can still pack badly."""
    per, k = shape.gpus // shape.nodes, shape.k
    n = per * k
    pos = bound_positions(n, k, per)
    wa = int(shape.spare().max())  # each node holds exactly its spare slots' worth of mobile replicas
    active = np.arange(d.items.shape[0])
    for _ in range(rounds):
        if active.size == 0:
            break
        active = active[_level_round(d, active, shape, pos, wa)]
    return d


def _level_round(d: Deal, layers: np.ndarray, shape: Shape, pos: np.ndarray, wa: int) -> np.ndarray:
    """One swap per layer (see ``level_nodes``); returns which layers moved. The heaviest
    node's bound after a swap is exact; the partner's is bounded above term by term (its
    terms now plus the load it gains over j), which only ever turns a swap down."""
    per, k, nodes = shape.gpus // shape.nodes, shape.k, shape.nodes
    n, a_n = per * k, layers.size
    col, lr = layers[:, None], np.arange(a_n)
    load, node_of, mobile = d.load[layers], d.node_of[layers], d.mobile[layers]
    order = np.lexsort((-load, node_of), axis=1)  # by node, heaviest first
    top = np.zeros((a_n, nodes, n + 1))
    np.cumsum(np.take_along_axis(load, order, 1).reshape(a_n, nodes, n), axis=2, out=top[..., 1:])
    terms = bound_terms(top[..., pos], k, per)  # (A, nodes, per + 1)
    bound = terms.max(2)
    h = bound.argmax(1)
    limit = bound[lr, h] * (1 - 1e-9)
    on_h = node_of == h[:, None]
    a = np.argsort(~(mobile & on_h), axis=1, kind="stable")[:, :wa]
    b_ok = mobile & ~on_h
    m = max(int(b_ok.sum(1).max()), 1)
    b = np.argsort(~b_ok, axis=1, kind="stable")[:, :m]
    a_ok, b_ok = np.take_along_axis(mobile & on_h, a, 1), np.take_along_axis(b_ok, b, 1)
    va, vb = np.take_along_axis(load, a, 1), np.take_along_axis(load, b, 1)
    ea, eb, nb = d.items[col, a], d.items[col, b], np.take_along_axis(node_of, b, 1)
    gain = va[:, :, None] - vb[:, None, :]  # (A, wa, m): what the heaviest node sheds
    # the partner's terms can only grow, by at most gain / j: a cheap test first, then compact
    partner = (terms[lr[:, None], nb][:, None] + gain[..., None] / _growth(per)).max(3)
    ok = a_ok[:, :, None] & b_ok[:, None, :] & (gain > 0) & (partner < limit[:, None, None])
    ok &= ea[:, :, None] != eb[:, None, :]
    ok &= d.copies[layers[:, None, None], ea[:, :, None], nb[:, None, :]] < per
    ok &= (d.copies[col, eb, h[:, None]] < per)[:, None, :]
    li, ai, bi = np.nonzero(ok)
    if li.size == 0:
        return np.zeros(a_n, dtype=bool)
    rank = np.empty_like(order)  # place of each item in its node's order
    np.put_along_axis(rank, order, np.broadcast_to(np.tile(np.arange(n), nodes), order.shape), 1)
    t_h = top[lr, h][li]  # (c, n + 1)
    v_in, v_out = vb[li, bi], va[li, ai]
    above = (np.diff(t_h, axis=1) > v_in[:, None]).sum(1) - (v_out > v_in)  # its other items heavier than b
    new_h = bound_terms(_swapped(t_h, rank[li, a[li, ai]], v_out, v_in, above, pos), k, per).max(1)
    score = np.full((a_n, wa * m), np.inf)
    score[li, ai * m + bi] = np.maximum(new_h, partner[li, ai, bi])
    best = score.argmin(1)
    moved = score[lr, best] < limit
    i, j = np.divmod(best[moved], m)
    _swap_nodes(d, layers[moved], a[moved, i], b[moved, j])
    return moved


def _growth(per: int) -> np.ndarray:
    """Per term of ``bound_terms``: how many GPUs share a load that one item gains."""
    return np.append(np.arange(1.0, per + 1), 1.0)


def _swapped(t: np.ndarray, out_at: np.ndarray, out_v: np.ndarray, in_v: np.ndarray, in_rank: np.ndarray,
             pos: np.ndarray) -> np.ndarray:
    """(c, len(pos)): prefix sums at ``pos`` of each candidate's node (prefix ``t``, (c, n + 1))
    after the item at place ``out_at`` (load ``out_v``) leaves and one of load ``in_v`` comes
    in, ranking ``in_rank`` among the rest (all (c,))."""
    n = t.shape[-1] - 1
    here, up, down = t[:, pos], t[:, np.minimum(pos + 1, n)], t[:, np.maximum(pos - 1, 0)]
    out_at, out_v, in_v, in_rank = out_at[:, None], out_v[:, None], in_v[:, None], in_rank[:, None]
    without = np.where(pos <= out_at, here, up - out_v)  # the item out gone: prefix sums at pos
    shifted = np.where(pos - 1 <= out_at, down, here - out_v)  # the same at pos - 1
    return np.where(pos <= in_rank, without, shifted + in_v)
