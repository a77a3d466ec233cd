"""The trio engine end to end: real runtime processes over shared memory, the tiny torch
model on CPU, the Python API, aborts, bad input, a runtime killed mid-step, and leaks."""

import functools
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
import trio

from lockstep.api import open_engine
from lockstep.llm import LLM
from lockstep.engine.config import EngineConfig
from lockstep.engine.runtime_client import RuntimeDied
from lockstep.policy.config import SchedulerConfig
from lockstep.policy.request import RequestError, SamplingParams
from lockstep.runtime.models import load_model
from lockstep.runtime.models.batch import ForwardBatch
from leaks import child_pids, descendant_pids, fd_count

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def config(**kw) -> EngineConfig:
    # Small token budget: long prompts are prefilled in chunks across steps.
    sched = SchedulerConfig(num_blocks=256, block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
                            max_model_len=512)
    return EngineConfig(model="tiny", dtype="float64", scheduler=sched, **kw)


def prompts() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    base = rng.integers(3, 500, 150).astype(np.int32)
    # Shared leading blocks give prefix-cache hits; lengths cross block boundaries.
    return [base[:1], base[:37], base, np.concatenate([base[:64], [7, 8, 9]]).astype(np.int32),
            rng.integers(3, 500, 90).astype(np.int32)]


@functools.cache
def tiny_model():
    return load_model("tiny", dtype=torch.float64, device="cpu", seed=0)


