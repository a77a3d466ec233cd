"""EPLB bound: no placement under the rules (home nodes, k slots per GPU, one replica of an
expert per GPU) beats it, checked against an exhaustive search on tiny machines."""

import itertools

import numpy as np
import pytest

from lockstep.policy.eplb import Topology, absorb_bound, bound, plan


def best_max(w: np.ndarray, topo: Topology) -> float:
    """Least heaviest-GPU load over every valid placement of one layer, even split. A GPU
    holds a k-subset of the experts (no expert twice); the GPUs of a node are interchangeable,
    so each node takes a multiset of subsets."""
    k, per = topo.slots_per_rank, topo.ranks // topo.nodes
    subsets = np.array(list(itertools.combinations(range(topo.experts), k)))
    node = subsets[np.array(list(itertools.combinations_with_replacement(range(len(subsets)), per)))]
    node = node.reshape(len(node), per * k)  # one node's slots, per choice
    pick = np.array(list(itertools.product(range(len(node)), repeat=topo.nodes)))
    p2l = node[pick].reshape(len(pick), topo.slots)
    held = p2l[:, :, None] == np.arange(topo.experts)
    r = held.sum(1)
    slot_node = np.arange(topo.slots) // (per * k)
    at_home = (held & (slot_node[:, None] == topo.home()[None, :])).any(1)
    ok = (r >= 1).all(1) & at_home.all(1)
    share = (w / np.maximum(r, 1))[np.arange(len(p2l))[:, None], p2l]
    return float(share.reshape(len(p2l), topo.ranks, k).sum(2).max(1)[ok].min())


# several nodes with few spare slots, where what a node can carry binds; one of k = 5
SMALL = [Topology(6, 8, 4, 2), Topology(7, 8, 4, 2), Topology(6, 8, 4, 4), Topology(6, 9, 3, 3), Topology(8, 10, 2, 2)]


@pytest.mark.parametrize("topo", SMALL, ids=lambda t: f"{t.experts}x{t.slots}x{t.ranks}x{t.nodes}")
@pytest.mark.parametrize("seed", range(8))
def test_no_placement_beats_the_bound(topo, seed):
    rng = np.random.default_rng(seed)
    alpha = rng.uniform(0.5, 2.5)  # mild to one expert carrying most of the layer
    w = (rng.permutation(topo.experts) + 1.0) ** -alpha * np.exp(0.5 * rng.standard_normal(topo.experts)) * 100
    best = best_max(w, topo)
    assert absorb_bound(w[None], topo)[0] <= best * (1 + 1e-9)
    assert bound(w[None], topo).per_layer[0] >= w.sum() / topo.ranks / best - 1e-9
    assert plan(w[None], topo).balancedness.per_layer[0] <= w.sum() / topo.ranks / best + 1e-9


def test_a_node_without_spare_slots_keeps_its_hot_expert_beside_a_cold_one():
    # node 0 holds experts 0-3 in its 4 slots (2 GPUs of 2), node 1 experts 4-6 and one spare
    # slot. Expert 0 (8 tokens) splits at best in two: 4 beside a 1 on each node, max 5. The
    # node terms see it: each node's GPU with a replica of expert 0 (node 0) or of another
    # node's expert (node 1) holds one more, at least its coldest; the rest of the node holds
    # its other experts: W = 14 <= 2 (T + 3 - 1), T >= 5. Without slots per GPU: T >= 4
    topo = Topology(7, 8, 4, 2)
    w = np.array([[8.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    assert best_max(w[0], topo) == pytest.approx(5.0)
    assert absorb_bound(w, topo)[0] == pytest.approx(5.0)
    assert bound(w, topo).per_layer[0] == pytest.approx(3.5 / 5.0)
    assert plan(w, topo).balancedness.per_layer[0] == pytest.approx(3.5 / 5.0)
