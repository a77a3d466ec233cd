"""Structured outputs (vLLM's: JSON schema, regex, choice, EBNF grammar, any JSON object) end
to end: real runtime processes, the tiny torch model on CPU and its byte tokenizer. Greedy
tokens are checked against a reference that decodes one sequence alone and masks its logits
with its own xgrammar matcher; also with batching, chunked prefill, prefix hits, plain
requests beside guided ones, preemptions (a recompute re-feeds the output) and a P/D hand-off
(the decode side's first token was drawn by the prefill side)."""

import json
import re

import attrs

import numpy as np
import pytest
import torch
import trio
import xgrammar as xgr

from lockstep import StructuredOutputsParams as S
from lockstep.api import open_engine
from lockstep.engine.config import EngineConfig
from lockstep.policy.config import SchedulerConfig
from lockstep.policy.request import FinishReason, RequestError, SamplingParams
from lockstep.policy.step import PLACEHOLDER
from lockstep.runtime.grammar import Grammars, tokenizer_info
from lockstep.runtime.grammar_check import check
from lockstep.runtime.tokenizer import ByteTokenizer
from test_engine import collect, config, prompts, reference_greedy, tiny_model
from test_model_hf import hf_tokenizer_dir  # noqa: F401 - a fixture
from test_pd import pd_config, run_all, settle
from test_penalties import decode_alone

EOS = 1  # the tiny preset's
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                                            "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "color", "n"], "additionalProperties": False}
CASES = {
    "regex": S(regex=r"[0-9]{3}-[a-z]{2,4}"),
    "choice": S(choice=["yes", "no", "maybe \"so\" é"]),
    "json": S(json=SCHEMA, disable_any_whitespace=True),
    "grammar": S(grammar='root ::= "(" [a-c] [a-c]? [a-c]? ")"'),
}


def vocab() -> int:
    return tiny_model().cfg.vocab_size


def text(tokens: list[int]) -> str:
    return ByteTokenizer(vocab()).decode(tokens)


def matcher(so: S):
    info = tokenizer_info(ByteTokenizer(vocab()), vocab(), [EOS])
    g = Grammars(lambda: info, vocab(), 1)
    g.add(0, so.spec())
    return g.guides[0].matcher


def allowed(m) -> np.ndarray:
    """The model's ids the matcher allows next (the tokenizer's 259; none past them)."""
    n = 3 + 256
    bm = xgr.allocate_token_bitmask(1, n)
    m.fill_next_token_bitmask(bm, 0)
    bits = (bm[0].numpy().astype(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return np.concatenate([bits.reshape(-1)[:n], np.zeros(vocab() - n, np.uint32)]).astype(bool)


def reference(prompt: np.ndarray, p: SamplingParams) -> list[int]:
    """Greedy decoding of one sequence alone, each step's logits masked by the grammar."""
    m = matcher(p.structured_outputs)

    def pick(logits, out):
        x = logits.copy()
        x[~allowed(m)] = -np.inf
        t = int(x.argmax())
        assert m.accept_token(t)
        return t
    return decode_alone(prompt, p, pick)


def greedy(so: S, max_tokens: int = 64) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=so)


def assert_matches(kind: str, tokens: list[int]) -> None:
    """The output is the grammar's and ends with the end of sequence."""
    assert tokens[-1] == EOS, (kind, tokens)
    t = text(tokens[:-1])
    if kind == "regex":
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)
    elif kind == "choice":
        assert t in CASES["choice"].choice
    elif kind == "json":
        v = json.loads(t)
        assert set(v) == {"ok", "color", "n"} and isinstance(v["ok"], bool) and v["color"] in ("red", "green", "blue")
        assert 0 <= v["n"] <= 99
    else:
        assert re.fullmatch(r"\([a-c]{1,3}\)", t)


@pytest.mark.parametrize("kind", list(CASES))
async def test_guided_greedy_matches_the_reference_with_batching_chunks_and_prefix_hits(kind):
    ps = prompts()
    p = greedy(CASES[kind])
    async with open_engine(config(tokenizer=None)) as engine:
        got = await run_all(engine, ps, p)
    want = [reference(x, p) for x in ps]
    assert got == want
    for tokens in got:
        assert_matches(kind, tokens)