def reference_greedy(prompt: np.ndarray, n: int) -> list[int]:
    """Greedy decoding of one sequence alone: the whole prompt in one forward, then one
    token per forward (no batching, no chunks, no shared blocks)."""
    model = tiny_model()
    kv = model.make_kv_cache(64, 16)
    seq = [int(t) for t in prompt]
    table = list(range(-(-(len(seq) + n) // 16)))
    logits, _ = model(ForwardBatch.build([seq], [0], [table], 16), kv)
    out = [int(logits[0].argmax())]
    for _ in range(n - 1):
        logits, _ = model(ForwardBatch.build([[out[-1]]], [len(seq) + len(out) - 1], [table], 16), kv)
        out.append(int(logits[0].argmax()))
    return out


async def collect(engine, prompt, params, **kw):
    toks, last = [], None
    async for out in engine.generate(prompt, params, **kw):
        toks.append(out.token_ids)
        last = out
    return np.concatenate(toks).tolist(), last


async def test_greedy_matches_reference_with_batching_chunks_and_prefix_hits():
    ps = prompts()
    got = [None] * len(ps)
    async with open_engine(config(tokenizer=None)) as engine:
        async def one(i):
            got[i], _ = await collect(engine, ps[i], GREEDY)
        async with trio.open_nursery() as n:
            for i in range(len(ps)):
                n.start_soon(one, i)
        stats = engine.statistics()
        engine.scheduler.core.check_integrity()
    assert stats.prefix_hits > 0
    for p, g in zip(ps, got):
        assert g == reference_greedy(p, GREEDY.max_tokens)


async def test_seeded_sampling_repeats_whatever_shares_the_batch():
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, top_k=40, seed=1234, ignore_eos=True)
    ps = prompts()
    async with open_engine(config(tokenizer=None)) as engine:
        alone, _ = await collect(engine, ps[2], params)
        together = {}

        async def one(i, p):
            together[i], _ = await collect(engine, ps[i], p)
        async with trio.open_nursery() as n:
            n.start_soon(one, 2, params)
            n.start_soon(one, 4, SamplingParams(max_tokens=10, temperature=1.0))
    assert together[2] == alone


async def test_a_tiny_temperature_or_top_p_samples_the_greedy_tokens():
    """Any temperature > 0 and top_p in (0, 1] are served (OpenAI's ranges): a temperature of
    1e-30 or 1e-50 (0 in float32), or a top_p of 1e-50, tends to greedy, where dividing the
    logits by a temperature before shifting them, or a top_p rounded to 0, made the sampler
    NaN and killed the runtime."""
    p = prompts()[2]
    async with open_engine(config(tokenizer=None)) as engine:
        for t, top_p in ((1e-30, 0.9), (1e-50, 0.9), (1.0, 1e-50)):
            got, _ = await collect(engine, p, SamplingParams(max_tokens=8, temperature=t, top_p=top_p, seed=7,
                                                             ignore_eos=True))
            assert got == reference_greedy(p, 8), (t, top_p)


async def test_stream_deltas_finish_reason_counts_and_text():
    async with open_engine(config()) as engine:
        outs = [o async for o in engine.generate("hello there", SamplingParams(max_tokens=6, ignore_eos=True))]
    assert [o.finished for o in outs][-1] and not any(o.finished for o in outs[:-1])
    last = outs[-1]
    assert last.finish_reason == "length" and last.num_output_tokens == 6
    assert last.num_prompt_tokens == len("hello there")
    assert last.ttft_s is not None and last.e2e_s >= last.ttft_s
    assert sum(len(o.token_ids) for o in outs) == 6


async def test_outputs_report_the_prompt_tokens_served_from_the_prefix_cache():
    """vLLM's num_cached_tokens: 0 for a prompt seen first, the hit (whole blocks) after."""
    prompt = prompts()[2]  # 150 tokens: 9 whole blocks of 16
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    async with open_engine(config(tokenizer=None)) as engine:
        first = await engine.complete(prompt, params)
        hits = engine.statistics().prefix_hits
        outs = [o async for o in engine.generate(prompt, params)]
        again = await engine.complete(prompt, params)
        assert first.num_cached_tokens == 0
        assert {o.num_cached_tokens for o in outs} == {144} and again.num_cached_tokens == 144
        assert engine.statistics().prefix_hits - hits == 2 * 144


async def test_priority_needs_priority_scheduling_and_then_orders_the_queue():
    """vLLM's rule: a priority under first-come-first-served scheduling is an error, not
    ignored; under priority scheduling the lower value starts first."""
    async with open_engine(config(tokenizer=None)) as engine:
        with pytest.raises(RequestError, match="priority 3 needs priority scheduling") as e:
            engine.generate([5, 6], SamplingParams(max_tokens=2), priority=3)
        assert e.value.field == "priority"
        assert len((await engine.complete([5, 6], SamplingParams(max_tokens=2), priority=0)).token_ids) == 2
    sched = SchedulerConfig(num_blocks=256, block_size=16, max_num_seqs=1, max_num_batched_tokens=64,
                            max_model_len=512, policy="priority")
    done = []
    async with open_engine(EngineConfig(model="tiny", dtype="float64", scheduler=sched, tokenizer=None)) as engine:
        async def one(name, prio, n):
            await engine.complete([5, 6, 7], SamplingParams(max_tokens=n, ignore_eos=True), priority=prio)
            done.append(name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "first", 0, 200)
            while engine.statistics().running == 0:  # it holds the one slot for 200 steps
                await trio.sleep(0.001)
            nursery.start_soon(one, "low", 5, 2)
            await trio.sleep(0.001)
            nursery.start_soon(one, "high", -5, 2)
    assert done == ["first", "high", "low"]


async def test_stop_token_ids_end_the_request_early():
    async with open_engine(config(tokenizer=None)) as engine:
        full, _ = await collect(engine, prompts()[1], GREEDY)
        stop = full[4]
        cut, last = await collect(engine, prompts()[1], attrs_evolve(GREEDY, stop_token_ids=(stop,)))
        await trio.sleep(0.05)  # the abort reaches the scheduler at the next step boundary
        used = engine.statistics().kv_blocks_used
    assert cut == full[: full.index(stop) + 1]
    assert last.finish_reason == "stop" and last.stop_reason == stop  # vLLM's stop_reason: the id
    assert last.e2e_s is not None and last.e2e_s >= last.ttft_s  # (it was None: a crash in `generate`)
    assert used == 0


async def test_stop_strings_spanning_deltas_are_never_partly_returned():
    """Every stop string cuts the text where it first starts, wherever the deltas split it
    (text is held back until no stop string can start in it), streamed and whole."""
    from lockstep.runtime.tokenizer import IncrementalDetokenizer

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    async with open_engine(config()) as engine:
        whole = await engine.complete("hello", params)
        full, ids = whole.text, whole.token_ids.tolist()
        assert len(full) >= 6
        stops = [full[i : i + w] for w in (2, 3) for i in range(1, len(full) - w + 1)]

        def completing(stop):  # tokens up to the one whose text completes the stop string
            detok, seen = IncrementalDetokenizer(engine.tokenizer), ""
            for k, t in enumerate(ids, 1):
                seen += detok.push([t])
                if stop in seen:
                    return k
            return len(ids)

        async def check(stop):
            outs = [o async for o in engine.generate("hello", attrs_evolve(params, stop=(stop, "never here")))]
            text = "".join(o.text for o in outs)
            assert text == full[: full.find(stop)], (stop, full)
            assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
            assert outs[-1].e2e_s is not None
            got = [t for o in outs for t in o.token_ids.tolist()]
            assert got == ids[: completing(stop)] and outs[-1].num_output_tokens == len(got), (stop, full)

        async with trio.open_nursery() as nursery:
            for stop in stops:
                nursery.start_soon(check, stop)
        await trio.sleep(0.05)
        assert engine.statistics().kv_blocks_used == 0


def attrs_evolve(params, **kw):
    import attrs
    return attrs.evolve(params, **kw)


async def test_leaving_the_loop_aborts_and_frees_blocks():
    async with open_engine(config(tokenizer=None)) as engine:
        agen = engine.generate(prompts()[2], SamplingParams(max_tokens=200, ignore_eos=True))
        async for _ in agen:
            break
        await agen.aclose()
        with trio.fail_after(5):
            while engine.statistics().running or engine.statistics().kv_blocks_used:
                await trio.sleep(0.01)
        engine.scheduler.core.check_integrity()


async def test_a_request_abandoned_before_it_reaches_a_scheduler_never_runs():
    """The consumer leaves while the Frontend still tokenizes and hashes its prompt: the abort
    finds no scheduler entry, so the request must be dropped where it arrives (it used to run
    to max_tokens for nobody, holding blocks)."""
    async with open_engine(config(tokenizer=None)) as engine:
        entered, gate, left = threading.Event(), threading.Event(), threading.Event()
        prepare = engine.frontend._prepare

        def held(p):  # the Frontend's worker thread waits here until the consumer is gone
            entered.set()
            gate.wait(30)
            try:
                return prepare(p)
            finally:
                left.set()
        engine.frontend._prepare = held

        async def consume():
            async for _ in engine.generate(prompts()[2], SamplingParams(max_tokens=300, ignore_eos=True)):
                pass
        async with trio.open_nursery() as n:
            n.start_soon(consume)
            await trio.to_thread.run_sync(entered.wait, 30)
            n.cancel_scope.cancel()  # the consumer leaves; its abort reaches every rank, empty
        gate.set()
        await trio.to_thread.run_sync(left.wait, 30)
        for _ in range(20):  # the Frontend routes, the scheduler takes its message, steps pass
            await trio.sleep(0.01)
        stats = engine.statistics()
        assert stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0
        assert engine.scheduler.streams == {} and engine.frontend.rank_of == {}
        engine.scheduler.core.check_integrity()


async def test_engine_abort_before_routing_ends_the_request_there():
    """``Engine.abort`` reaches a request still in the Frontend: it ends as aborted, never runs."""
    async with open_engine(config(tokenizer=None)) as engine:
        entered, gate = threading.Event(), threading.Event()
        prepare = engine.frontend._prepare

        def held(p):
            entered.set()
            gate.wait(30)
            return prepare(p)
        engine.frontend._prepare = held
        outs = []

        async def consume():
            async for out in engine.generate(prompts()[2], SamplingParams(max_tokens=300, ignore_eos=True)):
                outs.append(out)
        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                n.start_soon(consume)
                await trio.to_thread.run_sync(entered.wait, 30)
                (rid,) = list(engine._live)
                engine.abort(rid)  # the broadcast finds no scheduler entry
                gate.set()
        assert outs[-1].finish_reason == "abort" and outs[-1].num_output_tokens == 0
        stats = engine.statistics()
        assert stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0


async def test_bad_input_fails_at_submission_and_queues_nothing():
    async with open_engine(config(tokenizer=None)) as engine:
        with pytest.raises(RequestError, match="temperature"):
            engine.generate([5, 6], SamplingParams(temperature=-1))
        with pytest.raises(RequestError, match="context"):
            engine.generate(np.arange(3, 600), SamplingParams(max_tokens=1))
        with pytest.raises(RequestError, match=r"token ids must be in \[0, 512\)"):
            engine.generate([5, 9999], SamplingParams())
        with pytest.raises(RequestError, match="1-D"):
            engine.generate([[1, 2]], SamplingParams())
        with pytest.raises(RequestError, match="stop strings need a tokenizer") as e:
            engine.generate([5, 6], SamplingParams(stop="x"))
        assert e.value.field == "stop"
        assert engine.statistics().waiting == 0 and engine.statistics().running == 0


async def test_killed_runtime_fails_inflight_requests_then_engine_restarts_it():
    async with open_engine(config(tokenizer=None)) as engine:
        pid = engine.scheduler.client.ready.pid
        agen = engine.generate(prompts()[2], SamplingParams(max_tokens=300, ignore_eos=True))
        await agen.__anext__()
        os.kill(pid, signal.SIGKILL)
        with trio.fail_after(5):
            with pytest.raises(RuntimeDied, match="exited"):
                async for _ in agen:
                    pass
        toks, last = await collect(engine, prompts()[1], GREEDY)
        assert len(toks) == GREEDY.max_tokens and last.finish_reason == "length"
        assert engine.statistics().runtime_restarts == 1
        assert engine.scheduler.client.ready.pid != pid


async def test_a_runtime_killed_again_while_it_restarts_is_restarted_again():
    async with open_engine(config(tokenizer=None)) as engine:
        first = engine.scheduler.client.ready.pid
        os.kill(first, signal.SIGKILL)  # idle: the engine restarts it at once
        with trio.fail_after(30):
            while engine.scheduler.client.proc is None or engine.scheduler.client.proc.pid in (None, first):
                await trio.sleep(0.002)
            os.kill(engine.scheduler.client.proc.pid, signal.SIGKILL)  # the replacement, before it is ready
            toks, last = await collect(engine, prompts()[1], GREEDY)
        assert len(toks) == GREEDY.max_tokens and last.finish_reason == "length"
        assert engine.statistics().runtime_restarts == 1


async def test_requests_still_queued_when_the_engine_stops_fail_and_a_closed_engine_says_so():
    results = []

    async def consume(engine, i):
        try:
            await collect(engine, [5, 6, 7 + i], SamplingParams(max_tokens=50, ignore_eos=True))
            results.append("done")
        except RuntimeError as e:
            results.append(str(e))

    with trio.fail_after(30):
        async with trio.open_nursery() as outer:  # consumers that outlive the engine's block
            async with open_engine(config(tokenizer=None)) as engine:
                admit, gate = engine.frontend._admit, trio.Event()

                async def held(p):  # the Frontend takes one prompt and waits: the rest queue up
                    await gate.wait()
                    await admit(p)
                engine.frontend._admit = held
                for i in range(10):
                    outer.start_soon(consume, engine, i)
                while engine.frontend.send_channel.statistics().current_buffer_used < 9:
                    await trio.sleep(0.001)
    assert results == ["the engine shut down"] * 10
    with pytest.raises(RuntimeError, match="this engine is closed"):
        engine.generate([5, 6], SamplingParams())


async def test_prompts_in_every_shape_vllm_takes_and_ids_that_would_wrap():
    async with open_engine(config(tokenizer=None)) as engine:
        want, _ = await collect(engine, [5, 6, 7], GREEDY)
        got, _ = await collect(engine, {"prompt_token_ids": [5, 6, 7]}, GREEDY)
        assert got == want
        for bad in ([2**32 + 5], np.array([2**63 + 5], dtype=np.uint64), [-(2**32) + 5]):
            with pytest.raises(RequestError, match=r"token ids must be in \[0, 2\*\*31 - 1\]") as e:
                engine.generate(bad, GREEDY)  # not wrapped into range and served as id 5
            assert e.value.field == "prompt"
        for bad, match in (({"prompt": "x", "extra": 1}, "may hold 'cache_salt'"), ([[1, 2], [3]], "1-D sequence")):
            with pytest.raises(RequestError, match=match):
                engine.generate(bad, GREEDY)
        # vLLM's dicts may carry a cache_salt: another salt, no prefix hit on the same prompt
        long = list(range(3, 60))
        first = await engine.complete({"prompt_token_ids": long, "cache_salt": "a"}, GREEDY)
        again = await engine.complete({"prompt_token_ids": long, "cache_salt": "a"}, GREEDY)
        other = await engine.complete({"prompt_token_ids": long, "cache_salt": "b"}, GREEDY)
        assert (first.num_cached_tokens, again.num_cached_tokens, other.num_cached_tokens) == (0, 48, 0)
        with pytest.raises(RequestError, match="cache_salt given twice"):
            engine.generate({"prompt_token_ids": long, "cache_salt": "a"}, GREEDY, cache_salt="b")


def test_other_forkserver_processes_still_stop_on_terminate():
    """The forkserver ignores SIGTERM (a group signal must not take it down mid-drain), but
    what it forks for anyone else still stops on terminate()."""
    import time as _time

    from lockstep.engine.runtime_client import forkserver_context

    p = forkserver_context().Process(target=_time.sleep, args=(60,))
    p.start()
    p.terminate()
    p.join(20)
    assert p.exitcode == -signal.SIGTERM


async def test_engine_leaves_no_process_or_fd_behind():
    async with open_engine(config(runtime="timing", tokenizer=None)) as engine:  # warm the forkserver
        await collect(engine, [5, 6, 7], SamplingParams(max_tokens=2))
    fds, kids = fd_count(), child_pids()
    for _ in range(3):
        async with open_engine(config(tokenizer=None)) as engine:
            await collect(engine, [5, 6, 7], SamplingParams(max_tokens=2))
    assert fd_count() == fds
    assert child_pids() == kids


@pytest.mark.parametrize("kw, match", [
    (dict(device=None), "engine.device must be a string"), (dict(device="cudaX"), "cuda\\[:N\\]"),
    (dict(model=5), "engine.model must be a string"), (dict(scheduler="x"), "must be a SchedulerConfig"),
    (dict(hash_secret=5), "engine.hash_secret must be a string"), (dict(tokenizer=5), "engine.tokenizer"),
    (dict(runtime_options="x"), "engine.runtime_options must be a dict"), (dict(seed="x"), "engine.seed"),
    (dict(ring_bytes=100), "engine.ring_bytes"), (dict(mailbox_size=-1), "engine.mailbox_size"),
    (dict(dep=True), "engine.dep"),
    # read from the configs before any weights load (they used to fail inside the runtime)
    (dict(draft_model="layers:4"), r"'layers:4': N must be in \[1, 4\)"),
    (dict(draft_model="layers:x"), "N an integer"), (dict(draft_model="v2-lite"), "vocabulary of 102400"),
    (dict(runtime="timing", draft_model="x"), "prices the draft of its deployment's \\[speculative\\] table"),
    # settings that mean nothing without P/D or a draft (they used to be ignored)
    (dict(prefill_dep=2), "prefill_dep 2: only used with prefill/decode"),
    (dict(kv_transport="shm"), "kv_transport 'shm': only used with prefill/decode"),
    (dict(spec_adaptive=True), "spec_adaptive True: only used with speculative"),
    (dict(draft_experts="sharded"), "draft_experts 'sharded': only used with speculative"),
])
def test_engine_config_names_a_field_of_the_wrong_kind(kw, match):
    from lockstep.policy.config import ConfigError
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kw)
    with pytest.raises(ConfigError, match="scheduler.max_num_seqs must be an integer"):
        SchedulerConfig(max_num_seqs=True)


async def test_a_checkpoint_with_a_bad_config_is_refused_at_start(tmp_path):
    from lockstep.policy.config import ConfigError
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match="engine.model: .*config.json: model_type must be 'deepseek_v3'"):
        async with open_engine(EngineConfig(model=str(tmp_path))):
            pass


