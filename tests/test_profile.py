"""`lockstep profile` and the measured cost model: a profile written on the CPU loads, the
simulator's steps cost what the profile says, advance(k) still matches stepping, and a bad
profile is refused by name."""

import json
from pathlib import Path

import attrs
import numpy as np
import pytest

from lockstep.cli import main
from lockstep.policy.config import ConfigError
from lockstep.policy.deployment_file import load_deployment
from lockstep.sim.profile import Grid, ProfiledCost, load_profile, step_mix
from lockstep.sim.simulator import Simulator
from lockstep.sim.traces import agentic_workload

EXAMPLES = Path(__file__).parents[1] / "examples"

# A made-up v2-lite profile (not a measurement): round numbers, so lookups are checkable.
DECODE = [[1, 1024, 0.004], [1, 4096, 0.005], [64, 1024, 0.012], [64, 4096, 0.016],
          [256, 1024, 0.018], [256, 4096, 0.034]]
PREFILL = [[256, 0, 0.010], [256, 8192, 0.020], [8192, 0, 0.300], [8192, 8192, 0.500]]


def write_profile(path: Path, **fields) -> Path:
    data = {"model": "v2-lite", "device": "NVIDIA H200 (made up)", "dtype": "bfloat16", "dep": 1, "decode": DECODE,
            "prefill": PREFILL, **fields}
    path.write_text(json.dumps(data))
    return path


def write_deployment(tmp_path: Path, profile: str, model: str = "v2-lite") -> Path:
    text = (EXAMPLES / "h200-v2lite.toml").read_text().replace('preset = "v2-lite"', f'preset = "{model}"')
    path = tmp_path / "dep.toml"
    path.write_text(text + f'\n[cost]\nprofile = "{profile}"\n')
    return path


def test_profile_command_writes_a_loadable_profile_on_cpu(tmp_path, capsys):
    out = tmp_path / "tiny.json"
    assert main(["profile", "--model", "tiny", "--device", "cpu", "--out", str(out), "--batches", "1,3",
                 "--contexts", "16,40", "--chunks", "24,48", "--steps", "1", "--warmup", "1"]) == 0
    data = json.loads(out.read_text())
    assert data["model"] == "tiny" and data["device"] == "cpu" and data["dep"] == 1
    assert sorted((b, c) for b, c, _ in data["decode"]) == [(1, 16), (1, 40), (3, 16), (3, 40)]
    assert {(t, c) for t, c, _ in data["prefill"]} == {(24, 16), (48, 16), (24, 40), (48, 40)}
    assert all(s > 0 for *_, s in data["decode"] + data["prefill"])
    prof = load_profile(out, "test")
    assert prof.model == "tiny" and prof.decode.xs == (1.0, 3.0)
    # ... and `lockstep sim` runs on it with a tiny deployment
    dep = tmp_path / "tiny.toml"
    dep.write_text('[[models]]\npreset = "tiny"\n[[pools]]\nname = "main"\nrole = "colocated"\n'
                   '[cost]\nprofile = "tiny.json"\n')
    assert main(["sim", "--deployment", str(dep), "--limit", "20"]) == 2  # a CPU's times priced as an H200's
    dep.write_text(dep.read_text() + '[hardware]\npreset = "h200"\nname = "this-cpu"\n')  # hardware of its own
    rep = tmp_path / "rep.json"
    capsys.readouterr()
    assert main(["sim", "--deployment", str(dep), "--limit", "20", "--json", str(rep)]) == 0
    cp = json.loads(rep.read_text())["cost_profile"]
    assert cp["lookups"] > 0
    table = capsys.readouterr().out  # the table says the costs were measured, and how far off the grid
    assert "measured profile" in table and f"{cp['lookups_outside_grid']:,} of {cp['lookups']:,} lookups" in table
    assert main(["profile", "--model", "tiny", "--device", "cpu", "--out", str(out), "--budget-s", "0"]) == 2
    with pytest.raises(SystemExit):
        main(["profile", "--model", "tiny", "--device", "cpu", "--out", str(out), "--batches", "0,8"])
    err = capsys.readouterr().err
    assert "--budget-s must be > 0" in err and "argument --batches: expected comma-separated integers >= 1" in err


def test_profile_command_with_an_fp8_cache(tmp_path):
    out = tmp_path / "tiny-fp8.json"
    assert main(["profile", "--model", "tiny", "--device", "cpu", "--out", str(out), "--batches", "2",
                 "--contexts", "24", "--chunks", "16", "--steps", "1", "--warmup", "0",
                 "--kv-cache-dtype", "fp8"]) == 0
    data = json.loads(out.read_text())
    assert data["kv_cache_dtype"] == "fp8" and len(data["decode"]) == 1 and len(data["prefill"]) == 1
    assert load_profile(out, "test").model == "tiny"


