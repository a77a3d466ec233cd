"""The simulator's fast paths change nothing but speed.

- ``SchedulerCore.decode_run`` / ``advance(k)`` through the round in which requests finish
  equal k single steps (same finish steps, outputs, pool state);
- the simulator folds that last step, or the one in which the next arrival falls, into its
  run and still gives what stepping one by one gives, to the bit;
- the block pool's host tier takes a run of new blocks at once as it takes them one by one.
"""

from pathlib import Path

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_core import (FAST, FakeRuntime, Run, check_outcome, check_plan, decode_only, drive, pool_state,
                       same_schedule, simple, workloads)

from lockstep.policy.block_pool import HostTier
from lockstep.policy.config import SchedulerConfig
from lockstep.policy.core import SchedulerCore
from lockstep.policy.config import ConfigError
from lockstep.policy.deployment_file import load_deployment
from lockstep.policy.hashing import BlockHasher
from lockstep.policy.request import FinishReason, Request, SamplingParams
from lockstep.policy.step import StepResult
from lockstep.sim import cost as cost_module
from lockstep.sim.simulator import Simulator
from lockstep.sim.traces import read_trace

ROOT = Path(__file__).parents[1]
DATA = Path(__file__).parent / "data"


# --- the core: advance through the finishing round ----------------------------------------------


def drive_through_finish(cfg: SchedulerConfig, specs: list) -> Run:
    """test_core's driver (async, with KV loads, aborts and preemption), its runs reaching
    the round in which requests finish. The plan such a run leaves may be empty: like an
    empty scheduled plan, it is not kept in flight."""
    core = SchedulerCore(cfg, BlockHasher(b"test-secret", cfg.block_size))
    by_id = {s.rid: s for s in specs}
    rt = FakeRuntime(cfg, by_id, core.hasher, check_kv=False)
    arrivals = sorted(specs, key=lambda s: (s.arrival, s.rid))
    aborts = sorted((s.abort_at, s.rid) for s in specs if s.abort_at is not None)
    run = Run(core, {}, [], [], runtime=rt)
    step, infl = 0, None

    def apply(plan):
        for rid, why in core.update(plan, rt.execute(plan), float(step)).finished:
            run.finished.append((rid, why, step))

    while arrivals or aborts or core.has_work() or infl is not None:
        assert step < 10_000
        while arrivals and arrivals[0].arrival <= step:
            s = arrivals.pop(0)
            run.reqs[s.rid] = s.request()
            core.add_request(run.reqs[s.rid])
        while aborts and aborts[0][0] <= step:
            rid = aborts.pop(0)[1]
            if core.abort(rid):
                run.finished.append((rid, FinishReason.ABORT, step))
        if not core.has_work() and infl is None and not rt.loading:
            nxt = [a.arrival for a in arrivals[:1]] + [a[0] for a in aborts[:1]]
            if nxt:
                step = max(step + 1, min(nxt))
            continue
        if infl is not None and decode_only(core, infl, rt):
            nxt = [a.arrival for a in arrivals[:1]] + [a[0] for a in aborts[:1]]
            k, _ = core.decode_run()
            if nxt:
                k = min(k, min(nxt) - step)
            if k >= 2:
                slots = np.flatnonzero(core.s_active)
                idx = np.arange(k)
                tokens = np.stack([rt.truth[int(core.s_rid[s])][core.s_req[s].prompt_len + core.s_nout[s] + idx]
                                   for s in slots]).astype(np.int32)
                out, infl = core.advance(k, tokens)
                step += k
                for rid, why in out.finished:
                    run.finished.append((rid, why, step - 1))
                run.advanced_steps += k
                core.check_integrity()
                check_plan(infl, cfg)
                if infl.is_empty() and not rt.loading:
                    infl = None
                continue
        plan = core.schedule(float(step))
        check_plan(plan, cfg)
        if infl is not None:
            apply(infl)
        infl = plan if not (plan.is_empty() and not rt.loading) else None
        step += 1
        core.check_integrity()
    run.steps = step
    return run


@FAST
@given(workloads())
def test_advance_through_finish_equals_stepping(wl):
    cfg, specs = wl
    stepped, advanced = drive(cfg, specs), drive_through_finish(cfg, specs)
    check_outcome(advanced, specs, cfg)
    same_schedule(advanced, stepped, specs)
    assert pool_state(advanced, specs) == pool_state(stepped, specs)


def test_advance_through_finish_skips_the_last_steps_too():
    cfg = SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    specs = simple(3, max_tokens=30)
    stepped, advanced = drive(cfg, specs), drive_through_finish(cfg, specs)
    assert advanced.advanced_steps > drive(cfg, specs, use_advance=True).advanced_steps
    check_outcome(advanced, specs, cfg)
    same_schedule(advanced, stepped, specs)
    assert pool_state(advanced, specs) == pool_state(stepped, specs)


