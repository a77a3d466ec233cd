"""Incremental EPLB's second route: the fresh plan's nodes inside the current layout."""

import numpy as np
import pytest

from lockstep.policy.eplb import Placement, Topology, plan
from lockstep.policy.eplb_adopt import adopt_fresh_nodes, fewest_moves, heavy_nodes
from lockstep.policy.eplb_align import align
from lockstep.policy.eplb_split import replica_counts, split_loads


def zipf(layers: int, experts: int, alpha: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ranks = np.stack([rng.permutation(experts) + 1 for _ in range(layers)])
    return ranks**-alpha * np.exp(0.3 * rng.standard_normal((layers, experts))) * 1000


def drifted(w: np.ndarray, sigma: float, seed: int) -> np.ndarray:
    return w * np.exp(sigma * np.random.default_rng(seed).standard_normal(w.shape))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shape", [(64, 72, 18, 3), (64, 80, 16, 2), (48, 64, 16, 4)])
def test_adopted_nodes_hold_the_fresh_replicas_keep_the_rules_and_the_cap(seed, shape):
    topo = Topology(*shape)
    w = zipf(5, topo.experts, 0.8, seed)
    current = plan(w, topo).placement
    w2 = drifted(w, 0.1, seed + 100)
    fresh = align(plan(w2, topo).placement.phy2log, current.phy2log, topo.shape())
    fresh_top = split_loads(fresh, w2, topo.ranks, "even").max(1)
    out = adopt_fresh_nodes(w2, current.phy2log, fresh, topo.shape(), fresh_top * 1.005, fresh_top * 1.01)
    placement = Placement.from_phy2log(out, topo.experts)
    placement.check_integrity(topo)
    size = topo.slots // topo.nodes
    for layer in range(w.shape[0]):
        for node in range(topo.nodes):
            span = slice(node * size, (node + 1) * size)
            assert sorted(out[layer, span]) == sorted(fresh[layer, span])  # the fresh plan's replicas
            moved = (out[layer, span] != current.phy2log[layer, span]).sum()
            assert moved <= (fresh[layer, span] != current.phy2log[layer, span]).sum()
    assert (replica_counts(out, topo.experts) == replica_counts(fresh, topo.experts)).all()
    assert (split_loads(out, w2, topo.ranks, "even").max(1) <= fresh_top * 1.01 * (1 + 1e-9)).all()


@pytest.mark.parametrize("seed", range(3))
def test_incremental_with_home_nodes_stays_within_eps_and_moves_fewer(seed):
    topo = Topology(64, 72, 18, 3)  # 4 slots per GPU, 2-3 spare slots per node: the hard case
    w = zipf(6, topo.experts, 0.8, seed)
    current = plan(w, topo).placement
    w2 = drifted(w, 0.1, seed + 7)
    reference = plan(w2, topo)  # the incremental plan's own reference uses the default tol
    incr = plan(w2, topo, current, incremental=True, eps=0.01)
    incr.placement.check_integrity(topo)
    top = split_loads(incr.placement.phy2log, w2, topo.ranks, "even").max(1)
    ref_top = split_loads(reference.placement.phy2log, w2, topo.ranks, "even").max(1)
    assert (top <= ref_top * 1.01 * (1 + 1e-9)).all()
    renumbered = plan(w2, topo, current)
    assert len(incr.moves) < len(renumbered.moves)


def test_fewest_moves_takes_the_cheapest_try_that_is_ok_else_the_fallback():
    old = np.array([[0, 1, 2, 3], [0, 1, 2, 3]])
    one, two = np.array([[0, 1, 2, 0], [9, 1, 2, 3]]), np.array([[0, 1, 0, 0], [0, 1, 2, 3]])
    fallback = np.array([[3, 2, 1, 0], [3, 2, 1, 0]])
    out = fewest_moves(old, [one, two], [np.array([True, True]), np.array([True, False])], fallback)
    assert out.tolist() == [[0, 1, 2, 0], [9, 1, 2, 3]]  # one move each; the free try was not ok
    out = fewest_moves(old, [one], [np.array([False, False])], fallback)
    assert (out == fallback).all()


def test_heavy_nodes_are_those_whose_mean_gpu_is_near_or_over_the_goal():
    topo = Topology(4, 8, 4, 2)  # experts 0, 1 home on node 0 (GPUs 0, 1), 2, 3 on node 1
    old = np.array([[0, 1, 1, 0, 2, 3, 3, 2]])
    w = np.array([[4.0, 4.0, 1.0, 1.0]])  # node 0 carries 8 on 2 GPUs, node 1 carries 2
    assert heavy_nodes(w, old, topo.shape(), np.array([4.0])).tolist() == [[True, False]]
    assert heavy_nodes(w, old, topo.shape(), np.array([4.5])).tolist() == [[False, False]]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shape", [(64, 72, 18, 3), (64, 80, 16, 2), (32, 48, 12, 1)])
def test_repair_with_rotations_keeps_the_rules_and_its_state_exact(seed, shape):
    from lockstep.policy.eplb_incr import repair
    from lockstep.policy.eplb_search import SearchState

    topo = Topology(*shape)
    w = zipf(4, topo.experts, 0.8, seed)
    current = plan(w, topo).placement
    w2 = drifted(w, 0.2, seed + 3)
    goal = w2.sum(1) / topo.ranks * 1.01  # near the mean: the repair has to work
    st_ = repair(w2, current.phy2log, topo.shape(), goal)
    Placement.from_phy2log(st_.p2l, topo.experts).check_integrity(topo)
    exact = SearchState.build(st_.p2l, w2, topo.shape())
    assert np.allclose(exact.load, st_.load) and (exact.has == st_.has).all()
    assert (exact.at_home == st_.at_home).all() and (exact.r == st_.r).all()
    assert (st_.load.max(1) <= split_loads(current.phy2log, w2, topo.ranks, "even").max(1) + 1e-9).all()
