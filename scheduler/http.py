"""The OpenAI-compatible HTTP app (Starlette, served by hypercorn's trio worker).

`/v1/completions` and `/v1/chat/completions` (SSE streaming with usage), `/v1/models`,
`/health`, `/tokenize`, `/detokenize`, `/metrics`. Bodies are checked at the boundary
(``openai_protocol``): bad fields and prompts over the context get a 400 (an unknown model a 404) in
OpenAI's error shape and nothing is queued. A client that disconnects cancels its handler,
which aborts its requests and frees their blocks.
"""

from __future__ import annotations

import json
import secrets
import time
from functools import partial

import attrs
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .openai_protocol import BadRequest, Job, parse_body, parse_completion
from .openai_reasoning import THINK_END, thinking_closed
from .openai_responses import cancel_on_disconnect, error, request_param, stream_response, whole_response
from .policy.request import RequestError
from .prom import ServerMetrics, merge_exposition


class Server:
    """What the handlers share: the engine, the served model name, metrics, draining."""

    def __init__(self, engine, model_name: str, *, default_max_tokens: int = 256, reasoning_parser: str | None = None,
                 tool_parser: str | None = None, chat_template: str | None = None):
        self.engine, self.model_name = engine, model_name
        # the chat template: the tokenizer's, or one given in its place (serve --chat-template)
        self.apply_chat_template = None if engine.tokenizer is None else engine.tokenizer.apply_chat_template
        if chat_template is not None and engine.tokenizer is not None:
            from lockstep.runtime.tokenizer import custom_chat_template

            self.apply_chat_template = custom_chat_template(engine.tokenizer, chat_template)
        self.default_max_tokens = default_max_tokens
        self.reasoning_parser = reasoning_parser  # chat answers' thinking apart (lockstep.openai_reasoning)
        self.tool_parser = tool_parser  # tool_choice "auto" (lockstep.openai_tool_parser)
        self.metrics = ServerMetrics(model_name, engine.frontend.max_model_len)
        self.draining = False
        self.cut = False  # the drain deadline passed: requests still running were aborted
        self.created = int(time.time())

    def cut_off(self) -> None:
        """The drain deadline: abort what still runs; each response then ends with a 503
        (or a stream with an error event and [DONE]) instead of a dropped connection."""
        self.cut = True
        self.engine.abort_all()


def refused(e: BadRequest) -> Response:
    return error(str(e), e.param, status=e.status, kind="not_found_error" if e.status == 404 else "invalid_request_error")


