"""Logits processing as vLLM's (allowed_token_ids, logit_bias, presence, frequency and
repetition penalties, min_p, min_tokens) end to end: real runtime processes, the tiny torch model on CPU, greedy tokens
checked against a reference that decodes one sequence alone and applies the rules written
out here from their definitions. Also across preemptions (a recompute re-feeds the output,
which must not count twice) and across a P/D hand-off (the decode side's first token was
sampled by the prefill side)."""

import attrs
import numpy as np
import pytest
import trio

from lockstep.api import open_engine
from lockstep.engine.stops import StopStrings, feed_stop_strings
from lockstep.engine.config import EngineConfig
from lockstep.policy.config import SchedulerConfig
from lockstep.policy.request import RequestError, SamplingParams
from lockstep.runtime.models.batch import ForwardBatch
from test_engine import collect, config, prompts, tiny_model
from test_pd import pd_config, run_all, settle

PENALIZED = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.6,
                           frequency_penalty=0.8, presence_penalty=0.5)
EOS = 1  # the tiny preset's


def processed(logits: np.ndarray, prompt, out: list[int], p: SamplingParams) -> np.ndarray:
    """vLLM's rules, from their definitions: min_tokens masks end of sequence and stop ids;
    a token in the prompt or the output has a positive logit divided by the repetition
    penalty and a negative one multiplied; an output token loses frequency x its count and
    presence once."""
    x = logits.copy()
    if p.allowed_token_ids is not None:
        x = np.where(np.isin(np.arange(len(x)), p.allowed_token_ids), x, -np.inf)
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if len(out) < p.min_tokens:
        x[list(p.stop_token_ids) + ([] if p.ignore_eos else [EOS])] = -np.inf
    counts = np.bincount(np.asarray(out, np.int64), minlength=len(x))
    seen = (counts > 0) | np.isin(np.arange(len(x)), prompt)
    r = p.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def decode_alone(prompt: np.ndarray, p: SamplingParams, pick) -> list[int]:
    """One sequence decoded alone by the tiny model, each token ``pick(logits, out)``,
    stopping as the engine does (stop ids, end of sequence, max_tokens)."""
    model = tiny_model()
    kv = model.make_kv_cache(64, 16)
    seq = [int(t) for t in prompt]
    table = list(range(-(-(len(seq) + p.max_tokens) // 16)))
    logits, _ = model(ForwardBatch.build([seq], [0], [table], 16), kv)
    out: list[int] = []
    while True:
        out.append(pick(logits[0].numpy(), out))
        if len(out) == p.max_tokens or out[-1] in p.stop_token_ids or (out[-1] == EOS and not p.ignore_eos):
            return out
        logits, _ = model(ForwardBatch.build([[out[-1]]], [len(seq) + len(out) - 1], [table], 16), kv)


def reference(prompt: np.ndarray, p: SamplingParams) -> list[int]:
    """Greedy decoding of one sequence alone under ``p``'s rules."""
    return decode_alone(prompt, p, lambda x, out: int(processed(x, prompt, out, p).argmax()))


async def serve(cfg: EngineConfig, ps, params) -> tuple[list[list[int]], object]:
    """Every prompt's tokens, served concurrently by a fresh engine, and its statistics."""
    async with open_engine(cfg) as engine:
        got = await run_all(engine, ps, params)
        return got, engine.statistics()


async def test_penalized_greedy_matches_the_reference_with_batching_chunks_and_prefix_hits():
    ps = prompts()
    got, _ = await serve(config(tokenizer=None), ps, PENALIZED)
    want = [reference(p, PENALIZED) for p in ps]
    assert got == want
    plain = [reference(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) for p in ps]
    assert sum(a != b for a, b in zip(want, plain)) >= 3  # the penalties changed the tokens


@pytest.mark.parametrize("which", ["repetition", "frequency", "presence"])
async def test_each_penalty_alone_matches_the_reference(which):
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                       **{f"{which}_penalty": {"repetition": 1.9, "frequency": 1.5, "presence": -1.0}[which]})
    ps = prompts()[1:3]
    got, _ = await serve(config(tokenizer=None), ps, p)
    assert got == [reference(x, p) for x in ps]


async def test_preempted_requests_count_their_output_once_after_the_recompute():
    """Few blocks: requests are preempted and recomputed (their outputs re-fed, some from
    the prefix cache): the counts must be rebuilt, not doubled or lost."""
    sched = SchedulerConfig(num_blocks=14, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                            max_model_len=128)
    cfg = EngineConfig(model="tiny", dtype="float64", scheduler=sched, tokenizer=None)
    rng = np.random.default_rng(3)
    ps = [rng.integers(3, 500, n).astype(np.int32) for n in (40, 45, 50, 35)]
    p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, repetition_penalty=1.5,
                       frequency_penalty=0.6)
    got, stats = await serve(cfg, ps, p)
    assert stats.preemptions > 0
    assert got == [reference(x, p) for x in ps]


async def test_min_tokens_holds_off_stop_ids_and_end_of_sequence():
    prompt = prompts()[2]
    first = reference(prompt, SamplingParams(max_tokens=12, temperature=0.0))
    stop = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(first[0],))
    held = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(first[0],), min_tokens=5)
    eos_first = SamplingParams(max_tokens=12, temperature=0.0, min_tokens=5, repetition_penalty=1.2)
    got, _ = await serve(config(tokenizer=None), [prompt], stop)
    assert got == [[first[0]]]
    got, _ = await serve(config(tokenizer=None), [prompt], held)
    want = reference(prompt, held)
    assert got == [want] and len(want) >= 5 and first[0] not in want[:5]
    got, _ = await serve(config(tokenizer=None), [prompt], eos_first)
    assert got == [reference(prompt, eos_first)]


