"""The expert load balancer's runtime side: physical expert slots and replica dispatch, new
placements staged in the background and switched at a step boundary, the balancer policy,
DEP2 on CPU rebalancing mid-generation with greedy tokens unchanged, and again after a rank
died; one rank switching placements mid-generation."""

import importlib.util
import os
import signal
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch
import trio

# The runtimes that run the dispatch kernels (ep_exchange "direct") interpret them on CPU;
# set before any runtime process starts (their forkserver keeps the environment it began with).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lockstep.api import open_engine
from lockstep.engine.config import EngineConfig
from lockstep.engine.runtime_client import RuntimeDied
from lockstep.policy.config import ConfigError
from lockstep.policy.eplb import Placement, Topology, naive, plan
from lockstep.policy.eplb_align import moves
from lockstep.policy.rebalance import EplbConfig, Rebalancer
from lockstep.policy.request import SamplingParams
from lockstep.runtime.models.expert_parallel import ShardedExperts, choose_slots
from lockstep.runtime.placements import ExpertPlacements
from leaks import leaked_shm, shm_names


def _engine_tests():
    """tests/test_engine.py's helpers (the greedy reference, the tiny engine config)."""
    spec = importlib.util.spec_from_file_location("_engine_tests", Path(__file__).with_name("test_engine.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


E = _engine_tests()


def moe_layer(index: int = 1):
    return E.tiny_model().layers[index].mlp


def routed(n_tokens: int = 24, seed: int = 0):
    """Hidden states and the tiny model's own routing of them."""
    mlp = moe_layer()
    x = torch.randn(n_tokens, mlp.gate.cfg.hidden_size, generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64)
    weights, ids = mlp.gate(x)
    return x, weights, ids


# -- dispatch ---------------------------------------------------------------------------------
def test_pairs_split_evenly_over_replicas_and_ranks_start_at_different_ones():
    p = Placement.from_phy2log(np.array([[0, 1, 2, 0, 3, 0]]), 4)  # expert 0 in slots 0, 3, 5
    log2phy, replicas = torch.tensor(p.log2phy[0]), torch.tensor(p.replicas[0])
    flat = torch.tensor([0, 1, 0, 0, 2, 0, 0, 3])
    a = choose_slots(flat, log2phy, replicas, rank=0)
    assert a.tolist() == [0, 1, 3, 5, 2, 0, 3, 4]
    assert choose_slots(flat, log2phy, replicas, rank=0).tolist() == a.tolist()  # deterministic
    assert choose_slots(flat, log2phy, replicas, rank=1).tolist()[:4] == [3, 1, 5, 0]
    assert choose_slots(flat[:0], log2phy, replicas, rank=0).numel() == 0  # a dummy step


def test_any_placement_computes_what_the_unsharded_experts_do():
    x, w, ids = routed()
    want = moe_layer().experts(x, w, ids)
    for perm in ([0, 1, 2, 3, 4, 5, 6, 7], [7, 3, 5, 1, 0, 2, 6, 4]):
        sharded = ShardedExperts(moe_layer().experts, np.array(perm), rank=0, world=1)
        assert torch.equal(sharded(x, w, ids), want)


@pytest.mark.parametrize("split", ["even", "proportional"])
def test_padded_dispatch_computes_what_exact_dispatch_does(split):
    """Fixed-size buffers, padding tokens (ids past the last expert) choosing nothing, and the
    local experts through a fused kernel's reference: the same sums as exact dispatch."""
    from lockstep.kernels.fused_moe import fused_moe_reference

    x, w, ids = routed()
    want = moe_layer().experts(x, w, ids)
    layer = ShardedExperts(moe_layer().experts, np.array([7, 3, 5, 1, 0, 2, 6, 4]), rank=0, world=1, split=split)
    assert torch.equal(layer(x, w, ids), want)
    layer.dispatch, layer.pad_tokens = "padded", 32
    pad = torch.cat([ids, torch.full((4, ids.shape[1]), 8)])  # four padding tokens
    xp, wp = torch.cat([x, torch.randn(4, x.shape[1], dtype=x.dtype)]), torch.cat([w, torch.ones(4, w.shape[1])])
    got = layer(xp, wp, pad)
    assert torch.equal(got[:24], want) and not got[24:].any()
    fused = layer(xp, wp, pad, local=fused_moe_reference)
    assert torch.allclose(fused[:24], want, rtol=1e-5, atol=1e-6) and not fused[24:].any()
    layer.pad_tokens = 20
    with pytest.raises(ValueError, match="28 tokens exceed the step's pad_tokens 20"):
        layer(xp, wp, pad)


def test_received_rows_take_the_tiles_of_the_served_experts_not_of_the_storage_entries():
    """Spare storage for rebalancing holds no slot: the fused kernel's config is looked up
    for the experts the rank serves (a DEP rank's tuned entries), with its rows and k = 1."""
    from lockstep.kernels.fused_moe import fused_moe_reference, moe_config

    x, w, ids = routed()
    layer = ShardedExperts(moe_layer().experts, np.array([7, 3, 5, 1, 0, 2, 6, 4]), rank=0, world=1, spare=8)
    seen = []

    def local(rx, w13, w2, tw, ti, **kw):
        seen.append((kw["config"], len(rx), w13.shape[0]))
        return fused_moe_reference(rx, w13, w2, tw, ti, **kw)

    want = layer(x, w, ids)
    assert torch.allclose(layer(x, w, ids, local=local), want, rtol=1e-5, atol=1e-6)
    (cfg, rows, entries), = seen
    g, d = layer.gate_up_proj, layer.down_proj
    assert entries == 16 and cfg == moe_config(8, g.shape[2], d.shape[2], False, rows, 1)


# -- staging and switching ----------------------------------------------------------------------
def test_a_staged_placement_switches_only_when_ready_and_keeps_the_math():
    x, w, ids = routed()
    want = moe_layer().experts(x, w, ids)
    layer = ShardedExperts(moe_layer().experts, np.arange(8), rank=0, world=1, spare=8)
    places = ExpertPlacements([layer], torch.device("cpu"), min_stage_steps=2)
    places.receive(1, np.array([[5, 4, 7, 6, 1, 0, 3, 2]]))
    places._staging.thread.join()  # the copy is done, but fewer steps than asked have run
    with pytest.raises(RuntimeError, match="asks for expert placement 1"):
        places.use(1)
    for _ in range(3):
        assert places.ready_gen() == 0
        places.use(0)  # steps go on with the active placement
        assert torch.equal(layer(x, w, ids), want)
        places.step_done()
    assert places.ready_gen() == 1
    places.use(1)
    assert places.active == 1 and layer.tables.phy2log.tolist() == [5, 4, 7, 6, 1, 0, 3, 2]
    assert torch.equal(layer(x, w, ids), want)
    with pytest.raises(ValueError, match="generations only grow"):
        places.receive(1, np.array([[0, 1, 2, 3, 4, 5, 6, 7]]))


def test_copies_land_in_spare_entries_only():
    experts = moe_layer().experts
    topo = Topology(8, 10, 2)
    layer = ShardedExperts(experts, naive(topo, 1).phy2log[0], rank=0, world=2, spare=5)  # holds 0..4
    active = [t[:5].clone() for t in (layer.gate_up_proj, layer.down_proj)]
    staged = layer.prepare(np.array([0, 6, 2, 4, 3, 5, 1, 7, 0, 2]))  # rank 0 gets 6, keeps 0 2 4 3
    assert [e for _, e in staged.copies] == [6] and staged.copies[0][0] >= 5
    layer.copy_in(staged)
    assert torch.equal(layer.gate_up_proj[:5], active[0]) and torch.equal(layer.down_proj[:5], active[1])
    layer.switch(staged)
    entry = int(layer.tables.store_of[1])
    assert torch.equal(layer.gate_up_proj[entry], experts.gate_up_proj[6])
    assert layer.tables.store_of.tolist()[2:] == [2, 4, 3]  # kept experts never move in memory
    with pytest.raises(ValueError, match="two replicas"):
        layer.prepare(np.array([0, 0, 2, 4, 3, 5, 1, 7, 6, 2]))


def test_copy_all_copies_every_expert_that_changes_slot_into_spare_entries():
    """One rank holds every expert, so a new order of its slots copies nothing; with
    ``copy_all`` each expert that changes slot is copied in as if it came from elsewhere."""
    x, w, ids = routed()
    want = moe_layer().experts(x, w, ids)
    swap = np.array([0, 6, 2, 3, 4, 5, 1, 7])  # experts 1 and 6 trade slots
    assert ShardedExperts(moe_layer().experts, np.arange(8), rank=0, world=1, spare=8).prepare(swap).copies == []
    layer = ShardedExperts(moe_layer().experts, np.arange(8), rank=0, world=1, spare=8, copy_all=True)
    staged = layer.prepare(swap)
    assert sorted(e for _, e in staged.copies) == [1, 6] and all(entry >= 8 for entry, _ in staged.copies)
    layer.copy_in(staged)
    layer.switch(staged)
    assert layer.tables.store_np.tolist() == [0, staged.copies[0][0], 2, 3, 4, 5, staged.copies[1][0], 7]
    assert torch.equal(layer(x, w, ids), want)


# -- the balancer policy ------------------------------------------------------------------------
def test_rebalancer_plans_on_a_window_and_waits_for_every_rank():
    topo = Topology(8, 10, 2)
    rb = Rebalancer(EplbConfig(redundant_experts=2, window_steps=2), topo, moe_layers=[1, 2])
    hot = np.zeros((3, 8), np.int32)
    hot[1:, 5] = 40
    hot[1:, :] += 1
    for _ in range(2):
        assert not rb.due()
        rb.add(0, hot, 0)
        rb.add(1, None, 0)  # a dummy step on rank 1
    assert rb.due()
    new = rb.plan(rb.take_window())
    assert rb.adopt(new) == 1 and rb.pending == 1 and (new.placement.replicas[:, 5] == 2).all()
    for _ in range(2):
        rb.add(0, hot, 1)
        rb.add(1, hot, 0)  # rank 1 has not switched yet: nothing new goes out
    assert not rb.due()
    rb.add(1, hot, 1)
    assert rb.due()
    same = plan(rb.take_window(), topo, rb.placement, incremental=True)
    assert rb.adopt(same) is None and rb.gen == 1  # nothing to move, nothing handed out
    rb.restarted()
    assert rb.placement is rb.initial and rb.pending is None


def test_engine_config_refuses_slots_that_do_not_split_over_the_ranks():
    with pytest.raises(ConfigError, match="multiple of engine.dep"):
        EngineConfig(model="tiny", dep=2, eplb=EplbConfig(redundant_experts=1))
    with pytest.raises(ConfigError, match="window_steps"):
        EplbConfig(window_steps=0)
    # what the model's experts allow, read from its config before any runtime starts (these
    # used to be runtime tracebacks)
    with pytest.raises(ConfigError, match=r"engine.dep 3 must divide the expert slots: .* 8 routed experts"):
        EngineConfig(model="tiny", dep=3)
    with pytest.raises(ConfigError, match="redundant_experts 10: .* at most 8 replicas"):
        EngineConfig(model="tiny", dep=2, eplb=EplbConfig(redundant_experts=10))
    with pytest.raises(ConfigError, match="one rank has no room for replicas"):
        EngineConfig(model="tiny", eplb=EplbConfig(redundant_experts=2))


# -- DEP2 end to end ----------------------------------------------------------------------------
async def greedy_all(engine, ps, params) -> list:
    """Every prompt's tokens, the prompts served concurrently."""
    got = [None] * len(ps)

    async def one(i):
        got[i], _ = await E.collect(engine, ps[i], params)
    async with trio.open_nursery() as n:
        for i in range(len(ps)):
            n.start_soon(one, i)
    return got


HOLD = 2  # the results of this many steps after a placement came, at least, report it not ready


async def test_dep2_rebalances_mid_generation_with_greedy_tokens_unchanged():
    ps = E.prompts()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    cfg = attrs.evolve(E.config(tokenizer=None), dep=2, eplb=EplbConfig(redundant_experts=2, window_steps=3),
                       runtime_options={"eplb_min_stage_steps": HOLD})
    log = []  # every rank's plans and results, in the one order the engine saw them
    async with open_engine(cfg) as engine:
        for r, s in enumerate(engine.schedulers):
            s.on_plan = lambda p, r=r, s=s: log.append(("plan", r, p.placement_gen, s.placement_status().forwarded,
                                                        p.is_dummy))
            s.on_result = lambda p, res, r=r: log.append(("result", r, p.placement_gen, res.placement_ready))

        got = await greedy_all(engine, ps, params)
        stats = engine.balancer_statistics()
        status = [s.placement_status() for s in engine.schedulers]
    for p, g in zip(ps, got):
        assert g == E.reference_greedy(p, params.max_tokens)
    assert stats.generation >= 1 and stats.moved_experts > 0
    assert all(st.running >= 1 for st in status)  # the placement advanced on both ranks
    _check_switch(log, gen=1)


async def test_a_planner_process_that_dies_is_replaced_and_serving_goes_on():
    """The planner's process killed (the OOM killer's pick, say) loses one window's plan:
    a new planner takes the next windows, requests are served on (the whole engine used to
    die with BrokenProcessPool)."""
    ps = E.prompts()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    cfg = attrs.evolve(E.config(tokenizer=None), dep=2, eplb=EplbConfig(redundant_experts=2, window_steps=3),
                       runtime_options={"eplb_min_stage_steps": HOLD})
    async with open_engine(cfg) as engine:
        await greedy_all(engine, ps[:2], params)
        before = engine.balancer_statistics().plans
        for pid in list(engine.balancer._pool._processes):
            os.kill(pid, signal.SIGKILL)
        want = [E.reference_greedy(p, params.max_tokens) for p in ps]
        for _ in range(8):  # until the new planner has planned (its start takes a while)
            assert await greedy_all(engine, ps, params) == want
            stats = engine.balancer_statistics()
            if stats.plans > before:
                break
        from lockstep.prom import ServerMetrics
        text = ServerMetrics("tiny").render(engine.statistics(), (), stats, len(engine.down()))
    assert stats.planner_restarts == 1 and stats.plans > before
    assert 'lockstep:eplb_planner_restarts_total{model_name="tiny"} 1.0' in text  # what /metrics shows
    assert f'lockstep:eplb_plans_total{{model_name="tiny"}} {float(stats.plans)}' in text


@pytest.mark.parametrize("split, exchange", [("even", "nccl"), ("proportional", "nccl"), ("even", "peer"),
                                             ("proportional", "direct")])
async def test_dep2_padded_dispatch_keeps_greedy_tokens_through_a_switch(split, exchange):
    """Decode steps with padded dispatch (fixed-size all-to-alls, nothing on the host: what a
    CUDA graph holds), prefill steps with exact dispatch, and a placement switched in place
    mid-generation: greedy tokens unchanged. ``peer``: the exchanges as copies into the
    peers' memory (a shared file on CPU) and a barrier, not Gloo all-to-alls; ``direct``:
    the dispatch and combine kernels (``kernels.ep_dispatch``, interpreted), dummy steps and
    the switch included."""
    ps = E.prompts()
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    shm = shm_names()
    cfg = attrs.evolve(E.config(tokenizer=None), dep=2,
                       eplb=EplbConfig(redundant_experts=2, window_steps=3, token_split=split),
                       runtime_options={"ep_dispatch": "padded", "ep_exchange": exchange})
    async with open_engine(cfg) as engine:
        got = await greedy_all(engine, ps, params)
        stats = engine.balancer_statistics()
    for p, g in zip(ps, got):
        assert g == E.reference_greedy(p, params.max_tokens)
    assert stats.generation >= 1
    assert not leaked_shm(shm, "lockstep-ep-")


def _peer_exchange_worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    from lockstep.runtime.models.peer_exchange import PeerExchange

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ex = PeerExchange(8, [10, 6], world, rank, None, torch.device("cpu"))
        g = torch.Generator().manual_seed(rank)
        for step, n in enumerate((8, 3, 8, 1)):  # blocks of any size up to the room, channels alternating
            c = step % 2
            send = torch.randint(0, 256, (world * n, ex.row_bytes[c]), generator=g, dtype=torch.uint8)
            want = torch.empty_like(send)
            dist.all_to_all_single(want, send)
            assert torch.equal(ex.exchange(c, send), want), (rank, step)
        with pytest.raises(ValueError, match="9 rows a block, room for 8"):
            ex.exchange(0, torch.zeros(world * 9, 10, dtype=torch.uint8))
        with pytest.raises(ValueError, match="send must be uint8"):
            ex.exchange(1, torch.zeros(world, 10, dtype=torch.uint8))
        ex.close()
    finally:
        dist.destroy_process_group()


def _direct_worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    from lockstep.runtime.models.expert_parallel import attach_peer_exchange

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        experts = moe_layer().experts.to(torch.float32)
        x, w, ids = routed(24, seed=rank)
        x, w = x.float(), w.float()
        perm = np.array([7, 3, 5, 1, 0, 2, 6, 4])  # 4 slots a rank
        want = ShardedExperts(experts, perm, rank, world)(x, w, ids)  # exact dispatch, Gloo
        layer = ShardedExperts(experts, perm, rank, world, dispatch="padded")
        layer.pad_tokens = 32
        ex = attach_peer_exchange([layer], 32, ids.shape[1], None, torch.device("cpu"), direct=True)
        pad = torch.cat([ids, torch.full((4, ids.shape[1]), 8)])  # four padding tokens
        xp, wp = torch.cat([x, torch.randn(4, x.shape[1])]), torch.cat([w, torch.ones(4, w.shape[1])])
        from lockstep.kernels.fused_moe import fused_moe_reference

        # The second layer finds every tag reset; the third runs the experts through a fused
        # kernel's reference, which writes only the taken rows of an output area full of NaN.
        for local in (None, None, fused_moe_reference):
            if local is not None:
                ex.local(2, ex.rows).fill_(255)  # all-ones bytes: float32 NaN
                dist.barrier()
            got = layer(xp, wp, pad, local=local)
            assert torch.allclose(got[:24], want, rtol=1e-5, atol=1e-6) and not got[24:].any(), rank
            dist.barrier()  # (the check only: a peer's next layer would write tags again)
            assert (ex.local(1, ex.rows).view(torch.int32) == -1).all()
            dist.barrier()
        ex.close()
    finally:
        dist.destroy_process_group()


def test_direct_dispatch_kernels_compute_what_exact_dispatch_does(monkeypatch):
    """Two ranks (processes, Gloo; the Triton kernels interpreted): padded dispatch by
    kernels that write each pair's row into its owner's area and read the results back from
    the owners' areas sums what exact dispatch through Gloo's all-to-alls does; padding
    tokens get nothing, the tags are reset for the next layer, and rows no pair took are
    never read."""
    import socket

    import torch.multiprocessing as tmp

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp.start_processes(_direct_worker, args=(2, port), nprocs=2, start_method="spawn")


def test_the_exchange_through_peers_memory_is_chosen_only_on_one_host():
    from lockstep.runtime.runtime_setup import exchange_for

    assert exchange_for(None, "cuda", ["a", "a"]) == "direct"
    assert exchange_for(None, "cpu", ["a", "a"]) == "nccl"
    assert exchange_for(None, "cuda", ["a", "b"]) == "nccl"  # the default falls back
    assert exchange_for("peer", "cpu", ["a", "a"]) == "peer"
    with pytest.raises(ValueError, match="ep_exchange 'direct' needs every DEP rank on one host.*2 hosts"):
        exchange_for("direct", "cuda", ["a", "b", "a"])
    with pytest.raises(ValueError, match="ep_exchange must be 'nccl', 'peer' or 'direct', got 'shm'"):
        exchange_for("shm", "cuda", ["a"])


async def test_exact_dispatch_with_cuda_graphs_is_refused_at_load_on_every_rank():
    """Capturing a step whose MoE layers sync the host fails on one rank mid-collective and
    left its peers waiting in it (found on two H200s): refused before any capture, by name."""
    cfg = EngineConfig(model="tiny", device="cpu", dtype="bfloat16", dep=2, tokenizer=None,
                       runtime_options={"fast": True, "ep_dispatch": "exact", "cuda_graphs": "on"})
    with trio.fail_after(60), pytest.raises(RuntimeDied) as got:  # every rank's, raised as the first's
        async with open_engine(cfg):
            pass
    assert "cuda_graphs 'on' does not run with ep_dispatch 'exact'" in str(got.value)


def test_peer_exchange_delivers_what_an_all_to_all_does_and_leaves_no_file():
    """Three ranks (processes, Gloo): each copies its blocks into the peers' areas of one
    shared file; every exchange, at any block size, equals all_to_all_single's; the file is
    gone once the ranks have mapped it."""
    import socket

    import torch.multiprocessing as tmp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = shm_names()
    tmp.start_processes(_peer_exchange_worker, args=(3, port), nprocs=3, start_method="forkserver")
    assert not leaked_shm(before, "lockstep-ep-")


async def test_dep2_proportional_token_split_keeps_greedy_tokens():
    """Each batch's replicated experts split by the GPUs' loads (an all-reduce per layer):
    it changes which rank computes a pair, never the math."""
    ps = E.prompts()[:3]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cfg = attrs.evolve(E.config(tokenizer=None), dep=2,
                       eplb=EplbConfig(redundant_experts=2, window_steps=10_000, token_split="proportional"))
    async with open_engine(cfg) as engine:
        got = await greedy_all(engine, ps, params)
    for p, g in zip(ps, got):
        assert g == E.reference_greedy(p, params.max_tokens)


def test_proportional_split_levels_the_gpus_holding_replicas():
    """4 ranks of 2 slots: expert 0 on GPUs 0 and 3, expert 1 on GPUs 1 and 3; GPU 0 also
    holds the heavy expert 2. The split moves expert 0's pairs off GPU 0."""
    import torch

    from lockstep.policy.eplb import Placement
    from lockstep.runtime.models.expert_parallel import choose_slots, proportional_slots

    phy2log = np.array([0, 2, 1, 3, 4, 5, 0, 1])
    p = Placement.from_phy2log(phy2log[None], 6)
    log2phy, reps = torch.tensor(p.log2phy[0]), torch.tensor(p.replicas[0])
    rng = np.random.default_rng(0)
    ranks = [torch.tensor(rng.choice(6, size=400, p=[.4, .1, .15, .15, .1, .1])) for _ in range(4)]
    total = sum(torch.bincount(f, minlength=6) for f in ranks)
    loads = {}
    for name in ("even", "proportional"):
        load = torch.zeros(4)
        for r, f in enumerate(ranks):
            s = (choose_slots(f, log2phy, reps, r) if name == "even"
                 else proportional_slots(f, log2phy, reps, r, 4, total, 2))
            assert (torch.tensor(phy2log)[s] == f).all()  # every pair reaches its own expert
            load += torch.bincount(s // 2, minlength=4)
        assert load.sum() == 1600
        loads[name] = (load.mean() / load.max()).item()
    assert loads["proportional"] > loads["even"] + 0.1  # 0.855 against 0.733


def _check_switch(log: list, gen: int, ranks: tuple[int, ...] = (0, 1)) -> None:
    """Steps went on while the copy ran, and the ranks switched together, at a step boundary
    after every rank had said it was ready: no step waited for the copy."""
    first_plan = next(i for i, e in enumerate(log) if e[0] == "plan" and e[2] >= gen)
    for r in ranks:
        ready_at = next(i for i, e in enumerate(log) if e[0] == "result" and e[1] == r and e[3] >= gen)
        assert ready_at < first_plan
        plans = [e for e in log if e[0] == "plan" and e[1] == r]
        results = [e for e in log if e[0] == "result" and e[1] == r]
        # Steps this rank's runtime ran after the placement reached it and before it was ready:
        staging = [p for p, res in zip(plans, results) if p[3] >= gen and res[3] < gen]
        assert len(staging) >= HOLD
        # Once a rank ran the new placement it never ran an older one.
        gens = [p[2] for p in plans]
        assert gens == sorted(gens)
    switched = [e for e in log if e[0] == "plan" and e[2] >= gen]
    assert any(not e[4] for e in switched)  # real tokens ran on the new placement (mid-generation)


# -- one rank ------------------------------------------------------------------------------------
def _swap_hot_and_cold(policy: Rebalancer, pairs: int = 2) -> list[np.ndarray]:
    """One rank holds every expert once (a GPU holds one replica of an expert: no redundant
    slots), so the planner has nothing to balance and moves nothing. Hand out instead the
    placement in use with the slots of each layer's ``pairs`` hottest and coldest experts
    swapped (what ``bench_multi_gpu.py --dep 1`` does). Returns the list the placements
    handed out are appended to (phy2log, in generation order)."""
    inner_take, inner_adopt, handed, loads = policy.take_window, policy.adopt, [], []

    def take_window():  # the load the planner (another process) plans for
        loads.append(inner_take())
        return loads[-1]

    def swapped(load, new):
        old = policy.placement.phy2log
        assert not len(new.moves)
        p2l = old.copy()
        for row, w in zip(p2l, load):
            order, slot = np.argsort(-w, kind="stable"), np.argsort(row)
            a, b = slot[order[:pairs]], slot[order[::-1][:pairs]]
            row[a], row[b] = row[b].copy(), row[a].copy()
        return attrs.evolve(new, placement=Placement.from_phy2log(p2l, policy.topo.experts), moves=moves(old, p2l))

    def adopt(new):
        new = swapped(loads[-1], new)
        gen = inner_adopt(new)
        if gen is not None:
            handed.append(new.placement.phy2log)
        return gen
    policy.take_window, policy.adopt = take_window, adopt
    return handed


def _replay_copies(cfg: EngineConfig, placements: list[np.ndarray]) -> int:
    """The expert copies a runtime started as ``cfg``'s makes to switch through
    ``placements`` in turn (the engine's runtime is another process, so a second one here
    replays them), checking that every slot then reads its expert's weights."""
    from lockstep.runtime.torch_runtime import TorchRuntime

    rt = TorchRuntime()
    rt.load(cfg.runtime_spec(options={**cfg.runtime_options, "threads": torch.get_num_threads()}))
    n = 0
    for p2l in placements:
        for layer, row in zip(rt.placements.layers, p2l):
            staged = layer.prepare(row)
            n += len(staged.copies)
            layer.copy_in(staged)
            layer.switch(staged)
            for entry, e in zip(layer.tables.store_np, row):
                assert torch.equal(layer.gate_up_proj[entry], layer._source[0][e])
                assert torch.equal(layer.down_proj[entry], layer._source[1][e])
    rt.shutdown()
    return n


@pytest.mark.parametrize("dispatch, copy_all", [("exact", False), ("padded", False), ("padded", True)])
async def test_one_rank_switches_placements_mid_generation_with_greedy_tokens_unchanged(dispatch, copy_all):
    """One rank with the balancer on and skewed routing: placements handed out mid-generation
    are staged while steps go on and switched at a step boundary; greedy tokens equal a run
    without the balancer. With padded dispatch the one-rank scheduler marks decode-only steps
    as the DP sync of a DEP instance would (the runtime then pads them: CUDA graphs on a GPU).
    With runtime option ``eplb_copy_all`` every switch copies the experts that change slot
    (one rank's share of a DEP switch), and tokens still do not change."""
    ps = E.prompts()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    skewed = {"expert_skew": 1.0}
    async with open_engine(E.config(tokenizer=None, runtime_options=skewed)) as engine:
        want = await greedy_all(engine, ps, params)
    cfg = E.config(tokenizer=None, eplb=EplbConfig(redundant_experts=0, window_steps=3),
                   runtime_options={**skewed, "eplb_min_stage_steps": HOLD, "ep_dispatch": dispatch,
                                    "eplb_copy_all": copy_all})
    log, plans = [], []
    async with open_engine(cfg) as engine:
        handed = _swap_hot_and_cold(engine.balancer.policy)
        s = engine.schedulers[0]
        s.on_plan = lambda p: (log.append(("plan", 0, p.placement_gen, s.placement_status().forwarded, p.is_dummy)),
                               plans.append(p))
        s.on_result = lambda p, res: log.append(("result", 0, p.placement_gen, res.placement_ready))
        got = await greedy_all(engine, ps, params)
        stats, status = engine.balancer_statistics(), s.placement_status()
    assert got == want
    assert stats.generation >= 1 and stats.moved_experts > 0 and status.running >= 1
    _check_switch(log, gen=1, ranks=(0,))
    # Mid-generation: a request decoded on the initial placement and then on a new one.
    before = {int(r) for p in plans if p.placement_gen == 0 for r in p.req_ids}
    after = {int(r) for p in plans if p.placement_gen >= 1 for r in p.req_ids}
    assert before & after
    decodes = [p for p in plans if p.num_reqs and p.num_new.max() <= 1]
    assert decodes and all(p.uniform_decode for p in decodes)
    assert not any(p.uniform_decode for p in plans if p.num_reqs and p.num_new.max() > 1)
    # One copy per slot whose expert changed with the option, none without it.
    assert len(handed) == stats.generation
    assert _replay_copies(cfg, handed) == (stats.moved_experts if copy_all else 0)


async def test_dep2_rebalancing_starts_over_after_a_rank_dies():
    cfg = attrs.evolve(E.config(tokenizer=None), dep=2, eplb=EplbConfig(redundant_experts=2, window_steps=3))
    async with open_engine(cfg) as engine:
        gen = engine.generate(E.prompts()[2], SamplingParams(max_tokens=300, ignore_eos=True))
        async for _ in gen:  # until the ranks run a balanced placement
            if min(s.placement_status().running for s in engine.schedulers) >= 1:
                break
        before = engine.balancer_statistics().generation
        os.kill(engine.schedulers[1].client.ready.pid, signal.SIGKILL)
        with trio.fail_after(10), pytest.raises(RuntimeDied):
            async for _ in gen:
                pass
        # The new runtimes start at the initial placement (generation 0); the balancer
        # starts over from it, with generations that keep growing.
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        toks, _ = await E.collect(engine, E.prompts()[2], params)
        assert toks == E.reference_greedy(E.prompts()[2], params.max_tokens)
        assert all(s.placement_status().running > before for s in engine.schedulers)
        assert [s.statistics().runtime_restarts for s in engine.schedulers] == [1, 1]