async def test_plain_requests_beside_guided_ones_are_unchanged():
    ps = prompts()
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    got = [None] * len(ps)
    async with open_engine(config(tokenizer=None)) as engine:
        async def one(i):
            got[i], _ = await collect(engine, ps[i], greedy(CASES["regex"]) if i % 2 else plain)
        async with trio.open_nursery() as n:
            for i in range(len(ps)):
                n.start_soon(one, i)
    for i, x in enumerate(ps):
        assert got[i] == (reference(x, greedy(CASES["regex"])) if i % 2 else reference_greedy(x, 10))


async def test_sampled_outputs_match_their_grammar():
    ps = prompts()
    async with open_engine(config(tokenizer=None)) as engine:
        for kind, so in CASES.items():
            got = await run_all(engine, ps, SamplingParams(max_tokens=60, temperature=1.0, seed=7,
                                                           structured_outputs=so))
            for tokens in got:
                assert_matches(kind, tokens)


async def test_preempted_guided_requests_follow_their_grammar_after_the_recompute():
    """Few blocks: requests are preempted and recomputed (their outputs re-fed, some from the
    prefix cache, and a step in flight dropped): each matcher must resume where its output stands."""
    sched = SchedulerConfig(num_blocks=14, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                            max_model_len=128)
    cfg = EngineConfig(model="tiny", dtype="float64", scheduler=sched, tokenizer=None)
    rng = np.random.default_rng(3)
    ps = [rng.integers(3, 500, n).astype(np.int32) for n in (40, 45, 50, 35)]
    p = greedy(S(grammar='root ::= [a-z] ([a-z] | " ")+ "."'), max_tokens=40)
    async with open_engine(cfg) as engine:
        got = await run_all(engine, ps, p)
        assert engine.statistics().preemptions > 0
    assert got == [reference(x, p) for x in ps]


async def test_guided_requests_carry_across_a_pd_hand_off():
    """The decode side's first token was drawn by the prefill side: its matcher takes it first."""
    ps = prompts()
    p = greedy(CASES["json"])
    async with open_engine(pd_config("shm")) as engine:
        got = await run_all(engine, ps, p)
        await settle(engine)
    assert got == [reference(x, p) for x in ps]


async def test_a_guided_request_arriving_mid_batch_waits_for_its_grammar_not_the_batch():
    """Scheduled at once, its first sampling step would wait for the compile, and the whole
    batch with it: while others run, no plan holds it before a result says its grammar is
    compiled (vLLM's WAITING_FOR_FSM). Its tokens, and the others', are those of decoding alone."""
    ps = prompts()
    plain = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    p = greedy(CASES["json"])
    events = []
    got = {}
    async with open_engine(config(tokenizer=None)) as engine:
        s = engine.schedulers[0]
        s.on_plan = lambda plan: events.append(("plan", set(plan.req_ids.tolist())))
        s.on_result = lambda plan, r: events.append(("ready", set(r.grammars_ready.tolist())))

        async def one(key, prompt, params):
            got[key], _ = await collect(engine, prompt, params)
        async with trio.open_nursery() as n:
            n.start_soon(one, "plain", ps[0], plain)
            while s.steps < 3:  # (the plain request decodes: 300 steps to go)
                await trio.sleep(0.01)
            n.start_soon(one, "guided", ps[4], p)
        assert (s.inbound, s.statistics().waiting, s.holds.held) == (0, 0, {})
    plain_id = next(iter(events[0][1]))
    guided_id = next(r for kind, ids in events for r in ids if r != plain_id)
    first_plan = next(i for i, (kind, ids) in enumerate(events) if kind == "plan" and guided_id in ids)
    assert any(kind == "ready" and guided_id in ids for kind, ids in events[:first_plan])
    assert got["guided"] == reference(ps[4], p)
    assert got["plain"] == reference_greedy(ps[0], 300)