async def test_min_p_one_keeps_only_the_most_likely_token():
    """min_p 1: every token less likely than the most likely one is dropped, so sampling at
    temperature 1 draws the greedy tokens."""
    ps = prompts()[:3]
    got, _ = await serve(config(tokenizer=None), ps, SamplingParams(max_tokens=8, temperature=1.0, min_p=1.0,
                                                                     ignore_eos=True))
    assert got == [reference(x, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)) for x in ps]


async def test_penalties_carry_across_a_pd_hand_off():
    """The decode side's first token was drawn by the prefill side: it counts as output."""
    ps = prompts()
    async with open_engine(pd_config("shm")) as engine:
        got = await run_all(engine, ps, PENALIZED)
        await settle(engine)
    assert got == [reference(p, PENALIZED) for p in ps]


async def test_speculative_decoding_refuses_them_by_name():
    async with open_engine(config(tokenizer=None, draft_model="tiny-draft")) as engine:
        with pytest.raises(RequestError, match="frequency_penalty is not supported with speculative") as e:
            engine.generate(prompts()[0], SamplingParams(frequency_penalty=0.5))
        assert e.value.field == "frequency_penalty"
        with pytest.raises(RequestError, match="logit_bias is not supported with speculative"):
            engine.generate(prompts()[0], SamplingParams(logit_bias={5: 1.0}))
        with pytest.raises(RequestError, match="prompt_logprobs is not supported with speculative"):
            engine.generate(prompts()[0], SamplingParams(prompt_logprobs=0))
        got, _ = await collect(engine, prompts()[0], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(got) == 3  # the engine serves on


async def test_logit_bias_and_allowed_token_ids_match_the_reference():
    """A ban (-100) on each prompt's first greedy token, a push (+100) on another token for
    one request, and allowed ids for another, batched together with penalties."""
    ps = prompts()[:4]
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    firsts = [reference(x, plain)[0] for x in ps]
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={firsts[0]: -100.0}),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={7: 100, firsts[1]: -3.5}),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, allowed_token_ids=[11, 12, 13, firsts[2]],
                       logit_bias={firsts[2]: -100}),
        attrs.evolve(PENALIZED, max_tokens=8, logit_bias={firsts[3]: -100}, allowed_token_ids=(5, 9, 17, 200)),
    ]
    got = [None] * len(ps)

    async def one(i):
        got[i], _ = await collect(engine, ps[i], params[i])
    async with open_engine(config(tokenizer=None)) as engine:
        async with trio.open_nursery() as n:
            for i in range(len(ps)):
                n.start_soon(one, i)
    want = [reference(x, p) for x, p in zip(ps, params)]
    assert got == want
    assert want[0][0] != firsts[0] and want[1] == [7] * 8 and set(want[2]) <= {11, 12, 13}
    assert set(want[3]) <= {5, 9, 17, 200} and firsts[3] not in want[3]


