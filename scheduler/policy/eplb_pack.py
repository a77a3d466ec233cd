"""Packing replicas onto GPUs for the EPLB planner: greedy placement within each node.

A placement is ``phy2log`` (layers, slots); slot s lives on GPU s // k (k slots per GPU).
Rules every function here keeps: no GPU holds two replicas of one expert, and every expert
keeps at least one replica on its home node (``home``); redundant replicas may sit anywhere.
Loops run over items; each step is vectorized over layers, which is what keeps a 61-layer
plan inside the planner's time budget.
"""

from __future__ import annotations

import attrs
import numpy as np


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


def greedy_pack(items: np.ndarray, load_of: np.ndarray, item_node: np.ndarray, shape: Shape) -> np.ndarray:
    """Deal each node's replicas (heaviest first) to its GPUs in rounds of one per GPU, the
    heaviest of a round to the GPU lightest so far; then undo the few rounds that gave a
    GPU a second replica of one expert."""
    layers, nodes = items.shape[0], shape.nodes
    per_node, k = shape.gpus // nodes, shape.k
    order = np.argsort(item_node, axis=1, kind="stable")  # by node, heaviest first within
    it = np.take_along_axis(items, order, 1).reshape(layers, nodes, k, per_node)
    ld = np.take_along_axis(load_of, order, 1).reshape(layers, nodes, k, per_node)
    load = np.zeros((layers, nodes, per_node))
    out = np.empty((layers, nodes, per_node, k), dtype=np.int64)
    ln, nn = np.arange(layers)[:, None, None], np.arange(nodes)[None, :, None]
    for j in range(k):
        gpu = np.argsort(load, axis=2, kind="stable")  # i-th heaviest item -> i-th lightest GPU
        out[ln, nn, gpu, j] = it[:, :, j, :]
        load[ln, nn, gpu] += ld[:, :, j, :]
    _fix_duplicates(out)
    return out.reshape(layers, shape.slots)


def _fix_duplicates(out: np.ndarray) -> None:
    """Where a GPU got two replicas of one expert (an expert whose replicas straddle two
    rounds), trade one of them with a replica of another GPU of the node that neither GPU
    holds. Rare, so a plain loop; ``out`` is (layers, nodes, gpus per node, k)."""
    srt = np.sort(out, axis=3)
    for layer, node, g in zip(*np.nonzero((srt[..., 1:] == srt[..., :-1]).any(3))):
        gpus = out[layer, node]
        while len(set(gpus[g].tolist())) < gpus.shape[1]:
            if not _trade_one(gpus, g):
                _column_major(gpus)
                break


def _trade_one(gpus: np.ndarray, g: int) -> bool:
    values, counts = np.unique(gpus[g], return_counts=True)
    e = values[counts > 1][0]
    i = int(np.flatnonzero(gpus[g] == e)[-1])
    for h in range(gpus.shape[0]):
        if h == g or e in gpus[h]:
            continue
        for j, x in enumerate(gpus[h]):
            if x not in gpus[g]:
                gpus[g, i], gpus[h, j] = x, e
                return True
    return False


def _column_major(gpus: np.ndarray) -> None:
    """Re-lay one node's replicas so that each expert's are on consecutive GPUs: valid as
    long as no expert has more replicas than the node has GPUs (the node deal sees to it)."""
    items = np.sort(gpus.ravel())
    n = gpus.shape[0]
    gpus[np.arange(items.size) % n, np.arange(items.size) // n] = items
