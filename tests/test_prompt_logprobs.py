"""Prompt logprobs (vLLM's ``prompt_logprobs``; the OpenAI server's echo with logprobs) end to
end: real runtime processes, the tiny torch model on CPU, every prompt token's logprob and top
k checked against one forward of the whole prompt; through chunked prefill (a chunk's last
position scores the next chunk's first token), next to requests that share its prefix (it
takes no prefix-cache hit), after preemptions (a recompute scores the prompt again: each
token is reported once) and across a P/D hand-off."""

import dataclasses

import numpy as np
import pytest
import torch

from lockstep.api import open_engine
from lockstep.engine.config import EngineConfig
from lockstep.policy.config import SchedulerConfig
from lockstep.policy.request import RequestError, SamplingParams
from lockstep.runtime.models.batch import ForwardBatch
from test_engine import config, prompts, tiny_model
from test_pd import pd_config, settle
from test_penalties import reference, serve

ASK = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=3)


def scored(prompt: np.ndarray, k: int) -> list:
    """Each prompt token's (id, logprob, top k) from one forward of the whole prompt."""
    model = tiny_model()
    seq = [int(t) for t in prompt]
    b = ForwardBatch.build([seq], [0], [list(range(-(-len(seq) // 16)))], 16)
    logits, _ = model(dataclasses.replace(b, sample_index=torch.arange(len(seq))), model.make_kv_cache(64, 16))
    lp = torch.log_softmax(logits, -1)
    top = lp.topk(k, -1)
    # rank: 1 + the ids more likely than the token, as vLLM's (also outside the top k)
    return [(seq[0], None, [], None)] + [(seq[i], float(lp[i - 1, seq[i]]),
                                          list(zip(top.indices[i - 1].tolist(), top.values[i - 1].tolist())),
                                          int((lp[i - 1] > lp[i - 1, seq[i]]).sum()) + 1)
                                         for i in range(1, len(seq))]


def check(got: list, want: list) -> None:
    assert [r[0] for r in got] == [r[0] for r in want]
    assert got[0][1] is None and got[0][2] == [] and got[0][3] is None
    for (_, a, ta, ra), (_, b, tb, rb) in zip(got[1:], want[1:]):
        assert a == pytest.approx(b, abs=1e-5) and [t for t, _ in ta] == [t for t, _ in tb]
        assert [v for _, v in ta] == pytest.approx([v for _, v in tb], abs=1e-5)
        assert ra == rb


async def complete_all(engine, ps, params):
    out = [None] * len(ps)

    async def one(i):
        out[i] = await engine.complete(ps[i], params)
    import trio
    async with trio.open_nursery() as n:
        for i in range(len(ps)):
            n.start_soon(one, i)
    return out


async def test_prompt_logprobs_match_one_forward_of_the_prompt_through_chunks_and_shared_prefixes():
    ps = prompts()  # 1 to 150 tokens, a 64-token budget: chunks; prompts 2 and 3 share 64 tokens
    async with open_engine(config(tokenizer=None)) as engine:
        plain = await engine.complete(ps[2], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        got = await complete_all(engine, ps, ASK)
    for p, c in zip(ps, got):
        check(c.prompt_logprobs, scored(p, 3))
        assert c.token_ids.tolist() == reference(p, ASK)  # sampling unchanged by the extra rows
    assert len(got[0].prompt_logprobs) == 1  # a one-token prompt: its first token alone
    assert plain.prompt_logprobs is None


async def test_each_prompt_token_is_reported_once_after_a_preemption():
    sched = SchedulerConfig(num_blocks=14, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                            max_model_len=128)
    cfg = EngineConfig(model="tiny", dtype="float64", scheduler=sched, tokenizer=None)
    rng = np.random.default_rng(3)
    ps = [rng.integers(3, 500, n).astype(np.int32) for n in (40, 45, 50, 35)]
    p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    async with open_engine(cfg) as engine:
        got = await complete_all(engine, ps, p)
        assert engine.statistics().preemptions > 0
    for x, c in zip(ps, got):
        check(c.prompt_logprobs, scored(x, 1))
        assert c.token_ids.tolist() == reference(x, p)


async def test_prompt_logprobs_come_from_the_prefill_side_of_a_pd_deployment():
    ps = prompts()[1:4]
    async with open_engine(pd_config("shm")) as engine:
        got = await complete_all(engine, ps, ASK)
        await settle(engine)
    for p, c in zip(ps, got):
        check(c.prompt_logprobs, scored(p, 3))
        assert c.token_ids.tolist() == reference(p, ASK)


async def test_the_first_output_carries_them_and_bad_values_name_their_field():
    async with open_engine(config(tokenizer=None)) as engine:
        outs = [o async for o in engine.generate(prompts()[1], ASK)]
    assert len(outs[0].prompt_logprobs) == 37 and all(o.prompt_logprobs is None for o in outs[1:])
    for bad in (21, -1, 1.5, True):
        with pytest.raises(RequestError, match="prompt_logprobs") as e:
            SamplingParams(prompt_logprobs=bad).validate()
        assert e.value.field == "prompt_logprobs"
    got, _ = await serve(config(tokenizer=None), [prompts()[1]], ASK)  # (serve: the token path alone)
    assert got == [reference(prompts()[1], ASK)]


def test_scored_chunks_are_capped_so_a_steps_rows_fit_its_result():
    """A step scores at most max_scored_tokens_per_step prompt tokens (their rows travel in
    the step's result, a ring message: too many overflowed it and killed the runtime)."""
    from lockstep.policy.core import SchedulerCore
    from lockstep.policy.hashing import BlockHasher
    from lockstep.policy.request import Request

    cfg = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=100,
                          max_model_len=512, max_scored_tokens_per_step=24, async_scheduling=False)
    core = SchedulerCore(cfg, BlockHasher(b"k", 16))
    rng = np.random.default_rng(0)
    for i, k in enumerate((2, 0, None)):
        core.add_request(Request(id=i, prompt=rng.integers(3, 500, 60).astype(np.int32),
                                 params=SamplingParams(max_tokens=2, prompt_logprobs=k)))
    plan = core.schedule(0.0)
    fed = dict(zip(plan.req_ids.tolist(), plan.num_new.tolist()))
    # the cap is the step's: request 1 waits for the next step (and 2, in FCFS order, behind it)
    assert fed == {0: 24}


def test_the_ring_must_hold_a_steps_scored_rows():
    from lockstep.policy.config import ConfigError

    with pytest.raises(ConfigError, match="max_scored_tokens_per_step 4096: .* engine.ring_bytes"):
        EngineConfig(ring_bytes=1 << 20)
    EngineConfig(ring_bytes=1 << 20, scheduler=SchedulerConfig(max_scored_tokens_per_step=1024))


async def test_a_long_prompt_scored_in_capped_chunks_matches_one_forward():
    sched = SchedulerConfig(num_blocks=256, block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
                            max_model_len=512, max_scored_tokens_per_step=20)
    prompt = prompts()[2]  # 150 tokens: chunks of 20
    async with open_engine(EngineConfig(model="tiny", dtype="float64", scheduler=sched, tokenizer=None)) as engine:
        got = await engine.complete(prompt, ASK)
    check(got.prompt_logprobs, scored(prompt, 3))
    assert got.token_ids.tolist() == reference(prompt, ASK)