def test_grid_interpolates_in_log_batch_and_context():
    g = Grid.from_points(DECODE)
    assert g.at(64, 1024) == (0.012, False)
    assert g.at(64, 2560)[0] == pytest.approx(0.014)  # halfway in context
    assert g.at(8, 1024)[0] == pytest.approx(0.004 + 0.008 * 0.5)  # halfway in log2 batch (1 -> 8 -> 64)
    assert g.at(512, 1024) == (0.018, True)  # batch clamped
    assert g.at(64, 512) == (0.012, True)  # context clamped below
    assert g.at(64, 7168)[0] == pytest.approx(0.020)  # extrapolated above along the last segment


def test_sim_step_times_follow_the_profile(tmp_path):
    write_profile(tmp_path / "p.json")
    d = load_deployment(write_deployment(tmp_path, "p.json"))
    sim = Simulator(d, agentic_workload(seed=0, num_conversations=1))
    cost = sim.instances[0].cost
    assert isinstance(cost, ProfiledCost)
    floor, added = d.host.step_terms(1)
    # decode-only: 64 requests with 1024 cached tokens each
    mix = [step_mix([1] * 64, [1024] * 64)]
    t = cost.rank_step_time([64.0], [64.0 * 1025], [64.0 * 1025], [0.0], mix=mix)
    assert t == max(0.012, floor) + added
    # without the split the sums give the same answer
    assert cost.rank_step_time([64.0], [64.0 * 1025], [64.0 * 1025], [0.0]) == t
    # mixed: the same decodes plus a 256-token chunk after 8192 cached tokens
    mix = [step_mix([1] * 64 + [256], [1024] * 64 + [8192])]
    assert cost.rank_step_time([320.0], [0.0], [0.0], [0.0], mix=mix) == pytest.approx(0.012 + 0.020 + added)
    rep = sim.run()
    assert rep["cost_profile"]["lookups"] > 0 and rep["requests"]["completed"] > 0


def test_advance_matches_stepping_with_a_profile(tmp_path):
    write_profile(tmp_path / "p.json")
    d = load_deployment(write_deployment(tmp_path, "p.json"))
    workload = agentic_workload(seed=0, num_conversations=2)
    runs = {}
    for adv in (True, False):
        sim = Simulator(d, workload, seed=0, use_advance=adv)
        runs[adv] = (sim.run(), sim.metrics)
    (rep_a, a), (rep_b, b) = runs[True], runs[False]
    assert rep_a["steps"] == rep_b["steps"]
    for key in ("first", "last", "finish"):
        assert np.array_equal(getattr(a, key), getattr(b, key), equal_nan=True), key
    analytic = Simulator(attrs.evolve(d, cost=attrs.evolve(d.cost, profile="")), workload).run()
    assert analytic["e2e_s"] != rep_a["e2e_s"]  # the profile, not the analytic model, priced it


def test_sim_profile_flag_overrides_the_deployment(tmp_path):
    write_profile(tmp_path / "p.json")
    out = tmp_path / "rep.json"
    assert main(["sim", "--deployment", str(EXAMPLES / "h200-v2lite.toml"), "--limit", "10",
                 "--profile", str(tmp_path / "p.json"), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["cost_profile"]["profile"] == str(tmp_path / "p.json")


def test_bad_profiles_are_refused_by_name(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"\[cost\]: field 'profile': file .*missing.json does not exist"):
        load_deployment(write_deployment(tmp_path, "missing.json"))
    write_profile(tmp_path / "bad.json", decode=[[0, 1024, 0.01]])
    d = load_deployment(write_deployment(tmp_path, "bad.json"))
    with pytest.raises(ConfigError, match=r"\[cost\] profile: profile file .*bad.json: field 'decode' point 0"):
        Simulator(d, [])
    write_profile(tmp_path / "tiny.json", model="tiny")
    d = load_deployment(write_deployment(tmp_path, "tiny.json"))
    with pytest.raises(ConfigError, match=r"runs model 'v2-lite', but profile .* measured 'tiny'"):
        Simulator(d, [])
    write_profile(tmp_path / "h200.json")
    path = write_deployment(tmp_path, "h200.json")
    path.write_text(path.read_text().replace('preset = "h200"', 'preset = "gb300"'))
    with pytest.raises(ConfigError, match=r"runs on \[hardware\] 'gb300', but profile .* measured on 'NVIDIA H200"):
        Simulator(load_deployment(path), [])
    (tmp_path / "junk.json").write_text("{not json")
    assert main(["sim", "--deployment", str(EXAMPLES / "h200-v2lite.toml"), "--limit", "5",
                 "--profile", str(tmp_path / "junk.json")]) == 2
    assert "junk.json: not readable JSON" in capsys.readouterr().err
    assert main(["sim", "--profile", str(tmp_path / "nope.json")]) == 2
    assert "--profile" in capsys.readouterr().err
    # a profile given by the flag that does not fit: the error names the flag, not the file's [cost] profile
    assert main(["sim", "--deployment", str(EXAMPLES / "h200-v2lite.toml"), "--limit", "5",
                 "--profile", str(tmp_path / "tiny.json")]) == 2
    err = capsys.readouterr().err
    assert "--profile" in err and "measured 'tiny'" in err and "[cost] profile" not in err
