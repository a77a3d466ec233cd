"""Node level of the EPLB planner: which node each replica goes to.

Every expert's first replica (its primary) lives on its home node; the others form a pool
that fills the nodes' remaining slots, heaviest first onto the node with the least load.
A node whose own experts are heavy still has to fill its remaining slots, and the pool holds
replicas of hot experts only, so it can end up overloaded however the pool is dealt. The fix
is in the counts: such a node gives up some pool slots to *fillers*, second replicas of its
own coldest experts kept at home (they split load the node carries anyway, so they add
none), and the pool shrinks by as many of its least useful replicas.
"""

from __future__ import annotations

import attrs
import numpy as np

from .eplb_pack import Shape, sorted_items


@attrs.define
class Deal:
    """Which node each replica goes to; items in packing order (heaviest first, an expert's
    replicas adjacent, its primary first). Arrays are (layers, slots) unless noted."""

    items: np.ndarray  # expert of each item
    load: np.ndarray  # tokens of each item
    node_of: np.ndarray  # node of each item
    pool: np.ndarray  # bool: free to go to any node (not a primary, not a filler)
    node_load: np.ndarray  # (layers, nodes)
    copies: np.ndarray  # (layers, experts, nodes) replicas of each expert on each node
    r: np.ndarray  # (layers, experts) replica counts (the deal may have to change one)


def assign_nodes(w: np.ndarray, r: np.ndarray, stay: np.ndarray, shape: Shape) -> Deal:
    """Deal replicas to nodes: primaries and fillers home, the pool heaviest first onto the
    node with the least load that has a slot left and no replica of it on every GPU."""
    layers = w.shape[0]
    rows = np.arange(layers)
    items, load, first = sorted_items(w / r, r)
    forced = first | stay[rows[:, None], items]
    node_of = np.where(forced, shape.home[items], 0)
    node_load = _sum_by_node(load * forced, node_of, shape.nodes)
    left = shape.slots // shape.nodes - _sum_by_node(forced.astype(np.int64), node_of, shape.nodes)
    copies = np.zeros((layers, w.shape[1], shape.nodes), dtype=np.int64)
    np.add.at(copies, (rows[:, None], items, node_of), forced.astype(np.int64))
    per_node = shape.gpus // shape.nodes
    order = np.argsort(forced, axis=1, kind="stable")[:, : int((~forced).sum(1).max())]
    for i in order.T:
        live, e = ~forced[rows, i], items[rows, i]
        ok = (left > 0) & (copies[rows, e] < per_node)
        ok = np.where(ok.any(1)[:, None], ok, left > 0)  # fixed below
        n = np.where(ok, node_load, np.inf).argmin(1)
        node_of[rows[live], i[live]] = n[live]
        node_load[rows[live], n[live]] += load[rows[live], i[live]]
        left[rows[live], n[live]] -= 1
        copies[rows[live], e[live], n[live]] += 1
    deal = Deal(items, load, node_of, ~forced, node_load, copies, r.copy())
    _repair_copies(deal, w, per_node)
    return deal


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


def plan_nodes(w: np.ndarray, r: np.ndarray, shape: Shape, passes: int = 2, slack: float = 1e-3):
    """Counts with fillers, and the node of every replica, so each node's load fits its GPUs at
    the mean (within ``slack``) where it can. Returns (r, deal)."""
    r, stay = r.copy(), np.zeros(r.shape, dtype=bool)
    cap = w.sum(1) / shape.nodes * (1 + slack)  # a node's share of the layer
    for i in range(passes + 1):
        deal = balance_nodes(assign_nodes(w, r, stay, shape), shape)
        r = deal.r
        need = _fillers_needed(deal.load, deal.node_of, deal.pool, deal.node_load, cap, shape.nodes)
        need = np.minimum(need, _filler_room(w, r, stay, shape))
        if i == passes or not need.any():
            return r, deal
        _drop_increments(w, r, stay, need.sum(1))
        _add_fillers(w, r, stay, need, shape)


