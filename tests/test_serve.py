"""`lockstep serve` with real clients over loopback: the official `openai` package, raw SSE
through httpx, 2,000 concurrent streams against the timing runtime with leak counts, a
client that disconnects, fuzzed bodies (never a 5xx), and SIGTERM draining a real process."""

import contextlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers import wait_healthy

from lockstep.cli import _parser
from lockstep.serve_cli import serve
from leaks import child_pids, fd_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_args(*extra: str):
    return _parser().parse_args(["serve", "--port", "0", "--drain-timeout", "5", *extra])


class InProcess:
    """A server in the test's own trio run; ``stop`` drains it like a SIGTERM would."""

    def __init__(self, *extra: str):
        self.args = serve_args(*extra)
        self._stop = trio.Event()

    async def __aenter__(self):
        self._nursery_cm = trio.open_nursery()
        self.nursery = await self._nursery_cm.__aenter__()
        self.server, binds = await self.nursery.start(lambda task_status: serve(
            self.args, shutdown=self._stop.wait, task_status=task_status))
        self.url = binds[0]
        return self

    async def __aexit__(self, *exc):
        self._stop.set()
        return await self._nursery_cm.__aexit__(*exc)


TIMING = ("--runtime", "timing", "--model", "tiny", "--runtime-option", "sleep=false",
          "--num-blocks", "65536", "--max-num-seqs", "512")


async def sse_completion(client: httpx.AsyncClient, url: str, body: dict) -> list[dict]:
    chunks = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
                if data == "[DONE]":
                    break
                chunks.append(json.loads(data))
    return chunks




def _tasks() -> int:
    """Every trio task alive in this run, found from the root task."""
    todo, n = [trio.lowlevel.current_root_task()], 0
    while todo:
        t = todo.pop()
        n += 1
        todo += [c for nursery in t.child_nurseries for c in nursery.child_tasks]
    return n




