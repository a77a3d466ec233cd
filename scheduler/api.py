"""The Python API: ``open_engine`` (trio-native, streaming); ``LLM`` (synchronous, batch) is
``lockstep.llm``'s, on top of it.

    async with lockstep.open_engine(EngineConfig(model="tiny")) as engine:
        async for out in engine.generate("hello", SamplingParams(max_tokens=8)):
            print(out.text, end="")

``generate`` checks its arguments when called (a bad parameter raises ``RequestError`` there,
and nothing is queued); a prompt that turns out too long once tokenized raises on the first
iteration. Leaving the loop early aborts the request and frees its blocks.
"""

from __future__ import annotations

import itertools
import weakref
from contextlib import asynccontextmanager
from typing import AsyncIterator

import attrs
import numpy as np
import trio

from lockstep.engine.balancer import Balancer, BalancerStats
from lockstep.engine.config import EngineConfig
from lockstep.engine.errors import plain_error
from lockstep.engine.frontend import Frontend, Prompt, as_token_array, check_prompt, truncated
from lockstep.engine.output import RequestStream
from lockstep.engine.scheduler import Abort, Scheduler, SchedulerStats
from lockstep.engine.startup import start_actors
from lockstep.engine.stops import StopStrings, cut_at_stop_ids, feed_stop_strings
from lockstep.policy.request import FinishReason, RequestError, SamplingParams


@attrs.frozen
class RequestOutput:
    """One streamed delta; the last one has ``finished`` set and the totals."""

    request_id: int
    text: str
    token_ids: np.ndarray
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    queue_s: float | None = None  # arrival to the first step that computed it
    # With SamplingParams.logprobs: per token (token id, logprob, [(top id, logprob), ...])
    logprobs: list | None = None
    # With SamplingParams.prompt_logprobs, on the first output only: per prompt token, the
    # same and its rank, vLLM's (1 + the ids more likely than it): (token id, logprob, top,
    # rank); the first token's logprob and rank None (nothing comes before it)
    prompt_logprobs: list | None = None
    # On the last output: the stop string (str) or stop token id (int) that ended the request,
    # as vLLM's stop_reason; None when it ended otherwise (end of sequence, length, abort)
    stop_reason: str | int | None = None
    prompt: str | None = None  # the prompt as given, where it was text (vLLM's)
    prompt_token_ids: np.ndarray | None = None  # the prompt's token ids (vLLM's)


