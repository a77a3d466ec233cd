"""The simulator and `lockstep sim`: completes workloads, is deterministic, keeps its contract."""

import copy
import json
import tomllib
from pathlib import Path

import numpy as np
import pytest

from lockstep.cli import main
from lockstep.policy.deployment_file import (
    DEFAULT_DEPLOYMENT_TOML, default_deployment, deployment_from_dict, load_deployment,
)
from lockstep.sim.simulator import Simulator
from lockstep.sim.traces import TraceRequest, agentic_workload, read_trace

ROOT = Path(__file__).parents[1]
EXAMPLES = ROOT / "examples"
DATA = Path(__file__).parent / "data"
MOONCAKE = DATA / "mooncake_conversation_300.jsonl"
STATS = {"mean", "p50", "p90", "p99"}


def sim_json(tmp_path: Path, name: str, *args: str) -> tuple[bytes, dict]:
    out = tmp_path / name
    assert main(["sim", "--json", str(out), *args]) == 0
    raw = out.read_bytes()
    return raw, json.loads(raw)


def check_contract(rep: dict) -> None:
    """The keys DESIGN.md promises to tools reading `lockstep sim --json`."""
    assert set(rep["requests"]) == {"total", "completed", "rejected", "rejected_reasons"}
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(rep[key]) == STATS, key
    for key in ("output_tokens_per_s", "output_tokens_per_s_per_gpu", "preemptions"):
        assert isinstance(rep[key], (int, float)), key
    assert "goodput" in rep
    # later features may add keys (the host tier adds host_hits); these three are the contract
    assert {"queries", "hits", "hit_rate"} <= set(rep["prefix_cache"])
    assert set(rep["kv_cache_use"]) == {"mean", "max"}
    r = rep["requests"]
    assert r["completed"] + r["rejected"] == r["total"]
    assert r["rejected"] == sum(r["rejected_reasons"].values())
    pc = rep["prefix_cache"]
    assert 0 <= pc["hits"] <= pc["queries"]
    assert pc["hit_rate"] == pytest.approx(pc["hits"] / pc["queries"] if pc["queries"] else 0.0)
    assert 0 <= rep["kv_cache_use"]["mean"] <= rep["kv_cache_use"]["max"] <= 1


# --- the default run -------------------------------------------------------------------------


def test_default_agentic_run_completes_everything(tmp_path, capsys):
    _, rep = sim_json(tmp_path, "default.json")
    check_contract(rep)
    r = rep["requests"]
    assert r["total"] == len(agentic_workload(seed=0)) > 100
    assert r["completed"] == r["total"] and r["rejected"] == 0
    assert rep["prefix_cache"]["hit_rate"] > 0.5  # every turn re-sends the conversation
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        s = rep[key]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"]
    assert rep["output_tokens_per_s_per_gpu"] == pytest.approx(rep["output_tokens_per_s"] / rep["num_gpus"])
    assert "lockstep sim" in capsys.readouterr().out  # the human table


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a, _ = sim_json(tmp_path, "a.json", "--seed", "3", "--limit", "80")
    b, _ = sim_json(tmp_path, "b.json", "--seed", "3", "--limit", "80")
    c, _ = sim_json(tmp_path, "c.json", "--seed", "4", "--limit", "80")
    assert a == b
    assert a != c


def test_invariants_hold_after_every_step():
    workload = agentic_workload(seed=1, num_conversations=3)
    checked = []

    def on_plan(inst, rank, plan):
        inst.cores[rank].check_integrity()
        checked.append(plan.step_id)

    rep = Simulator(default_deployment(), workload, seed=1, on_plan=on_plan).run()
    assert rep["requests"]["completed"] == len(workload)
    assert len(checked) > 100


# --- advance(k) changes nothing but speed ------------------------------------------------------


def run_both(deployment, workload):
    runs = {}
    for adv in (True, False):
        sim = Simulator(deployment, workload, seed=0, use_advance=adv)
        runs[adv] = (sim.run(), sim.metrics)
    return runs