async def test_a_grammar_the_runtime_has_compiled_is_not_held_again():
    """Once a result has said a grammar is compiled, a later request with the same grammar
    arriving mid-batch is planned at once (its compile is a cache hit in the runtime); another
    grammar is still held. Tokens are those of decoding alone."""
    ps = prompts()
    plain = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    p, other = greedy(CASES["regex"], max_tokens=8), greedy(CASES["json"], max_tokens=8)
    got, held = {}, []

    class Held(dict):  # the requests ever held
        def __setitem__(self, rid, req):
            held.append(rid)
            super().__setitem__(rid, req)

    async with open_engine(config(tokenizer=None)) as engine:
        s = engine.schedulers[0]
        s.holds.held = Held()
        got["first"], _ = await collect(engine, ps[3], p)  # (compiled, and reported, here)
        ids = {}

        async def one(key, prompt, params):
            gen = engine.generate(prompt, params)
            out = []
            async for o in gen:
                ids.setdefault(key, o.request_id)
                out += o.token_ids.tolist()
            got[key] = out
        steps = s.steps
        async with trio.open_nursery() as n:
            n.start_soon(one, "plain", ps[0], plain)
            while s.steps < steps + 3:  # (the plain request decodes: 300 steps to go)
                await trio.sleep(0.01)
            n.start_soon(one, "again", ps[4], p)
            n.start_soon(one, "other", ps[2], other)
        assert (s.holds.held, s.holds.awaiting) == ({}, {})
    assert held == [ids["other"]]
    assert got["first"] == reference(ps[3], p) and got["again"] == reference(ps[4], p)
    assert got["other"] == reference(ps[2], other)
    assert got["plain"] == reference_greedy(ps[0], 300)


async def test_requests_held_for_one_grammar_start_when_the_first_of_them_is_ready():
    """Requests arriving mid-batch with the same new grammar are all held; once a result says
    one of them is compiled, the others start too (the runtime has the grammar), even where
    no result names them (here: taken out of every result)."""
    ps = prompts()
    plain = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    p = greedy(CASES["grammar"], max_tokens=8)
    first, second = 1000, 1001  # (request ids)
    got, plans = {}, []
    async with open_engine(config(tokenizer=None)) as engine:
        s = engine.schedulers[0]
        s.on_plan = lambda plan: plans.append(set(plan.req_ids.tolist()))

        async def first_only(receive=s.client.receive_result):
            r = await receive()
            return attrs.evolve(r, grammars_ready=r.grammars_ready[r.grammars_ready == first])
        s.client.receive_result = first_only

        async def one(key, prompt, params, rid=None):
            got[key], _ = await collect(engine, prompt, params, request_id=rid)
        async with trio.open_nursery() as n:
            n.start_soon(one, "plain", ps[0], plain)
            while s.steps < 3:  # (the plain request decodes: 300 steps to go)
                await trio.sleep(0.01)
            n.start_soon(one, first, ps[3], p, first)
            n.start_soon(one, second, ps[4], p, second)
        assert (s.holds.held, s.holds.awaiting) == ({}, {})  # (its report was taken out; it finished)
    start = {rid: next(i for i, planned in enumerate(plans) if rid in planned) for rid in (first, second)}
    assert start[second] <= start[first] + 1 < 100  # (not once the plain request is done)
    assert got[first] == reference(ps[3], p) and got[second] == reference(ps[4], p)
    assert got["plain"] == reference_greedy(ps[0], 300)


