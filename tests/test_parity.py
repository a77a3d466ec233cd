"""Sim parity: the trio engine, with a real `timing` runtime process and async scheduling,
makes exactly the simulator's StepPlans for the same trace, step by step.

Both run in step time: each step lasts what the cost model says (the timing runtime reports
it instead of sleeping), and arrivals are released at step boundaries.
"""

from pathlib import Path

import numpy as np
import pytest
import trio

from lockstep.engine.output import RequestStream
from lockstep.engine.pacing import StepTime
from lockstep.engine.runtime_client import RuntimeClient
from lockstep.engine.scheduler import Scheduler, Submit
from lockstep.policy.core import SchedulerCore
from lockstep.policy.deployment_file import load_deployment
from lockstep.policy.request import Request, SamplingParams
from lockstep.runtime.base import RuntimeSpec
from lockstep.sim.simulator import Simulator
from lockstep.sim.traces import read_trace, segment_tokens

DATA = Path(__file__).parent / "data"
DEPLOYMENT = DATA / "parity-small-kv.toml"
# Fields that make a scheduling decision. Token ids are left out: the sim samples the
# trace's output tokens and the timing runtime stand-ins, which only re-prefills show.
FIELDS = ("req_ids", "slots", "num_new", "start_pos", "samples", "block_start", "block_ids",
          "block_offsets", "kv_load_req_ids", "kv_load_first_block", "kv_load_num_blocks",
          "finished_req_ids", "num_tokens")


def sim_plans(workload) -> list:
    plans = []
    sim = Simulator(load_deployment(DEPLOYMENT), workload, use_advance=False,
                    on_plan=lambda inst, rank, plan: plans.append(plan))
    sim.run()
    return plans


async def engine_plans(workload) -> tuple[list, list[RequestStream]]:
    dep = load_deployment(DEPLOYMENT)
    pool = dep.pools[0]
    cfg = dep.scheduler_for(pool)
    model = dep.model(pool.model)
    hasher = Simulator(dep, []).hasher
    arrivals, streams = [], []
    for rid, w in enumerate(workload):
        prompt = segment_tokens(w.seg_ids, w.seg_lens, vocab_size=model.vocab_size, seed=0)
        stream = RequestStream(rid, len(prompt), w.arrival_s)
        req = Request(id=rid, prompt=prompt, params=SamplingParams(max_tokens=w.output_len, ignore_eos=True),
                      arrival_time=w.arrival_s)
        arrivals.append((w.arrival_s, Submit(req, stream)))
        streams.append(stream)
    spec = RuntimeSpec(runtime="timing", block_size=cfg.block_size, num_blocks=cfg.num_blocks,
                       options={"deployment": str(DEPLOYMENT), "sleep": False})
    plans = []
    pacer = StepTime(arrivals)
    sched = Scheduler(lambda: SchedulerCore(cfg, hasher), lambda: RuntimeClient(spec), pacer=pacer,
                      on_plan=plans.append)
    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run)
            while pacer.pending or not all(s.done for s in streams):
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    return plans, streams


def check_same(sim: list, eng: list) -> None:
    assert len(eng) == len(sim)
    for i, (a, b) in enumerate(zip(sim, eng)):
        for f in FIELDS:
            x, y = getattr(a, f), getattr(b, f)
            assert np.array_equal(x, y), f"step {i}: {f} differs: sim {x} engine {y}"


async def test_engine_matches_sim_on_azure_code_trace():
    workload = read_trace(DATA / "azure_code_300.csv").requests[:200]
    sim = sim_plans(workload)
    eng, streams = await engine_plans(workload)
    check_same(sim, eng)
    assert len(sim) > 1000
    assert all(s.done for s in streams)


@pytest.mark.slow
async def test_engine_matches_sim_with_prefix_hits_and_preemption():
    workload = read_trace(DATA / "mooncake_conversation_300.jsonl").requests[:30]
    sim = sim_plans(workload)
    eng, _ = await engine_plans(workload)
    check_same(sim, eng)
    assert any(len(p.finished_req_ids) for p in eng)
