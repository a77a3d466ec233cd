"""Speculative decoding in the simulator: acceptance models, the runtime's positions, the
draft's cost, the report, the [speculative] table and `lockstep sim --num-spec-tokens`."""

import json
from pathlib import Path

import numpy as np
import pytest

from lockstep.cli import main
from lockstep.policy.config import ConfigError
from lockstep.policy.deployment_file import deployment_from_dict, load_deployment
from lockstep.policy.step import PLACEHOLDER
from lockstep.sim.run import with_spec_tokens
from lockstep.sim.simulator import Simulator
from lockstep.sim.spec import DraftCost
from lockstep.sim.traces import TraceRequest

ROOT = Path(__file__).parents[1]
AZURE = Path(__file__).parent / "data" / "azure_code_300.csv"
K = 3

BASE = {
    "models": [{"preset": "tiny"}],  # 512-token vocabulary, like tiny-draft
    "hardware": {"preset": "h200", "hbm_bytes": 2e7},  # about a thousand KV blocks
    "pools": [{"name": "main", "role": "colocated", "dep": 1}],
    "scheduler": {"block_size": 16, "max_num_seqs": 32, "max_num_batched_tokens": 1024},
    "speculative": {"draft_model": "tiny-draft", "num_spec_tokens": K, "acceptance": "fixed", "rate": 0.7},
}


def deployment(source="spec-test", **tables):
    """BASE with tables merged in (a field set to None is dropped)."""
    data = {k: dict(v) if isinstance(v, dict) else list(v) for k, v in BASE.items()}
    for table, fields in tables.items():
        if isinstance(fields, list):
            data[table] = fields
            continue
        merged = {**data.get(table, {}), **fields}
        data[table] = {k: v for k, v in merged.items() if v is not None}
    return deployment_from_dict(data, source=source)


