"""The OpenAI server's answers: the whole JSON body of a request's choices, or its SSE stream
of chunks (thinking and tool calls split out of the text as they arrive, usage, and an error
event where the engine failed or the drain deadline cut a request off), and the error shape
every refusal takes."""

from __future__ import annotations

import math
import time

import msgspec
import structlog
import trio
from starlette.responses import Response

from .openai_output import logprobs_json, prompt_logprobs_json, usage
from .openai_protocol import Job
from .openai_reasoning import ThinkSplitter, split_reasoning
from .openai_tool_parser import AutoToolStream, parse_tool_calls
from .openai_tools import ToolStream, tool_calls
from .policy.request import RequestError

_JSON = msgspec.json.Encoder()
log = structlog.get_logger("lockstep.http")


def error(message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error") -> Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return Response(_JSON.encode(body), status_code=status, media_type="application/json")


def request_param(e: BaseException, chat: bool) -> str | None:
    """The request field a RequestError blames (``field``), if any; a chat request's prompt
    is its messages."""
    param = getattr(e, "field", None)
    return "messages" if chat and param == "prompt" else param


async def _run_all(gens: list, on_delta, server) -> None:
    """Drain every generator concurrently, calling ``on_delta(index, output)``. A generator
    cut short (the client went away) is counted as aborted."""
    async def one(i, g):
        done, seen = False, {}
        try:
            async for out in g:
                done = out.finished
                server.metrics.tokens(seen, out, trio.current_time())
                await on_delta(i, out)
        finally:
            if not done:
                server.metrics.request_aborted()

    async with trio.open_nursery() as nursery:
        for i, g in enumerate(gens):
            nursery.start_soon(one, i, g)


async def _run_checked(gens: list, on_delta, server) -> tuple[str, BaseException] | None:
    """Like ``_run_all``, but a failure comes back as (OpenAI error type, error) instead of
    escaping as a group: a request refused after submission ("invalid_request_error"), or
    the engine failing it, a runtime process dying say ("server_error"), so that the client
    still gets an error in OpenAI's shape (and a stream its end)."""
    failed = None
    try:
        await _run_all(gens, on_delta, server)
    except* RequestError as eg:
        failed = ("invalid_request_error", eg.exceptions[0])
    except* Exception as eg:  # noqa: BLE001 - reported to the client, and logged
        log.error("request_failed", error=repr(eg.exceptions[0]))
        failed = failed or ("server_error", eg.exceptions[0])
    return failed


def _failed(exc: BaseException) -> str:
    """What a client is told of an engine failure: its first line (a runtime's traceback,
    its internal paths included, is for the server's log, where it is)."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(":")
    return f"the engine failed this request: {first} (the server's log has the details)"


_CUT = ("the server shut down before this request finished: its drain deadline (--drain-timeout) passed "
        "with the request still running")


def _cut(server, finals: list) -> bool:
    """Whether the drain deadline aborted one of these requests."""
    return server.cut and any(f is not None and f.finish_reason == "abort" for f in finals)


def _finish_reason(reason: str | None) -> str | None:
    return {"abort": "abort", "rejected": "abort"}.get(reason, reason)


async def whole_response(server, job: Job, gens: list, rid: str) -> Response:
    texts = [[] for _ in gens]
    lps = [[] for _ in gens]
    finals: list = [None] * len(gens)

    prompt_rows: list = [None] * len(gens)

    async def on_delta(i, out):
        if out.prompt_logprobs is not None:
            prompt_rows[i] = out.prompt_logprobs
            if job.echo and job.params.logprobs is not None:  # echo with logprobs: the prompt's rows come first
                lps[i][:0] = list(out.prompt_logprobs)
        if not job.echo_only:
            texts[i].append(out.text)
            lps[i] += out.logprobs or []
        if out.finished:
            finals[i] = out
            _record(server, out)

    failed = await _run_checked(gens, on_delta, server)
    if failed is not None:
        kind, exc = failed
        if kind == "server_error":
            return error(_failed(exc), status=500, kind=kind)
        return error(str(exc), request_param(exc, job.chat))
    if _cut(server, finals):
        return error(_CUT, status=503, kind="service_unavailable")
    choices = []
    for i, f in enumerate(finals):
        text = (job.echoes[i // job.n] if job.echo else "") + "".join(texts[i])
        reason = "length" if job.echo_only else _finish_reason(f.finish_reason)  # (its one token unasked for)
        lp = logprobs_json(server.engine.tokenizer, lps[i], job.chat) if job.params.logprobs is not None else None
        stop = None if job.echo_only else f.stop_reason  # vLLM's: the stop string or token id that ended it
        if job.chat:
            message = {"role": "assistant", "content": text}
            if server.reasoning_parser:
                reasoning, text = (None, text) if job.thinking_closed else split_reasoning(text)
                message = {"role": "assistant", "content": text, "reasoning_content": reasoning}
            if job.tool_choice == "auto":  # the model's own format (openai_tool_parser)
                content, calls = parse_tool_calls(text or "")
                if calls:
                    message.update(content=content, tool_calls=calls)
                    reason = "tool_calls" if reason == "stop" else reason
            elif job.tool_choice and text is not None:  # (text None: it never stopped thinking)
                # (OpenAI's: a forced function's call ends with "stop", or "length"; a "required"
                # answer cut at max_tokens keeps its whole calls and the one it was cut in)
                calls = tool_calls(text, job.tool_choice)
                message.update(content=None, **({"tool_calls": calls} if calls else {}))
                reason = "tool_calls" if job.tool_choice == "required" and reason == "stop" else reason
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason,
                            "stop_reason": stop})
        else:
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reason, "stop_reason": stop})
            if job.prompt_logprobs:
                choices[-1]["prompt_logprobs"] = prompt_logprobs_json(server.engine.tokenizer, prompt_rows[i])
    body = {"id": rid, "object": "chat.completion" if job.chat else "text_completion", "created": int(time.time()),
            "model": server.model_name, "choices": choices, "usage": usage(finals, job)}
    if job.chat and job.prompt_logprobs:  # vLLM's: the conversation's, once
        body["prompt_logprobs"] = prompt_logprobs_json(server.engine.tokenizer, prompt_rows[0])
    return Response(_JSON.encode(body), media_type="application/json")


def _record(server, out) -> None:
    server.metrics.request_done(out.finish_reason or "abort", out.e2e_s, out.queue_s, out.ttft_s,
                                out.num_prompt_tokens, out.num_output_tokens)


class SSEResponse(Response):
    """Server-sent events written by ``produce(send_event)``; a client that goes away
    cancels the producer (and so aborts its requests)."""

    media_type = "text/event-stream"

    def __init__(self, produce):
        self.produce = produce
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        events, queued = trio.open_memory_channel(math.inf)

        async def write():
            async for data in queued:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_on_disconnect, receive, nursery.cancel_scope)
            async with trio.open_nursery() as inner:
                inner.start_soon(write)
                async with events:
                    await self.produce(events.send_nowait)
            nursery.cancel_scope.cancel()


async def cancel_on_disconnect(receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def stream_response(server, job: Job, gens: list, rid: str) -> SSEResponse:
    kind = "chat.completion.chunk" if job.chat else "text_completion"
    created = int(time.time())
    finals: list = [None] * len(gens)

    latest: list = [None] * len(gens)  # each choice's last output (vLLM's continuous usage)

    def chunk(choices: list, usage=None) -> bytes:
        body = {"id": rid, "object": kind, "created": created, "model": server.model_name, "choices": choices}
        if usage is None and job.include_usage and job.continuous_usage and choices:  # vLLM's: the usage so far
            # (before a prompt's first output: its tokens, which were counted before the response began)
            prompt = sum(o.num_prompt_tokens if o is not None else len(job.prompts[k])
                         for k, o in enumerate(latest[::job.n]))
            done = sum(o.num_output_tokens for o in latest if o is not None)
            usage = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
        if usage is not None or job.include_usage:  # OpenAI's: every other chunk then says "usage": null
            body["usage"] = usage
        return b"data: " + _JSON.encode(body) + b"\n\n"

    offsets = [0] * len(gens)  # per choice: its tokens' text so far (completions' text_offset)
    calls = ([AutoToolStream() if job.tool_choice == "auto" else ToolStream(job.tool_choice) for _ in gens]
             if job.tool_choice else None)
    thinks = [ThinkSplitter(closed=job.thinking_closed) for _ in gens] if job.chat and server.reasoning_parser \
        else None

    def choice(i: int, text: str, reason: str | None, first: bool = False, rows=None, stop=None) -> dict | None:
        lp = None
        if rows is not None:
            lp = logprobs_json(server.engine.tokenizer, rows, job.chat, offsets[i])
            if not job.chat and lp["tokens"]:
                offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        if job.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            if (thinks is not None or calls is not None) and not first:
                final = reason is not None
                # thinking apart from the answer, then the answer's tool calls apart from its text
                reasoning, content = thinks[i].feed(text, final=final) if thinks is not None else ("", text)
                delta = {"reasoning_content": reasoning} if reasoning else {}
                if calls is not None:
                    delta.update(calls[i].delta(content, final) or {})
                elif content:
                    delta["content"] = content
                if not delta and not final and lp is None:
                    return None  # (held: a marker may begin there, or a "required" answer is not whole)
                called = "tool_calls" in delta or getattr(calls[i], "n", 0) if calls is not None else False
                if reason == "stop" and called and job.tool_choice in ("required", "auto"):
                    reason = "tool_calls"
            return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason, "stop_reason": stop}
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason, "stop_reason": stop}

    async def produce(emit) -> None:
        async def on_delta(i, out):
            latest[i] = out
            if out.finished:
                finals[i] = out
                _record(server, out)
            if out.prompt_logprobs is not None and job.echo and job.params.logprobs is not None:
                # echo with logprobs: the prompt, with its rows
                emit(chunk([choice(i, job.echoes[i // job.n], None, rows=out.prompt_logprobs)]))
            if job.echo_only:  # the prompt is the answer
                if out.finished:
                    emit(chunk([choice(i, "", "length")]))
                return
            c = choice(i, out.text, _finish_reason(out.finish_reason), rows=out.logprobs, stop=out.stop_reason)
            if c is None:  # (held back; prompt_logprobs, which come with the first output, go out anyway)
                if not (job.prompt_logprobs and out.prompt_logprobs is not None):
                    return
                c = {"index": i, "delta": {}, "logprobs": None, "finish_reason": None, "stop_reason": None}
            if job.prompt_logprobs and out.prompt_logprobs is not None:  # vLLM's field, with the first delta
                c["prompt_logprobs"] = prompt_logprobs_json(server.engine.tokenizer, out.prompt_logprobs)
            emit(chunk([c]))

        if job.chat:
            emit(chunk([choice(i, "", None, first=True) for i in range(len(gens))]))
        elif job.echo and job.params.logprobs is None:  # each choice's prompt first, as vLLM streams
            emit(chunk([choice(i, job.echoes[i // job.n], None) for i in range(len(gens))]))
        failed = await _run_checked(gens, on_delta, server)
        if failed is not None:
            kind, exc = failed
            message = _failed(exc) if kind == "server_error" else str(exc)
            emit(b"data: " + _JSON.encode({"error": {"message": message, "type": kind,
                 "param": None if kind == "server_error" else request_param(exc, job.chat), "code": None}}) + b"\n\n")
        elif _cut(server, finals):
            emit(b"data: " + _JSON.encode({"error": {"message": _CUT, "type": "service_unavailable", "param": None,
                                                     "code": None}}) + b"\n\n")
        if job.include_usage and all(f is not None for f in finals):
            emit(chunk([], usage(finals, job)))
        emit(b"data: [DONE]\n\n")

    return SSEResponse(produce)
