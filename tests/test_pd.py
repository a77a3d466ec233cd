"""Prefill/decode disaggregation end to end on CPU: real runtime processes, real NIXL agents
(UCX over process_vm_readv) and real shared memory, the tiny torch model.

Greedy tokens must equal one sequence decoded alone, KV must really be pulled (a pull that
moved nothing would leave zeros and change the tokens), blocks must come back on both sides
on every path (finish, abort, expiry, a killed prefill runtime), and the decode side must
start at most ``max_kv_loads_per_step`` pulls per step.
"""

import os
import signal

import attrs
import numpy as np
import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.api import open_engine
from lockstep.engine.config import EngineConfig
from lockstep.engine.disagg import Disagg, PrefillSide
from lockstep.policy.config import ConfigError, SchedulerConfig
from lockstep.policy.core import SchedulerCore
from lockstep.policy.hashing import BlockHasher
from lockstep.policy.request import Request, SamplingParams
from lockstep.policy.step import StepResult
from lockstep.transports.kv import nixl_transport
from leaks import descendant_pids, fd_count
from test_engine import GREEDY, collect, config, prompts, reference_greedy

needs_nixl = pytest.mark.skipif(not nixl_transport.available(), reason="nixl is not installed (test extra)")


def pd_config(kind="nixl", prefill=1, decode=1, **kw):
    return config(tokenizer=None, prefill_instances=prefill, instances=decode, kv_transport=kind, **kw)


async def settle(engine):
    """Wait until every prefill side has been told its holds are released."""
    with trio.fail_after(30):
        while engine.statistics().kv_held or engine.statistics().kv_blocks_used:
            await trio.sleep(0.01)


def check_cores(engine):
    for s in engine.schedulers:
        s.core.check_integrity()
        assert not s.core.held and s.core.pool.num_used == 0


async def run_all(engine, ps, params=GREEDY):
    got = [None] * len(ps)

    async def one(i):
        got[i], _ = await collect(engine, ps[i], params)
    async with trio.open_nursery() as n:
        for i in range(len(ps)):
            n.start_soon(one, i)
    return got


async def greedy_through_pd(cfg):
    """Serve the prompts greedily: tokens equal the reference's, every KV pull landed, the
    cores intact after; the engine's statistics."""
    ps = prompts()
    async with open_engine(cfg) as engine:
        got = await run_all(engine, ps)
        await settle(engine)
        stats = engine.statistics()
        check_cores(engine)
    for p, g in zip(ps, got):
        assert g == reference_greedy(p, GREEDY.max_tokens)
    assert stats.kv_pulls == len(ps) and stats.kv_pull_failures == 0  # KV really moved
    return stats


@pytest.mark.parametrize("kind,prefill,decode", [
    pytest.param("nixl", 1, 1, marks=needs_nixl), ("shm", 1, 1), pytest.param("nixl", 2, 2, marks=needs_nixl)])
async def test_pd_greedy_equals_reference(kind, prefill, decode):
    stats = await greedy_through_pd(pd_config(kind, prefill, decode))
    assert stats.waiting_for_kv == 0 and stats.kv_held == 0


@pytest.mark.parametrize("dispatch", ["exact", "padded"])
async def test_pd_with_a_dep2_decode_instance_greedy_equals_reference(dispatch):
    """The decode instance's two ranks pull KV while the other decodes: a rank whose plan
    holds only entries waiting for their KV (no tokens) still joins the expert all-to-alls."""
    await greedy_through_pd(pd_config("shm", dep=2, runtime_options={"ep_dispatch": dispatch}))


async def test_pd_engine_leaves_no_process_or_fd_behind():
    async with open_engine(pd_config("shm")) as engine:  # warm the forkserver
        await collect(engine, [5, 6, 7], SamplingParams(max_tokens=2))
    fds, procs = fd_count(), descendant_pids()
    for kind in ("shm", "nixl") if nixl_transport.available() else ("shm",):
        async with open_engine(pd_config(kind)) as engine:
            await collect(engine, [5, 6, 7], SamplingParams(max_tokens=3))
    assert fd_count() == fds
    assert descendant_pids() == procs


