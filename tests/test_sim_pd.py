"""The simulator's prefill/decode split: hand-offs, KV pulls over the link, the load cap."""

import json
from pathlib import Path

import numpy as np
import pytest

from lockstep.cli import main
from lockstep.policy.config import ConfigError
from lockstep.policy.deployment_file import deployment_from_dict, load_deployment
from lockstep.sim.link import Link, descriptors
from lockstep.sim.simulator import Simulator
from lockstep.sim.traces import TraceRequest, read_trace

ROOT = Path(__file__).parents[1]
AZURE = Path(__file__).parent / "data" / "azure_code_300.csv"

PD = {
    "models": [{"preset": "tiny"}],  # 4096-token context, 768 bytes of KV per token
    "hardware": {"preset": "h200", "hbm_bytes": 4e6},  # a few hundred blocks per rank
    "pools": [{"name": "prefill", "role": "prefill", "instances": 2, "dep": 1},
              {"name": "decode", "role": "decode", "instances": 1, "dep": 2}],
    "scheduler": {"block_size": 16, "max_num_seqs": 64, "max_num_batched_tokens": 2048},
    "kv_transfer": {"bandwidth": 2e9, "setup_s": 1e-4, "per_descriptor_s": 1e-5},
}


def pd_deployment(**tables):
    data = {k: dict(v) if isinstance(v, dict) else list(v) for k, v in PD.items()}
    for table, fields in tables.items():
        data[table] = {**data.get(table, {}), **fields}
    return deployment_from_dict(data, source="pd-test")