async def test_access_log_writes_one_line_per_request(capsys):
    async with InProcess(*TIMING, "--access-log") as srv:
        async with httpx.AsyncClient() as client:
            for _ in range(5):
                assert (await client.get(f"{srv.url}/v1/models")).status_code == 200
            assert (await client.post(f"{srv.url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})).status_code == 200
            assert (await client.get(f"{srv.url}/nope")).status_code == 404
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ' - "' in ln]
    assert len(lines) == 7, lines
    assert sum('"GET /v1/models HTTP/1.1" 200 ' in ln for ln in lines) == 5
    assert any('"POST /v1/completions HTTP/1.1" 200 ' in ln for ln in lines)
    assert any('"GET /nope HTTP/1.1" 404 ' in ln for ln in lines)


async def test_health_is_503_while_a_runtime_or_dep_group_restarts():
    """A load balancer routes elsewhere while nothing can serve (a runtime restarting, a DEP
    group waiting for a lost node to rejoin: /health used to say ok throughout); while other
    ranks can, it is ok, lists the ranks down, and new requests go to the others."""
    async with InProcess(*TIMING) as srv:
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{srv.url}/health")).status_code == 200
            srv.server.engine.schedulers[0].down = True  # as _restart sets it
            r = await client.get(f"{srv.url}/health")
            assert r.status_code == 503 and "restarting: ranks {'tiny': [0]}" in r.json()["error"]["message"]
            srv.server.engine.schedulers[0].down = False
            assert (await client.get(f"{srv.url}/health")).status_code == 200
    async with InProcess(*TIMING, "--instances", "2") as srv:  # one of two down: the other serves
        async with httpx.AsyncClient() as client:
            srv.server.engine.schedulers[1].down = True
            r = await client.get(f"{srv.url}/health")
            assert r.status_code == 200 and r.json() == {"status": "ok", "ranks_down": {"tiny": [1]}}
            got = await client.post(f"{srv.url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
            assert got.status_code == 200 and srv.server.engine.schedulers[0].statistics().generated_tokens == 2


async def test_echo_with_logprobs_is_refused_where_the_prompt_cannot_be_scored():
    """The timing runtime computes no logits: echo with logprobs (the prompt's) is a 400
    naming what the client sent (echo), not the engine's internal prompt_logprobs."""
    async with InProcess(*TIMING) as srv:
        async with httpx.AsyncClient() as client:
            r = await client.post(f"{srv.url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "echo": True,
                                                                     "logprobs": 1})
            plain = await client.post(f"{srv.url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2,
                                                                         "logprobs": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "echo", err
    assert "echo with logprobs (the prompt's) is not supported with the timing runtime" in err["message"]
    # nor the sampled tokens' (it answered an empty list)
    assert plain.status_code == 400 and plain.json()["error"]["param"] == "logprobs"


@pytest.mark.slow
async def test_two_thousand_concurrent_streams_no_errors_no_leaks():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 16384)), hard))
    async with InProcess(*TIMING) as srv:  # warm: forkserver, imports
        async with httpx.AsyncClient(timeout=60) as c:
            await sse_completion(c, srv.url, {"model": "tiny", "prompt": [5, 6], "max_tokens": 2, "stream": True})
    fds, kids, tasks = fd_count(), len(child_pids()), _tasks()
    errors = []
    async with InProcess(*TIMING) as srv:
        limits = httpx.Limits(max_connections=2100, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            async def one(i):
                try:
                    chunks = await sse_completion(c, srv.url, {
                        "model": "tiny", "prompt": [5 + i % 200, 6, 7, 8], "max_tokens": 4, "stream": True,
                        "ignore_eos": True, "stream_options": {"include_usage": True}})
                    assert chunks[-1]["usage"]["completion_tokens"] == 4
                    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
                except Exception as e:  # noqa: BLE001 - every failure is counted
                    errors.append(repr(e))
            with trio.fail_after(240):
                async with trio.open_nursery() as n:
                    for i in range(2000):
                        n.start_soon(one, i)
        engine = srv.server.engine
        stats = engine.statistics()
        assert errors == []
        assert stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0
        assert engine.scheduler.streams == {}
        engine.scheduler.core.check_integrity()
        assert srv.server.metrics.finished == {"length": 2000}
    assert len(child_pids()) == kids
    assert fd_count() == fds
    assert _tasks() == tasks


async def test_client_disconnect_aborts_and_frees_blocks():
    async with InProcess(*TIMING[:-4], "--runtime-option", "sleep=true") as srv:
        async with httpx.AsyncClient(timeout=30) as c:
            async with c.stream("POST", f"{srv.url}/v1/completions", json={
                    "model": "tiny", "prompt": list(range(5, 100)), "max_tokens": 3000,
                    "ignore_eos": True, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break
        engine = srv.server.engine
        with trio.fail_after(10):
            while engine.statistics().running or engine.statistics().kv_blocks_used:
                await trio.sleep(0.02)
        assert srv.server.metrics.finished.get("abort") == 1


async def test_metrics_count_tokens_and_first_token_while_a_request_streams():
    def value(text: str, name: str) -> float:
        return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    async with InProcess(*TIMING[:-4], "--runtime-option", "sleep=true", "--served-model-name", 'a"b\\c') as srv:
        async with httpx.AsyncClient(timeout=30) as c:
            async with c.stream("POST", f"{srv.url}/v1/completions", json={
                    "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: {")
                    if seen == 30:
                        mid = (await c.get(f"{srv.url}/metrics")).text
                        break
            with trio.fail_after(10):
                while srv.server.engine.statistics().running:
                    await trio.sleep(0.02)
    label = 'model_name="a\\"b\\\\c"'  # the text format's escapes: a\"b\\c
    assert f"vllm:generation_tokens_total{{{label}}}" in mid
    assert value(mid, "vllm:generation_tokens_total") >= 29  # while it runs, not only at its end
    assert value(mid, "vllm:time_to_first_token_seconds_count") == 1
    assert value(mid, "vllm:inter_token_latency_seconds_count") >= 28  # a gap per delta
    assert value(mid, "vllm:prompt_tokens_total") == 3
    with trio.fail_after(30):  # once it ends: the per-request histograms vLLM's dashboards read
        async with InProcess(*TIMING) as srv:
            async with httpx.AsyncClient(timeout=30) as c:
                for n in (3, 7):
                    r = await c.post(f"{srv.url}/v1/completions", json={"prompt": [5] * 12, "max_tokens": n,
                                                                          "ignore_eos": True})
                    assert r.status_code == 200
                end = (await c.get(f"{srv.url}/metrics")).text
    assert value(end, "vllm:request_generation_tokens_sum") == 10
    assert value(end, "vllm:request_prompt_tokens_sum") == 24
    assert 'vllm:request_prompt_tokens_bucket{model_name="tiny",le="10.0"} 0' in end
    assert 'vllm:request_prompt_tokens_bucket{model_name="tiny",le="20.0"} 2' in end
    for name in ("request_time_per_output_token_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        assert value(end, f"vllm:{name}_count") == 2, name


async def test_start_up_access_and_drain_lines(capsys):
    """The per-model start-up line, JSON access lines with --log-format json, no hypercorn
    line of its own, and a drain whose deadline cuts a stream off says so."""
    srv = InProcess(*TIMING[:-4], "--runtime-option", "sleep=true", "--access-log", "--log-format", "json")
    srv.args.drain_timeout = 0.5
    async with srv:
        async with httpx.AsyncClient(timeout=30) as c:
            assert (await c.get(f"{srv.url}/v1/models")).status_code == 200
            async with c.stream("POST", f"{srv.url}/v1/completions", json={
                    "prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):
                        break
                srv._stop.set()  # drain, with this stream far from done
                with trio.move_on_after(10):
                    try:
                        async for _ in lines:
                            pass
                    except httpx.HTTPError:  # cut off at the deadline
                        pass
    got = capsys.readouterr()
    text = got.out + got.err
    access = [json.loads(ln) for ln in got.out.splitlines() if ln.startswith('{"event":"access"')]
    assert {"GET", "POST"} <= {a["method"] for a in access} and all(a["timestamp"].endswith("Z") for a in access)
    assert "runtime_pids" in text and "max_model_len" in text  # the start-up line per model
    assert "Running on" not in text
    assert "drain ended with sequences cut off" in text


async def test_bench_serve_counts_requests_the_server_failed_mid_stream_as_failed():
    from lockstep import bench_serve

    async with InProcess(*TIMING[:-4], "--runtime-option", "sleep=true") as srv:
        args = _parser().parse_args(["bench", "serve", "--base-url", srv.url, "--num-prompts", "4",
                                     "--random-input-len", "16", "--random-output-len", "3000", "--disable-tqdm",
                                     "--percentile-metrics", "ttft, tpot"])
        got = {}

        async def bench():
            got["res"] = await bench_serve.run(args)

        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(bench)
                engine = srv.server.engine
                while engine.statistics().generated_tokens < 20:  # streaming
                    await trio.sleep(0.01)
                os.kill(engine.scheduler.client.ready.pid, signal.SIGKILL)
    res = got["res"]
    assert res["completed"] == 0 and res["failed"] == 4, res
    assert any("server_error" in e and e.startswith("4 x ") for e in res["errors"]), res["errors"]
    assert "mean_tpot_ms" in res and "mean_itl_ms" not in res  # "ttft, tpot": spaces allowed
    assert json.loads(json.dumps(bench_serve._strict_json(res), allow_nan=False))["mean_ttft_ms"] is None
    bad = _parser().parse_args(["bench", "serve", "--percentile-metrics", "ttft,foo"])
    with pytest.raises(ValueError, match="--percentile-metrics"):
        bench_serve.run_bench(bad)  # before any request is sent


BODIES = st.fixed_dictionaries({
    "model": st.sampled_from(["tiny", "tiny", "tiny", "other", 3, None]),
    "prompt": st.one_of(st.text(min_size=1, max_size=20), st.lists(st.integers(3, 300), min_size=1, max_size=8),
                        st.lists(st.integers(-5, 600), max_size=8), st.none(), st.integers(),
                        st.lists(st.lists(st.integers(0, 600), max_size=3), max_size=2),
                        st.lists(st.integers(2**62, 2**80), min_size=1, max_size=2), st.just("")),
}, optional={
    "max_tokens": st.one_of(st.integers(-2, 5), st.floats(), st.text(max_size=2), st.integers(2**31, 2**70)),
    "temperature": st.one_of(st.floats(-1, 3), st.just(float("nan")), st.booleans(), st.text(max_size=2),
                             st.floats(0, 1e-20), st.just(1e308)),
    "top_p": st.one_of(st.floats(-1, 2), st.just(float("inf"))), "n": st.integers(-1, 20),
    "top_k": st.one_of(st.integers(-3, 5), st.integers(2**31, 2**100)),
    "bogus": st.integers(), "logit_bias": st.one_of(st.just({}), st.just({"5": 1}), st.just({"x": 1}), st.just({"5": 500}),
                                           st.just({"999999": -100}), st.integers()),
    "allowed_token_ids": st.one_of(st.lists(st.integers(-2, 2**40), max_size=3), st.just([3]), st.text(max_size=2)),
    "stop_token_ids": st.one_of(st.lists(st.integers(-1, 2**40), max_size=2), st.integers()),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=10), st.integers()),
    "seed": st.one_of(st.integers(-3, 2**64), st.text(max_size=2)), "stream": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(0, 3)), "stream_options": st.one_of(st.none(), st.integers(),
                                                                                      st.fixed_dictionaries({"include_usage": st.booleans()})),
    "priority": st.one_of(st.integers(-5, 5), st.text(max_size=2)), "cache_salt": st.one_of(st.text(max_size=4), st.integers()),
})


async def test_a_reasoning_parser_returns_the_thinking_apart():
    """--reasoning-parser deepseek_r1: the random model never closes its thinking, so the whole
    answer is reasoning_content and content is null, whole or streamed, also with structured
    outputs (which apply after the thinking)."""
    async with InProcess("--model", "tiny", "--reasoning-parser", "deepseek_r1") as srv:
        async with httpx.AsyncClient(timeout=60) as c:
            body = {"messages": [{"role": "user", "content": "think"}], "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True}
            whole = (await c.post(f"{srv.url}/v1/chat/completions", json=body)).json()
            msg = whole["choices"][0]["message"]
            assert msg["content"] is None and len(msg["reasoning_content"]) > 0
            pieces = {"reasoning_content": "", "content": ""}
            async with c.stream("POST", f"{srv.url}/v1/chat/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        delta = json.loads(line[6:])["choices"][0]["delta"]
                        for k in pieces:
                            pieces[k] += delta.get(k) or ""
            assert pieces == {"reasoning_content": msg["reasoning_content"], "content": ""}
            # structured outputs apply after the thinking, which this model never closes
            thought = await c.post(f"{srv.url}/v1/chat/completions", json={
                **body, "response_format": {"type": "json_object"}})
            assert thought.status_code == 200 and thought.json()["choices"][0]["message"]["content"] is None
            # a forced tool call that stops while still thinking: no call, the thinking kept
            tools = [{"type": "function", "function": {"name": "f"}}]
            stopped = (await c.post(f"{srv.url}/v1/chat/completions", json={
                **body, "tools": tools, "tool_choice": "required", "ignore_eos": False,
                "stop_token_ids": list(range(3, 259))})).json()["choices"][0]
            assert stopped["finish_reason"] == "stop" and stopped["message"]["content"] is None
            assert not stopped["message"].get("tool_calls")
            # a template that closes the thinking in the prompt: the answer is all content
            closed = (await c.post(f"{srv.url}/v1/chat/completions", json={
                **body, "messages": [{"role": "user", "content": "x"},
                                     {"role": "assistant", "content": "<think>no</think>"}],
                "continue_final_message": True})).json()["choices"][0]["message"]
            assert closed["reasoning_content"] is None and len(closed["content"]) > 0
            plain = (await c.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 3})).json()
            assert "text" in plain["choices"][0]  # completions are left as they are


async def test_auto_tool_choice_reads_the_models_own_calls():
    """--enable-auto-tool-choice --tool-call-parser deepseek_v3: tool_choice "auto" (the default
    with tools) answers in text or with the calls the answer writes in DeepSeek's format (here
    forced by a regex: the byte tokenizer spells the markers), whole or streamed."""
    call = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>time<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
            "<｜tool▁calls▁end｜>")
    async with InProcess("--model", "tiny", "--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v3") as srv:
        async with httpx.AsyncClient(timeout=60) as c:
            body = {"messages": [{"role": "user", "content": "time?"}], "max_tokens": 300, "temperature": 0,
                    "tools": [{"type": "function", "function": {"name": "time"}}]}
            plain = (await c.post(f"{srv.url}/v1/chat/completions", json={**body, "max_tokens": 5})).json()
            msg = plain["choices"][0]["message"]
            assert not msg.get("tool_calls") and isinstance(msg["content"], str)
            forced = {**body, "guided_regex": "Now\\." + re.escape(call).replace("\\<", "<")}
            got = (await c.post(f"{srv.url}/v1/chat/completions", json=forced)).json()["choices"][0]
            assert got["finish_reason"] == "tool_calls", got
            assert got["message"]["content"] == "Now." and [t["function"] for t in got["message"]["tool_calls"]] == [
                {"name": "time", "arguments": "{}"}]
            deltas, reason = [], None
            async with c.stream("POST", f"{srv.url}/v1/chat/completions", json={**forced, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        ch = json.loads(line[6:])["choices"][0]
                        deltas.append(ch["delta"])
                        reason = ch["finish_reason"] or reason
            assert "".join(d.get("content") or "" for d in deltas) == "Now." and reason == "tool_calls"
            streamed = [t["function"] for d in deltas for t in d.get("tool_calls", [])]
            assert streamed == [{"name": "time", "arguments": "{}"}]


async def test_fuzzed_completion_bodies_never_get_a_5xx():
    async with InProcess(*TIMING) as srv:
        async with httpx.AsyncClient(timeout=30) as c:
            statuses = []

            @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            @given(BODIES)
            def check(body):
                statuses.append(trio.from_thread.run(post, c, f"{srv.url}/v1/completions", body))

            await trio.to_thread.run_sync(check)
            await c.post(f"{srv.url}/v1/chat/completions", content=b"{not json")
        assert statuses and max(statuses) < 500
        assert 400 in statuses and 200 in statuses
        stats = srv.server.engine.statistics()
        assert stats.running == 0 and stats.kv_blocks_used == 0


async def test_a_body_the_parser_cannot_take_is_a_400_naming_it():
    """Found by a walkthrough: a non-string model (unhashable) and JSON nested past the
    decoder's recursion were plain-text 500s; a template refusing /tokenize's messages too."""
    template = "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}{% endif %}" \
               "{{ m.content }}{% endfor %}"
    async with InProcess(*TIMING, "--chat-template", template) as srv:
        async with httpx.AsyncClient(timeout=30) as c:
            chat = [{"role": "user", "content": "x"}]
            for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 1}),
                               ("/v1/chat/completions", {"messages": chat, "max_tokens": 1}),
                               ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
                r = await c.post(srv.url + path, json={"model": ["tiny"], **body})
                assert r.status_code == 400 and r.json()["error"]["param"] == "model", (path, r.text)
            deep = b'{"prompt":' + b"[" * 5000 + b"]" * 5000 + b"}"
            r = await c.post(srv.url + "/v1/completions", content=deep, headers={"content-type": "application/json"})
            assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
            r = await c.post(srv.url + "/tokenize", json={"messages": [{"role": "system", "content": "s"}]})
            assert r.status_code == 400 and "chat template refused them" in r.json()["error"]["message"]
            assert r.json()["error"]["param"] == "messages"
            # continuous usage: the first chunk already counts the prompt (vLLM's)
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            async with c.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
                usages = [json.loads(line[6:])["usage"] async for line in r.aiter_lines()
                          if line.startswith("data: {")]
            n_prompt = usages[-1]["prompt_tokens"]
            assert n_prompt > 0 and all(u["prompt_tokens"] == n_prompt for u in usages), usages


async def post(c: httpx.AsyncClient, url: str, body) -> int:
    r = await c.post(url, content=json.dumps(body), headers={"content-type": "application/json"})
    await r.aread()
    return r.status_code


@contextlib.contextmanager
def running_server(*args: str):
    """`lockstep serve ARGS` as its own process, like a user runs it; yields (process, URL)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def real_server():
    """`lockstep serve --model tiny`."""
    with running_server("--model", "tiny", "--drain-timeout", "10", "--log-format", "json") as server:
        yield server


def test_openai_client_completions_chat_and_errors(real_server):
    _, url = real_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    assert [m.id for m in client.models.list()] == ["tiny"]
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                            stream=True, stream_options={"include_usage": True}, n=2, seed=7,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 8
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    lp = client.completions.create(model="tiny", prompt="hi", max_tokens=3, logprobs=2, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(len(t) <= 3 for t in lp.top_logprobs)  # logprobs + 1 at most
    assert all(tok in top for tok, top in zip(lp.tokens, lp.top_logprobs))  # the sampled token's, always
    lp0 = client.completions.create(model="tiny", prompt="hi", max_tokens=2, logprobs=0, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].logprobs
    assert [list(t) for t in lp0.top_logprobs] == [[tok] for tok in lp0.tokens]
    chat_lp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2, logprobs=True, top_logprobs=2,
                                             extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(chat_lp.content) == 2 and len(chat_lp.content[0].top_logprobs) == 2
    # with include_usage every chunk but the last says "usage": null (OpenAI's stream shape)
    sse = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True,
                                                    "stream_options": {"include_usage": True}}).text
    events = [json.loads(x[6:]) for x in sse.split("\n\n") if x.startswith("data: {")]
    assert all("usage" in e and e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["total_tokens"]
    with pytest.raises(openai.NotFoundError, match="not served here"):  # 404, as OpenAI's and vLLM's
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt=[7] * 4000, max_tokens=200)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model="tiny", prompt="x", top_p=3)
    tok = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": "hé"}).json()
    assert tok["count"] == 3
    for body, param in (({"prompt": "hi", "foo": 1}, "foo"), ({"prompt": "hi", "add_special_tokens": "yes"},
                                                               "add_special_tokens")):
        bad = httpx.post(f"{url}/tokenize", json=body)  # nothing asked for is dropped silently
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param
    assert httpx.post(f"{url}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "hé"
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [5, 10**6]})  # out of the vocabulary: not ""
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    with pytest.raises(openai.BadRequestError, match="seed"):  # sample 1 would take seed + 1 = 2**63
        client.completions.create(model="tiny", prompt="x", max_tokens=1, n=2, seed=2**63 - 1)
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client.completions.create(model="tiny", prompt="x", max_tokens=1, frequency_penalty=3)
    # vLLM's stop_reason (the stop token id here), top_k 0 as off, vLLM's extras at their defaults
    full = client.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    stop_id = client.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0, logprobs=0,
                                        extra_body={"ignore_eos": True}).choices[0]
    ids = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": full.choices[0].text}).json()["tokens"]
    # (one token of room past it: a stop id that is the last token allowed ends by length, as in vLLM)
    got = client.completions.create(model="tiny", prompt="hello", max_tokens=7, temperature=0, extra_body={
        "ignore_eos": True, "stop_token_ids": [ids[-1]], "top_k": 0, "include_stop_str_in_output": False,
        "skip_special_tokens": True})
    assert got.choices[0].finish_reason == "stop" and got.choices[0].model_extra["stop_reason"] == ids[-1]
    assert stop_id.model_extra["stop_reason"] is None  # (it ended on length)
    # vLLM's logits processing, through the OpenAI client (vLLM's own fields in extra_body)
    done = client.completions.create(model="tiny", prompt="x", max_tokens=4, frequency_penalty=0.5,
                                     presence_penalty=0.2, extra_body={"repetition_penalty": 1.1, "min_p": 0.1,
                                                                       "min_tokens": 4})
    assert done.usage.completion_tokens == 4
    # OpenAI's usage.prompt_tokens_details.cached_tokens: the prompt's whole blocks seen before
    long = " ".join(f"w{i}" for i in range(60))
    once, twice = (client.completions.create(model="tiny", prompt=long, max_tokens=1) for _ in range(2))
    assert once.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < twice.usage.prompt_tokens_details.cached_tokens <= twice.usage.prompt_tokens
    # OpenAI's logit_bias (+100 all but forces a token) and vLLM's allowed_token_ids; ids
    # outside the vocabulary are a 400 naming the field
    forced = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0,
                                       logit_bias={str(ids[0]): 100}, logprobs=0, extra_body={"ignore_eos": True})
    assert [t for t in forced.choices[0].logprobs.tokens] == [forced.choices[0].logprobs.tokens[0]] * 3
    allowed = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=1.0, seed=3,
                                        logprobs=0, extra_body={"ignore_eos": True, "allowed_token_ids": ids[:2]})
    texts = {httpx.post(f"{url}/detokenize", json={"tokens": [t]}).json()["prompt"] for t in ids[:2]}
    assert set(allowed.choices[0].logprobs.tokens) <= texts
    with pytest.raises(openai.BadRequestError, match="logit_bias") as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=1, logit_bias={"99999999": 5})
    assert e.value.body["param"] == "logit_bias"
    # vLLM's read-only routes, and unknown routes and methods as JSON errors
    assert httpx.get(f"{url}/v1/models/tiny").json()["id"] == "tiny"
    assert httpx.get(f"{url}/v1/models/nope").status_code == 404
    assert httpx.get(f"{url}/version").json()["version"]
    for resp, status in ((httpx.get(f"{url}/nope"), 404), (httpx.get(f"{url}/v1/completions"), 405)):
        assert resp.status_code == status and resp.json()["error"]["message"], resp.text
    assert "POST" in httpx.get(f"{url}/v1/completions").headers["allow"]  # a 405 says what is allowed
    assert httpx.get(f"{url}/v1/models/").json()["data"][0]["id"] == "tiny"
    # no max_tokens: the server's default, capped by what the context leaves the prompt
    room = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [7] * 4090, "ignore_eos": True},
                      timeout=60).json()
    assert room["usage"]["completion_tokens"] == 6 and room["choices"][0]["finish_reason"] == "length"
    # one model served: a body may leave it out, as vLLM allows
    for model in ({}, {"model": None}):
        unnamed = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "ignore_eos": True,
                                                            **model})
        assert unnamed.status_code == 200 and unnamed.json()["model"] == "tiny", model
    chat_long = httpx.post(f"{url}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6})
    assert chat_long.status_code == 400 and chat_long.json()["error"]["param"] == "max_completion_tokens"
    # a prompt that fits with max_tokens too large: the error blames max_tokens
    long = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 10**6})
    assert long.status_code == 400 and long.json()["error"]["param"] == "max_tokens"
    metrics = httpx.get(f"{url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
                 "vllm:inter_token_latency_seconds_sum", "vllm:request_queue_time_seconds_count"):
        assert name in metrics


def test_structured_outputs_through_the_openai_client(real_server):
    """OpenAI's response_format and vLLM's guided_choice / structured_outputs: the answers
    match; a schema xgrammar cannot read is a 400 naming the field it came in."""
    _, url = real_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    chat = [{"role": "user", "content": "pick"}]
    picked = client.chat.completions.create(model="tiny", messages=chat, max_tokens=20, temperature=1.0, seed=1,
                                            extra_body={"guided_choice": ["red", "green", "blue"]})
    assert picked.choices[0].message.content in ("red", "green", "blue") and picked.choices[0].finish_reason == "stop"
    code = client.completions.create(model="tiny", prompt="code:", max_tokens=20, temperature=1.0, seed=2,
                                     extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", code.choices[0].text)
    schema = {"type": "object", "properties": {"c": {"enum": ["r", "g"]}, "ok": {"type": "boolean"}},
              "required": ["c", "ok"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    for seed in range(3):  # (random weights may fill the allowed whitespace up to max_tokens)
        js = client.chat.completions.create(model="tiny", messages=chat, max_tokens=60, temperature=1.0, seed=seed,
                                            response_format=fmt).choices[0]
        if js.finish_reason == "stop":
            v = json.loads(js.message.content)
            assert set(v) == {"c", "ok"} and v["c"] in ("r", "g") and isinstance(v["ok"], bool)
            break
        assert js.message.content.lstrip().startswith("{")
    else:
        raise AssertionError("no JSON answer ended within 60 tokens in three tries")
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=chat, max_tokens=20, temperature=1.0, seed=4, stream=True,
        extra_body={"guided_regex": "(ab|cd)+!"}))
    assert re.fullmatch("(ab|cd)+!", streamed) or re.fullmatch("(ab|cd)+", streamed), streamed
    # vLLM's continuous_usage_stats: every chunk carries the usage so far
    lines = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": chat, "max_tokens": 6, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).text.splitlines()
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    done = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert done == sorted(done) and done[-1] == 6 and chunks[-1]["usage"]["completion_tokens"] == 6
    bad = dict(fmt, json_schema={"name": "x", "schema": {"type": "objectx"}})
    with pytest.raises(openai.BadRequestError, match="response_format.json_schema.schema: not a JSON schema") as e:
        client.chat.completions.create(model="tiny", messages=chat, max_tokens=5, response_format=bad)
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="guided_regex: not a regular expression") as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=5, extra_body={"guided_regex": "a["})
    assert e.value.body["param"] == "guided_regex"


def test_tool_calls_through_the_openai_client(real_server):
    """tool_choice "required" or a named function: the answer comes back as tool calls, whole
    or streamed; "auto" (no parser here) is a 400 naming tool_choice."""
    _, url = real_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    chat = [{"role": "user", "content": "weather?"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}}, {"type": "function", "function": {"name": "noop"}}]
    named = {"type": "function", "function": {"name": "weather"}}

    def first_whole(**kw):  # (random weights may fill the allowed whitespace up to max_tokens)
        for seed in range(6):
            c = client.chat.completions.create(model="tiny", messages=chat, tools=tools, max_tokens=80,
                                               temperature=1.0, seed=seed, **kw).choices[0]
            if c.finish_reason != "length":
                return c
        raise AssertionError("no answer ended within 80 tokens in six tries")

    cut = client.chat.completions.create(model="tiny", messages=chat, tools=tools, max_tokens=3, temperature=0,
                                         tool_choice=named).choices[0]  # (vLLM's: a named call even cut short)
    assert cut.finish_reason == "length" and cut.message.tool_calls[0].function.name == "weather"
    for n in (3, 6, 12):  # "required" cut short: never the internal array as content
        cut = client.chat.completions.create(model="tiny", messages=chat, tools=tools, max_tokens=n, temperature=0,
                                             tool_choice="required").choices[0]
        assert cut.finish_reason == "length" and cut.message.content is None
    c = first_whole(tool_choice=named)
    assert c.finish_reason == "stop" and c.message.content is None and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.function.name == "weather" and json.loads(call.function.arguments)["city"] in ("Oslo", "Rome")
    c = first_whole(tool_choice="required", parallel_tool_calls=False)
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    assert c.message.tool_calls[0].function.name in ("weather", "noop")
    json.loads(c.message.tool_calls[0].function.arguments)
    for seed in range(6):  # streamed: the named function's arguments arrive as deltas
        args, names, reason = "", [], None
        for chunk in client.chat.completions.create(model="tiny", messages=chat, tools=tools, tool_choice=named,
                                                    max_tokens=80, temperature=1.0, seed=seed, stream=True):
            d = chunk.choices[0].delta
            for tc in d.tool_calls or ():
                names += [tc.function.name] if tc.function.name else []
                args += tc.function.arguments or ""
            reason = chunk.choices[0].finish_reason or reason
        if reason == "stop":
            assert names == ["weather"] and json.loads(args)["city"] in ("Oslo", "Rome")
            break
    else:
        raise AssertionError("no streamed answer ended within 80 tokens in six tries")
    with pytest.raises(openai.BadRequestError, match="needs a parser") as e:
        client.chat.completions.create(model="tiny", messages=chat, tools=tools, max_tokens=5)
    assert e.value.body["param"] == "tool_choice"
    # streamed "required" answers are held until whole: the prompt's logprobs still go out
    lines = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": chat, "tools": tools, "tool_choice": "required", "max_tokens": 30, "stream": True,
        "prompt_logprobs": 1}).text.splitlines()
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert sum("prompt_logprobs" in c["choices"][0] for c in chunks if c["choices"]) == 1
    # a tool whose parameters xgrammar cannot read: the error names the tool
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.function\.parameters: not a JSON schema") as e:
        client.chat.completions.create(model="tiny", messages=chat, tools=bad, max_tokens=5,
                                       tool_choice={"type": "function", "function": {"name": "f"}})
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError, match=r"tools\[1\]\.function\.parameters: not a JSON schema") as e:
        client.chat.completions.create(model="tiny", messages=chat, tools=tools[:1] + bad, max_tokens=5,
                                       tool_choice="required")
    assert e.value.body["param"] == "tools"


def test_pd_deployment_serves_the_same_greedy_tokens(real_server):
    """`lockstep serve --deployment examples/serve-pd-cpu.toml`: a prefill pool and a decode
    pool pulling KV over NIXL, answering as the colocated server does."""
    body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    want = httpx.post(f"{real_server[1]}/v1/completions", json=body, timeout=60).json()
    with running_server("--deployment", "examples/serve-pd-cpu.toml", "--log-format", "json") as (proc, url):
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["usage"] == want["usage"]
        assert 'lockstep:kv_pulls_total{model_name="tiny"} 1.0' in httpx.get(f"{url}/metrics").text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        model = next(json.loads(ln) for ln in proc.stdout.read().decode().splitlines()
                     if ln.startswith("{") and json.loads(ln).get("event") == "model")
        assert model["prefill_instances"] == 1 and model["kv_transport"] == "nixl"  # what runs, P/D included


def test_one_server_serves_two_models_by_name(real_server):
    """`examples/serve-two-models-cpu.toml`: each model has its own engine and statistics."""
    body = {"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    want = httpx.post(f"{real_server[1]}/v1/completions", json={**body, "model": "tiny"}, timeout=60).json()
    with running_server("--deployment", "examples/serve-two-models-cpu.toml", "--log-format", "json") as (proc, url):
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny", "tiny-draft"]
        a = httpx.post(f"{url}/v1/completions", json={**body, "model": "tiny"}, timeout=60).json()
        b = httpx.post(f"{url}/v1/completions", json={**body, "model": "tiny-draft", "max_tokens": 6},
                       timeout=60).json()
        assert a["choices"][0]["text"] == want["choices"][0]["text"] and a["model"] == "tiny"
        assert b["usage"]["completion_tokens"] == 6 and b["model"] == "tiny-draft"
        bad = httpx.post(f"{url}/v1/completions", json={**body, "model": "gpt-4"})
        assert bad.status_code == 404 and "tiny-draft" in bad.json()["error"]["message"]
        unnamed = httpx.post(f"{url}/v1/completions", json=body)  # two models: which one?
        assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "model"
        metrics = httpx.get(f"{url}/metrics").text
        assert 'vllm:generation_tokens_total{model_name="tiny"} 4.0' in metrics
        assert 'vllm:generation_tokens_total{model_name="tiny-draft"} 6.0' in metrics
        assert metrics.count("# TYPE vllm:generation_tokens_total counter") == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_bench_serve_prints_and_saves_its_report(real_server, tmp_path, capsys):
    from lockstep.cli import main

    port = real_server[1].rsplit(":", 1)[1]
    rc = main(["bench", "serve", "--port", port, "--num-prompts", "12", "--random-input-len", "20",
               "--random-output-len", "4", "--request-rate", "50", "--goodput", "ttft:5000",
               "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json", "--disable-tqdm"])
    assert rc == 0
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["completed"] == 12 and res["failed"] == 0 and res["total_output_tokens"] == 48
    for key in ("p99_ttft_ms", "median_tpot_ms", "p90_itl_ms", "mean_e2el_ms", "request_goodput", "output_throughput"):
        assert key in res
    # vLLM's keys, for tools that read `vllm bench serve` results
    assert res["backend"] == "lockstep" and res["duration"] > 0 and len(res["date"]) == 15
    assert res["output_lens"] == [4] * 12 and len(res["ttfts"]) == 12 and all(len(i) <= 3 for i in res["itls"])
    assert "median_ttft_ms" in capsys.readouterr().out


def test_the_openai_client_example_runs_against_the_server(real_server):
    _, url = real_server
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "openai_client.py"), "--base-url",
                          f"{url}/v1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "completion: " in out.stdout and "usage: CompletionUsage(" in out.stdout


def test_echo_starts_each_choice_with_its_prompt(real_server):
    _, url = real_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    plain = client.completions.create(model="tiny", prompt=["hello", "wörld"], max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    echo = client.completions.create(model="tiny", prompt=["hello", "wörld"], max_tokens=4, temperature=0, n=2,
                                     echo=True, extra_body={"ignore_eos": True})
    assert [c.text for c in echo.choices] == ["hello" + plain.choices[0].text] * 2 + ["wörld" + plain.choices[1].text] * 2
    assert echo.usage.completion_tokens == 16 and echo.usage.prompt_tokens == plain.usage.prompt_tokens
    ids = client.completions.create(model="tiny", prompt=[104, 105], max_tokens=1, echo=True)  # byte ids: "ef"
    assert ids.choices[0].text.startswith(bytes([104 - 3, 105 - 3]).decode())
    chunks = list(client.completions.create(model="tiny", prompt="hello", max_tokens=3, echo=True, stream=True,
                                            temperature=0, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text == "hello" and "".join(c.choices[0].text for c in chunks) == (
        "hello" + client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text)
    # echo with logprobs scores the prompt too (vLLM's prompt_logprobs); echo with max_tokens 0
    # answers with the prompt alone: how lm-evaluation-harness scores a text
    scored = client.completions.create(model="tiny", prompt="hello", max_tokens=2, temperature=0, echo=True,
                                       logprobs=1, extra_body={"ignore_eos": True})
    lp = scored.choices[0].logprobs
    assert lp.tokens[:5] == list("hello") and len(lp.tokens) == 7 and lp.text_offset[:6] == list(range(6))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) in (1, 2) for t in lp.top_logprobs[1:])
    only = client.completions.create(model="tiny", prompt="hello", max_tokens=0, echo=True, logprobs=1)
    c = only.choices[0]
    assert c.text == "hello" and c.logprobs.token_logprobs == lp.token_logprobs[:5] and c.finish_reason == "length"
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == 5
    chunks = list(client.completions.create(model="tiny", prompt="hello", max_tokens=2, temperature=0, echo=True,
                                            logprobs=1, stream=True, extra_body={"ignore_eos": True}))
    streamed = [t for ch in chunks for t in (ch.choices[0].logprobs.token_logprobs if ch.choices[0].logprobs else [])]
    assert chunks[0].choices[0].text == "hello" and streamed == lp.token_logprobs
    with pytest.raises(openai.BadRequestError, match="0 only with echo"):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    # vLLM's own prompt_logprobs field: per prompt token None (the first) or {id: {logprob, rank,
    # decoded_token}}, the same numbers as echo's
    got = client.completions.create(model="tiny", prompt="hello", max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 1, "ignore_eos": True})
    plp = got.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 5
    for row, tok, lp_ in zip(plp[1:], "ello", lp.token_logprobs[1:5]):
        mine = next(v for v in row.values() if v["decoded_token"] == tok)
        ranks = [v["rank"] for v in row.values()]  # every one an integer, the prompt token's too (vLLM's)
        assert mine["logprob"] == pytest.approx(lp_) and all(isinstance(r, int) for r in ranks) and min(ranks) == 1
        assert (mine["rank"] == 1) == (len(row) == 1)  # it is the top one exactly when it is the only entry
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, "prompt_logprobs": 0,
                                                          "messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 2  # the conversation's, once


def test_streamed_logprobs_count_text_offsets_from_the_start(real_server):
    """Each chunk's text_offset goes on from the chunks before it: the stream's offsets and
    tokens are the whole response's."""
    _, url = real_server
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    whole = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["choices"][0]["logprobs"]
    offsets, tokens = [], []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                lp = json.loads(line[6:])["choices"][0]["logprobs"]
                offsets += lp["text_offset"]
                tokens += lp["tokens"]
    assert tokens == whole["tokens"] and offsets == whole["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] > 0


def test_sigterm_drains_in_flight_requests_and_exits_cleanly(real_server):
    proc, url = real_server
    t, result = _stream_in_thread(url)
    time.sleep(1.0)
    kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert kids  # the forkserver (and through it the runtime)
    proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert proc.wait(30) == 0
    assert result["lines"][-1] == "data: [DONE]"
    assert json.loads(result["lines"][-2][6:])["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 10  # the orphaned forkserver notices its parent is gone
    while any(_running(pid) for pid in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in kids)


def test_sigterm_to_the_whole_process_group_still_drains():
    """A service manager signals every process of the group (forkserver and runtimes too):
    the in-flight request still finishes, and nothing of the group is left."""
    with running_server("--model", "tiny", "--drain-timeout", "60", "--log-format", "json") as (proc, url):
        t, result = _stream_in_thread(url)
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGTERM)
        t.join(60)
        assert proc.wait(30) == 0
        log = proc.stdout.read().decode()
        assert "runtime died" not in log, log[-2000:]
        assert result["lines"][-1] == "data: [DONE]"
        assert json.loads(result["lines"][-2][6:])["choices"][0]["finish_reason"] == "length"
        _group_gone(proc.pid)


def test_the_drain_deadline_ends_requests_with_an_error_not_a_dropped_connection():
    """Requests still running when --drain-timeout runs out are aborted: a stream ends with an
    error event and [DONE], a whole response is a 503 in OpenAI's shape (both used to be a
    connection closed mid-response)."""
    import threading

    with running_server("--model", "tiny", "--drain-timeout", "1") as (proc, url):
        t, streamed = _stream_in_thread(url, max_tokens=4000)  # seconds of work: still running at 1 s
        whole = {}

        def post():
            r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4000,
                                                          "ignore_eos": True}, timeout=60)
            whole.update(status=r.status_code, body=r.json())
        w = threading.Thread(target=post)
        w.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        w.join(60)
        assert proc.wait(30) == 0
    assert streamed["lines"][-1] == "data: [DONE]"
    err = json.loads(streamed["lines"][-2][6:])["error"]
    assert err["type"] == "service_unavailable" and "drain" in err["message"]
    assert whole["status"] == 503 and "drain" in whole["body"]["error"]["message"]


def test_json_logs_stay_json_when_a_runtime_writes_a_traceback():
    """With --log-format json a runtime's stderr (its traceback, native libraries' lines)
    comes through as events, one a line (it used to be raw text in the JSON log); the
    command's own error is its one line."""
    p = subprocess.run([sys.executable, "-m", "lockstep.cli", "serve", "--model", "tiny", "--log-format", "json",
                        "--runtime-option", "kv_cache_dtype=bogus", "--port", str(free_port())],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert p.returncode == 2 and lines[-1] == ("lockstep serve: error: runtime process 'torch' failed (its traceback "
                                               "is in the log)"), lines[-3:]
    events = [json.loads(ln) for ln in lines[:-1]]  # every other line is JSON
    said = [e["line"] for e in events if e["event"] == "runtime stderr"]
    assert any("ValueError: runtime option kv_cache_dtype must be 'auto' or 'fp8'" in ln for ln in said), said


def _stream_in_thread(url: str, max_tokens: int = 300):
    """A streamed completion of ``max_tokens`` in a thread: (the thread, a dict whose "lines"
    are the stream's data lines once it ends)."""
    import threading

    result = {}

    def run():
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}) as r:
            result["lines"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    t = threading.Thread(target=run)
    t.start()
    return t, result


def _running(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_second_sigint_stops_at_once_without_a_traceback():
    """The first SIGINT drains (here up to 120 s, for a request of 3,000 tokens); a second
    stops now: the stream is cut off, the process exits 0 with no traceback, and its whole
    process group (forkserver, runtime) is gone."""
    with running_server("--model", "tiny", "--drain-timeout", "120", "--log-format", "json") as (proc, url):
        got = {"lines": []}

        def long_request():
            try:
                with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                        "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True,
                        "stream": True}) as r:
                    for line in r.iter_lines():
                        got["lines"].append(line)
            except httpx.HTTPError as e:
                got["error"] = e

        import threading
        t = threading.Thread(target=long_request)
        t.start()
        while not got["lines"]:  # streaming
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None  # draining
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130  # requests were cut off: not the 0 of a drain that ran its course
        t.join(30)
        log = proc.stdout.read().decode()
        assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-2000:]
        assert "stopping now" in log and "stopped without draining" in log
        assert "data: [DONE]" not in got["lines"] and not any('"length"' in ln for ln in got["lines"])
        _group_gone(proc.pid)


def _group_gone(pgid: int) -> None:
    """Every process of the server's session (it runs with start_new_session) has exited."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"processes of group {pgid} still running")


def test_a_runtime_that_does_not_load_in_time_is_a_one_line_error(capsys):
    from lockstep.cli import main

    assert main(["serve", *TIMING, "--runtime-option", "load_s=30", "--start-timeout", "1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "did not load and report ready within 1 s" in err and "--start-timeout" in err and "Traceback" not in err


def test_a_signal_while_the_engine_loads_stops_the_start():
    """SIGTERM during a (here 60 s) model load stops it at once: no port bound, exit 143
    (128 + SIGTERM: interrupted, as Ctrl-C's 130; a drain after serving exits 0)."""
    proc = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "serve", "--port", str(free_port()), *TIMING,
                             "--runtime-option", "load_s=60", "--log-format", "json"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        lines = []
        for raw in proc.stdout:  # until the signal watcher is up
            lines.append(raw.decode())
            if '"starting"' in lines[-1]:
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
        log = "".join(lines) + proc.stdout.read().decode()
        assert "stopped before serving" in log and '"serving"' not in log and "Traceback" not in log, log[-2000:]
        _group_gone(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