@needs_nixl
async def test_pd_burst_respects_the_load_cap():
    cap = 2
    sched = attrs.evolve(config().scheduler, max_kv_loads_per_step=cap, max_num_seqs=64, num_blocks=512)
    rng = np.random.default_rng(5)
    ps = [rng.integers(3, 500, int(rng.integers(4, 40))).astype(np.int32) for _ in range(40)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    async with open_engine(attrs.evolve(pd_config(), scheduler=sched)) as engine:
        loads = []
        engine.schedulers[-1].on_plan = lambda plan: loads.append(len(plan.kv_load_req_ids))
        got = await run_all(engine, ps, params)
        await settle(engine)
        stats = engine.statistics()
        check_cores(engine)
    assert max(loads) <= cap and sum(loads) == len(ps)
    assert stats.kv_pulls + stats.kv_pull_failures == len(ps)
    for p, g in zip(ps[:5], got[:5]):
        assert g == reference_greedy(p, 3)


async def test_pd_with_the_timing_runtime_serves_and_frees_everything():
    """Load tests of a P/D deployment without a model: nothing is pulled, a load is done in
    the decode step that plans it (the runtime used to die at the first hand-off)."""
    ps = prompts()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    async with open_engine(attrs.evolve(pd_config("shm"), runtime="timing",
                                        runtime_options={"sleep": False})) as engine:
        got = await run_all(engine, ps, params)
        await settle(engine)
        stats = engine.statistics()
        check_cores(engine)
    assert [len(g) for g in got] == [6] * len(ps) and stats.kv_pull_failures == 0


async def test_pd_health_and_hand_offs_see_decode_ranks_being_restarted():
    """/health's view (Engine.accepting) needs a decode rank up too, and hand-offs go to decode
    ranks that are up (a restarting rank's empty core took every one meanwhile)."""
    async with open_engine(pd_config("shm", decode=2)) as engine:
        prefill, decode = engine.schedulers[0], engine.schedulers[1:]
        disagg = decode[0].role.d
        assert engine.accepting()
        decode[0].down = True
        assert engine.accepting() and disagg.choose_decode(10) == 1
        decode[1].down = True
        assert not engine.accepting() and engine.down() == [1, 2]
        decode[0].down = decode[1].down = False
        prefill.down = True
        assert not engine.accepting()
        prefill.down = False


async def test_pd_aborts_free_blocks_on_both_sides():
    ps = prompts() * 3
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    async with open_engine(pd_config("shm")) as engine:
        async def one(i):
            n = 0
            async for out in engine.generate(ps[i], params):
                n += len(out.token_ids)
                if n >= i % 4:  # 0: before any token; 1: right after the hand-off; later: decoding
                    break
        async with trio.open_nursery() as nursery:
            for i in range(len(ps)):
                nursery.start_soon(one, i)
        await settle(engine)
        check_cores(engine)
        assert engine.statistics().running == 0


@needs_nixl
async def test_killed_prefill_runtime_loses_no_decode_request():
    """Requests already handed to the decode side finish with the right tokens; the
    prefill runtime restarts and serves new requests."""
    ps = prompts()
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    async with open_engine(pd_config("nixl")) as engine:
        prefill = engine.schedulers[0]
        handed = trio.Event()
        results = [None] * len(ps)
        firsts = [0]

        async def one(i):
            toks = []
            async for out in engine.generate(ps[i], params):
                if not toks:
                    firsts[0] += 1
                    if firsts[0] == len(ps):
                        handed.set()
                toks += out.token_ids.tolist()
            results[i] = toks

        async with trio.open_nursery() as nursery:
            for i in range(len(ps)):
                nursery.start_soon(one, i)
            await handed.wait()
            os.kill(prefill.client.ready.pid, signal.SIGKILL)
        for p, r in zip(ps, results):
            assert r == reference_greedy(p, 40)
        with trio.fail_after(60):
            while prefill.restarts == 0:
                await trio.sleep(0.01)
        again, _ = await collect(engine, ps[2], GREEDY)  # through the new prefill runtime
        assert again == reference_greedy(ps[2], GREEDY.max_tokens)
        await settle(engine)
        check_cores(engine)


async def test_expired_holds_fall_back_to_prefilling_on_the_decode_side():
    ps = prompts()
    async with open_engine(pd_config("shm", kv_hold_timeout_s=1e-9)) as engine:
        got = await run_all(engine, ps)
        await settle(engine)
        stats = engine.statistics()
        check_cores(engine)
    for p, g in zip(ps, got):
        assert g == reference_greedy(p, GREEDY.max_tokens)
    assert stats.kv_pulls + stats.kv_pull_failures == len(ps)


def test_hold_claimed_once_and_never_after_expiry_or_restart():
    """The prefill side's bookkeeping alone: a hold is claimed at most once, not after it
    expired, and not across a runtime restart (its blocks may be reused by then)."""
    cfg = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256)

    class Sched:  # what PrefillSide touches of its Scheduler
        core = SchedulerCore(cfg, BlockHasher(b"k", 16))
        streams: dict = {}

    side = PrefillSide(Disagg("shm", hold_timeout_s=5.0), 0)
    side.gen = 1
    for rid in (0, 1, 2):
        req = Request(id=rid, prompt=np.arange(3, 40, dtype=np.int32), params=SamplingParams(max_tokens=1),
                      hold_kv=True)
        Sched.core.add_request(req)
    plan = Sched.core.schedule(0.0)
    Sched.core.update(plan, StepResult(plan.step_id, np.ones(3, np.int32), np.full(3, 9, np.int32)), 0.0)
    for rid in (0, 1, 2):
        side.held_at[rid] = 0.0
    assert side.claim(Sched, 0, gen=1) == Sched.core.held[0]
    assert side.claim(Sched, 0, gen=1) is None  # once
    assert side.claim(Sched, 1, gen=0) is None  # an older runtime's blocks
    side.tick(Sched, now=5.0)  # 1 and 2 expire; 0 is being pulled and stays
    assert sorted(Sched.core.held) == [0] and side.expired == 2
    assert side.claim(Sched, 2, gen=1) is None
    Sched.core.release_held(0)
    assert Sched.core.pool.num_used == 0