def test_sync_llm_generates_text_for_each_prompt():
    with LLM("tiny", dtype="float64", max_model_len=1024) as llm:
        assert llm.config.scheduler.max_model_len == 1024  # SchedulerConfig's fields, as vLLM's LLM takes them
        outs = llm.generate(["hello", "wörld"], SamplingParams(max_tokens=5, ignore_eos=True))
        assert [o.finish_reason for o in outs] == ["length", "length"]
        assert all(len(o.token_ids) == 5 for o in outs)
        assert outs[1].num_prompt_tokens == len("wörld".encode())
        assert llm.generate([]) == []
        assert len(llm.generate(np.array([[5, 6], [7, 8]]), SamplingParams(max_tokens=2))) == 2


def test_sync_llm_chat_goes_through_the_chat_template():
    """vLLM's LLM.chat: a conversation (or several) through the template, with tools,
    chat_template_kwargs and continue_final_message; bad ones name their field."""
    from lockstep.runtime.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    conv = [{"role": "user", "content": "hi"}]
    with LLM("tiny", dtype="float64") as llm:
        (one,) = llm.chat(conv, greedy)
        (same,) = llm.generate([tok.encode(tok.apply_chat_template(conv))], greedy)
        assert one.token_ids.tolist() == same.token_ids.tolist() and one.num_prompt_tokens == same.num_prompt_tokens
        two = llm.chat([conv, conv + [{"role": "assistant", "content": "Hel"}]], greedy, continue_final_message=False,
                       add_generation_prompt=True, tools=[{"type": "function", "function": {"name": "f"}}])
        assert len(two) == 2 and two[0].num_prompt_tokens > one.num_prompt_tokens  # the tools are in the prompt
        (cont,) = llm.chat(conv + [{"role": "assistant", "content": "Hel"}], greedy, continue_final_message=True)
        want = tok.apply_chat_template(conv + [{"role": "assistant", "content": "Hel"}], add_generation_prompt=False)
        assert cont.num_prompt_tokens == len(tok.encode(want[:want.rindex("Hel") + 3]))
        with pytest.raises(RequestError, match="role must be") as e:
            llm.chat([{"role": "robot", "content": "x"}], greedy)
        assert e.value.field == "messages"
        with pytest.raises(RequestError, match="continue_final_message needs") as e:
            llm.chat(conv, greedy, continue_final_message=True)
        assert e.value.field == "continue_final_message"