def make_app(servers: Server | list[Server]) -> Starlette:
    """One app for one or several served models; requests route by their ``model`` field."""
    servers = [servers] if isinstance(servers, Server) else list(servers)
    by_name = {s.model_name: s for s in servers}
    if len(by_name) != len(servers):
        raise ValueError(f"served model names must be unique, got {[s.model_name for s in servers]}")
    first = servers[0]

    def pick(body: dict, required: bool = True) -> Server:
        model = body.get("model")
        if model is None and (not required or len(servers) == 1):  # one model: it needs no name, as in vLLM
            return first
        if model is None:
            raise BadRequest(f"model is required: this server serves {sorted(by_name)}", "model")
        if not isinstance(model, str):  # (a list is not even hashable)
            raise BadRequest(f"model must be a string, one of {sorted(by_name)}; got {type(model).__name__}", "model")
        if model not in by_name:
            raise BadRequest(f"model {model!r} is not served here; available: {sorted(by_name)}", "model", status=404)
        return by_name[model]

    async def health(request: Request) -> Response:
        if first.draining:
            return error("the server is shutting down", status=503, kind="service_unavailable")
        down = {s.model_name: s.engine.down() for s in servers if s.engine.down()}
        if any(not s.engine.accepting() for s in servers):  # a model nothing can serve until they are back
            return error(f"restarting: ranks {down} (a runtime died, or a node is being waited for)", status=503,
                         kind="service_unavailable")
        return JSONResponse({"status": "ok", **({"ranks_down": down} if down else {})})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": s.model_name, "object": "model", "created": s.created, "owned_by": "lockstep",
            "max_model_len": s.engine.frontend.max_model_len, "vocab_size": s.engine.frontend.vocab_size}
            for s in servers]})

    async def metrics(request: Request) -> Response:
        texts = []
        for s in servers:
            eng = s.engine
            per_pos = eng.spec_statistics()["accepted_per_position"] if eng.config.draft_model else ()
            texts.append(s.metrics.render(eng.statistics(), per_pos, eng.balancer_statistics(), len(eng.down())))
        return PlainTextResponse(merge_exposition(texts), media_type="text/plain; version=0.0.4")

    async def tokenize(request: Request) -> Response:
        """vLLM's: a prompt (bos added as for completions, unless add_special_tokens is
        false) or chat messages (the template's own; add_generation_prompt, true)."""
        try:
            body = parse_body(await request.body())
            unknown = sorted(set(body) - {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                                          "continue_final_message", "chat_template_kwargs", "tools"})
            if unknown:
                raise BadRequest(f"unknown field {unknown[0]!r} for tokenize (it takes model, prompt or messages, "
                                 "add_special_tokens, and for messages add_generation_prompt, continue_final_message, "
                                 "chat_template_kwargs and tools)", unknown[0])
            for flag in ("add_special_tokens",):
                if flag in body and not isinstance(body[flag], bool):
                    raise BadRequest(f"{flag} must be true or false, got {body[flag]!r}", flag)
            server = pick(body, required=False)
            tok = _tokenizer(server)
            chat = "messages" in body
            if chat:
                from .openai_chat import chat_prompt
                from .openai_tools import ToolError, check_tools

                try:
                    tools = check_tools(body.get("tools"))
                except ToolError as e:
                    raise BadRequest(str(e), e.param) from None
                text = chat_prompt(body, server.apply_chat_template, tools)
            elif isinstance(body.get("prompt"), str):
                text = body["prompt"]
            else:
                raise BadRequest("prompt must be a string (or give messages)", "prompt")
        except BadRequest as e:
            return refused(e)
        ids = tok.encode(text, add_bos=tok.add_bos and body.get("add_special_tokens", not chat)).tolist()
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": server.engine.frontend.max_model_len})

    async def detokenize(request: Request) -> Response:
        try:
            body = parse_body(await request.body())
            server = pick(body, required=False)
            tokens = body.get("tokens")
            vocab = server.engine.frontend.vocab_size
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                       for t in tokens):
                raise BadRequest(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
            return JSONResponse({"prompt": _tokenizer(server).decode(tokens)})
        except BadRequest as e:
            return refused(e)

    async def completions(request: Request) -> Response:
        return await _complete(pick, request, chat=False)

    async def chat(request: Request) -> Response:
        return await _complete(pick, request, chat=True)

    async def model(request: Request) -> Response:
        if not request.path_params["name"]:  # /v1/models/
            return await models(request)
        s = by_name.get(request.path_params["name"])
        if s is None:
            return error(f"model {request.path_params['name']!r} is not served here; available: {sorted(by_name)}",
                         "model", status=404, kind="not_found_error")
        return JSONResponse({"id": s.model_name, "object": "model", "created": s.created, "owned_by": "lockstep",
                             "max_model_len": s.engine.frontend.max_model_len,
                             "vocab_size": s.engine.frontend.vocab_size})

    async def version(request: Request) -> Response:
        from importlib.metadata import PackageNotFoundError, version as installed

        try:
            return JSONResponse({"version": installed("lockstep")})
        except PackageNotFoundError:
            return JSONResponse({"version": "unknown"})

    async def http_error(request: Request, exc: HTTPException) -> Response:
        """Unknown routes and methods in OpenAI's error shape, as every other error (a 405
        keeps its Allow header)."""
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        resp = error(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code, kind=kind)
        resp.headers.update(exc.headers or {})
        return resp

    return Starlette(routes=[
        Route("/health", health), Route("/v1/models", models), Route("/v1/models/{name:path}", model),
        Route("/version", version), Route("/metrics", metrics),
        Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ], exception_handlers={HTTPException: http_error})


def _tokenizer(server: Server):
    if server.engine.tokenizer is None:
        raise BadRequest("this model has no tokenizer")
    return server.engine.tokenizer


async def _complete(pick, request: Request, *, chat: bool) -> Response:
    try:
        body = parse_body(await request.body())
        server = pick(body)
        if body.get("model") is None:  # the one model served, if the body named none (or null)
            body["model"] = server.model_name
    except BadRequest as e:
        return refused(e)
    if server.draining:
        return error("the server is shutting down", status=503, kind="service_unavailable")
    engine, job = server.engine, None
    try:
        template = server.apply_chat_template
        if chat and template is None:
            raise BadRequest("this model has no tokenizer, so no chat template", "messages")
        job = parse_completion(body, chat=chat, default_max_tokens=server.default_max_tokens,
                               chat_template=template, auto_tools=server.tool_parser is not None)
        # Text prompts are tokenized here (off the event loop), so that one too long, empty or
        # otherwise refused is a 400 before any response starts, not an error inside a stream.
        if job.echo:
            if engine.tokenizer is None:
                raise BadRequest("echo needs a tokenizer to write the prompt's text; this model has none", "echo")
            job = attrs.evolve(job, echoes=tuple(p if isinstance(p, str) else engine.tokenizer.decode(p.tolist())
                                                 for p in job.prompts))
        if any(isinstance(p, str) for p in job.prompts):
            if engine.tokenizer is None:
                raise BadRequest("this model has no tokenizer: give the prompt as token ids", "prompt")
            # A chat's template writes its own bos; a completion prompt gets the checkpoint's.
            encode = partial(engine.tokenizer.encode, add_bos=not chat and engine.tokenizer.add_bos)
            ids = [await trio.to_thread.run_sync(encode, p) if isinstance(p, str) else p for p in job.prompts]
            job = attrs.evolve(job, prompts=tuple(ids))
        so = job.params.structured_outputs
        if job.chat and server.reasoning_parser and engine.tokenizer is not None:
            if thinking_closed(engine.tokenizer, job.prompts[0]):  # (a template with thinking off closes it)
                job = attrs.evolve(job, thinking_closed=True)
            elif so is not None:  # the grammar applies to the answer, after the thinking (as vLLM's)
                so = attrs.evolve(so, after_tokens=tuple(engine.tokenizer.encode(THINK_END).tolist()))
                job = attrs.evolve(job, params=attrs.evolve(job.params, structured_outputs=so))
        if so is not None and engine.config.runtime != "timing":  # compiled off the event loop (xgrammar's first
            from lockstep.runtime.grammar_check import check  # import alone takes ~2 s), checked once more when made

            if job.tool_choice == "required":  # a function xgrammar cannot read is named, not the whole list
                for i, tool in enumerate(job.tools):
                    params = tool["function"].get("parameters")
                    if params:
                        try:
                            await trio.to_thread.run_sync(check, "json", json.dumps(params), "none")
                        except RequestError as e:
                            raise BadRequest(str(e).replace("structured_outputs.json",
                                                            f"tools[{i}].function.parameters", 1), "tools") from None
            await trio.to_thread.run_sync(check, *so.spec())
        gens = _start(engine, job)
    except BadRequest as e:
        return refused(e)
    except RequestError as e:
        param, message = request_param(e, chat), str(e)
        if param and param.startswith("structured_outputs") and job is not None and job.structured_from:
            # (the field it came in, as the client wrote it)
            param, message = job.structured_from[0], message.replace(param, job.structured_from[1], 1)
        if param == "max_tokens" and body.get("max_completion_tokens") is not None:  # the name it was given
            param = "max_completion_tokens"
        if param == "prompt_logprobs" and body.get("prompt_logprobs") is None:  # asked for as echo with logprobs
            param, message = "echo", message.replace("prompt_logprobs", "echo with logprobs (the prompt's)", 1) \
                .replace(": leave it None", ": drop echo or logprobs")
        return error(message, param)
    rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    if job.stream:
        return stream_response(server, job, gens, rid)
    result = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(cancel_on_disconnect, request.receive, nursery.cancel_scope)
        result = await whole_response(server, job, gens, rid)
        nursery.cancel_scope.cancel()
    return result or Response(status_code=499)  # the client went away


def _start(engine, job: Job) -> list:
    """One generator per (prompt, sample); every one is checked before any is consumed."""
    gens = []
    for k, p in enumerate(job.prompts):
        for i in range(job.n):
            params = job.capped(p, engine.frontend.max_model_len)
            if job.n > 1 and params.seed is not None:
                params = attrs.evolve(params, seed=params.seed + i)  # in range: parse_completion checked
            try:
                gens.append(engine.generate(p, params, priority=job.priority, cache_salt=job.cache_salt))
            except RequestError as e:
                if len(job.prompts) == 1:
                    raise
                raise RequestError(f"prompt[{k}]: {e}", reason=e.reason, field=e.field) from None  # which one
    return gens