def workload(n=24, out=lambda i: 1 + (K + 1) * (3 + i % 5), seed=0, gap=0.002):
    """n requests a little apart; every fourth shares a 32-token prefix with the others."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        n_in = int(rng.integers(40, 300))
        segs, lens = ([9, 100 + i], [32, n_in - 32]) if i % 4 == 0 else ([100 + i], [n_in])
        reqs.append(TraceRequest(gap * i, n_in, out(i), np.array(segs), np.array(lens)))
    return reqs


def run(dep, reqs, *, seed=0, check=True, **kw):
    plans = []

    def on_plan(inst, rank, plan):
        if check:
            inst.cores[rank].check_integrity()
        plans.append((inst, rank, plan))

    sim = Simulator(dep, reqs, seed=seed, on_plan=on_plan, **kw)
    return sim, sim.run(), plans


def ended_empty(sim):
    for inst in sim.instances:
        for core in inst.cores:
            core.check_integrity()
            assert core.pool.num_used == 0 and not core.held and not core.has_work()


def core_counters(sim):
    cores = [c for inst in sim.instances for c in inst.cores if c.config.num_spec_tokens]
    return (sum(c.spec_drafts for c in cores), sum(c.spec_draft_tokens for c in cores),
            sum(c.spec_accepted_tokens for c in cores), sum(c.spec_accepted_per_pos for c in cores).tolist())


# --- acceptance --------------------------------------------------------------------------------


def test_every_draft_accepted_at_rate_one():
    reqs = workload()  # 1 + 4m outputs: with every draft kept, every decode proposes all 3
    sim, rep, _ = run(deployment(speculative={"rate": 1.0}), reqs)
    base_sim, base, _ = run(with_spec_tokens(deployment(), 0), reqs)
    sd = rep["spec_decode"]
    assert sd["mean_acceptance_length"] == K + 1 and sd["draft_acceptance_rate"] == 1.0
    assert sd["num_accepted_tokens_per_pos"] == [sd["num_drafts"]] * K
    assert sd["num_draft_tokens"] == K * sd["num_drafts"] == sum(w.output_len - 1 for w in reqs) // (K + 1) * K
    assert (sim.metrics.ntok == base_sim.metrics.ntok).all()
    assert sim.metrics.ntok.tolist() == [w.output_len for w in reqs]
    assert rep["output_tokens"] == base["output_tokens"] and "spec_decode" not in base
    assert rep["requests"]["completed"] == len(reqs)
    assert rep["steps"] < base["steps"]
    ended_empty(sim)


def test_nothing_accepted_at_rate_zero():
    reqs = workload(out=lambda i: 5 + 7 * i)
    sim, rep, _ = run(deployment(speculative={"rate": 0.0}), reqs)
    sd = rep["spec_decode"]
    assert sd["num_accepted_tokens"] == 0 and sd["mean_acceptance_length"] == 1.0
    assert sd["num_accepted_tokens_per_pos"] == [0] * K and sd["num_drafts"] > 0
    assert sim.metrics.ntok.tolist() == [w.output_len for w in reqs]
    ended_empty(sim)


def test_simulator_counts_what_the_core_counts():
    sim, rep, _ = run(deployment(), workload(out=lambda i: 3 + 11 * i))
    sd = rep["spec_decode"]
    assert core_counters(sim) == (sd["num_drafts"], sd["num_draft_tokens"], sd["num_accepted_tokens"],
                                  sd["num_accepted_tokens_per_pos"])
    assert 0 < sd["num_accepted_tokens"] < sd["num_draft_tokens"]


def test_per_position_rates_are_measured_back():
    rates = [0.9, 0.6, 0.3]
    dep = deployment(speculative={"acceptance": "per_position", "rates": rates, "rate": None})
    reqs = workload(n=32, out=lambda i: 400)
    sim, rep, _ = run(dep, reqs, check=False)
    sd = rep["spec_decode"]
    n, per = sd["num_drafts"], sd["num_accepted_tokens_per_pos"]
    assert n > 3000
    conditional = [per[0] / n, per[1] / per[0], per[2] / per[1]]  # P(draft j | drafts before it)
    assert conditional == pytest.approx(rates, abs=0.03)
    assert sd["acceptance_rate_per_pos"] == pytest.approx([0.9, 0.54, 0.162], abs=0.03)
    ended_empty(sim)


def test_replay_cycles_the_file_and_caps_at_the_drafts(tmp_path):
    counts = tmp_path / "accepted.txt"
    counts.write_text("# drafts accepted per decode\n3\n0\n\n5\n1\n")  # 5 > k: capped at 3
    dep = deployment(source=str(tmp_path / "dep.toml"),
                     speculative={"acceptance": "replay", "file": "accepted.txt", "rate": None})
    assert dep.speculative.replay == (3, 0, 5, 1)
    reqs = [TraceRequest(0.0, 50, 1 + 4 * 20, np.array([1]), np.array([50]))]  # one request: one order
    sim, rep, _ = run(dep, reqs)
    sd = rep["spec_decode"]
    n, per = sd["num_drafts"], sd["num_accepted_tokens_per_pos"]
    # every decode proposes 3 until the last few tokens; a cycle of 4 accepts 3, 0, 3, 1
    assert n > 20
    assert per[0] == pytest.approx(3 * n / 4, abs=2) and per[1] == per[2] == pytest.approx(n / 2, abs=2)
    assert sim.metrics.ntok.tolist() == [81]
    ended_empty(sim)


def test_same_seed_same_draws_other_seed_differs(tmp_path):
    args = ["--deployment", str(ROOT / "examples" / "h200-v2lite-spec.toml"), "--trace", str(AZURE), "--limit", "60"]
    outs = []
    for seed in ("1", "1", "2"):
        path = tmp_path / f"{len(outs)}.json"
        assert main(["sim", "--json", str(path), "--seed", seed, *args]) == 0
        outs.append(path.read_bytes())
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_preemption_with_speculation():
    dep = deployment(hardware={"hbm_bytes": 2.6e6})  # a few dozen blocks: requests get preempted
    reqs = workload(out=lambda i: 40 + 13 * i)
    sim, rep, _ = run(dep, reqs)
    assert rep["preemptions"] > 0 and rep["requests"]["completed"] == len(reqs)
    assert sim.metrics.ntok.tolist() == [w.output_len for w in reqs]
    assert core_counters(sim)[2] == rep["spec_decode"]["num_accepted_tokens"] > 0
    ended_empty(sim)


# --- the runtime's side: positions and cost ---------------------------------------------------------


def test_decodes_go_where_the_runtime_counts():
    """A plan made before the last result names a decode's position as if every draft were
    accepted; the runtime feeds it at its own count, never ahead of the plan."""
    behind = []

    def on_plan(inst, rank, plan):
        pos = inst.spec.pos[rank]  # before the step runs: the runtime's count so far
        offs = plan.token_offsets
        for i, rid in enumerate(plan.req_ids.tolist()):
            if plan.num_new[i] and plan.token_ids[offs[i]] == PLACEHOLDER and rid in pos:
                actual = pos[rid][0]
                assert actual <= plan.start_pos[i]
                behind.append(plan.start_pos[i] - actual)

    for rate, lag in ((1.0, False), (0.5, True)):
        behind.clear()
        Simulator(deployment(speculative={"rate": rate}), workload(), seed=0, on_plan=on_plan).run()
        assert behind and any(behind) == lag and max(behind) <= K


def test_a_lone_request_pays_the_target_step_and_the_draft_passes():
    dep = deployment(speculative={"rate": 1.0})
    n_in, steps = 50, 6
    reqs = [TraceRequest(0.0, n_in, 1 + (K + 1) * steps, np.array([1]), np.array([n_in]))]
    sim, rep, _ = run(dep, reqs)
    target, draft = sim.instances[0].cost, DraftCost(dep.speculative.draft, dep.hardware, dep.cost, 1)

    def one(c, s):  # a draft pass feeding c tokens from position s, proposing one draft
        return draft.pass_time([[c, s + c, c * s + c * (c + 1) // 2, 1]])

    # decode j feeds 1 + K tokens from position s (the last sampled token); the draft first
    # catches up (one token after the prefill, then two: the last draft and the bonus token)
    # and then feeds one token per further draft
    expect, s = [], n_in
    for j in range(steps):
        pend = 1 if j == 0 else 2
        draft_s = one(pend, s - pend + 1) + sum(one(1, s + i) for i in range(1, K))
        expect.append(target.rank_step_time([float(K + 1)], [float(s + K + 1)],
                                            [float((K + 1) * s + (K + 1) * (K + 2) // 2)], [0.0], None, draft_s))
        s += K + 1
    m = sim.metrics
    assert rep["tpot_s"]["mean"] == pytest.approx(sum(expect) / (K + 1) / steps, rel=1e-12)
    assert m.last[0] - m.first[0] == pytest.approx(sum(expect), rel=1e-12)
    assert rep["spec_decode"]["draft_time_fraction"] > 0


def test_the_draft_head_runs_only_where_a_draft_is_proposed():
    d = load_deployment(ROOT / "examples" / "h200-v2lite-spec.toml")
    draft = DraftCost(d.speculative.draft, d.hardware, d.cost, 1)
    prefill = [[2048, 2048, 2048 * 2049 // 2, 0]]
    assert draft.pass_time(prefill) == draft.layers.rank_step_time([2048.0], [2048.0], [2048 * 2049 / 2], [0.0])
    head = d.speculative.draft.vocab_size * d.speculative.draft.hidden_size
    assert draft.layers.m.dense_params == pytest.approx(d.speculative.draft.dense_params - head)
    one, many = [[1, 100, 100, 1]], [[256, 25600, 25600, 256]]
    alone = draft.layers.rank_step_time([1.0], [100.0], [100.0], [0.0])
    assert draft.pass_time(one) == pytest.approx(alone + draft.head_bytes, rel=1e-12)  # reading it
    assert draft.pass_time(many) > draft.pass_time(one)


def test_adaptive_proposes_fewer_drafts_when_few_are_kept():
    reqs = workload(out=lambda i: 200)
    low = run(deployment(speculative={"rate": 0.2, "adaptive": True}), reqs)[1]["spec_decode"]
    fixed = run(deployment(speculative={"rate": 0.2}), reqs)[1]["spec_decode"]
    high = run(deployment(speculative={"rate": 1.0, "adaptive": True}), reqs)[1]["spec_decode"]
    assert low["num_draft_tokens"] / low["num_drafts"] < 1.5 < fixed["num_draft_tokens"] / fixed["num_drafts"]
    assert high["num_draft_tokens"] / high["num_drafts"] > K - 0.1
    assert low["adaptive"] and not fixed["adaptive"]


def test_prefill_decode_pools_with_speculation_on_the_decode_pool():
    pools = [{"name": "prefill", "role": "prefill", "instances": 1, "dep": 1},
             {"name": "decode", "role": "decode", "instances": 1, "dep": 2}]
    dep = deployment(pools=pools, kv_transfer={"bandwidth": 2e9})
    cfgs = {p.role: dep.scheduler_for(p) for p in dep.pools}
    assert cfgs["decode"].num_spec_tokens == K and cfgs["prefill"].num_spec_tokens == 0
    reqs = workload(out=lambda i: 1 + 9 * (i % 4))  # some end at the prefill
    sim, rep, plans = run(dep, reqs)
    assert rep["requests"]["completed"] == len(reqs)
    assert sim.metrics.ntok.tolist() == [w.output_len for w in reqs]
    assert rep["spec_decode"]["num_drafts"] > 0 and rep["kv_transfer"]["pulls"] > 0
    assert any(p.num_new.max() > 1 for inst, _, p in plans if inst.role == "decode" and p.num_reqs)
    assert core_counters(sim)[0] == rep["spec_decode"]["num_drafts"]
    bs, t, d = 16, dep.model("tiny"), dep.speculative.draft  # a pull carries both caches
    assert sim._block_bytes == (t.kv_bytes_per_token + d.kv_bytes_per_token) * bs
    ended_empty(sim)


# --- the deployment table ----------------------------------------------------------------------------


def test_the_draft_takes_memory_next_to_the_target():
    with_draft, without = deployment(), with_spec_tokens(deployment(), 0)
    pool = with_draft.pools[0]
    assert with_draft.kv_blocks_per_rank(pool) < without.kv_blocks_per_rank(pool)
    assert with_draft.scheduler_for(pool).num_spec_tokens == K
    assert without.scheduler_for(pool).num_spec_tokens == 0
    assert with_spec_tokens(with_draft, 5).speculative.num_spec_tokens == 5


@pytest.mark.parametrize("fields,words", [
    ({"colour": 1}, ["colour", "[speculative]", "draft_model"]),
    ({"draft_model": "nope"}, ["draft_model", "nope", "tiny-draft"]),
    ({"draft_model": "v2-lite-draft"}, ["vocabulary", "102400", "512"]),
    ({"num_spec_tokens": 0}, ["num_spec_tokens", "[1, 16]"]),
    ({"num_spec_tokens": "3"}, ["num_spec_tokens", "integer"]),
    ({"acceptance": "oracle"}, ["acceptance", "oracle", "per_position", "replay"]),
    ({"rate": 1.5}, ["rate", "[0, 1]"]),
    ({"rates": [0.5]}, ["rates", "belongs to acceptance = 'per_position'", "not 'fixed'"]),
    ({"acceptance": "per_position", "rate": None, "rates": [0.5, 0.5]}, ["rates", "2 positions", "3"]),
    ({"acceptance": "per_position", "rate": None, "rates": [0.5, "x", 1]}, ["rates", "numbers"]),
    ({"acceptance": "per_position"}, ["acceptance = 'per_position'", "rates"]),
    ({"acceptance": "replay", "rate": None, "file": "missing.txt"}, ["file", "missing.txt"]),
    ({"adaptive": "yes"}, ["adaptive", "true or false"]),
])
def test_bad_speculative_fields_are_named(fields, words):
    with pytest.raises(ConfigError) as e:
        deployment(speculative=fields)
    msg = str(e.value)
    assert "spec-test" in msg and "[speculative]" in msg
    for w in words:
        assert w in msg, (w, msg)


def test_bad_replay_file_names_its_line(tmp_path):
    (tmp_path / "acc.txt").write_text("2\n1\n-1\n")
    with pytest.raises(ConfigError, match=r"acc\.txt, line 3.*'-1'"):
        deployment(source=str(tmp_path / "d.toml"),
                   speculative={"acceptance": "replay", "file": "acc.txt", "rate": None})


def test_spec_tokens_only_in_the_speculative_table():
    with pytest.raises(ConfigError, match=r"\[scheduler\]: num_spec_tokens belongs in \[speculative\]"):
        deployment(scheduler={"num_spec_tokens": 2})


# --- the command line ----------------------------------------------------------------------------------


def test_num_spec_tokens_flag(tmp_path, capsys):
    spec_toml = str(ROOT / "examples" / "h200-v2lite-spec.toml")
    args = ["--trace", str(AZURE), "--limit", "40"]
    reps = {}
    for k in ("0", "1", None):
        path = tmp_path / f"{k}.json"
        extra = [] if k is None else ["--num-spec-tokens", k]
        assert main(["sim", "--deployment", spec_toml, "--json", str(path), *args, *extra]) == 0
        reps[k] = json.loads(path.read_text())
    assert "speculative decoding" in capsys.readouterr().out
    assert "spec_decode" not in reps["0"]
    assert reps["1"]["spec_decode"]["num_spec_tokens"] == 1
    assert reps[None]["spec_decode"]["num_spec_tokens"] == load_deployment(spec_toml).speculative.num_spec_tokens
    plain, plain_toml = tmp_path / "plain.json", str(ROOT / "examples" / "h200-v2lite.toml")
    assert main(["sim", "--deployment", plain_toml, "--json", str(plain), *args]) == 0
    base = json.loads(plain.read_text())
    base.pop("deployment"), base.pop("run")
    assert base == {k: v for k, v in reps["0"].items() if k not in ("deployment", "run")}  # K = 0: the same run
    assert reps["0"]["run"]["num_spec_tokens"] == 0
    for rep in reps.values():
        assert rep["output_tokens"] == base["output_tokens"]
    assert main(["sim", "--deployment", plain_toml, "--num-spec-tokens", "2", *args]) == 2
    assert "[speculative]" in capsys.readouterr().err
    assert main(["sim", "--deployment", spec_toml, "--num-spec-tokens", "17", *args]) == 2
    assert "--num-spec-tokens 17" in capsys.readouterr().err


def test_a_serving_table_without_an_acceptance_model_is_for_the_engine_only():
    """A deployment that serves a draft need not model its acceptance (the engine measures
    it; a 'rate' used to be required anyway): the simulator refuses it, saying what to add."""
    from lockstep.engine.config import EngineConfig

    dep = deployment(speculative={"acceptance": None, "rate": None},
                     engine={"runtime": "torch", "device": "cpu", "dtype": "float32"})
    assert dep.speculative.acceptance == "measured"
    cfg = EngineConfig.from_deployment(dep)
    assert (cfg.draft_model, cfg.num_spec_tokens) == ("tiny-draft", K)
    with pytest.raises(ConfigError, match=r"spec-test: \[speculative\]: the simulator .* acceptance = 'fixed' with rate"):
        Simulator(dep, workload())