def lone_core(max_tokens: int) -> tuple[SchedulerCore, int]:
    cfg = SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    core = SchedulerCore(cfg, BlockHasher(b"k", 4))
    core.add_request(Request(id=0, prompt=np.arange(10, 23, dtype=np.int32),
                             params=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    prefill = core.schedule(0.0)
    core.schedule(0.0)  # async: the first decode, planned before the prefill's result
    core.update(prefill, StepResult(prefill.step_id, np.ones(1, np.int32), np.array([5], np.int32)), 0.0)
    return core, prefill.step_id


@pytest.mark.parametrize("max_tokens", [3, 4, 9])
def test_decode_run_counts_the_finishing_round(max_tokens):
    core, first = lone_core(max_tokens)
    k, finishes = core.decode_run()
    assert (k, finishes) == (max_tokens - 1, True)  # the prefill sampled the first token
    assert core.identical_decode_steps() == k - 1
    out, left = core.advance(k, np.arange(k, dtype=np.int32)[None] + 100)
    assert out.finished and out.finished[0][0] == 0 and left.is_empty()
    assert left.step_id == first + 1 + k  # as many plans as single steps make
    assert not core.has_work() and core.pool.num_used == 0
    core.check_integrity()


# --- the simulator: folded runs ----------------------------------------------------------------


def both(deployment, workload):
    runs = []
    for adv in (True, False):
        sim = Simulator(deployment, workload, seed=0, use_advance=adv)
        runs.append((sim.run(), sim.metrics))
    return runs


@pytest.mark.parametrize("example,trace,n", [
    ("h200-v2lite.toml", "azure_code_300.csv", 300),
    ("h200-dep8.toml", "azure_code_300.csv", 300),
    ("h200-v2lite.toml", "mooncake_conversation_300.jsonl", 80),
])
def test_folded_runs_equal_stepping_to_the_bit(example, trace, n):
    (rep_a, a), (rep_b, b) = both(load_deployment(ROOT / "examples" / example), read_trace(DATA / trace).requests[:n])
    for key in ("arrival", "first", "second", "last", "finish"):
        assert np.array_equal(getattr(a, key), getattr(b, key), equal_nan=True), key
    assert (a.ntok == b.ntok).all()
    assert a.steps == b.steps
    for key in ("prefix_cache", "preemptions", "kv_cache_use", "ttft_s", "tpot_s", "e2e_s", "requests"):
        assert rep_a[key] == rep_b[key], key


def test_a_lone_request_costs_two_step_events():
    """Arrival, the prefill's end, the end of the run that finishes it: no single step for
    the last token."""
    workload = read_trace(DATA / "azure_code_300.csv").requests[:1]
    sim = Simulator(load_deployment(ROOT / "examples" / "h200-v2lite.toml"), workload)
    calls = []
    update = SchedulerCore.update
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SchedulerCore, "update", lambda self, *a: calls.append(1) or update(self, *a))
        rep = sim.run()
    assert rep["requests"]["completed"] == 1 and rep["steps"] == workload[0].output_len
    assert len(calls) == 1  # only the prefill's result is applied as a single step


@pytest.mark.parametrize("arrival", [0.05, 0.2])
def test_a_run_takes_the_step_in_which_an_arrival_falls(arrival):
    """A arrives alone and decodes; B arrives during A's run. Single steps: A's prefill, the
    step planned before B arrived but dispatched after, and the one that prefills B. The
    step in which B arrives ends A's run, and is applied with it; results equal stepping."""
    a, b = read_trace(DATA / "azure_code_300.csv").requests[:2]
    workload = [attrs.evolve(a, arrival_s=0.0, output_len=200), attrs.evolve(b, arrival_s=arrival, output_len=50)]
    deployment = load_deployment(ROOT / "examples" / "h200-v2lite.toml")
    sim = Simulator(deployment, workload)
    calls = []
    update = SchedulerCore.update
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SchedulerCore, "update", lambda self, *a: calls.append(1) or update(self, *a))
        sim.run()
    assert len(calls) == 3
    (_, fast), (_, slow) = both(deployment, workload)
    for key in ("first", "second", "last", "finish", "ntok"):
        assert np.array_equal(getattr(fast, key), getattr(slow, key), equal_nan=True), key