def test_sync_llm_keeps_one_engine_across_calls_and_releases_it_on_close():
    procs, fds = descendant_pids(), fd_count()
    llm = LLM("tiny", dtype="float64")
    runtimes = descendant_pids() - procs
    assert runtimes
    for _ in range(3):  # the same runtime processes serve every call: weights load once
        llm.generate(["a", [5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert descendant_pids() - procs == runtimes
    llm.close()
    llm.close()  # idempotent
    assert descendant_pids() == procs and fd_count() == fds
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("a")


def test_sync_llm_inside_a_trio_run_says_what_to_use_and_still_closes():
    """Its calls would block the run's loop: refused, naming the async API; a close from
    there stops the engine (it used to fail half-way and leave the runtimes running)."""
    procs = descendant_pids()
    llm = LLM("tiny", dtype="float64")
    # the runtimes: below the forkserver (this process's own children, forkserver and resource
    # tracker, stay for the process's life)
    runtimes = {p for p in descendant_pids() - procs
                if int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]) != os.getpid()}
    assert runtimes and llm.generate("a", sampling_params=SamplingParams(max_tokens=2))  # vLLM's keyword

    async def inside():
        with pytest.raises(RuntimeError, match="synchronous API and this is a trio run.*open_engine"):
            llm.generate("a", SamplingParams(max_tokens=2))
        with pytest.raises(RuntimeError, match=r"LLM\(\) is the synchronous API"):
            LLM("tiny")
        llm.close()
    trio.run(inside)
    assert not runtimes & descendant_pids()
    with pytest.raises(TypeError, match="not both"):
        llm.generate("a", SamplingParams(), sampling_params=SamplingParams())
    with LLM("tiny", dtype="float64") as other, pytest.raises(RequestError, match="needs priority scheduling"):
        other.generate(["a", "b"], priority=[0, 3])  # (per prompt, through to the engine)


def test_sync_llm_rejects_bad_input_plainly_and_leaves_nothing_behind():
    kids = descendant_pids()
    with pytest.raises(ValueError, match="unknown argument 'max_model_length' \\(did you mean 'max_model_len'"):
        LLM("tiny", max_model_length=10)
    with pytest.raises(ValueError, match="engine.model must be a preset"):
        LLM("no-such-model")
    assert descendant_pids() == kids
    with LLM("tiny", dtype="float64") as llm:
        with pytest.raises(RequestError, match="top_k"):
            llm.generate(["a"], SamplingParams(top_k=2.5))
        with pytest.raises(RequestError, match="params"):
            llm.generate(["a"], {"max_tokens": 3})
        with pytest.raises(RequestError, match="prompts\\[1\\]: prompt token ids"):  # which prompt, too
            llm.generate(["a", [5, 10**6]], SamplingParams(max_tokens=2))
        with pytest.raises(RequestError, match="prompts\\[1\\]: prompt must hold at least one token"):
            llm.generate(["a", ""], SamplingParams(max_tokens=2))
        assert llm.generate("a", SamplingParams(max_tokens=2))[0].finish_reason is not None
    assert descendant_pids() == kids


_EXIT_SCRIPT = """
import os, signal, sys, tempfile, threading, time
def descendants():
    kids, parent = set(), {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                parent[int(p)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            pass
    todo = [os.getpid()]
    while todo:
        me = todo.pop()
        new = [p for p, q in parent.items() if q == me]
        kids.update(new)
        todo += new
    return kids
if __name__ == "__main__":
    keep = tempfile.TemporaryDirectory()  # a weakref.finalize made before the LLM's
    import lockstep
    from lockstep import SamplingParams
    if sys.argv[1] == "unclosed":
        llm = lockstep.LLM("tiny")
        print(llm.generate("hi", SamplingParams(max_tokens=2))[0].finish_reason, flush=True)
    else:  # Ctrl-C while the engine starts
        def interrupt():  # as soon as the engine's thread exists: long before the engine is up
            while not any(t.name == "lockstep-llm" for t in threading.enumerate()):
                time.sleep(0.0005)
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=interrupt, daemon=True).start()
        try:
            lockstep.LLM("tiny")
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    print(",".join(map(str, sorted(descendants()))) or "-", flush=True)
"""


@pytest.mark.parametrize("case", ["unclosed", "interrupted"])
def test_sync_llm_never_outlives_the_interpreter(tmp_path, case):
    """An LLM never closed is closed at exit (before multiprocessing waits for its runtime),
    and one interrupted while its engine starts stops it: the script exits, nothing left."""
    import subprocess
    import sys
    script = tmp_path / "s.py"
    script.write_text(_EXIT_SCRIPT)
    out = subprocess.run([sys.executable, str(script), case], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    first, pids = out.stdout.split()
    assert first == ("length" if case == "unclosed" else "interrupted")
    pids = [int(p) for p in pids.split(",") if p != "-"]  # its processes (runtimes too) when it last looked
    if case == "unclosed":
        assert len(pids) >= 3  # forkserver, resource tracker, runtime: the check below checks something
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sync_llm_batch_whose_runtime_dies_raises_that_error_once_and_serves_on():
    with LLM("tiny", dtype="float64") as llm:
        pid = llm._runner._engine.scheduler.client.ready.pid
        timer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
        timer.start()
        with pytest.raises(RuntimeDied) as e:  # not a group of three
            llm.generate(["a", "b", "c"], SamplingParams(max_tokens=3000, ignore_eos=True))
        timer.join()
        assert "2 more requests of this call failed" in "".join(getattr(e.value, "__notes__", []))
        assert len(llm.generate("b", SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2


def test_sync_llm_keyboard_interrupt_aborts_the_call_and_the_engine_goes_on():
    with LLM("tiny", dtype="float64") as llm:
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["a"] * 4, SamplingParams(max_tokens=3000, ignore_eos=True))
        timer.join()
        deadline = time.monotonic() + 10  # the aborts reach the scheduler at its next step
        while llm._runner._engine.statistics().running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert llm._runner._engine.statistics().running == 0
        assert len(llm.generate("b", SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2


async def test_dep2_ranks_step_in_lockstep_and_match_one_rank():
    ps = prompts()
    got = [None] * len(ps)
    sent = {0: [], 1: []}
    async with open_engine(attrs_evolve(config(tokenizer=None), dep=2)) as engine:
        for r, s in enumerate(engine.schedulers):
            s.on_plan = lambda p, r=r: sent[r].append((p.num_padded_tokens, p.is_dummy, p.num_tokens))

        async def one(i):
            got[i], _ = await collect(engine, ps[i], GREEDY)
        async with trio.open_nursery() as n:
            for i in range(len(ps)):
                n.start_soon(one, i)
        ranks = [s.statistics() for s in engine.schedulers]
        with pytest.raises(RequestError, match="prompt_logprobs is not supported with DEP") as e:
            engine.generate(ps[0], SamplingParams(prompt_logprobs=1))
        assert e.value.field == "prompt_logprobs"
    for p, g in zip(ps, got):
        assert g == reference_greedy(p, GREEDY.max_tokens)
    assert all(r.generated_tokens > 0 for r in ranks)  # both ranks served requests
    # Every step ran on both ranks with the same padded size; an idle rank ran a dummy.
    assert [x[0] for x in sent[0]] == [x[0] for x in sent[1]]
    assert all(pad == max(a[2], b[2]) for (pad, _, _), a, b in zip(sent[0], sent[0], sent[1]))
    assert any(d for _, d, _ in sent[0] + sent[1])


async def test_a_burst_of_requests_spreads_over_the_dep_ranks():
    """Requests that arrive together are routed before any rank has taken the previous
    ones into its core: the router must count what it already sent each rank, or every one
    of them sees the same loads and a burst lands on one rank."""
    rng = np.random.default_rng(3)
    burst = [rng.integers(3, 500, 40).astype(np.int32) for _ in range(12)]  # no shared prefix
    seen = {0: set(), 1: set()}
    async with open_engine(attrs_evolve(config(tokenizer=None), dep=2)) as engine:
        for r, s in enumerate(engine.schedulers):
            s.on_plan = lambda p, r=r: seen[r].update(p.req_ids.tolist())
        async with trio.open_nursery() as n:
            for p in burst:
                n.start_soon(collect, engine, p, SamplingParams(max_tokens=2, ignore_eos=True))
        assert [s.inbound for s in engine.schedulers] == [0, 0]
    assert len(seen[0]) + len(seen[1]) == len(burst) and abs(len(seen[0]) - len(seen[1])) <= 2


async def test_dep2_a_killed_rank_fails_the_group_cleanly_and_it_restarts():
    async with open_engine(attrs_evolve(config(tokenizer=None), dep=2)) as engine:
        pids = [s.client.ready.pid for s in engine.schedulers]
        gens = [engine.generate(p, SamplingParams(max_tokens=300, ignore_eos=True)) for p in prompts()[1:3]]
        for g in gens:
            await g.__anext__()
        os.kill(pids[1], signal.SIGKILL)
        with trio.fail_after(5):  # the survivor's runtime must not hang in its collective
            for g in gens:
                with pytest.raises(RuntimeDied):
                    async for _ in g:
                        pass
        toks, _ = await collect(engine, prompts()[1], GREEDY)
        assert toks == reference_greedy(prompts()[1], GREEDY.max_tokens)
        assert [s.statistics().runtime_restarts for s in engine.schedulers] == [1, 1]
        assert not set(pids) & {s.client.ready.pid for s in engine.schedulers}


async def test_dep2_a_rank_killed_while_idle_restarts_the_group_before_any_request():
    """As a lone rank does: the next request is served, not failed with the dead rank's
    error (the group used to notice only when a request reached it)."""
    async with open_engine(attrs_evolve(config(tokenizer=None), dep=2)) as engine:
        pids = [s.client.ready.pid for s in engine.schedulers]
        os.kill(pids[0], signal.SIGKILL)
        with trio.fail_after(60):  # (a guard against a hang, not a timing assertion)
            while [s.statistics().runtime_restarts for s in engine.schedulers] != [1, 1]:
                await trio.sleep(0.05)
        toks, _ = await collect(engine, prompts()[1], GREEDY)
        assert toks == reference_greedy(prompts()[1], GREEDY.max_tokens)
        assert not set(pids) & {s.client.ready.pid for s in engine.schedulers}
        assert engine.down() == []  # (what /health reads)


async def test_n_samples_per_prompt_as_vllm_with_seed_plus_i():
    """SamplingParams.n through Engine.complete and LLM.generate: Completion.outputs holds the
    n samples (vLLM's RequestOutput.outputs), sample i seeded seed + i as the server's n; a
    stream is one sample, so generate refuses n > 1 by name."""
    p = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3)
    async with open_engine(config(tokenizer=None)) as engine:
        whole = await engine.complete(prompts()[1], p)
        alone = [await engine.complete(prompts()[1], attrs_evolve(p, n=1, seed=11 + i)) for i in range(3)]
        with pytest.raises(RequestError, match="n 3: a stream carries one sample") as e:
            engine.generate(prompts()[1], p)
        assert e.value.field == "n"
    assert [o.token_ids.tolist() for o in whole.outputs] == [a.token_ids.tolist() for a in alone]
    assert whole.token_ids.tolist() == whole.outputs[0].token_ids.tolist() and alone[0].outputs == (alone[0],)
    with pytest.raises(RequestError, match="seed must be at most 2\\*\\*63 - n"):
        SamplingParams(n=2, seed=2**63 - 1).validate()


async def test_max_tokens_none_fills_what_the_context_leaves():
    """vLLM's max_tokens None: the prompt's room in max_model_len (512 here), at least min_tokens."""
    p = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    async with open_engine(config(tokenizer=None)) as engine:
        got = await engine.complete(prompts()[2], p)  # 150 tokens
        assert len(got.token_ids) == 512 - 150 and got.finish_reason == "length"
        with pytest.raises(RequestError, match="leaves 2 of the model's context of 512 tokens, fewer than min_tokens"):
            await engine.complete(np.full(510, 7, np.int32), attrs_evolve(p, min_tokens=3))


async def test_n_samples_refused_after_tokenizing_raise_the_request_error_itself():
    """As one sample's would (it came wrapped in an ExceptionGroup of the samples' nursery)."""
    async with open_engine(config()) as engine:
        with pytest.raises(RequestError, match="prompt"):
            await engine.complete("x" * 600, SamplingParams(max_tokens=4, n=2))


async def test_logprobs_of_sampled_tokens_and_top_k():
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3)
    async with open_engine(config(tokenizer=None)) as engine:
        outs = [o async for o in engine.generate(prompts()[1], params)]
        whole = await engine.complete(prompts()[1], params)
    rows = [r for o in outs for r in o.logprobs]
    assert whole.logprobs == rows  # Engine.complete (and LLM.generate) keep them too
    toks = [t for o in outs for t in o.token_ids.tolist()]
    assert [r[0] for r in rows] == toks and len(rows) == 5
    for tok, lp, top in rows:
        assert len(top) == 3 and top[0][0] == tok  # greedy: the sampled token is the most likely
        assert lp == pytest.approx(top[0][1]) and lp <= 0
        assert top[0][1] >= top[1][1] >= top[2][1]


async def test_what_leaves_an_open_engine_block_leaves_it_as_itself():
    """Not wrapped in trio's group (a user's `except KeyError` must catch their KeyError); a
    text prompt with no tokenizer, and other checks that need no tokens, at generate()."""
    with pytest.raises(KeyError, match="mine"):
        async with open_engine(config(tokenizer=None)) as engine:
            raise KeyError("mine")
    async with open_engine(config(tokenizer=None)) as engine:
        for prompt, params, field in (("hello", SamplingParams(), "prompt"),
                                      ([5], SamplingParams(max_tokens=512), "max_tokens"),
                                      ("hi", SamplingParams(stop_token_ids=[9999]), "stop_token_ids")):
            with pytest.raises(RequestError) as e:
                engine.generate(prompt, params)
            assert e.value.field == field
        for bad in ("abc", None, 1.5):
            with pytest.raises(RequestError, match="request_id must be an integer"):
                engine.abort(bad)
        engine.abort(10**6)  # no such request (any more): nothing to do
    with pytest.raises(RequestError, match="temperature"):  # SamplingParams checks itself when made
        SamplingParams(temperature=-1)
    p = SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.0), allowed_token_ids=np.arange(5, 9))
    assert p.max_tokens == 3 and type(p.max_tokens) is int and p.allowed_token_ids == (5, 6, 7, 8)


@pytest.mark.parametrize("fields, says", [
    ({"dep": 2, "eplb": 2}, "engine.eplb must be None, an EplbConfig or a dict of its fields"),
    ({"dep": 2, "eplb": {"bogus": 1}}, "engine.eplb: "),
    ({"draft_model": "tiny-draft", "spec_adaptive": "no"}, "engine.spec_adaptive must be true or false"),
    ({"prefill_instances": True}, "engine.prefill_instances must be an integer"),
    # each would start runtimes that fail at load with tracebacks: named before anything starts
    ({"prefill_instances": 1, "prefill_dep": 3}, "engine.prefill_dep 3 must divide the routed experts"),
    ({"dep": 8, "draft_model": "tiny-draft", "draft_experts": "sharded"}, "engine.dep 8 must divide the draft's"),
])
def test_engine_config_names_bad_fields_found_in_a_walkthrough(fields, says):
    import re

    from lockstep.engine.config import EngineConfig
    from lockstep.policy.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(says)):
        EngineConfig(model="tiny", **fields)
    assert EngineConfig(model="tiny", dep=2, eplb={"redundant_experts": 2}).eplb.redundant_experts == 2


def test_a_deployment_with_several_colocated_pools_of_one_model_is_refused_by_the_engine(tmp_path):
    """The engine runs one colocated pool of a model: serving the first alone dropped the others."""
    from pathlib import Path

    from lockstep.engine.config import EngineConfig
    from lockstep.policy.config import ConfigError
    from lockstep.policy.deployment_file import load_deployment

    text = (Path(__file__).parents[1] / "examples" / "serve-tiny-cpu.toml").read_text()
    pool = text[text.index("[[pools]]"):].split("\n\n")[0]
    path = tmp_path / "two.toml"
    path.write_text(text + "\n" + pool.replace('name = "main"', 'name = "b"') + "\n")
    dep = load_deployment(path)
    with pytest.raises(ConfigError, match="all serve model 'tiny' colocated"):
        EngineConfig.from_deployment(dep)
    assert EngineConfig.from_deployment(dep, pool_index=1).model == "tiny"
