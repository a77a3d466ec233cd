"""Smoke run of the whole Mooncake conversation trace (12,031 requests) through the simulator."""

from pathlib import Path

import pytest

from lockstep.policy.deployment_file import load_deployment
from lockstep.sim.simulator import Simulator
from lockstep.sim.traces import read_trace

DATA = Path(__file__).parent / "data"


@pytest.mark.slow
def test_whole_mooncake_trace_is_accounted_for():
    load = read_trace(DATA / "mooncake_conversation_full.jsonl")
    assert len(load.requests) == 12031 and load.skipped == 0
    sim = Simulator(load_deployment(DATA / "eight-v2lite.toml"), load.requests)
    report = sim.run()
    r = report["requests"]
    assert r["total"] == 12031
    assert r["completed"] + r["rejected"] == r["total"]
    assert sum(r["rejected_reasons"].values()) == r["rejected"]
    for inst in sim.instances:
        for core in inst.cores:
            core.check_integrity()
            assert not core.has_work() and core.pool.num_free == core.pool.num_blocks
    # 36.6% of the trace's 512-token blocks repeat an earlier one (infinite cache); eight
    # separate caches, 16-token blocks and a finite host tier get part of that.
    assert 0.30 < report["prefix_cache"]["hit_rate"] < 0.40