@pytest.mark.parametrize("example", ["h200-v2lite.toml", "h200-dep8.toml", "gb300-nvl72.toml"])
def test_long_runs_are_priced_to_the_bit_as_step_by_step(example, monkeypatch):
    """decode_run_ends prices a long run with numpy: the same floats as its Python loop."""
    d = load_deployment(ROOT / "examples" / example)
    pool = d.pools[0]
    cost = cost_module.AnalyticCost(d.model(pool.model), d.hardware, d.cost, pool.dep, d.host)
    rng = np.random.default_rng(7)
    for _ in range(100):
        ns = [float(rng.integers(0, 200)) if rng.random() < 0.8 else 0.0 for _ in range(pool.dep)]
        ns[0] = ns[0] or 1.0
        bases = [float(rng.integers(0, 10**7)) if n else 0.0 for n in ns]
        k, t = int(rng.integers(cost_module.VECTOR_RUN, 400)), float(rng.random() * 1000)
        until = t + float(rng.random() * 0.5) if rng.random() < 0.7 else np.inf
        last_free, through = bool(rng.random() < 0.5), bool(rng.random() < 0.5)
        fast = cost.decode_run_ends(t, ns, bases, k, until, last_free=last_free, through=through)
        with monkeypatch.context() as mp:
            mp.setattr(cost_module, "VECTOR_RUN", 1 << 30)
            assert cost.decode_run_ends(t, ns, bases, k, until, last_free=last_free, through=through) == fast
        if through and fast and fast[-1] >= until:  # the step that reaches until ends it
            assert all(e < until for e in fast[:-1])


def test_a2a_latency_adds_two_exchanges_a_moe_layer_to_dep_steps_only():
    """[cost] a2a_latency_s: each MoE layer's dispatch and combine cost that much more, of
    which a2a_overlap hides its share; one rank has no all-to-all; the priced runs agree."""
    import attrs

    for example in ("h200-dep8.toml", "h200-v2lite.toml"):
        d = load_deployment(ROOT / "examples" / example)
        pool = d.pools[0]
        model = d.model(pool.model)
        plain = cost_module.AnalyticCost(model, d.hardware, d.cost, pool.dep, d.host)
        slow_cost = attrs.evolve(d.cost, a2a_latency_s=50e-6)
        slow = cost_module.AnalyticCost(model, d.hardware, slow_cost, pool.dep, d.host)
        ns, bases = [64.0] * pool.dep, [64.0 * 1024] * pool.dep
        want = 0.0 if pool.dep == 1 else model.moe_layers * 2 * 50e-6 * (1 - d.cost.a2a_overlap)
        a = plain.decode_run_ends(0.0, ns, bases, 1, np.inf, last_free=False)
        b = slow.decode_run_ends(0.0, ns, bases, 1, np.inf, last_free=False)
        assert b[-1] - a[-1] == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_a2a_latency_must_not_be_negative(tmp_path):
    src = (ROOT / "examples" / "h200-dep8.toml").read_text()
    bad = tmp_path / "bad.toml"
    assert "a2a_latency_s = 0.0" in src
    bad.write_text(src.replace("a2a_latency_s = 0.0", "a2a_latency_s = -1e-6", 1))
    with pytest.raises(ConfigError, match=r"\[cost\].*'a2a_latency_s' must be a finite number >= 0, got -1e-06"):
        load_deployment(bad)


# --- the pool's bulk paths --------------------------------------------------------------------


@FAST
@given(st.integers(0, 2**32 - 1), st.integers(1, 40))
def test_host_tier_put_in_bulk_equals_one_at_a_time(seed, capacity):
    rng = np.random.default_rng(seed)
    bulk, single = HostTier(capacity), HostTier(capacity)
    for _ in range(30):
        lane0 = rng.integers(0, 60, int(rng.integers(0, 12))).tolist()
        lane1 = rng.integers(0, 9, len(lane0)).tolist()
        bulk.put(lane0, lane1)
        for k, v in zip(lane0, lane1):  # the documented rule, one block at a time
            single._lru[k] = v
            single._lru.move_to_end(k)
            while len(single._lru) > capacity:
                single._lru.popitem(last=False)
        assert list(bulk._lru.items()) == list(single._lru.items())


def test_a_dep_group_wider_than_a_node_pays_the_scaleout_links():
    """Within gpus_per_node the all-to-all runs over NVLink; DEP16 on 8-GPU nodes sends half its
    bytes over the (slower) scale-out links, so the same per-rank batch costs more there."""
    from lockstep.policy.deployment import CostSpec, HardwareSpec, MODEL_PRESETS, ModelSpec
    from lockstep.sim.cost import AnalyticCost
    hw = HardwareSpec(name="h", hbm_bytes=141e9, hbm_bandwidth=4.8e12, flops=989e12, link_bandwidth=450e9,
                      gpus_per_node=8, scaleout_bandwidth=50e9)
    model = ModelSpec(name="v3", **MODEL_PRESETS["deepseek-v3"])
    a8, a16 = AnalyticCost(model, hw, CostSpec(), 8), AnalyticCost(model, hw, CostSpec(), 16)
    per_byte = model.moe_layers * 64 * model.top_k * model.hidden_size * 3
    assert a8._a2a(64) == pytest.approx(per_byte / 450e9)
    assert a16._a2a(64) == pytest.approx(per_byte * 0.5 / 50e9)  # the off-node half sets the time