def balance_nodes(d: Deal, shape: Shape, rounds: int = 12, width: int = 8) -> Deal:
    """Swap pool replicas between each layer's heaviest node and the others while that
    lowers it; the heaviest node offers its ``width`` largest pool replicas."""
    per_node = shape.gpus // shape.nodes
    size = int(d.pool.sum(1).max())
    if size == 0:
        return d
    pos = np.argsort(~d.pool, axis=1, kind="stable")[:, :size]  # pool items, heaviest first
    valid = np.take_along_axis(d.pool, pos, 1)
    active = np.arange(d.items.shape[0])
    for _ in range(rounds):
        if active.size == 0:
            break
        active = active[_balance_round(d, active, pos[active], valid[active], per_node, width)]
    return d


def _balance_round(d: Deal, layers, pos, valid, per_node: int, width: int) -> np.ndarray:
    n, col = layers.size, layers[:, None]
    lr = np.arange(n)
    node_of, load, items = d.node_of[col, pos], d.load[col, pos], d.items[col, pos]  # (n, pool)
    hn = d.node_load[layers].argmax(1)
    mine = valid & (node_of == hn[:, None])
    a = np.argsort(~mine, axis=1, kind="stable")[:, :width]
    a_ok, ea, la = mine[lr[:, None], a], items[lr[:, None], a], load[lr[:, None], a]
    delta = la[:, :, None] - load[:, None, :]
    top = d.node_load[layers, hn]
    score = np.maximum(top[:, None, None] - delta, d.node_load[col, node_of][:, None, :] + delta)
    ok = a_ok[:, :, None] & (valid & (node_of != hn[:, None]))[:, None, :] & (delta > 0)
    ok &= d.copies[layers[:, None, None], ea[:, :, None], node_of[:, None, :]] < per_node
    ok &= (d.copies[col, items, hn[:, None]] < per_node)[:, None, :] & (ea[:, :, None] != items[:, None, :])
    score = np.where(ok, score, np.inf).reshape(n, -1)
    best = score.argmin(1)
    moved = score[lr, best] < top * (1 - 1e-12)
    i, j = np.divmod(best[moved], pos.shape[1])
    _swap_nodes(d, layers[moved], pos[moved][np.arange(i.size), a[lr[moved], i]], pos[moved][np.arange(j.size), j])
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
    need = np.zeros(node_load.shape, dtype=np.int64)
    for n in range(nodes):
        mine = np.sort(np.where(pool & (node_of == n), load, 0.0), axis=1)[:, ::-1]
        before = node_load[:, n : n + 1] - (np.cumsum(mine, axis=1) - mine)  # load before dropping each
        need[:, n] = ((before > cap[:, None]) & (mine > 0)).sum(1)
    return need


def _filler_room(w, r, stay, shape: Shape) -> np.ndarray:
    """(layers, nodes): own experts that could become fillers (one replica, not yet one);
    none where a node has one GPU (a filler needs a second GPU at home)."""
    if shape.gpus // shape.nodes < 2:
        return np.zeros((w.shape[0], shape.nodes), dtype=np.int64)
    free = (r == 1) & ~stay
    return np.stack([(free & (shape.home == n)).sum(1) for n in range(shape.nodes)], axis=1)


def _drop_increments(w, r, stay, count) -> None:
    """Take ``count`` (per layer) replicas back from the experts that miss them least."""
    rows = np.arange(w.shape[0])
    for step in range(int(count.max())):
        live = step < count
        cost = np.where((r >= 2) & ~stay, w / np.maximum(r - 1, 1), np.inf)
        x = cost.argmin(1)
        live &= np.isfinite(cost[rows, x])
        r[rows[live], x[live]] -= 1


def _add_fillers(w, r, stay, need, shape: Shape) -> None:
    """Give each node ``need`` fillers: its coldest experts that have one replica."""
    for n in range(shape.nodes):
        cand = np.where((shape.home == n) & (r == 1) & ~stay, w, np.inf)
        rank = np.argsort(np.argsort(cand, axis=1, kind="stable"), axis=1)
        pick = (rank < need[:, n : n + 1]) & np.isfinite(cand)
        stay |= pick
        r += pick