@settings(max_examples=25, deadline=None)
@given(cap=st.integers(1, 8), seed=st.integers(0, 2**32 - 1))
def test_decode_core_caps_new_loads_under_a_burst(cap, seed):
    """100 arrivals at once with KV elsewhere: every plan starts at most ``cap`` loads,
    loads finish after random delays (some fail), and every request ends up decoding."""
    rng = np.random.default_rng(seed)
    cfg = SchedulerConfig(num_blocks=4000, block_size=16, max_num_seqs=128, max_num_batched_tokens=4096,
                          max_kv_loads_per_step=cap)
    core = SchedulerCore(cfg, BlockHasher(b"k", 16))
    for rid in range(100):
        n = int(rng.integers(2, 300))
        core.add_request(Request(id=rid, prompt=rng.integers(3, 1000, n).astype(np.int32),
                                 params=SamplingParams(max_tokens=2), remote_kv_tokens=n - 1))
    pending: dict[int, int] = {}  # request id -> steps until its load reports
    started, finished = set(), set()
    for _ in range(400):
        plan = core.schedule(0.0)
        assert len(plan.kv_load_req_ids) <= cap
        for rid in plan.kv_load_req_ids.tolist():
            assert rid not in started
            started.add(rid)
            pending[rid] = int(rng.integers(0, 4))
        due = [r for r, k in pending.items() if k == 0]
        for r in due:
            del pending[r]
        for r in pending:
            pending[r] -= 1
        fail = [r for r in due if rng.random() < 0.1]
        ok = [r for r in due if r not in fail]
        samp = plan.samples
        toks = np.full(int(samp.sum()), 5, np.int32)
        out = core.update(plan, StepResult(plan.step_id, samp.astype(np.int32), toks,
                                           kv_loads_done=np.array(ok, np.int64),
                                           kv_loads_failed=np.array(fail, np.int64)), 0.0)
        finished |= {rid for rid, _ in out.finished}
        core.check_integrity()
        if len(finished) == 100:
            break
    assert len(finished) == 100 and started == set(range(100))
    assert core.pool.num_used == 0


async def test_pd_with_an_fp8_kv_cache_moves_quantized_blocks_exactly():
    """An FP8 pool (e4m3 values and a float32 scale per token and layer, one span per block)
    crosses P/D unchanged: the same greedy tokens as a colocated engine with the same cache."""
    ps = prompts()[:3]
    out = []
    for cfg in (config(tokenizer=None, kv_cache_dtype="fp8"), pd_config("shm", kv_cache_dtype="fp8")):
        async with open_engine(cfg) as engine:
            out.append(await run_all(engine, ps))
            stats = engine.statistics()
            per_token = engine.schedulers[-1].client.ready.kv_bytes_per_token
    assert out[0] == out[1] and stats.kv_pulls == len(ps) and stats.kv_pull_failures == 0
    # tiny: 4 layers x (48 one-byte values + a 4-byte scale), against 4 x 48 x 8 in float64
    assert per_token == 4 * (48 + 4)


def test_a_cuda_engine_gives_each_runtime_its_own_gpu():
    """On ``cuda`` (no index) the engine numbers its runtimes, prefill pool first, and each
    takes the GPU of its number: P/D's pools land on different GPUs. The clients are only
    made here, not started (no GPU on this machine)."""
    from lockstep.engine.startup import _pool

    cfg = EngineConfig(model="tiny", device="cuda", prefill_instances=1, instances=2, kv_transport="nixl")
    d = Disagg("nixl", 10.0)
    prefill = _pool(cfg, "prefill", 1, 1, d, None)
    decode = _pool(cfg, "decode", 2, 1, d, None, first_slot=len(prefill))
    slots = [s.make_client().spec.options["device_slot"] for s in prefill + decode]
    assert slots == [0, 1, 2]
    with pytest.raises(ConfigError, match="kv_transport"):
        EngineConfig(model="tiny", device="cuda", prefill_instances=1, kv_transport="shm")


def test_nixl_export_names_the_pool_memory_and_old_peers_still_decode():
    from lockstep.transports.kv.base import pool_device, pool_region

    assert pool_device(np.zeros((4, 8), np.uint8)) == ("DRAM", 0)
    assert pool_device(torch.zeros(4, 8, dtype=torch.uint8)) == ("DRAM", 0)
    with pytest.raises(ValueError, match="CPU memory only"):
        pool_region(torch.zeros(4, 8, dtype=torch.uint8, device="meta"))
    if not nixl_transport.available():
        pytest.skip("nixl is not installed")
    import msgspec

    t = nixl_transport.NixlKVTransport("export-check")
    try:
        t.register_pool(np.zeros((4, 64), np.uint8))
        meta = msgspec.msgpack.decode(t.export().metadata, type=nixl_transport._Meta)
        assert (meta.mem, meta.device, meta.num_blocks, meta.block_bytes) == ("DRAM", 0, 4, 64)
    finally:
        t.close()
