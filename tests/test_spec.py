"""Speculative decoding end to end (real runtime processes, the tiny model in float64) and
the rejection sampler's distribution.

Greedy output with speculation must equal greedy output without it, token for token, for
any draft: a random smaller model (acceptance near zero), the target's own first layers
(some acceptance) and the target itself (acceptance 100%). Sampled output must be
distributed as the target's: checked by chi-square on the sampler itself, with fixed seeds.
"""

import numpy as np
import pytest
import torch
import trio

from lockstep.api import open_engine
from lockstep.policy.request import SamplingParams
from lockstep.runtime.speculative import Speculator
from test_engine import collect, config, prompts, reference_greedy

LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


async def run_all(engine, ps, params):
    got = [None] * len(ps)

    async def one(i):
        got[i], _ = await collect(engine, ps[i], params)
    async with trio.open_nursery() as n:
        for i in range(len(ps)):
            n.start_soon(one, i)
    return got


async def greedy_checked(cfg, ps) -> dict:
    """Serve ``ps`` greedily: tokens equal the reference's, every core intact and empty after;
    the speculation counters."""
    async with open_engine(cfg) as engine:
        got = await run_all(engine, ps, LONG)
        sp = engine.spec_statistics()
        for s in engine.schedulers:
            s.core.check_integrity()
            assert s.core.pool.num_used == 0
    for p, g in zip(ps, got):
        assert g == reference_greedy(p, LONG.max_tokens)
    return sp


@pytest.mark.parametrize("draft,k,adaptive", [("tiny-draft", 3, False), ("layers:2", 2, False), ("tiny", 4, False),
                                              ("tiny-draft", 4, True)])
async def test_greedy_with_speculation_equals_greedy_without(draft, k, adaptive):
    ps = prompts()
    sp = await greedy_checked(config(tokenizer=None, draft_model=draft, num_spec_tokens=k, spec_adaptive=adaptive),
                              ps)
    assert sp["drafts"] > 0 and sp["draft_tokens"] <= k * sp["drafts"]
    if draft == "tiny":  # the draft is the target: every draft is accepted
        assert sp["accepted_tokens"] == sp["draft_tokens"] and sp["accepted_per_position"][-1] > 0
    if draft == "layers:2":
        assert sp["accepted_tokens"] > 0
    if adaptive:  # the runtime proposed fewer drafts than the core reserved: counted as proposed
        assert sp["draft_tokens"] < k * sp["drafts"]


async def test_speculation_across_dep_ranks_keeps_greedy_tokens_and_feeds_the_balancer():
    """DEP2 with experts sharded over the ranks: each rank drafts with its own copy of the
    draft (unsharded: its passes wait for nobody) and verifies in one target forward whose
    all-to-all every rank joins, an idle rank with an empty one. Greedy tokens equal one
    rank's without speculation; the expert balancer gets the verify passes' counts."""
    from lockstep.policy.rebalance import EplbConfig

    ps = prompts()
    cfg = config(tokenizer=None, draft_model="tiny", num_spec_tokens=3, dep=2,
                 eplb=EplbConfig(redundant_experts=2, window_steps=4))
    async with open_engine(cfg) as engine:
        got = await run_all(engine, ps, LONG)
        sp = engine.spec_statistics()
        bal = engine.balancer_statistics()
        for s in engine.schedulers:
            s.core.check_integrity()
            assert s.core.pool.num_used == 0
    for p, g in zip(ps, got):
        assert g == reference_greedy(p, LONG.max_tokens)
    assert sp["drafts"] > 0 and sp["accepted_tokens"] == sp["draft_tokens"]  # the draft is the target
    assert bal.plans >= 1


@pytest.mark.parametrize("draft,experts,adaptive", [("tiny", "sharded", False), ("layers:2", "replicated", False),
                                                    ("tiny-draft", "sharded", True)])
async def test_a_draft_with_sharded_experts_runs_in_lockstep_across_dep_ranks(draft, experts, adaptive):
    """The draft's experts sharded over the ranks (or the target's own sharded layers): each
    draft pass has all-to-alls, so every rank runs the step's agreed passes, an idle or less
    busy rank (fewer requests, fewer drafts with adaptive k) padding with empty ones."""
    ps = prompts()
    sp = await greedy_checked(config(tokenizer=None, draft_model=draft, num_spec_tokens=3, dep=2,
                                     draft_experts=experts, spec_adaptive=adaptive), ps)
    assert sp["drafts"] > 0
    if draft == "tiny":
        assert sp["accepted_tokens"] == sp["draft_tokens"]


async def test_the_balancer_plans_a_sharded_drafts_experts_apart_from_the_targets():
    """A draft with sharded experts has its own placement: the balancer's second planner
    moves the draft's experts from the draft passes' loads, the ranks stage and switch it as
    they do the target's, and greedy tokens stay the same."""
    from lockstep.policy.rebalance import EplbConfig

    ps = prompts()
    cfg = config(tokenizer=None, draft_model="tiny-draft", num_spec_tokens=3, dep=2, draft_experts="sharded",
                 eplb=EplbConfig(redundant_experts=2, window_steps=3))
    async with open_engine(cfg) as engine:
        got = await run_all(engine, ps, LONG)
        target, draft = engine.balancer_statistics(), engine.balancer_statistics("draft")
        running = [s.placement_status("draft").running for s in engine.schedulers]
    for p, g in zip(ps, got):
        assert g == reference_greedy(p, LONG.max_tokens)
    assert target.plans >= 1 and draft.plans >= 1
    assert draft.generation >= 1 and min(running) >= 1  # the ranks run a planned draft placement


