"""Scoring the EPLB local search's changes: which one each heavy GPU should make.

Three kinds, all off a heavy GPU h:
- swap: one of h's replicas trades places with a lighter replica on another GPU (two slots
  change);
- transfer: a redundant replica on h is overwritten by one more replica of the coldest expert
  h lacks (one slot changes; replica counts change);
- fill: one of h's replicas moves onto a partner GPU over a redundant replica there, and its
  slot on h takes one more replica of the coldest expert h lacks (two slots change). This is
  how a node whose own experts are heavy gets a small replica into a slot it must fill;
- split: an expert on h gets one more replica, on a partner GPU over a redundant replica
  there (one slot changes). After loads drift this is the cheap repair: the experts that
  grew get replicas from those that shrank.
A score is the heaviest load among the GPUs the change touches, afterwards; a change helps if
that is below h's load now. Every function returns, per row, the best score and what to do
(rows are (layer, heavy GPU) pairs). Rules are checked here: one replica of an expert per
GPU, and an expert's last copy on its home node never leaves that node.
"""

from __future__ import annotations

import numpy as np

from .eplb_pack import Shape

PAIR_BUDGET = 256  # replica pairs scored per row before a layer falls back to all GPUs
COVER_OFFERS = 96  # replicas offered to a GPU without one: those on the lightest GPUs