@attrs.frozen
class Completion:
    """A whole answer (``LLM.generate`` and ``Engine.complete``)."""

    request_id: int
    text: str
    token_ids: np.ndarray
    finish_reason: str
    num_prompt_tokens: int
    ttft_s: float | None
    e2e_s: float | None
    # With SamplingParams.logprobs: per token (token id, logprob, [(top id, logprob), ...])
    logprobs: list | None = None
    prompt_logprobs: list | None = None  # with SamplingParams.prompt_logprobs (RequestOutput's)
    stop_reason: str | int | None = None  # RequestOutput's
    samples: tuple = ()  # with SamplingParams.n > 1: every sample (this one's fields are the first's)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (RequestOutput's)
    prompt: str | None = None  # the prompt as given, where it was text (vLLM's)
    prompt_token_ids: np.ndarray | None = None  # the prompt's token ids (vLLM's)
    index: int = 0  # which of the n samples (vLLM's CompletionOutput.index)

    @property
    def finished(self) -> bool:
        """Always True: a Completion is a whole answer (vLLM's RequestOutput.finished)."""
        return True

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the tokens' logprobs, with SamplingParams.logprobs (else None, as vLLM's)."""
        return None if self.logprobs is None else float(sum(row[1] for row in self.logprobs))

    @property
    def outputs(self) -> tuple:
        """The n samples, each a Completion (vLLM's RequestOutput.outputs); one: itself."""
        return self.samples or (self,)


class Engine:
    def __init__(self, config: EngineConfig, schedulers: list[Scheduler], frontend: Frontend, tokenizer,
                 balancer: Balancer | None = None):
        self.config, self.schedulers, self.frontend, self.tokenizer = config, schedulers, frontend, tokenizer
        self.balancer = balancer
        self.scheduler = schedulers[0]
        self._ids = itertools.count()
        self._live: dict[int, RequestStream] = {}  # request id -> stream, while it is consumed
        # request id -> stream, from generate() on: an abort before the first output finds it
        self._made: weakref.WeakValueDictionary[int, RequestStream] = weakref.WeakValueDictionary()
        self.closed = False  # its open_engine block has ended

    def generate(self, prompt, params: SamplingParams | None = None, *, priority: int = 0,
                 cache_salt: str | None = None, request_id: int | None = None) -> AsyncIterator[RequestOutput]:
        if self.closed:
            raise RuntimeError("this engine is closed: its open_engine block has ended")
        if isinstance(prompt, dict) and "cache_salt" in prompt:  # vLLM's prompt dicts may carry it
            if cache_salt is not None:
                raise RequestError("cache_salt given twice: in the prompt dict and as the argument", field="cache_salt")
            prompt = dict(prompt)
            cache_salt = prompt.pop("cache_salt")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}", field="params")
        params.validate()
        if params.n != 1:
            raise RequestError(f"n {params.n}: a stream carries one sample; Engine.complete and LLM.generate take n "
                               "(Completion.outputs), or start n streams", field="n")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise RequestError(f"priority must be an integer, got {priority!r}", field="priority")
        if priority and self.config.scheduler.policy != "priority":  # vLLM's rule: never ignored silently
            raise RequestError(f"priority {priority} needs priority scheduling, and this engine schedules first come, "
                               "first served: start it with scheduler policy 'priority' (SchedulerConfig(policy="
                               "'priority'), lockstep serve --scheduling-policy priority)", field="priority")
        if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):  # ("" salts nothing)
            raise RequestError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}", field="cache_salt")
        if params.processes_logits and self.config.draft_model:  # (structured outputs do run with one)
            name = next((f for f in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                                     "min_tokens", "logit_bias", "allowed_token_ids")
                         if getattr(params, f) not in (getattr(SamplingParams(), f), {})), None)
        if params.processes_logits and self.config.draft_model and name is not None:
            raise RequestError(f"{name} is not supported with speculative decoding (this engine runs draft model "
                               f"{self.config.draft_model!r}): leave it at its default", field=name)
        if params.prompt_logprobs is not None:
            cfg = self.config
            dep = cfg.prefill_dep if cfg.prefill_instances else cfg.dep
            why = (f"speculative decoding (draft model {cfg.draft_model!r})" if cfg.draft_model else
                   f"DEP (a prompt here is computed on {dep} ranks)" if dep > 1 else
                   "the timing runtime (it computes no logits)" if cfg.runtime == "timing" else None)
            if why is not None:
                raise RequestError(f"prompt_logprobs is not supported with {why}: leave it None",
                                   field="prompt_logprobs")
        if params.logprobs is not None and self.config.runtime == "timing":  # (it would answer none)
            raise RequestError("logprobs is not supported with the timing runtime (it computes no logits): leave it "
                               "None", field="logprobs")
        if params.structured_outputs is not None:
            if self.config.runtime == "timing":
                raise RequestError("structured_outputs is not supported with the timing runtime (it computes no "
                                   "logits): leave it None", field="structured_outputs")
            from lockstep.runtime.grammar_check import check  # (xgrammar: imported on first use)

            check(*params.structured_outputs.spec())
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer, and this engine has none (tokenizer=None): use "
                               "stop_token_ids", field="stop")
        prompt = as_token_array(prompt)
        text_prompt = prompt if isinstance(prompt, str) else None  # (vLLM's RequestOutput.prompt)
        # what does not depend on the prompt's tokens, also for a text prompt (tokenized later)
        fe = self.frontend
        params.check_vocab(fe.vocab_size, fe.eos)
        if isinstance(prompt, str) and self.tokenizer is None:
            raise RequestError("prompt: this engine has no tokenizer (tokenizer=None); pass token ids", field="prompt")
        if params.max_tokens is not None and params.max_tokens >= fe.max_model_len:
            raise RequestError(f"max_tokens ({params.max_tokens}) leaves no room for a prompt in the model's context "
                               f"of {fe.max_model_len} tokens", reason="context_length", field="max_tokens")
        if params.stop and not params.detokenize:
            raise RequestError("stop strings are matched on the output's text, and detokenize=False makes none: use "
                               "stop_token_ids, or leave detokenize True", field="detokenize")
        if not isinstance(prompt, str):
            prompt = truncated(prompt, params, fe.max_model_len)
            check_prompt(prompt, params, self.frontend.max_model_len, self.frontend.vocab_size,
                         eos_token_id=self.frontend.eos)
        if request_id is None:
            rid = next(self._ids)
            while rid in self._made or rid in self._live:  # (one a caller chose)
                rid = next(self._ids)
        elif isinstance(request_id, bool) or not isinstance(request_id, int) or request_id < 0:
            raise RequestError(f"request_id must be None or an integer >= 0, got {request_id!r}", field="request_id")
        elif request_id in self._made or request_id in self._live:
            raise RequestError(f"request_id {request_id} is in use by another request", field="request_id")
        else:
            rid = request_id
        stream = RequestStream(rid, len(prompt) if not isinstance(prompt, str) else 0, trio.current_time())
        stream.prompt_text = text_prompt
        self._made[rid] = stream
        return self._stream(Prompt(rid, prompt, params, stream, priority, cache_salt))

    async def _stream(self, p: Prompt) -> AsyncIterator[RequestOutput]:
        stream, params = p.stream, p.params
        detok = self._detokenizer(params.skip_special_tokens) if params.detokenize else None
        stops, n, first = set(params.stop_token_ids), 0, True
        cut = StopStrings(params.stop, include=params.include_stop_str_in_output) if params.stop else None
        self._live[p.req_id] = stream  # here, not in generate: a generator never started holds nothing
        try:
            try:
                await self.frontend.send_channel.send(p)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise RuntimeError("the engine shut down") from None
            while True:
                tokens, reason = await stream.next_delta()
                lps = stream.take_logprobs() if params.logprobs is not None else None
                stop_reason = None  # the stop string or stop token id that ended it (vLLM's stop_reason)
                if stops and len(tokens):
                    kept, hit = cut_at_stop_ids(tokens, stops, params.min_tokens - n)
                    # vLLM checks the length first: a stop id that is the last token max_tokens allows
                    # ends the request by length (no stop_reason), its text written
                    at_length = reason is FinishReason.LENGTH and len(kept) == len(tokens)
                    tokens, hit = kept, hit and not at_length
                    if hit:  # (vLLM's stop_reason is None for the end of sequence, a stop id or not)
                        reason = self._stopped(stream)
                        stop_reason = None if int(tokens[-1]) == self.frontend.eos and not params.ignore_eos \
                            else int(tokens[-1])
                text = ""
                # The token that ended the request (end of sequence, a stop id) is not written,
                # as vLLM's (it shows only with skip_special_tokens false, or as a stop id's text)
                ended = reason is not None and len(tokens) and (
                    (int(tokens[-1]) in stops and reason is not FinishReason.LENGTH)
                    or (int(tokens[-1]) == self.frontend.eos and not params.ignore_eos))
                written = tokens[:-1] if ended else tokens
                if cut is not None:  # token by token: a stop string ends the tokens where it ends
                    text, upto = feed_stop_strings(cut, detok, written, final=reason is not None,
                                                   skip=params.min_tokens - n)
                    if upto is not None:
                        tokens, lps = tokens[:upto], None if lps is None else lps[:upto]
                        reason, stop_reason = self._stopped(stream), cut.matched
                elif detok is not None:
                    text = detok.push(written.tolist()) + (detok.finish() if reason is not None else "")
                n += len(tokens)
                out = self._output(stream, text, tokens, reason, n, _pair(tokens, lps))
                if stop_reason is not None:
                    out = attrs.evolve(out, stop_reason=stop_reason)
                if first and params.prompt_logprobs is not None:
                    out = attrs.evolve(out, prompt_logprobs=stream.take_prompt_logprobs() or [])
                first = False
                yield out
                if reason is not None:
                    return
        finally:
            if not stream.done:
                self.abort(p.req_id)
            self._live.pop(p.req_id, None)
            self.frontend.rank_of.pop(p.req_id, None)

    def _stopped(self, stream: RequestStream) -> FinishReason:
        """A stop string or stop token id ended the request here (the core goes on until the
        abort reaches it): it finished now, for its timings."""
        if stream.finished_at is None:  # when its last token came (the consumer may read later)
            stream.finished_at = stream.pushed_at if stream.pushed_at is not None else trio.current_time()
        self.abort(stream.req_id, FinishReason.STOP)
        return FinishReason.STOP

    def _output(self, s: RequestStream, text, tokens, reason, n, logprobs=None) -> RequestOutput:
        done = reason is not None
        return RequestOutput(
            request_id=s.req_id, text=text, token_ids=tokens, finished=done,
            finish_reason=reason.value if done else None, num_prompt_tokens=s.num_prompt_tokens,
            num_output_tokens=n, num_cached_tokens=s.num_cached_tokens,
            ttft_s=None if s.first_token_at is None else s.first_token_at - s.arrival,
            e2e_s=(s.finished_at - s.arrival) if done and s.finished_at is not None else None,
            queue_s=None if s.scheduled_at is None else s.scheduled_at - s.arrival, logprobs=logprobs,
            prompt=s.prompt_text, prompt_token_ids=s.prompt_ids,
        )

    def _detokenizer(self, skip_special_tokens: bool = True):
        if self.tokenizer is None:
            return None
        from lockstep.runtime.tokenizer import IncrementalDetokenizer
        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens=skip_special_tokens)

    async def complete(self, prompt, params: SamplingParams | None = None, **kw) -> Completion:
        """The whole answer; with ``params.n`` > 1 its n samples (``Completion.outputs``), run
        together."""
        gens = [self.generate(prompt, p, **kw) for p in per_sample(params)]
        if len(gens) == 1:
            return await collect(gens[0])
        got: list = [None] * len(gens)

        async def one(i):
            got[i] = await collect(gens[i])
        try:
            async with trio.open_nursery() as nursery:
                for i in range(len(gens)):
                    nursery.start_soon(one, i)
        except BaseExceptionGroup as eg:  # as one sample's would: a RequestError is raised as itself
            leaf = eg
            while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) >= 1:
                leaf = leaf.exceptions[0]
            if isinstance(leaf, Exception):
                raise leaf from None
            raise
        got = [attrs.evolve(g, index=i) for i, g in enumerate(got)]
        return attrs.evolve(got[0], samples=tuple(got))

    def abort(self, request_id: int, reason: FinishReason = FinishReason.ABORT) -> None:
        """Stop a request wherever it is; its blocks are freed at the next step boundary. That
        may be before its generator first runs (``generate(request_id=...)`` names it ahead):
        it then ends at once. An id of no live request is ignored (it may have just finished),
        as vLLM's."""
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            raise RequestError(f"request_id must be an integer (RequestOutput.request_id), got {request_id!r}",
                               field="request_id")
        stream = self._live.get(request_id) or self._made.get(request_id)  # (made: its generator not started yet)
        if stream is not None and reason is FinishReason.ABORT:
            stream.abandoned = True  # still in the Frontend, it is dropped there (RequestStream.abandoned)
        rank = self.frontend.rank_of.get(request_id)
        targets = self.schedulers if rank is None else [self.schedulers[rank]]  # None: not routed yet
        for s in targets:
            s.send_channel.send_nowait(Abort(request_id, reason))

    def down(self) -> list[int]:
        """The ranks (indices into ``schedulers``) whose runtime (or DEP group, or nodes) is
        being restarted right now."""
        return [i for i, s in enumerate(self.schedulers) if s.down]

    def accepting(self) -> bool:
        """Whether some rank that takes new requests is up (not being restarted), and with P/D
        some decode rank too."""
        if not any(not s.down for s in self.frontend.schedulers):
            return False
        decode = [s for s in self.schedulers if s not in self.frontend.schedulers]
        return not decode or any(not s.down for s in decode)

    def abort_all(self) -> None:
        """Abort every request being consumed (a server's drain deadline)."""
        for rid in list(self._live):
            self.abort(rid)

    def statistics(self) -> SchedulerStats:
        """A frozen snapshot, summed over the DP ranks."""
        stats = [s.statistics() for s in self.schedulers]
        return SchedulerStats(*(sum(getattr(x, f.name) for x in stats) for f in attrs.fields(SchedulerStats)))

    def spec_statistics(self) -> dict:
        """Speculative decoding, summed over the ranks: drafts, draft tokens, accepted tokens,
        acceptances per draft position and the mean accepted length (tokens per decode)."""
        st = self.statistics()
        per_pos = sum((s.spec_accepted_per_position() for s in self.schedulers),
                      np.zeros(self.schedulers[0].core.config.num_spec_tokens, dtype=np.int64))
        d = st.spec_drafts
        return {"drafts": d, "draft_tokens": st.spec_draft_tokens, "accepted_tokens": st.spec_accepted_tokens,
                "accepted_per_position": per_pos.tolist(),
                "acceptance_rate": st.spec_accepted_tokens / st.spec_draft_tokens if st.spec_draft_tokens else 0.0,
                "mean_accepted_length": 1 + st.spec_accepted_tokens / d if d else 0.0}

    def balancer_statistics(self, model: str = "target") -> BalancerStats | None:
        """The expert load balancer's, when it runs (``EngineConfig.eplb``); ``model``
        "draft": its planner for a speculative draft with sharded experts."""
        return None if self.balancer is None else self.balancer.statistics(model)