def assert_same_metrics(runs):
    (rep_a, a), (rep_b, b) = runs[True], runs[False]
    for key in ("arrival", "first", "last", "finish"):
        assert np.allclose(getattr(a, key), getattr(b, key), equal_nan=True, rtol=1e-9, atol=1e-9), key
    assert (a.ntok == b.ntok).all()
    assert rep_a["prefix_cache"] == rep_b["prefix_cache"]
    assert rep_a["preemptions"] == rep_b["preemptions"]


def test_advance_matches_stepping_on_mooncake_dep8():
    workload = read_trace(MOONCAKE).requests[:60]
    runs = run_both(load_deployment(EXAMPLES / "h200-dep8.toml"), workload)
    assert runs[True][0]["steps"] == runs[False][0]["steps"]
    assert_same_metrics(runs)


def test_advance_matches_stepping_on_agentic():
    workload = agentic_workload(seed=0, num_conversations=2)
    assert_same_metrics(run_both(load_deployment(EXAMPLES / "h200-v2lite.toml"), workload))


def test_no_advance_flag(tmp_path):
    _, a = sim_json(tmp_path, "a.json", "--trace", str(MOONCAKE), "--limit", "30",
                    "--deployment", str(EXAMPLES / "h200-v2lite.toml"))
    _, b = sim_json(tmp_path, "b.json", "--trace", str(MOONCAKE), "--limit", "30",
                    "--deployment", str(EXAMPLES / "h200-v2lite.toml"), "--no-advance")
    assert a["requests"] == b["requests"] and a["prefix_cache"] == b["prefix_cache"]
    for key in ("ttft_s", "e2e_s", "tpot_s"):
        for q in STATS:
            assert a[key][q] == pytest.approx(b[key][q], rel=1e-9)
    assert a["steps"] == b["steps"]


# --- real traces and rejections ----------------------------------------------------------------


def test_mooncake_excerpt_on_h200_dep8(tmp_path):
    _, rep = sim_json(tmp_path, "m.json", "--trace", str(MOONCAKE),
                      "--deployment", str(EXAMPLES / "h200-dep8.toml"))
    check_contract(rep)
    r = rep["requests"]
    assert r["total"] == 300 and r["completed"] + r["rejected"] == 300
    assert rep["prefix_cache"]["hit_rate"] > 0
    assert rep["num_gpus"] == 8


def tiny_deployment(hbm_bytes: float = 1.9e6):
    """The tiny preset (4096-token context) with memory for a few dozen KV blocks."""
    data = copy.deepcopy(tomllib.loads(DEFAULT_DEPLOYMENT_TOML))
    data["models"] = [{"preset": "tiny"}]
    data["hardware"] = {"preset": "h200", "hbm_bytes": hbm_bytes}
    data["pools"] = [{"name": "main", "role": "colocated", "dep": 1}]
    return deployment_from_dict(data, source="tiny")


def trace_req(t: float, n_in: int, n_out: int, seg: int) -> TraceRequest:
    return TraceRequest(t, n_in, n_out, np.array([seg]), np.array([n_in]))


def test_rejections_are_counted_with_reasons():
    d = tiny_deployment()
    blocks = d.scheduler_for(d.pools[0]).num_blocks
    assert 16 <= blocks < 4096 // 16
    workload = [
        trace_req(0.0, 100, 10, 1),
        trace_req(0.1, 5000, 10, 2),  # longer than the 4096-token context
        trace_req(0.2, 4000, 200, 3),  # prompt + output past the context as well
        trace_req(0.3, blocks * 16, 10, 4),  # fits the context, not the KV cache
        trace_req(0.4, 50, 5, 5),
    ]
    rep = Simulator(d, workload, seed=0).run()
    r = rep["requests"]
    assert r == {"total": 5, "completed": 2, "rejected": 3,
                 "rejected_reasons": {"context_length": 2, "kv_capacity": 1}}
    check_contract(rep)


def test_context_length_rejection_on_default():
    workload = [trace_req(0.0, 1000, 20, 1), trace_req(1.0, 131072, 1, 2), trace_req(2.0, 500, 5, 3)]
    rep = Simulator(default_deployment(), workload, seed=0).run()
    assert rep["requests"]["rejected_reasons"] == {"context_length": 1}
    assert rep["requests"]["completed"] == 2