async def test_logit_bias_and_allowed_ids_outside_the_vocabulary_are_refused_by_name():
    async with open_engine(config(tokenizer=None)) as engine:
        vocab = engine.frontend.vocab_size
        for kw, field in ((dict(logit_bias={vocab: 1.0}), "logit_bias"),
                          (dict(allowed_token_ids=(3, vocab + 5)), "allowed_token_ids"),
                          (dict(allowed_token_ids=(EOS,), min_tokens=2), "allowed_token_ids")):
            with pytest.raises(RequestError, match=f"{field}") as e:
                engine.generate(prompts()[0], SamplingParams(max_tokens=4, **kw))
            assert e.value.field == field
        with pytest.raises(RequestError, match=f"vocabulary of {vocab}"):
            engine.generate(prompts()[0], SamplingParams(logit_bias={vocab: 1.0}))
        got, _ = await collect(engine, prompts()[0], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(got) == 3  # the engine serves on


@pytest.mark.parametrize("kw, field", [
    (dict(logit_bias={5: 101}), "logit_bias"), (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(logit_bias={"5": 1}), "logit_bias"), (dict(logit_bias=[(5, 1.0)]), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[3, -2]), "allowed_token_ids"), (dict(allowed_token_ids=5), "allowed_token_ids"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    # a logit divided by 1e-40 overflowed float32: the runtime drew from NaNs and died
    (dict(repetition_penalty=1e-40), "repetition_penalty"), (dict(repetition_penalty=1e39), "repetition_penalty"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=1.0), "min_tokens"), (dict(presence_penalty="1"), "presence_penalty"),
])
def test_bad_values_name_their_field(kw, field):
    with pytest.raises(RequestError, match=field) as e:
        SamplingParams(**kw).validate()
    assert e.value.field == field


class _Pieces:
    """A detokenizer whose token t reads as the string pieces[t]."""

    def __init__(self, pieces):
        self.pieces = pieces

    def push(self, tokens):
        return "".join(self.pieces[t] for t in tokens)

    def finish(self):
        return ""


def test_stop_strings_end_nothing_before_min_tokens():
    """vLLM checks stop strings only once min_tokens tokens are out: one completed before is
    passed through, and one completing after ends the output, even if it began before."""
    pieces = {0: "a", 1: "STOP", 2: "b", 3: "ST", 4: "OP"}
    det = _Pieces(pieces)
    text, upto = feed_stop_strings(StopStrings(["STOP"]), det, np.array([0, 1, 2, 1, 2]), final=True, skip=3)
    assert (text, upto) == ("aSTOPb", 4)
    text, upto = feed_stop_strings(StopStrings(["STOP"]), det, np.array([0, 1, 2, 3, 4, 2]), final=True, skip=4)
    assert (text, upto) == ("aSTOPb", 5)  # "ST" came at 3 (held off), "OP" at 4 completes it
    text, upto = feed_stop_strings(StopStrings(["STOP"]), det, np.array([0, 1, 2]), final=True, skip=5)
    assert (text, upto) == ("aSTOPb", None)
