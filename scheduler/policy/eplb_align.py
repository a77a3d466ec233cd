"""Fewer expert moves for the same plan: renumber GPUs and reorder slots to match the old one.

Balance depends only on which replicas share a GPU, not on which GPU of a node it is or which
slot of a GPU; so a new plan is first given the GPU numbers (within each node) whose old
contents it shares most, then each replica that the GPU already held keeps its old slot.
A move is a slot whose expert changes: its weights have to be copied in.
"""

from __future__ import annotations

import numpy as np

from .eplb_pack import Shape


def moves(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """(n, 4) int64 rows (layer, slot, old expert, new expert) for every slot that changes."""
    layer, slot = np.nonzero(old != new)
    return np.stack([layer, slot, old[layer, slot], new[layer, slot]], axis=1).astype(np.int64)


def align(new: np.ndarray, old: np.ndarray, shape: Shape) -> np.ndarray:
    return align_slots(relabel_gpus(new, old, shape), old, shape.k)


def relabel_gpus(new: np.ndarray, old: np.ndarray, shape: Shape) -> np.ndarray:
    """Permute new's GPUs within each node to overlap old's: GPUs with the largest overlap
    first, each to its best still-free old GPU (greedy matching; a node never changes, so home
    nodes still hold)."""
    layers, slots = new.shape
    g, k = shape.gpus, shape.k
    experts = int(max(new.max(), old.max())) + 1
    # einsum, not @ on a transposed view: that falls off BLAS and cost a second per plan
    overlap = np.einsum("lge,lhe->lgh", _gpu_sets(new, g, k, experts), _gpu_sets(old, g, k, experts))
    same_node = shape.gpu_node[:, None] == shape.gpu_node[None, :]
    overlap = np.where(same_node, overlap, -1.0)  # (layers, new gpu, old gpu)
    rows = np.arange(layers)
    dest = np.empty((layers, g), dtype=np.int64)
    free = np.ones((layers, g), dtype=bool)
    for i in np.argsort(-overlap.max(2), axis=1, kind="stable").T:
        score = np.where(free & same_node[i], overlap[rows, i], -2.0)
        j = score.argmax(1)
        dest[rows, i] = j
        free[rows, j] = False
    out = np.empty_like(new).reshape(layers, g, k)
    out[rows[:, None], dest] = new.reshape(layers, g, k)
    return out.reshape(layers, slots)


def _gpu_sets(p2l: np.ndarray, g: int, k: int, experts: int) -> np.ndarray:
    """(layers, gpus, experts) float32 indicator of which experts each GPU holds."""
    layers = p2l.shape[0]
    out = np.zeros((layers, g, experts), dtype=np.float32)
    out[np.arange(layers)[:, None], np.arange(p2l.shape[1]) // k, p2l] = 1.0
    return out


def align_slots(new: np.ndarray, old: np.ndarray, k: int) -> np.ndarray:
    """Within each GPU, a replica the GPU already held keeps its old slot; the others fill
    the freed slots in order. The set per GPU is unchanged."""
    layers, slots = new.shape
    a, b = new.reshape(layers, -1, k), old.reshape(layers, -1, k)
    same = a[..., :, None] == b[..., None, :]  # (layers, gpus, new pos, old pos)
    kept, taken = same.any(3), same.any(2)
    free_pos = np.argsort(taken, axis=2, kind="stable")  # untaken old positions first
    nth_new = np.clip(np.cumsum(~kept, axis=2) - 1, 0, k - 1)
    pos = np.where(kept, same.argmax(3), np.take_along_axis(free_pos, nth_new, 2))
    out = np.empty_like(a)
    np.put_along_axis(out, pos, a, axis=2)
    return out.reshape(layers, slots)