def test_context_check_takes_the_longest_pool():
    """Two pools whose models differ in context: a request too long for the first pool's
    model but not the second's goes to the second, not rejected up front or by a rank of
    the first."""
    data = copy.deepcopy(tomllib.loads(DEFAULT_DEPLOYMENT_TOML))
    short = {**data["models"][0], "name": "short", "context_length": 4096}
    data["models"].append(short)
    data["models"].insert(0, data["models"].pop())  # the short model's pool comes first
    data["pools"] = [{**data["pools"][0], "name": "a", "model": "short"},
                     {**data["pools"][0], "name": "b", "model": "deepseek-v3"}]
    d = deployment_from_dict(data)
    workload = [trace_req(0.0, 1000, 20, 1), trace_req(1.0, 8000, 5, 2), trace_req(2.0, 200000, 1, 3)]
    rep = Simulator(d, workload, seed=0).run()
    # The 8,000-token prompt goes to pool b, whose model holds it; 200,000 fits neither.
    assert rep["requests"] == {"total": 3, "completed": 2, "rejected": 1,
                               "rejected_reasons": {"context_length": 1}}

# --- outputs and errors ------------------------------------------------------------------------


def test_plot_writes_a_png(tmp_path):
    png = tmp_path / "out.png"
    assert main(["sim", "--limit", "40", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name,text,line", [
    ("bad.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n'
                  '{"timestamp": 1, "input_length": 10, "output_length": 0, "hash_ids": [1]}\n', 2),
    ("bad.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n'
                  'not json\n', 2),
    ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                "2023-11-16 18:15:46.6805900,10,5\n2023-11-16 18:15:47.0,ten,5\n", 3),
])
def test_malformed_trace_exits_2_naming_file_and_line(tmp_path, capsys, name, text, line):
    path = tmp_path / name
    path.write_text(text)
    assert main(["sim", "--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and f"line {line}" in err


def test_skip_bad_rows(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n'
                    'garbage\n'
                    '{"timestamp": 5, "input_length": 20, "output_length": 3, "hash_ids": [2]}\n')
    _, rep = sim_json(tmp_path, "s.json", "--trace", str(path), "--skip-bad-rows")
    assert rep["requests"]["total"] == rep["requests"]["completed"] == 2
    assert rep["trace_rows_skipped"] == 1  # the count reaches the JSON report too


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert main(["sim", "--deployment", str(tmp_path / "nope.toml")]) == 2
    assert "nope.toml" in capsys.readouterr().err
    assert main(["sim", "--rate-scale", "0"]) == 2
    assert "rate-scale" in capsys.readouterr().err
    assert main(["sim", "--limit", "0"]) == 2


def test_missing_trace_file_exits_2(tmp_path, capsys):
    assert main(["sim", "--trace", str(tmp_path / "nope.jsonl")]) == 2


@pytest.mark.parametrize("method", ["keyed", "sha256"])
def test_prompts_hashed_together_equal_one_by_one(method):
    """The simulator materializes upcoming prompts in one pass: same hashes and accumulators."""
    from lockstep.policy.hashing import BlockHasher

    rng = np.random.default_rng(3)
    for bs in (16, 6):
        h = BlockHasher(b"secret", bs, method=method)
        prompts = [rng.integers(0, 50_000, int(n), dtype=np.int32) for n in rng.integers(1, 300, 12)]
        prompts.append(np.arange(bs - 1, dtype=np.int32))  # no full block
        for p, (hashes, acc) in zip(prompts, h.hash_prompts(prompts)):
            want, want_acc = h.hash_prompt(p)
            assert hashes.shape == want.shape and (hashes == want).all() and (acc == want_acc).all()


def _eplb_deployment(**cost):
    return deployment_from_dict({
        "models": [{"preset": "v2-lite"}], "hardware": {"preset": "h200"},
        "pools": [{"name": "main", "role": "colocated", "dep": 8}],
        "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 4096},
        "cost": {"expert_skew": 1.2, "expert_drift": 0.1, "expert_window_s": 2.0, **cost},
        "eplb": {"redundant_experts": 16},
    })


def test_balancer_raises_balancedness_and_advance_still_equals_stepping():
    workload = read_trace(MOONCAKE).requests[:60]
    d = _eplb_deployment()
    on = Simulator(d, workload)
    rep_on = on.run()
    off = Simulator(d, workload, eplb=False).run()
    step = Simulator(d, workload, use_advance=False)
    step.run()
    b_on, b_off = rep_on["balancedness"], off["balancedness"]
    assert b_on["balancer"] and not b_off["balancer"] and b_on["windows"] == b_off["windows"] > 2
    assert b_on["series"][0] == b_off["series"][0]  # the first window runs the naive layout
    assert b_on["mean"] > b_off["mean"] + 0.1
    assert rep_on["tpot_s"]["mean"] < off["tpot_s"]["mean"]
    assert np.array_equal(on.metrics.finish, step.metrics.finish, equal_nan=True)


@pytest.mark.parametrize("args, says", [
    (["--rate-scale", "nan"], "--rate-scale"),  # NaN arrivals used to hang the run
    (["--slo-ttft", "-1"], "--slo-ttft"),
    (["--slo-tpot", "nan"], "--slo-tpot"),
    (["--json", "/nonexistent-dir/out.json"], "does not exist"),  # checked before, not after, the run
    (["--plot", "out.txt"], "must end in"),
])
def test_bad_flags_fail_before_simulating(args, says, capsys):
    assert main(["sim", "--limit", "5", *args]) == 2
    assert says in capsys.readouterr().err


def test_the_deployments_seed_is_the_default_and_a_negative_one_is_refused(tmp_path, capsys):
    text = (ROOT / "examples" / "default.toml").read_text()
    assert "\nseed = 0\n" in text
    (tmp_path / "seed7.toml").write_text(text.replace("\nseed = 0\n", "\nseed = 7\n"))
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["sim", "--limit", "60", "--deployment", str(tmp_path / "seed7.toml"), "--json", str(a)]) == 0
    assert main(["sim", "--limit", "60", "--seed", "7", "--json", str(b)]) == 0
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    assert ra["seed"] == 7 and {k: v for k, v in ra.items() if k not in ("deployment", "run")} == \
        {k: v for k, v in rb.items() if k not in ("deployment", "run")}
    capsys.readouterr()
    assert main(["sim", "--limit", "5", "--seed", "-1"]) == 2
    assert "--seed must be >= 0, got -1" in capsys.readouterr().err


def test_what_a_run_does_not_model_is_noted(tmp_path, capsys):
    """[eplb] without expert skew, and async scheduling off, are the engine's to act on: the
    simulator says what it does with them instead of ignoring them silently."""
    text = DEFAULT_DEPLOYMENT_TOML + "\n[eplb]\nredundant_experts = 8\n"
    text = text.replace("[scheduler]", "[scheduler]\nasync_scheduling = false", 1)
    path = tmp_path / "d.toml"
    path.write_text(text)
    assert main(["sim", "--deployment", str(path), "--limit", "5"]) == 0
    err = capsys.readouterr().err
    assert "[eplb] changes nothing here: expert loads drift only with [cost] expert_skew > 0" in err
    assert "async_scheduling = false: host work is priced serially" in err


def test_settings_a_run_does_not_act_on_are_noted(tmp_path, capsys):
    assert "\nenable_prefix_caching = true" in DEFAULT_DEPLOYMENT_TOML
    text = DEFAULT_DEPLOYMENT_TOML.replace("\nenable_prefix_caching = true",
                                          "\nenable_prefix_caching = false\nmax_model_len = 999999", 1)
    text += "\n[kv_transfer]\nbandwidth = 400e9\n"
    path = tmp_path / "d.toml"
    path.write_text(text)
    assert main(["sim", "--deployment", str(path), "--limit", "5", "--num-spec-tokens", "0"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    for note in ("[kv_transfer] changes nothing here", "[scheduler] max_model_len (999999) exceeds model",
                 "[hardware] host_kv_bytes changes nothing here", "--num-spec-tokens 0 changes nothing here"):
        assert note in err, note
    assert main(["sim", "--deployment", str(ROOT / "examples" / "h200-v2lite.toml"), "--limit", "5",
                 "--max-kv-loads", "2"]) == 0  # (colocated, no host tier)
    assert "--max-kv-loads changes nothing here" in " ".join(capsys.readouterr().err.split())
    dep8 = (ROOT / "examples" / "h200-dep8.toml").read_text()
    assert "\nexpert_balancedness = 0.8 " in dep8
    path.write_text(dep8.replace("\nexpert_balancedness = 0.8 ", "\nexpert_skew = 1.0\nexpert_balancedness = 0.7 ", 1))
    assert main(["sim", "--deployment", str(path), "--limit", "5"]) == 0
    assert "expert_balancedness (0.7) is not used" in " ".join(capsys.readouterr().err.split())
    assert main(["sim", "--deployment", str(ROOT / "examples" / "serve-two-models-cpu.toml"), "--limit", "5"]) == 0
    assert "a trace names no model" in " ".join(capsys.readouterr().err.split())


def test_the_json_says_what_was_run_and_can_go_to_stdout(tmp_path, capsys):
    assert main(["sim", "--limit", "20", "--rate-scale", "2", "--json", "-"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out)  # (the JSON alone: the table went to stderr)
    assert report["run"]["rate_scale"] == 2.0 and report["run"]["limit"] == 20 and report["run"]["trace"] is None
    assert report["requests"]["total"] == 20


def test_pools_report_their_own_kv_use():
    d = load_deployment(ROOT / "examples" / "gb300-nvl72-pd.toml")
    rep = Simulator(d, read_trace(ROOT / "tests" / "data" / "mooncake_conversation_300.jsonl").requests[:80]).run()
    per = rep["kv_cache_use_per_pool"]
    assert set(per) == {p.name for p in d.pools}
    assert all(0 <= v["mean"] <= v["max"] <= 1 for v in per.values())
    assert max(v["max"] for v in per.values()) >= rep["kv_cache_use"]["max"]  # (a pool's peak, not diluted)


def test_throughput_bins_follow_the_run_length():
    from lockstep.sim.report import _bin_width

    assert [_bin_width(s) for s in (27.0, 600.0, 3600.0, 0.5, 0.0)] == [0.5, 10.0, 100.0, 0.01, 1.0]


def test_the_report_files_are_written_before_the_table(tmp_path, monkeypatch):
    """A reader of the table that stops early (`| head`) must not cost the --json and --plot files."""
    import lockstep.sim.run as run_mod

    seen = []

    def table(report, console):
        seen.append(((tmp_path / "r.json").exists(), (tmp_path / "r.png").exists()))
        raise BrokenPipeError

    monkeypatch.setattr(run_mod, "print_table", table)
    assert main(["sim", "--limit", "20", "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")]) == 1
    assert seen == [(True, True)]


def test_a_report_never_overwrites_an_input_and_idle_flags_are_noted(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(MOONCAKE.read_bytes())
    assert main(["sim", "--trace", str(trace), "--limit", "5", "--json", str(trace)]) == 2
    assert "--json" in capsys.readouterr().err and trace.read_bytes() == MOONCAKE.read_bytes()
    dep = tmp_path / "d.toml"
    dep.write_text(DEFAULT_DEPLOYMENT_TOML)
    assert main(["sim", "--deployment", str(dep), "--limit", "5", "--plot", str(dep.with_suffix(".png")),
                 "--json", str(dep)]) == 2
    assert "is the --deployment file" in capsys.readouterr().err
    assert main(["sim", "--limit", "5", "--format", "azure", "--skip-bad-rows"]) == 0
    assert "--format and --skip-bad-rows change nothing here" in capsys.readouterr().err
    assert main(["sim", "--limit", "5", "--rate-scale", "1e-300"]) == 2
    assert "--rate-scale must be a number in [1e-06, 1e+06]" in capsys.readouterr().err


def test_a_trace_spanning_months_is_noted_with_its_longest_gap(tmp_path, capsys):
    rows = [json.loads(line) for line in MOONCAKE.read_text().splitlines()[:5]]
    rows[-1]["timestamp"] = 1e20  # a stray row (or ms read as ns): the run would span aeons
    path = tmp_path / "far.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["sim", "--trace", str(path)]) == 0
    err = capsys.readouterr().err
    assert "span" in err and "comes before line 5" in err