def partners(load: np.ndarray, shape: Shape, wide: bool, h: np.ndarray, budget: int = PAIR_BUDGET) -> np.ndarray:
    """(rows, m) GPUs to trade with: all of them, or the lightest that fit the budget of
    replica pairs; with several nodes half of those from h's own node, where its primaries
    may go."""
    m = shape.gpus if wide else min(shape.gpus, max(4, budget // shape.k**2))
    if m == shape.gpus:
        return np.broadcast_to(np.arange(shape.gpus), load.shape)
    if shape.nodes == 1:
        return np.argpartition(load, m - 1, axis=1)[:, :m]
    per_node = shape.gpus // shape.nodes
    mine = min(per_node, max(1, m // 2))
    start = (h // per_node * per_node)[:, None]
    own_load = np.take_along_axis(load, start + np.arange(per_node), 1)
    own = start + np.argpartition(own_load, mine - 1, axis=1)[:, :mine]
    return np.concatenate([own, np.argpartition(load, m - mine - 1, axis=1)[:, : m - mine]], axis=1)


def best_swap(st, shape: Shape, layers: np.ndarray, h: np.ndarray, wide: bool):
    """Per row: (score, slot on h, partner slot) of the swap leaving the pair lightest."""
    k, n = shape.k, layers.size
    lr, col = np.arange(n), layers[:, None]
    load = st.load[layers]
    a_slot = h[:, None] * k + np.arange(k)  # (n, k)
    b_gpu = np.repeat(partners(load, shape, wide, h), k, axis=1)  # (n, m k)
    b_slot = b_gpu * k + np.tile(np.arange(k), b_gpu.shape[1] // k)
    a_e, b_e = st.p2l[col, a_slot], st.p2l[col, b_slot]
    delta = st.slot_load[col, a_slot][:, :, None] - st.slot_load[col, b_slot][:, None, :]
    score = np.maximum(load[lr, h][:, None, None] - delta, load[lr[:, None], b_gpu][:, None, :] + delta)
    flat = st.has.reshape(-1)
    gpu_row = (col * shape.gpus + b_gpu) * st.w.shape[1]  # (n, m k): row of has for b's GPU
    bad = (delta <= 0) | flat[(col * shape.gpus + h[:, None]) * st.w.shape[1] + b_e][:, None, :]
    bad |= flat[gpu_row[:, None, :] + a_e[:, :, None]]
    if shape.nodes > 1:
        cross = shape.gpu_node[b_gpu] != shape.gpu_node[h][:, None]
        bad |= (cross & pinned(st, shape, col, b_e, b_gpu))[:, None, :]
        bad |= pinned(st, shape, col, a_e, h[:, None])[:, :, None] & cross[:, None, :]
    score[bad] = np.inf
    best = score.reshape(n, -1).argmin(1)
    i, j = np.divmod(best, b_slot.shape[1])
    return score.reshape(n, -1)[lr, best], a_slot[lr, i], b_slot[lr, j]


def pinned(st, shape: Shape, col, e, gpu) -> np.ndarray:
    """Whether replica e on gpu is its expert's last copy on the home node."""
    return (shape.home[e] == shape.gpu_node[gpu]) & (st.at_home[col, e] < 2)


def _coldest_missing(st, shape: Shape, layers, h):
    """Per row: the expert h lacks whose next replica is smallest, its size, and whether one
    exists."""
    w, r = st.w[layers], st.r[layers]
    lacks = ~st.has[layers, h] & (r < shape.gpus)
    c = np.where(lacks, w / (r + 1.0), np.inf).argmin(1)
    lr = np.arange(layers.size)
    return c, w[lr, c] / (r[lr, c] + 1.0), lacks[lr, c]


def _others_max(st, shape: Shape, where: np.ndarray, layers, e, skip) -> np.ndarray:
    """Heaviest GPU holding expert e (rows, ...) other than GPU ``skip``; -inf if none."""
    lr = np.arange(layers.size).reshape((-1,) + (1,) * (e.ndim - 1))
    slots = where[lr, e]  # (..., R)
    gpu = np.where(slots >= 0, slots // shape.k, 0)
    held = (slots >= 0) & (gpu != skip[..., None])
    return np.where(held, st.load[layers.reshape(lr.shape + (1,)), gpu], -np.inf).max(-1)


def best_transfer(st, shape: Shape, layers: np.ndarray, h: np.ndarray, where: np.ndarray):
    """Per row: (score, slot on h, new expert) of the best transfer off h. ``where`` is
    (rows, experts, R) slots of each expert (-1 padded)."""
    k, n = shape.k, layers.size
    lr, col = np.arange(n), layers[:, None]
    c, arrive, any_c = _coldest_missing(st, shape, layers, h)
    slot = h[:, None] * k + np.arange(k)
    d = st.p2l[col, slot]
    rd, wd = st.r[col, d], st.w[col, d]
    grow = wd / np.maximum(rd * (rd - 1.0), 1.0)  # on each of d's other replicas
    after = np.maximum(st.load[layers, h][:, None] - wd / rd + arrive[:, None],
                       _others_max(st, shape, where, layers, d, h[:, None]) + grow)
    ok = (rd >= 2) & ~pinned(st, shape, col, d, h[:, None]) & any_c[:, None]
    score = np.where(ok, after, np.inf)
    best = score.argmin(1)
    return score[lr, best], slot[lr, best], c


def best_fill(st, shape: Shape, layers: np.ndarray, h: np.ndarray, where: np.ndarray, wide: bool):
    """Per row: (score, slot on h, partner slot, new expert) of the best fill off h."""
    k, n = shape.k, layers.size
    lr, col = np.arange(n), layers[:, None]
    load = st.load[layers]
    c, arrive, any_c = _coldest_missing(st, shape, layers, h)
    a_slot = h[:, None] * k + np.arange(k)
    b_gpu = np.repeat(partners(load, shape, wide, h), k, axis=1)
    b_slot = b_gpu * k + np.tile(np.arange(k), b_gpu.shape[1] // k)
    a_e, a_p = st.p2l[col, a_slot], st.slot_load[col, a_slot]
    y, y_p = st.p2l[col, b_slot], st.slot_load[col, b_slot]
    ry = st.r[col, y]
    y_after = _others_max(st, shape, where, layers, y, b_gpu) + st.w[col, y] / np.maximum(ry * (ry - 1.0), 1.0)
    new_j = load[lr[:, None], b_gpu][:, None, :] - y_p[:, None, :] + a_p[:, :, None]
    new_h = (load[lr, h][:, None] - a_p + arrive[:, None])[:, :, None]
    score = np.maximum(np.maximum(new_h, new_j), y_after[:, None, :])
    ok_y = (ry >= 2) & ~pinned(st, shape, col, y, b_gpu) & (b_gpu != h[:, None]) & (y != c[:, None])
    ok_y &= any_c[:, None] & ~st.has[col, h[:, None], y]  # y passes through h on its way out
    bad = st.has[layers[:, None, None], b_gpu[:, None, :], a_e[:, :, None]] | ~ok_y[:, None, :]
    if shape.nodes > 1:
        cross = shape.gpu_node[b_gpu] != shape.gpu_node[h][:, None]
        bad |= pinned(st, shape, col, a_e, h[:, None])[:, :, None] & cross[:, None, :]
    score = np.where(bad, np.inf, score).reshape(n, -1)
    best = score.argmin(1)
    i, j = np.divmod(best, b_slot.shape[1])
    return score[lr, best], a_slot[lr, i], b_slot[lr, j], c


def best_split(st, shape: Shape, layers: np.ndarray, h: np.ndarray, where: np.ndarray, wide: bool):
    """Per row: (score, partner slot, expert of h to replicate there) of the best split."""
    k, n = shape.k, layers.size
    lr, col = np.arange(n), layers[:, None]
    load = st.load[layers]
    c = st.p2l[col, h[:, None] * k + np.arange(k)]  # (n, k)
    rc, wc = st.r[col, c], st.w[col, c]
    b_gpu = np.repeat(partners(load, shape, wide, h), k, axis=1)
    b_slot = b_gpu * k + np.tile(np.arange(k), b_gpu.shape[1] // k)
    d = st.p2l[col, b_slot]
    rd, wd = st.r[col, d], st.w[col, d]
    d_after = _others_max(st, shape, where, layers, d, b_gpu) + wd / np.maximum(rd * (rd - 1.0), 1.0)
    new_h = (load[lr, h][:, None] - wc / (rc * (rc + 1.0)))[:, :, None]
    new_g = (load[lr[:, None], b_gpu] - wd / rd)[:, None, :] + (wc / (rc + 1.0))[:, :, None]
    score = np.maximum(np.maximum(new_h, new_g), d_after[:, None, :])
    ok_d = (rd >= 2) & ~pinned(st, shape, col, d, b_gpu) & (b_gpu != h[:, None])
    ok = ok_d[:, None, :] & (rc < shape.gpus)[:, :, None] & (c[:, :, None] != d[:, None, :])
    ok &= ~st.has[layers[:, None, None], b_gpu[:, None, :], c[:, :, None]]
    score = np.where(ok, score, np.inf).reshape(n, -1)
    best = score.argmin(1)
    i, j = np.divmod(best, b_slot.shape[1])
    return score[lr, best], b_slot[lr, j], c[lr, i]


def best_cover_swap(st, shape: Shape, layers: np.ndarray, h: np.ndarray, spare: np.ndarray):
    """Per row: (score, slot on h, partner slot) of the swap that gives GPU h (holding no
    replica of a replicated expert) one, from a GPU with two or more (``spare``: (rows,
    gpus) bool), leaving the pair lightest."""
    k, n = shape.k, layers.size
    lr, col = np.arange(n), layers[:, None]
    load = st.load[layers]
    give = spare[lr[:, None], np.arange(shape.slots) // k] & (st.r[col, st.p2l[layers]] >= 2)
    width = min(max(int(give.sum(1).max()), 1), COVER_OFFERS)
    key = np.where(give, np.repeat(load, k, axis=1), np.inf)  # the lightest GPUs' first
    b_slot = np.argpartition(key, width - 1, axis=1)[:, :width] if width < shape.slots else np.argsort(key, axis=1)
    offered = np.take_along_axis(give, b_slot, 1)
    b_gpu = b_slot // k
    a_slot = h[:, None] * k + np.arange(k)
    a_e, b_e = st.p2l[col, a_slot], st.p2l[col, b_slot]
    delta = st.slot_load[col, a_slot][:, :, None] - st.slot_load[col, b_slot][:, None, :]
    score = np.maximum(load[lr, h][:, None, None] - delta, load[lr[:, None], b_gpu][:, None, :] + delta)
    ok_b = offered & ~st.has[col, h[:, None], b_e]
    bad = ~ok_b[:, None, :] | st.has[layers[:, None, None], b_gpu[:, None, :], a_e[:, :, None]]
    if shape.nodes > 1:
        cross = shape.gpu_node[b_gpu] != shape.gpu_node[h][:, None]
        bad |= (cross & pinned(st, shape, col, b_e, b_gpu))[:, None, :]
        bad |= pinned(st, shape, col, a_e, h[:, None])[:, :, None] & cross[:, None, :]
    score = np.where(bad, np.inf, score).reshape(n, -1)
    best = score.argmin(1)
    i, j = np.divmod(best, width)
    return score[lr, best], a_slot[lr, i], b_slot[lr, j]