def test_draft_experts_setting_is_checked():
    from lockstep.policy.config import ConfigError

    with pytest.raises(ConfigError, match="draft_experts must be 'replicated' or 'sharded', got 'split'"):
        config(tokenizer=None, draft_model="tiny", dep=2, draft_experts="split")


async def test_speculation_with_sampling_and_seeds_is_reproducible():
    ps = prompts()[:3]
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    outs = []
    for _ in range(2):
        async with open_engine(config(tokenizer=None, draft_model="layers:2")) as engine:
            outs.append(await run_all(engine, ps, params))
    assert outs[0] == outs[1] and all(len(o) == 16 for o in outs[0])


def _sampler() -> Speculator:
    s = Speculator.__new__(Speculator)
    s.gen = torch.Generator().manual_seed(1234)
    return s


@pytest.mark.parametrize("drafts", [1, 3])
def test_rejection_sampling_reproduces_the_target_distribution(drafts):
    """Draft tokens from q, accepted by min(1, p/q), rejections resampled from (p - q)+:
    the first token out must follow p exactly, whatever q is."""
    V, trials = 6, 5000
    g = torch.Generator().manual_seed(7)
    target_logits = torch.randn(drafts + 1, V, generator=g, dtype=torch.float64) * 1.5
    q = [torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, -1).float() for _ in range(drafts)]
    p0 = torch.softmax(target_logits[0], -1).numpy()
    s = _sampler()
    params = (1.0, 1.0, -1, -1, -1)
    draw = torch.Generator().manual_seed(99)
    counts = np.zeros(V)
    accepted = 0
    for _ in range(trials):
        xs = [int(torch.multinomial(qj, 1, generator=draw).item()) for qj in q]
        got = s._accept(target_logits, xs, q, params, pos0=10)
        counts[got[0]] += 1
        accepted += len(got) - 1
    expected = p0 * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # chi-square with 5 degrees of freedom at p = 0.001
    assert 0 < accepted < trials * drafts  # some drafts accepted, some rejected


def test_greedy_acceptance_takes_the_longest_matching_prefix():
    s = _sampler()
    logits = torch.full((4, 5), -5.0)
    for row, tok in enumerate([2, 4, 1, 3]):
        logits[row, tok] = 5.0
    greedy = (0.0, 1.0, -1, -1, -1)
    assert s._accept(logits, [2, 4, 1], None, greedy, 0) == [2, 4, 1, 3]  # all accepted, bonus
    assert s._accept(logits, [2, 0, 1], None, greedy, 0) == [2, 4]  # first mismatch: target's token
    assert s._accept(logits, [3, 4, 1], None, greedy, 0) == [2]


async def test_timing_runtime_speculates_as_the_deployment_says():
    """The engine with the timing runtime and a [speculative] deployment: drafts accepted by
    its per-position rates (0.75, 0.65, 0.6), every request gets exactly its tokens."""
    import attrs
    from lockstep.engine.config import EngineConfig

    sched = attrs.evolve(config().scheduler, max_num_seqs=16)
    cfg = EngineConfig(runtime="timing", tokenizer=None, scheduler=sched, draft_model="v2-lite-draft",
                       num_spec_tokens=3, runtime_options={"deployment": "examples/h200-v2lite-spec.toml",
                                                           "sleep": False})
    rng = np.random.default_rng(1)
    async with open_engine(cfg) as engine:
        got = await run_all(engine, [rng.integers(5, 1000, 64).astype(np.int32) for _ in range(12)],
                            SamplingParams(max_tokens=60, ignore_eos=True))
        sp = engine.spec_statistics()
    assert all(len(g) == 60 for g in got)
    first, second, third = sp["accepted_per_position"]
    assert abs(first / sp["drafts"] - 0.75) < 0.1 and abs(second / first - 0.65) < 0.12


@pytest.mark.parametrize("draft", ["tiny", "tiny-draft"])  # every draft accepted; hardly any
async def test_logprobs_of_verified_tokens_are_the_targets(draft):
    """Each token a step verified (accepted drafts and the target's own) has its row: the
    target's log-probabilities, as without a draft (they used to be dropped)."""
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    ps = prompts()[1:4]
    got = {}
    for d in ("", draft):
        async with open_engine(config(tokenizer=None, draft_model=d)) as engine:
            got[d] = [await engine.complete(x, p) for x in ps]
            if d == "tiny":
                assert engine.spec_statistics()["acceptance_rate"] == 1.0
    for a, b in zip(got[""], got[draft]):
        assert a.token_ids.tolist() == b.token_ids.tolist() and len(b.logprobs) == 12
        for (ta, la, top_a), (tb, lb, top_b) in zip(a.logprobs, b.logprobs):
            assert ta == tb and la == pytest.approx(lb, abs=1e-5) and [t for t, _ in top_a] == [t for t, _ in top_b]