def _pair(tokens: np.ndarray, lps: list | None) -> list | None:
    """Token ids with their logprob rows (a stop cut may have dropped trailing tokens)."""
    if lps is None:
        return None
    out = []
    for t, (lp, top) in zip(tokens.tolist(), lps):
        out.append((t, lp, [] if top is None else list(zip(top[0].tolist(), top[1].tolist()))))
    return out


@asynccontextmanager
async def open_engine(config: EngineConfig | None = None) -> AsyncIterator[Engine]:
    """Start the runtime processes and the actors; stop them all on exit.

    Ranks are laid out flat: with P/D the prefill pool's ranks come first (new requests go
    there), then the decode pool's; otherwise every rank of every instance takes requests.
    What leaves the block leaves it as itself (``plain_error``), not in trio's group."""
    try:
        async with _open_engine(config) as engine:
            yield engine
    except BaseExceptionGroup as eg:
        raise plain_error(eg) from None


@asynccontextmanager
async def _open_engine(config: EngineConfig | None) -> AsyncIterator[Engine]:
    config = config or EngineConfig()
    async with start_actors(config) as a:
        engine = Engine(config, a.schedulers, a.frontend, a.tokenizer, a.balancer)
        try:
            yield engine
        finally:
            engine.closed = True


def per_sample(params: SamplingParams | None) -> list[SamplingParams | None]:
    """One SamplingParams per sample of ``params.n``: sample i with seed + i where seeded."""
    if params is None or not isinstance(params, SamplingParams) or params.n == 1:
        return [params]
    params.validate()  # (a seed too large for n is named before anything starts)
    return [attrs.evolve(params, n=1, seed=None if params.seed is None else params.seed + i)
            for i in range(params.n)]


async def collect(outputs: AsyncIterator[RequestOutput]) -> Completion:
    """A request's deltas gathered into its Completion."""
    texts, ids, lps, last, prompt = [], [], [], None, None
    async for out in outputs:
        texts.append(out.text)
        ids.append(out.token_ids)
        if out.logprobs is not None:
            lps += out.logprobs
        if out.prompt_logprobs is not None:
            prompt = out.prompt_logprobs
        last = out
    return Completion(last.request_id, "".join(texts), np.concatenate(ids).astype(np.int32),
                      last.finish_reason, last.num_prompt_tokens, last.ttft_s, last.e2e_s,
                      lps if last.logprobs is not None else None, prompt, last.stop_reason,
                      num_cached_tokens=last.num_cached_tokens, prompt=last.prompt,
                      prompt_token_ids=last.prompt_token_ids)
