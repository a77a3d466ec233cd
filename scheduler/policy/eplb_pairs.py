"""Pairwise re-partitioning for the EPLB planner: two GPUs pool their replicas and split them
again as evenly as the rules allow.

With few slots per GPU (k <= 5: EP64 and EP72 at 256-360 slots) a single swap is a weak
move: the best split of two GPUs' 2k replicas is often two or three swaps at once. So each
round pairs the GPUs of every node (heaviest with lightest, second heaviest with second
lightest, ...) and gives each pair the best of all C(2k - 1, k - 1) splits into two sets of k,
in all pairs and layers at once. A split that puts both replicas of one expert on one GPU is
out; pairs stay within a node, so home nodes hold. Replica counts do not change.
"""

from __future__ import annotations

import itertools

import numpy as np

from .eplb_pack import Shape

MAX_K = 5  # C(9, 4) = 126 splits per pair; beyond that single swaps do (and packing is finer)


def _splits(k: int) -> tuple[np.ndarray, np.ndarray]:
    """(splits, 2k) 0/1: which of the pair's 2k replicas go to the first GPU (replica 0
    always does, which halves the symmetric splits); and (splits, k * k) 0/1: whether
    replica i of the first GPU and replica j of the second end on the same GPU."""
    rest = np.array(list(itertools.combinations(range(1, 2 * k), k - 1)), dtype=np.int64).reshape(-1, k - 1)
    side = np.zeros((rest.shape[0], 2 * k))
    side[:, 0] = 1.0
    side[np.arange(rest.shape[0])[:, None], rest] = 1.0
    together = (side[:, :k, None] == side[:, None, k:]).reshape(-1, k * k).astype(np.float64)
    return side, together


def repartition(st, shape: Shape, rounds: int = 3, share: float = 0.25, stall: float = 1e-4) -> None:
    """Re-split paired GPUs, ``rounds`` times or until a layer's heaviest GPU stops falling
    by more than ``stall`` (relative); each round pairs the ``share`` heaviest GPUs of each
    node with as many of the lightest (``st`` is a ``SearchState``, changed in place)."""
    k = shape.k
    per = shape.gpus // shape.nodes
    if not 2 <= k <= MAX_K or per < 2:  # one slot each: a re-split only trades GPUs
        return
    side, together = _splits(k)
    layers = np.arange(st.p2l.shape[0])
    width = max(1, min(per // 2, int(np.ceil(per * share))))
    for _ in range(rounds):
        top = st.load[layers].max(1)
        g1, g2 = _pairs(st.load[layers], shape, width)
        _round(st, shape, layers, g1, g2, side, together)
        layers = layers[st.load[layers].max(1) < top * (1 - stall)]
        if layers.size == 0:
            break


def _pairs(load: np.ndarray, shape: Shape, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(layers, pairs) GPUs: within each node the i-th heaviest with the i-th lightest, for
    i < width."""
    layers = load.shape[0]
    per = shape.gpus // shape.nodes
    order = np.argsort(load.reshape(layers, shape.nodes, per), axis=2) + (np.arange(shape.nodes) * per)[None, :, None]
    return order[:, :, ::-1][:, :, :width].reshape(layers, -1), order[:, :, :width].reshape(layers, -1)


def _round(st, shape: Shape, layers, g1, g2, side, together) -> np.ndarray:
    k = shape.k
    col = layers[:, None, None]
    slots = np.concatenate([g1[..., None] * k + np.arange(k), g2[..., None] * k + np.arange(k)], axis=2)
    e, ld = st.p2l[col, slots], st.slot_load[col, slots]  # (n, pairs, 2k)
    first = ld @ side.T  # (n, pairs, splits): load of the first GPU
    total = ld.sum(2, keepdims=True)
    score = np.maximum(first, total - first)
    same = (e[..., :k, None] == e[..., None, k:]).reshape(*e.shape[:2], k * k)
    li, pi = np.nonzero(same.any(2))  # few pairs share an expert: rule out their bad splits
    if li.size:
        clash = same[li, pi].astype(np.float64) @ together.T > 0
        score[li, pi] = np.where(clash, np.inf, score[li, pi])
    best = score.argmin(2)
    top = np.maximum(st.load[layers[:, None], g1], st.load[layers[:, None], g2])
    better = np.take_along_axis(score, best[..., None], 2)[..., 0] < top * (1 - 1e-12)
    li, pi = np.nonzero(better)
    if li.size == 0:
        return better
    mine = side[best[li, pi]] > 0  # (m, 2k)
    order = np.argsort(~mine, axis=1, kind="stable")  # the first GPU's k replicas, then the other's
    new_e = np.take_along_axis(e[li, pi], order, 1)
    new_ld = np.take_along_axis(ld[li, pi], order, 1)
    rows, s = layers[li], slots[li, pi]
    gpus = s // k
    st.has[rows[:, None], gpus, e[li, pi]] = False
    st.p2l[rows[:, None], s] = new_e
    st.slot_load[rows[:, None], s] = new_ld
    st.has[rows[:, None], gpus, new_e] = True
    st.load[rows, g1[li, pi]] = new_ld[:, :k].sum(1)
    st.load[rows, g2[li, pi]] = new_ld[:, k:].sum(1)
    st.swaps += int(li.size)
    return better