def burst(n: int = 48, seed: int = 0) -> list[TraceRequest]:
    """n requests at t=0 (a burst), then a trickle; every third one shares a prefix."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = 0.0 if i < 2 * n // 3 else 0.5 + 0.01 * i
        n_in, n_out = int(rng.integers(40, 600)), int(rng.integers(1, 40))
        segs, lens = ([7, 1000 + i], [32, n_in - 32]) if i % 3 == 0 else ([1000 + i], [n_in])
        out.append(TraceRequest(t, n_in, n_out, np.array(segs), np.array(lens)))
    return out


def run(deployment, workload, **kw):
    sim = Simulator(deployment, workload, seed=0, **kw)
    return sim, sim.run()


def test_every_request_finishes_and_both_pools_end_empty():
    checked = []

    def on_plan(inst, rank, plan):
        inst.cores[rank].check_integrity()  # held prefill blocks count as references
        checked.append(inst.role)

    workload = burst()
    sim, rep = run(pd_deployment(), workload, on_plan=on_plan)
    assert rep["requests"]["completed"] == len(workload) and rep["requests"]["rejected"] == 0
    assert {"prefill", "decode"} <= set(checked)
    for inst in sim.instances:
        for core in inst.cores:
            assert core.pool.num_used == 0 and not core.held and not core.has_work()
            core.check_integrity()
    kv = rep["kv_transfer"]
    handed = sum(w.output_len > 1 for w in workload)
    assert kv["pulls"] == handed and kv["tokens"] == sum(w.input_len for w in workload if w.output_len > 1)
    assert kv["prefill_held_blocks"]["max"] > 0 and kv["waiting_for_kv"]["max"] > 0
    assert set(rep["pools"]) == {"prefill", "decode"}
    assert rep["pools"]["decode"]["steps"] > 0 and rep["pools"]["prefill"]["step_s"]["max"] > 0
    assert sim.metrics.ntok.tolist() == [w.output_len for w in workload]


@pytest.mark.parametrize("cap", [1, 4, 0])
def test_the_cap_holds_every_step(cap):
    most = []

    def on_plan(inst, rank, plan):
        if inst.role == "decode":
            most.append(len(plan.kv_load_req_ids))

    _, rep = run(pd_deployment(scheduler={"max_kv_loads_per_step": cap}), burst(), on_plan=on_plan)
    assert rep["requests"]["completed"] == 48
    if cap:
        assert max(most) == cap  # the burst reaches the cap, which holds
        assert rep["kv_transfer"]["pulls_started_per_rank_step"]["max"] == cap
    else:
        assert max(most) > 4  # without it the burst lands at once


def test_ttft_ends_at_the_prefill_and_the_pull_takes_the_link_formula():
    n_in, bs = 200, 16
    lone = [TraceRequest(0.0, n_in, 5, np.array([1]), np.array([n_in]))]
    for merged, desc in ((True, 1), (False, -(-n_in // bs))):  # fresh pools: one run of blocks
        d = pd_deployment(kv_transfer={"merged": merged})
        sim, rep = run(d, lone)
        kvt, kvb = d.kv_transfer, d.model("tiny").kv_bytes_per_token
        pull = kvt.setup_s + desc * kvt.per_descriptor_s + -(-n_in // bs) * bs * kvb / kvt.bandwidth
        assert rep["kv_transfer"]["transfer_s"]["max"] == pytest.approx(pull, rel=1e-12)
        assert rep["kv_transfer"]["descriptors_per_pull"] == desc
        gap = rep["kv_transfer"]["second_token_gap_s"]["max"]
        assert gap > kvt.handoff_s + pull  # and the decode steps around it
    # TTFT is the prefill step's end: the same as a colocated rank of the same shape.
    colo = deployment_from_dict({**PD, "pools": [{"name": "c", "role": "colocated", "dep": 1}]})
    _, rep_colo = run(colo, lone)
    assert rep["ttft_s"]["p50"] == rep_colo["ttft_s"]["p50"]
    assert rep["e2e_s"]["p50"] > rep_colo["e2e_s"]["p50"]  # the hand-off and the pull


def test_advance_equals_stepping_and_same_bytes_twice():
    d, workload = pd_deployment(), burst(seed=3)
    a, rep_a = run(d, workload)
    b, _ = run(d, workload, use_advance=False)
    for key in ("first", "last", "finish"):
        assert np.allclose(getattr(a.metrics, key), getattr(b.metrics, key), rtol=1e-9, atol=1e-9), key
    assert (a.metrics.ntok == b.metrics.ntok).all() and rep_a["steps"] == b.metrics.steps
    _, rep_again = run(d, workload)
    assert json.dumps(rep_a, sort_keys=True) == json.dumps(rep_again, sort_keys=True)


@pytest.mark.parametrize("line,bad,message", [
    ("bandwidth = 400e9", "bandwidth = -1.0",
     r"pd\.toml: \[kv_transfer\]: bandwidth must be a finite number >= 0, got -1"),
    ("setup_s = 20e-6", "setup_s = inf", r"pd\.toml: \[kv_transfer\]: setup_s must be a finite number >= 0, got inf"),
    ("bandwidth = 400e9", "bandwidth = 1", r"bandwidth must be 0 \(\[hardware\] link_bandwidth\) or at least 1e6"),
    ("merged = true", 'merged = "yes"', r"pd\.toml: \[kv_transfer\]: field 'merged' must be true or false"),
    ("setup_s = 20e-6", "latency_s = 20e-6",
     r"pd\.toml: \[kv_transfer\]: unknown field\(s\) \['latency_s'\]; allowed: .*'setup_s'"),
])
def test_a_bad_kv_transfer_field_names_file_table_and_field(tmp_path, line, bad, message):
    text = (ROOT / "examples" / "gb300-nvl72-pd.toml").read_text()
    assert line in text
    path = tmp_path / "pd.toml"
    path.write_text(text.replace(line, bad))
    with pytest.raises(ConfigError, match=message):
        load_deployment(path)


def test_pools_must_be_colocated_or_a_prefill_decode_split():
    mixed = {**PD, "pools": [PD["pools"][0], {"name": "c", "role": "colocated"}]}
    with pytest.raises(ConfigError, match="prefill/decode split.*'colocated'"):
        Simulator(deployment_from_dict(mixed, source="mixed.toml"), burst(3))
    with pytest.raises(ConfigError, match="mixed.toml"):
        Simulator(deployment_from_dict({**PD, "pools": [PD["pools"][1]]}, source="mixed.toml"), burst(3))


def test_cli_max_kv_loads_on_the_gb300_example(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["sim", "--deployment", str(ROOT / "examples" / "gb300-nvl72-pd.toml"), "--trace", str(AZURE),
            "--limit", "150", "--rate-scale", "100", "--json", str(out)]
    assert main([*args, "--max-kv-loads", "1"]) == 0
    rep = json.loads(out.read_bytes())
    assert rep["num_gpus"] == 72 and rep["requests"]["completed"] == 150
    assert rep["kv_transfer"]["pulls_started_per_rank_step"]["max"] == 1
    assert "KV transfer" in capsys.readouterr().out
    assert main([*args, "--max-kv-loads", "-1"]) == 2
    assert "--max-kv-loads must be >= 0" in capsys.readouterr().err


def test_example_split_is_the_published_rack():
    d = load_deployment(ROOT / "examples" / "gb300-nvl72-pd.toml")
    assert d.num_gpus == 72 and {p.role for p in d.pools} == {"prefill", "decode"}
    assert d.scheduler.max_kv_loads_per_step == 4
    assert read_trace(AZURE).requests  # the excerpt the CLI test replays


def test_pulls_in_flight_share_the_link():
    link = Link(1e9)
    link.add(1, 1e9, 0.0)
    link.add(2, 0.5e9, 0.5)  # 1 has 0.5 GB left: both move at 0.5 GB/s from here
    assert link.next_done() == pytest.approx(1.5)
    assert sorted(link.finish(link.next_done())) == [1, 2] and not link.left
    assert descriptors([4, 5, 6, 9], [0, 1, 2, 3], merged=True) == 2  # a run breaks on either side
    assert descriptors([4, 5, 6, 7], [0, 1, 3, 4], merged=True) == 2
    assert descriptors([4, 5, 6, 7], [0, 1, 2, 3], merged=False) == 4