@pytest.mark.parametrize("dep", [1, 2])
async def test_held_requests_start_once_nothing_else_runs(dep):
    """Where no result says a grammar is ready (here: taken out of every result), a held request
    starts once nothing else runs; in a DEP group its rank wakes the others as a message would."""
    ps = prompts()
    p = greedy(CASES["regex"], max_tokens=12)
    got = {}
    async with open_engine(attrs.evolve(config(tokenizer=None), dep=dep)) as engine:
        for s in engine.schedulers:
            async def no_ready(receive=s.client.receive_result):
                return attrs.evolve(await receive(), grammars_ready=np.zeros(0, np.int64))
            s.client.receive_result = no_ready

        async def one(key, prompt, params):
            got[key], _ = await collect(engine, prompt, params)
        async with trio.open_nursery() as n:
            for i in range(dep):
                n.start_soon(one, ("plain", i), ps[i], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
            while sum(s.steps for s in engine.schedulers) < 3 * dep:
                await trio.sleep(0.01)
            for i in range(2):
                n.start_soon(one, ("guided", i), ps[3 + i], p)
        assert [(s.inbound, s.holds.held) for s in engine.schedulers] == [(0, {})] * dep
    assert [got["guided", i] for i in range(2)] == [reference(ps[3 + i], p) for i in range(2)]


async def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing_behind():
    from lockstep.engine.output import RequestStream
    from lockstep.engine.scheduler import Abort, Submit
    from lockstep.policy.request import Request

    ps = prompts()
    async with open_engine(config(tokenizer=None)) as engine:
        s = engine.schedulers[0]
        async with trio.open_nursery() as n:
            async def plain():
                await collect(engine, ps[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
            n.start_soon(plain)
            while s.steps < 3:
                await trio.sleep(0.01)
            # (handled here between two of the actor's checkpoints: the engine is busy, so it is held)
            req = Request(id=10**6, prompt=ps[4], params=greedy(CASES["json"]), eos_token_id=EOS)
            stream = RequestStream(req.id, req.prompt_len, trio.current_time())
            s.inbound += req.prompt_len
            s._handle(Submit(req, stream), trio.current_time())
            assert list(s.holds.held) == [req.id] and s.statistics().waiting == 1
            s._handle(Abort(req.id), trio.current_time())
            assert (s.holds.held, stream.done, stream._finish) == ({}, True, FinishReason.ABORT)
            assert req.id not in s.core.requests and req.id not in s.streams
        assert (s.inbound, s.statistics().waiting, s.statistics().running) == (0, 0, 0)


def test_a_matcher_resumes_from_the_outputs_that_stand():
    """Outputs by index: a dropped step's output is forgotten, a recomputed different one
    restarts the matcher from the outputs before it."""
    info = tokenizer_info(ByteTokenizer(512), 512, [EOS])
    g = Grammars(lambda: info, 512, 4)
    g.add(5, S(regex="ab|ac|bd").spec())

    def allowed_after(k: int) -> set[int]:
        x = torch.zeros(1, 512)
        g.mask(x, [(0, 5, k)])
        return set(torch.nonzero(x[0] == 0).flatten().tolist())

    b = lambda c: ord(c) + 3  # noqa: E731 - the byte tokenizer's id of a character
    assert allowed_after(0) == {b("a"), b("b")}
    g.output(5, 0, b("a"))
    assert allowed_after(1) == {b("b"), b("c")}
    g.output(5, 1, b("b"))  # a step that is then dropped: output 1 is drawn again
    assert allowed_after(1) == {b("b"), b("c")}
    g.output(5, 0, b("b"))  # a recompute that fed another output 0
    assert allowed_after(1) == {b("d")}
    g.output(5, 1, b("d"))
    assert allowed_after(2) == {EOS}
    g.output(5, 2, EOS)
    x = torch.randn(1, 512)
    y = x.clone()
    g.mask(y, [(0, 5, 3)])  # a step after the end (the scheduler had planned it): left as it is
    assert torch.equal(x, y)
    with pytest.raises(RuntimeError, match="needs outputs 0..5"):
        g.mask(torch.zeros(1, 512), [(0, 5, 6)])
    assert PLACEHOLDER < 0  # (plans mark a decode's input so; the runtime never feeds it to a matcher)


def test_draft_masks_are_each_rows_own_mask_after_the_drafts_before_it():
    """A speculative step's masks, filled in rounds over several requests (one position of
    each a round): row first + j allows what the grammar allows after the outputs and
    drafts[:j]; a refused draft leaves the rows after it as they are; the end of a grammar
    allows only the end of sequence; the matchers give the drafts back after."""
    info = tokenizer_info(ByteTokenizer(512), 512, [EOS])
    g = Grammars(lambda: info, 512, 4)
    b = lambda c: ord(c) + 3  # noqa: E731
    specs = {1: "abc|abd|b", 2: "[a-c]+x", 3: "ab"}
    for rid, rx in specs.items():
        g.add(rid, S(regex=rx).spec())
    g.output(1, 0, b("a"))
    # request 1 from output 1: drafts b, d (both in the grammar), then the end
    # request 2 from output 0: drafts a, z (z refused: the row after it is never reached)
    # request 3 from output 0: drafts a, b (then only the end of sequence)
    rows = [(0, 1, 1, [b("b"), b("d")]), (3, 2, 0, [b("a"), b("z")]), (6, 3, 0, [b("a"), b("b")])]
    x = torch.zeros(9, 512)
    g.mask_drafts(x, rows)
    ok = lambda r: set(torch.nonzero(x[r] == 0).flatten().tolist())  # noqa: E731
    assert ok(0) == {b("b")} and ok(1) == {b("c"), b("d")} and ok(2) == {EOS}
    assert ok(3) == {b("a"), b("b"), b("c")} and ok(4) == {b("a"), b("b"), b("c"), b("x")}
    assert ok(5) == set(range(512))  # after the refused draft: left as it was
    assert ok(6) == {b("a")} and ok(7) == {b("b")} and ok(8) == {EOS}
    assert [len(g.guides[r].tokens) for r in specs] == [1, 0, 0]  # the drafts given back
    # a draft pass's rows: one a request, after the drafts so far
    y = torch.zeros(3, 512)
    g.mask_next_draft(y, [(0, 1, 1, [b("b")]), (1, 2, 0, []), (2, 3, 0, [b("a"), b("b")])])
    allowed_y = [set(torch.nonzero(y[r] == 0).flatten().tolist()) for r in range(3)]
    assert allowed_y == [{b("c"), b("d")}, {b("a"), b("b"), b("c")}, {EOS}]
    assert [len(g.guides[r].tokens) for r in specs] == [1, 0, 0]


@pytest.mark.parametrize("so, field, message", [
    (S(json='{"type": "objectx"}'), "structured_outputs.json", "Unsupported type"),
    (S(json="{not json"), "structured_outputs.json", "not valid JSON"),
    (S(regex="a["), "structured_outputs.regex", "Unclosed"),
    (S(grammar="root ::= undefined_rule"), "structured_outputs.grammar", "not a EBNF grammar|undefined"),
])
def test_grammars_xgrammar_cannot_read_are_refused_by_field(so, field, message):
    with pytest.raises(RequestError, match=message) as e:
        check(*so.spec())
    assert e.value.field == field


@pytest.mark.parametrize("kw, field", [
    (dict(), "structured_outputs"), (dict(regex="a", choice=["b"]), "structured_outputs"),
    (dict(json=3), "structured_outputs.json"), (dict(choice=[]), "structured_outputs.choice"),
    (dict(choice="ab"), "structured_outputs.choice"), (dict(regex=""), "structured_outputs.regex"),
    (dict(json_object=1), "structured_outputs.json_object"),
    (dict(regex="a", disable_any_whitespace=None), "structured_outputs.disable_any_whitespace"),
])
def test_bad_structured_outputs_name_their_field(kw, field):
    with pytest.raises(RequestError) as e:
        S(**kw)
    assert e.value.field == field


def test_sampling_params_take_the_dict_form_and_refuse_min_tokens_with_it():
    p = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert p.structured_outputs == S(choice=("a", "b")) and p.processes_logits
    with pytest.raises(RequestError, match="structured_outputs must be None") as e:
        SamplingParams(structured_outputs={"regexx": "a"})
    assert e.value.field == "structured_outputs"
    with pytest.raises(RequestError, match="min_tokens cannot be combined") as e:
        SamplingParams(min_tokens=2, structured_outputs=S(regex="a+"))
    assert e.value.field == "min_tokens"


async def test_engines_that_cannot_run_them_refuse_by_name():
    async with open_engine(config(tokenizer=None)) as engine:
        with pytest.raises(RequestError, match="parenthesis is not closed") as e:
            engine.generate(prompts()[0], greedy(S(regex="(a")))
        assert e.value.field == "structured_outputs.regex"
    async with open_engine(config(runtime="timing", tokenizer=None)) as engine:
        with pytest.raises(RequestError, match="not supported with the timing runtime") as e:
            engine.generate(prompts()[0], greedy(CASES["regex"]))
        assert e.value.field == "structured_outputs"


@pytest.mark.parametrize("draft", ["tiny", "tiny-draft"])
async def test_speculative_decoding_keeps_guided_greedy_tokens(draft):
    """Drafts are drawn from the grammar's tokens, and each verified row is masked as if the
    drafts before it were accepted: greedy tokens equal decoding alone with the grammar. The
    draft "tiny" is the target itself: its drafts are the target's tokens, all accepted."""
    ps = prompts()
    cfg = config(tokenizer=None, draft_model=draft, num_spec_tokens=3)
    async with open_engine(cfg) as engine:
        for kind in ("json", "regex"):
            p = greedy(CASES[kind], max_tokens=40)
            got = await run_all(engine, ps, p)
            assert got == [reference(x, p) for x in ps], kind
        stats = [s.statistics() for s in engine.schedulers]
        sampled = await run_all(engine, ps, SamplingParams(max_tokens=60, temperature=1.0, seed=3,
                                                           structured_outputs=CASES["json"]))
        for s in engine.schedulers:
            assert s.core.pool.num_used == 0
    accepted, drafted = sum(st.spec_accepted_tokens for st in stats), sum(st.spec_draft_tokens for st in stats)
    assert accepted > 0
    if draft == "tiny":  # the target's own drafts, from the same grammar's masks: every one accepted
        assert accepted == drafted
    for tokens in sampled:
        assert_matches("json", tokens)


def test_a_hugging_face_byte_level_vocabulary_spells_the_grammar(hf_tokenizer_dir):
    """A checkpoint's tokenizer.json (byte-level BPE, merged tokens): the masks let through
    the tokens that spell the grammar's strings, whichever merges the draws pick."""
    from lockstep.runtime.tokenizer import HFTokenizer

    tok = HFTokenizer(hf_tokenizer_dir)
    vocab_size = 320  # (the model's: past the tokenizer's 300, never allowed)
    g = Grammars(lambda: tokenizer_info(tok, vocab_size, [tok.eos_token_id]), vocab_size, 2)
    for seed in range(8):
        g.add(seed, S(regex="(hello|héllo) (world|there|ok)+").spec())
        gen = torch.Generator().manual_seed(seed)
        out = []
        while not out or out[-1] != tok.eos_token_id:
            x = torch.randn(1, vocab_size, generator=gen) * 3
            g.mask(x, [(0, seed, len(out))])
            assert torch.isinf(x[0, 300:]).all()
            out.append(int(x[0].argmax()))
            g.output(seed, len(out) - 1, out[-1])
            assert len(out) < 60
        assert re.fullmatch("(hello|héllo) (world|there|ok)+", tok.decode(out[:-1])), tok.decode(out)


def test_the_grammar_applies_after_the_marker_a_reasoning_model_thinks_before():
    """after_tokens: the outputs up to the marker are not constrained; the grammar applies from
    the output after it, and restarts where a recompute moves the marker."""
    info = tokenizer_info(ByteTokenizer(512), 512, [EOS])
    g = Grammars(lambda: info, 512, 4)
    b = lambda c: ord(c) + 3  # noqa: E731 - the byte tokenizer's id of a character
    g.add(7, S(regex="[0-9]+").spec(), [b("<"), b("/")])

    def free(k: int) -> bool:
        x = torch.zeros(1, 512)
        g.mask(x, [(0, 7, k)])
        return bool((x[0] == 0).all())

    assert free(0)
    for k, c in enumerate("hm</"):
        g.output(7, k, b(c))
    assert not free(4)  # from output 4 on: digits
    g.output(7, 4, b("5"))
    x = torch.zeros(1, 512)
    g.mask(x, [(0, 7, 5)])
    assert set(torch.nonzero(x[0] == 0).flatten().tolist()) == {b(d) for d in "0123456789"} | {EOS}
    g.output(7, 2, b("x"))  # a recompute without the marker there: thinking again
    assert free(3)
    with pytest.raises(RequestError) as e:
        S(regex="a", after_tokens=[-1])
    assert e.value.field == "structured_outputs.after_tokens"


def test_an_engine_constrains_only_what_follows_after_tokens():
    """Greedy: the first token (drawn free) is the marker; what follows matches the regex."""
    from lockstep import LLM

    with LLM("tiny", dtype="float64") as llm:
        free = llm.generate([prompts()[2]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
        first = int(free.token_ids[0])
        so = S(regex="[a-c]{5}", after_tokens=[first])
        out = llm.generate([prompts()[2]], SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=so))[0]
    toks = out.token_ids.tolist()
    assert toks[0] == first and toks[-1] == EOS and re.fullmatch("[a-c]{5}", text(toks[1:-1]))


def test_a_grammar_compiled_once_gives_later_requests_their_matchers_without_the_pool():
    """A request whose grammar the runtime compiled lately is ready when it arrives (reported
    at once), and one already queued behind another compile takes the compiled grammar rather
    than waiting its turn on the pool. A compile cancelled (its request gone) is not reported:
    the engine would take its grammar for compiled and start requests held for it."""
    import threading

    info = tokenizer_info(ByteTokenizer(512), 512, [EOS])
    g = Grammars(lambda: info, 512, 4)
    spec = S(regex="[0-9]{2}").spec()
    gate, blocker, compile_ = threading.Event(), threading.Event(), g._compile

    def gated(key, first=[True]):  # the first compile waits for the gate
        if first:
            first.clear()
            gate.wait(60)
        return compile_(key)
    g._compile = gated
    g.add(1, spec)
    g._pool.submit(blocker.wait, 60)  # the pool's one thread: busy after 1's compile
    g.add(2, spec)  # (queued behind the blocker: 1's compile has not run)
    gate.set()
    try:
        g.guides[1].future.result()
        assert g.take_ready() == [1]
        g.add(3, spec)
        assert g.guides[3].future.done() and g.take_ready() == [3]
        m = g.guides[2].matcher  # (the blocker still holds the pool)
        assert g.guides[2].future.cancelled() and m.accept_string("42") and not m.accept_string("7")
        g.add(4, S(regex="[a-z]{2}").spec())
        g.forget(4)  # (finished or aborted while its compile waits: cancelled, never reported)
    finally:
        blocker.set()
    g._pool.submit(lambda: None).result()  # (the pool is idle: any compile left has run)
    assert g.take_ready() == [2]  # (given its matcher from 1's grammar: ready)


def test_a_grammar_that_allows_nothing_or_refused_an_output_ends_it():
    """No tokens outside the grammar: where it allows nothing (a regex like [^\\s\\S]) or its
    matcher refused an output (fed by a plan), the row may draw only the end of sequence."""
    info = tokenizer_info(ByteTokenizer(512), 512, [EOS])
    g = Grammars(lambda: info, 512, 4)
    g.add(1, S(regex=r"[^\s\S]").spec())
    g.add(2, S(regex="ab").spec())
    g.output(2, 0, ord("z") + 3)  # (a recompute fed an output the grammar refuses)
    x = torch.zeros(2, 512)
    g.mask(x, [(0, 1, 0), (1, 2, 1)])
    for row in (0, 1):
        assert torch.nonzero(x[row] == 0).flatten().tolist() == [EOS]


async def test_an_engine_ends_an_output_whose_grammar_allows_nothing():
    async with open_engine(config(tokenizer=None)) as engine:
        got, last = await collect(engine, prompts()[1], greedy(S(regex=r"[^\s\S]")))
    assert got == [EOS] and last.finish_reason == "stop"


@pytest.mark.parametrize("schema, what", [
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "'uniqueItems' (at /)"),
    ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "'allOf' with 2 schemas"),
    ({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}, "'multipleOf' (at /properties/n)"),
    ({"$defs": {"x": {"not": {"type": "string"}}}, "$ref": "#/$defs/x"}, "'not' (at /$defs/x)"),
])
def test_schema_keywords_xgrammar_would_ignore_are_refused(schema, what):
    with pytest.raises(RequestError, match="which xgrammar does not enforce") as e:
        check(*S(json=schema).spec())
    assert what in str(e.value) and e.value.field == "structured_outputs.json"
    check(*S(json={"type": "object", "properties": {"not": {"type": "string"}, "enum": {"enum": [{"if": 1}]}}}).spec())


def test_strings_with_length_bounds_stay_json():
    """xgrammar 0.2.9 writes a maxLength string as a rule that lets raw control characters
    through; lockstep compiles the bounds as a pattern of JSON characters instead: random
    draws under the mask always parse, within the bounds."""
    import json as _json

    info = tokenizer_info(ByteTokenizer(512), 512, [EOS])
    g = Grammars(lambda: info, 512, 1)
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 2, "maxLength": 6}},
              "required": ["a"]}
    tok = ByteTokenizer(512)
    for seed in range(20):
        g.add(seed, S(json=schema, disable_any_whitespace=True).spec())
        gen, out = torch.Generator().manual_seed(seed), []
        while not out or out[-1] != EOS:
            x = torch.randn(1, 512, generator=gen) * 3
            g.mask(x, [(0, seed, len(out))])
            out.append(int(x[0].argmax()))
            g.output(seed, len(out) - 1, out[-1])
        assert 2 <= len(_json.loads(tok.decode(out[:-1]))["a"]) <= 6
        g.forget(seed)
