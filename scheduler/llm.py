"""The synchronous Python API: ``LLM("tiny").generate(["a", "b"])``, as vLLM's ``LLM``.

The engine runs in a trio run on a thread of its own (``_Runner``), started once with the
``LLM`` and serving every ``generate`` call until it is closed.
"""

from __future__ import annotations

import atexit
import contextlib
import difflib
import queue
import threading
import time
import weakref
from typing import Sequence

import attrs
import numpy as np
import trio

from lockstep.api import Completion, Engine, collect, open_engine, per_sample
from lockstep.engine.errors import plain_error
from lockstep.engine.config import EngineConfig
from lockstep.policy.config import ConfigError, SchedulerConfig
from lockstep.policy.request import RequestError, SamplingParams


class LLM:
    """Synchronous generation for scripts, as vLLM's ``LLM``::

        llm = LLM("tiny", max_model_len=2048)
        for c in llm.generate(["hello", "world"], SamplingParams(max_tokens=8)):
            print(c.text)

    The engine (runtime processes, weights) starts here, in a trio run on a thread of its
    own, and serves every ``generate`` call until ``close()``: at the end of a ``with`` block,
    when the LLM is garbage-collected, or at the interpreter's exit. Keyword arguments are
    EngineConfig's fields, or SchedulerConfig's (``max_model_len``, ``num_blocks``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``, ``enable_prefix_caching``,
    ...), which replace those of the engine's scheduler. A bad one, or an engine that cannot
    start, raises here."""

    def __init__(self, model: str = "tiny", **config):
        _not_in_trio("LLM()")
        self.config = _llm_config(model, config)
        self._runner = _Runner(self.config)
        self._finalizer = weakref.finalize(self, self._runner.close)  # also at the interpreter's exit

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the engine: runtime processes and shared memory released; idempotent."""
        self._finalizer()

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: int | Sequence[int] | None = None, use_tqdm: bool = True) -> list[Completion]:
        """One Completion per prompt (text, token ids, vLLM's prompt dicts, which may carry a
        ``cache_salt``, or a list of these), all run concurrently; ``params`` (or vLLM's name,
        ``sampling_params``): one SamplingParams for all, or one per prompt; ``priority``: one
        for all or one per prompt (with SchedulerConfig(policy="priority")). A bad one raises
        RequestError naming the field (and, in a batch, the prompt's index); a
        KeyboardInterrupt aborts every request of the call. (``use_tqdm`` is taken for vLLM's
        scripts: no progress bar is drawn either way.)"""
        if not isinstance(use_tqdm, bool) and not callable(use_tqdm):
            raise TypeError(f"use_tqdm must be a bool, got {use_tqdm!r}")
        if sampling_params is not None:
            if params is not None:
                raise TypeError("give params or sampling_params (vLLM's name for it), not both")
            params = sampling_params
        single = not isinstance(prompts, (list, tuple, np.ndarray)) or (  # text, a dict, or bad input
            isinstance(prompts, np.ndarray) and prompts.ndim == 1) or (
            len(prompts) > 0 and isinstance(prompts[0], (int, np.integer)))
        prompts = [prompts] if single else list(prompts)
        if not prompts:
            return []
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise RequestError(f"params: got {len(plist)} SamplingParams for {len(prompts)} prompts", field="params")
        for i, p in enumerate(plist):  # before anything is queued
            if p is not None and not isinstance(p, SamplingParams):
                raise RequestError(f"params[{i}] must be a SamplingParams, got {type(p).__name__}", field="params")
        prio = list(priority) if isinstance(priority, (list, tuple)) else [priority or 0] * len(prompts)
        if len(prio) != len(prompts):
            raise RequestError(f"priority: got {len(prio)} for {len(prompts)} prompts", field="priority")
        return self._runner.call(_generate_all, prompts, plist, single, prio)


    def chat(self, messages, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, priority: int | Sequence[int] | None = None,
             chat_template: str | None = None, use_tqdm: bool = True) -> list[Completion]:
        """One Completion per conversation (a list of OpenAI-style messages, or a list of such
        lists), through the model's chat template, as vLLM's ``LLM.chat``: ``tools`` (OpenAI's
        function definitions, for the template), ``chat_template_kwargs`` (the template's own
        variables), ``add_generation_prompt``, ``continue_final_message`` (the last message, an
        assistant's, left open), ``chat_template`` (a Jinja template of its own, in place of the
        tokenizer's). The rest as ``generate``."""
        one = isinstance(messages, (list, tuple)) and (not messages or isinstance(messages[0], dict))
        convs = [messages] if one else list(messages) if isinstance(messages, (list, tuple)) else [messages]
        body = {"continue_final_message": continue_final_message, "chat_template_kwargs": chat_template_kwargs}
        if add_generation_prompt is not True:  # (continue_final_message turns the default off)
            body["add_generation_prompt"] = add_generation_prompt
        ids = self._runner.call(_chat_prompts, convs, body, tools, one, chat_template)
        return self.generate(ids[0] if one else ids, params, sampling_params=sampling_params, priority=priority,
                             use_tqdm=use_tqdm)

    def get_tokenizer(self):
        """The engine's tokenizer (``encode``, ``decode``, ``apply_chat_template``), as vLLM's;
        None where the engine has none (tokenizer=None)."""
        return self._runner.call(_tokenizer)


async def _tokenizer(engine: Engine):
    return engine.tokenizer


async def _chat_prompts(engine: Engine, convs: list, body: dict, tools, one: bool,
                        chat_template: str | None = None) -> list[np.ndarray]:
    """Each conversation's token ids through the engine's chat template, or ``chat_template``
    (either writes its own bos)."""
    from lockstep.openai_chat import TemplateRefused, chat_prompt
    from lockstep.openai_protocol import BadRequest
    from lockstep.openai_tools import ToolError, check_tools
    from lockstep.runtime.tokenizer import TokenizerError, custom_chat_template

    if engine.tokenizer is None:
        raise RequestError("chat needs a tokenizer, and this engine has none (tokenizer=None)", field="messages")
    try:
        template = engine.tokenizer.apply_chat_template if chat_template is None else \
            custom_chat_template(engine.tokenizer, chat_template)
    except TokenizerError as e:
        raise RequestError(str(e), field="chat_template") from None
    out = []
    for i, conv in enumerate(convs):
        try:
            text = chat_prompt({**body, "messages": conv}, template, check_tools(tools))
        except (BadRequest, ToolError) as e:
            # a template the caller gave that fails is theirs to mend (the model's: the messages)
            if isinstance(e, TemplateRefused) and chat_template is not None:
                e, field = f"chat_template failed on these messages: {e.cause}", "chat_template"
            else:
                field = getattr(e, "param", None)
            raise RequestError(str(e) if one else f"messages[{i}]: {e}", field=field) from None
        out.append(engine.tokenizer.encode(text))
    return out


def _llm_config(model: str, config: dict) -> EngineConfig:
    known = {f.name for f in attrs.fields(EngineConfig)}
    fields = {f.name for f in attrs.fields(SchedulerConfig)} - known  # num_spec_tokens: the engine's
    for k in config:
        if k not in known | fields:
            near = difflib.get_close_matches(k, known | fields, n=1)
            raise ConfigError(f"LLM: unknown argument {k!r}" + (f" (did you mean {near[0]!r}?)" if near else "") +
                              "; it takes EngineConfig's and SchedulerConfig's fields")
    limits = {k: config.pop(k) for k in list(config) if k in fields}
    if limits:
        base = config.get("scheduler") or attrs.fields(EngineConfig).scheduler.default.factory()
        config["scheduler"] = attrs.evolve(base, **limits)
    return EngineConfig(model=model, **config)


async def _generate_all(engine: Engine, prompts: list, plist: list, single: bool, prio: list) -> list[Completion]:
    gens = []  # (prompt index, sample generator)
    for i, (prompt, params, pr) in enumerate(zip(prompts, plist, prio)):  # every prompt checked before any runs
        try:
            gens += [(i, engine.generate(prompt, p, priority=pr)) for p in per_sample(params)]
        except RequestError as e:
            if single:
                raise
            raise RequestError(f"prompts[{i}]: {e}", reason=e.reason, field=e.field) from None
    results: list[Completion | None] = [None] * len(gens)

    async def one(j):
        i, gen = gens[j]
        try:
            results[j] = await collect(gen)
        except RequestError as e:  # refused once tokenized (too long, empty)
            if single:
                raise
            raise RequestError(f"prompts[{i}]: {e}", reason=e.reason, field=e.field) from None

    async with trio.open_nursery() as nursery:
        for j in range(len(gens)):
            nursery.start_soon(one, j)
    by: list[list] = [[] for _ in prompts]  # each prompt's samples together (n > 1: Completion.outputs)
    for (i, _), r in zip(gens, results):
        by[i].append(r)
    out = []
    for mine in by:  # n > 1: the samples numbered, as Engine.complete numbers them (vLLM's index)
        mine = [attrs.evolve(c, index=k) for k, c in enumerate(mine)] if len(mine) > 1 else mine
        out.append(mine[0] if len(mine) == 1 else attrs.evolve(mine[0], samples=tuple(mine)))
    return out


class _Runner:
    """An engine in a trio run on a daemon thread; ``call`` runs a coroutine there. Closed by
    ``close``, or at the interpreter's exit by a hook registered once the engine is up: after
    multiprocessing's own, so it runs first (atexit runs the last registered first), while
    the runtime processes that multiprocessing would wait for can still be stopped."""

    def __init__(self, config: EngineConfig):
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope = trio.CancelScope()  # the engine's life: cancelled to stop it
        self._engine: Engine | None = None
        self._error: BaseException | None = None
        self._closed = False
        started: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, args=(config, started), name="lockstep-llm", daemon=True)
        try:
            self._thread.start()
            failed = started.get()
        except BaseException:  # interrupted while the engine starts: stop it, then go on raising
            self.close()
            raise
        if failed is not None:
            self.close()
            raise failed
        atexit.register(self.close)

    def _main(self, config: EngineConfig, started: queue.SimpleQueue) -> None:
        try:
            trio.run(self._serve, config, started)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            self._error = _plain(e)
            if self._engine is None:
                started.put(self._error)

    async def _serve(self, config: EngineConfig, started: queue.SimpleQueue) -> None:
        self._token = trio.lowlevel.current_trio_token()
        with self._scope:
            async with open_engine(config) as engine:
                self._engine = engine
                started.put(None)
                await trio.sleep_forever()

    def call(self, fn, *args):
        _not_in_trio("LLM.generate")
        if self._closed:
            raise RuntimeError("this LLM is closed")
        if not self._thread.is_alive():
            raise RuntimeError(self._gone())
        scope = trio.CancelScope()

        async def run():
            with scope:  # cancelled by the caller's KeyboardInterrupt, who no longer waits
                return await fn(self._engine, *args)

        try:
            return trio.from_thread.run(run, trio_token=self._token)
        except KeyboardInterrupt:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(scope.cancel, trio_token=self._token)
            raise
        except BaseExceptionGroup as eg:
            raise _plain(eg) from None
        except (trio.RunFinishedError, trio.Cancelled):  # the engine's run ended under this call
            raise RuntimeError(self._gone()) from None

    def _gone(self) -> str:
        if self._error is not None:
            return f"the engine stopped: {self._error!r}"
        return "this LLM was closed" if self._closed else "the engine stopped"

    def close(self) -> None:
        """Stop the engine (or its start) and wait for its thread; idempotent."""
        if threading.current_thread() is self._thread:
            # A finalizer that garbage collection ran on the engine's own thread: ask the run
            # to stop, and leave waiting for it to the atexit hook, still registered.
            if self._token is not None:
                self._token.run_sync_soon(self._scope.cancel)
            return
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        while self._token is None and self._thread.is_alive():  # the run is only beginning
            time.sleep(0.001)
        if self._token is not None:  # (from any thread, a trio run's too: nothing is awaited)
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._scope.cancel)
        if self._thread.ident is not None:  # (interrupted before it started: nothing to wait for)
            self._thread.join()
        from lockstep.engine.runtime_client import stop_forkserver

        stop_forkserver()  # (and the resource tracker: nothing of the engine outlives it; kept while others run)


def _not_in_trio(what: str) -> None:
    if trio.lowlevel.in_trio_run():  # it would block the run's loop while the engine works
        raise RuntimeError(f"{what} is the synchronous API and this is a trio run: there, use `async with "
                           "lockstep.api.open_engine(config) as engine` (engine.generate, engine.complete), or "
                           "call the LLM from a worker thread (trio.to_thread.run_sync)")


def _plain(e: BaseException) -> BaseException:
    return plain_error(e, "requests of this call failed with the same error type")
