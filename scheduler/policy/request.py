"""The request model: what the scheduler core knows about one request, and its states.

A ``Request`` is built at the boundary (the engine's Frontend, or the simulator), validated
there, and then owned by one ``SchedulerCore``: nobody else mutates it. Prompt tokens stay a
numpy int32 array end to end (an 855K-token ``list[int]`` alone costs ~33 ms to convert).
"""

from __future__ import annotations

import enum
import math

import attrs
import numpy as np


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued for (re)admission
    WAITING_FOR_KV = "waiting_for_kv"  # blocks allocated, KV arriving from elsewhere
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # a stop token was sampled
    ABORT = "abort"
    REJECTED = "rejected"  # could never be served (see Request.reject_reason)


class RequestError(ValueError):
    """A request that cannot be accepted; the message names the field and what is allowed,
    ``field`` is that field's name where one is to blame (what an HTTP error's ``param``
    reports), and ``reason`` is a short tag for counting rejections."""

    def __init__(self, message: str, reason: str = "invalid", *, field: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.field = field


INT32_MAX = 2**31 - 1
MAX_N = 128  # samples per prompt
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 120 else text[:117] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _as_stops(v):
    """One stop string given alone is one stop (not its characters); other values are
    left for ``validate`` to judge."""
    return (v,) if isinstance(v, str) else tuple(v) if isinstance(v, list) else v


def _scalar(v):
    """A numpy scalar as the Python one (np.int64(8) is an integer here, as vLLM takes it)."""
    return v.item() if isinstance(v, np.generic) else v


def _id_tuple(v):
    """A list, tuple, range or 1-D array of token ids as a tuple of Python values (what they
    are is ``validate``'s to judge); anything else as given."""
    if isinstance(v, np.ndarray):
        return tuple(v.tolist()) if v.ndim == 1 else v
    return tuple(_scalar(x) for x in v) if isinstance(v, (list, tuple, range)) else v


def _bias_dict(v):
    return {_scalar(t): _scalar(b) for t, b in v.items()} if isinstance(v, dict) else v


def _num(default):
    return attrs.field(default=default, converter=_scalar)


def _as_structured(v):
    """A dict of StructuredOutputsParams' fields as one (vLLM's dict form); anything else as given."""
    return StructuredOutputsParams(**v) if isinstance(v, dict) and set(v) <= _STRUCTURED_FIELDS else v


@attrs.frozen
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's structured outputs): exactly one of a JSON schema
    (a dict, or its JSON text), a regular expression, a list of choices, an EBNF grammar
    (GBNF-style, as xgrammar reads it) or any JSON object (``json_object``). The output then
    matches it and ends with the end-of-sequence token where it is complete (or at
    max_tokens, cut short). ``disable_any_whitespace``: JSON without whitespace between its
    tokens (by default any JSON whitespace is allowed, up to a few characters at a time).
    Checked here for its shape; the engine compiles it when the request is made."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_id_tuple)  # (a list as a tuple)
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # The grammar applies after these token ids appear in the output (a reasoning model's end
    # of thinking, "</think>": the server's --reasoning-parser sets it); empty: from the start.
    after_tokens: tuple[int, ...] = attrs.field(default=(), converter=_id_tuple)

    def __attrs_post_init__(self) -> None:
        given = [f for f in _STRUCTURED_KINDS if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            raise RequestError(f"structured_outputs must give exactly one of {', '.join(_STRUCTURED_KINDS)}, got "
                               f"{len(given)}{': ' + ', '.join(given) if given else ''}", field="structured_outputs")
        if self.json is not None and not (isinstance(self.json, dict) or isinstance(self.json, str) and self.json):
            raise RequestError(f"structured_outputs.json must be a JSON schema (a dict, or its JSON text), got "
                               f"{_short(self.json)}", field="structured_outputs.json")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, str) and v):
                raise RequestError(f"structured_outputs.{name} must be a non-empty string, got {_short(v)}",
                                   field=f"structured_outputs.{name}")
        if self.choice is not None and not (isinstance(self.choice, tuple) and self.choice and all(
                isinstance(c, str) and c for c in self.choice)):
            raise RequestError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got "
                               f"{_short(self.choice)}", field="structured_outputs.choice")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise RequestError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}",
                               field="structured_outputs.json_object")
        if not (isinstance(self.after_tokens, tuple) and all(_is_int(t) and 0 <= t <= INT32_MAX
                                                                for t in self.after_tokens)):
            raise RequestError(f"structured_outputs.after_tokens must be a tuple of token ids (integers in "
                               f"[0, 2**31 - 1]), got {_short(self.after_tokens)}",
                               field="structured_outputs.after_tokens")
        if not isinstance(self.disable_any_whitespace, bool):
            raise RequestError(f"structured_outputs.disable_any_whitespace must be a bool, got "
                               f"{self.disable_any_whitespace!r}", field="structured_outputs.disable_any_whitespace")

    @property
    def kind(self) -> str:
        return next(f for f in _STRUCTURED_KINDS if getattr(self, f) not in (None, False))

    def spec(self) -> list[str]:
        """[kind, text, whitespace]: what a runtime compiles (a schema as JSON text, choices as
        a JSON list; whitespace "any" or "none")."""
        import json

        kind = self.kind
        v = getattr(self, kind)
        text = (json.dumps(v) if kind == "json" and isinstance(v, dict) else json.dumps(list(v)) if kind == "choice"
                else "" if kind == "json_object" else v)
        return [kind, text, "none" if self.disable_any_whitespace else "any"]


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_STRUCTURED_FIELDS = {f.name for f in attrs.fields(StructuredOutputsParams)}


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to sample one request, as vLLM's; checked when made (``validate``): a bad value
    raises RequestError naming the field where it was typed. Fields are keywords only (vLLM's
    first positional is n, this one's would be max_tokens) and frozen: change one with
    ``attrs.evolve(params, max_tokens=...)``; ``clone()`` is vLLM's copy."""

    max_tokens: int | None = _num(16)  # None: what the context leaves after the prompt (vLLM's)
    temperature: float = _num(1.0)
    top_p: float = _num(1.0)
    top_k: int = _num(-1)
    seed: int | None = _num(None)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_id_tuple)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_as_stops)  # matched on the detokenized text
    ignore_eos: bool = _num(False)
    logprobs: int | None = _num(None)  # None: none; k >= 0: the sampled token's and the top k's
    # Logits processing before sampling, as vLLM's: penalties on tokens already generated
    # (frequency: per occurrence, presence: once), repetition on the prompt's and the
    # output's tokens (a positive logit divided by it, a negative one multiplied); min_p
    # drops tokens less likely than min_p times the most likely one; min_tokens: no end of
    # sequence, stop token or stop string before that many tokens.
    presence_penalty: float = _num(0.0)
    frequency_penalty: float = _num(0.0)
    repetition_penalty: float = _num(1.0)
    min_p: float = _num(0.0)
    min_tokens: int = _num(0)
    # Added to the logits of the token ids given, before the rest (OpenAI's logit_bias: -100
    # bans a token, 100 all but forces it); allowed_token_ids: every other id is masked (vLLM's).
    logit_bias: dict[int, float] | None = attrs.field(default=None, converter=_bias_dict)
    allowed_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_id_tuple)
    # The prompt's log-probabilities (each prompt token's after the first, and the top k),
    # as vLLM's prompt_logprobs; such a request computes its whole prompt (no prefix-cache
    # hits, as in vLLM).
    prompt_logprobs: int | None = _num(None)
    # Samples per prompt (LLM.generate, Engine.complete: Completion.outputs); sample i takes
    # seed + i where a seed is given, as the OpenAI server's n does. A stream is one sample.
    n: int = _num(1)
    # The output text leaves out special tokens (vLLM's; False: they are written, as a tool-call
    # parser reads them).
    skip_special_tokens: bool = _num(True)
    # The output matches a JSON schema, regex, choice or grammar (vLLM's structured outputs).
    structured_outputs: StructuredOutputsParams | None = attrs.field(default=None, converter=_as_structured)
    # The stop string that ended the output stays in its text (vLLM's; not a stop token's).
    include_stop_str_in_output: bool = _num(False)
    # Keep only the prompt's last k tokens (vLLM's; -1: as many as the context leaves room for
    # one output token).
    truncate_prompt_tokens: int | None = _num(None)
    # Text for the output (vLLM's; False: token ids only, no text).
    detokenize: bool = _num(True)
    # vLLM's: samples to draw to return the best n of. Only n itself (or None) is taken: like
    # vLLM's V1 engine, this one draws n and returns them all.
    best_of: int | None = _num(None)

    def clone(self) -> SamplingParams:
        """A copy (vLLM's; these are frozen, so it is an equal one)."""
        return attrs.evolve(self)

    def __attrs_post_init__(self) -> None:
        self.validate()

    @property
    def processes_logits(self) -> bool:
        """Whether a runtime must change the logits before sampling for this request."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.min_p or self.min_tokens or self.logit_bias or self.allowed_token_ids is not None
                    or self.structured_outputs is not None)

    def validate(self) -> None:
        """Every field's type and range, so that nothing accepted here fails later in the
        scheduler or a runtime (where one request's bad value would take others down)."""
        if self.max_tokens is not None and not (_is_int(self.max_tokens) and 1 <= self.max_tokens <= INT32_MAX):
            raise RequestError(f"max_tokens must be None (the context's room) or an integer in [1, 2**31 - 1], "
                               f"got {self.max_tokens!r}", field="max_tokens")
        t = self.temperature
        # Any t > 0 samples: the samplers shift the logits by their max before dividing by t,
        # so a tiny t tends to greedy instead of overflowing (1e-40 once made them NaN).
        if not (_is_num(t) and math.isfinite(t) and t >= 0):
            raise RequestError(f"temperature must be a finite number >= 0 (0: greedy), got {t!r}",
                               field="temperature")
        if not (_is_num(self.top_p) and 0 < self.top_p <= 1):
            raise RequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}", field="top_p")
        if not (_is_int(self.top_k) and (self.top_k in (-1, 0) or 1 <= self.top_k <= INT32_MAX)):
            raise RequestError(f"top_k must be -1 or 0 (off) or an integer in [1, 2**31 - 1], got {self.top_k!r}",
                               field="top_k")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**63):
            raise RequestError(f"seed must be None or an integer in [0, 2**63), got {self.seed!r}", field="seed")
        if not isinstance(self.stop_token_ids, (tuple, list)) or any(
                not (_is_int(t) and 0 <= t <= INT32_MAX) for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be a tuple (or list, range or 1-D array) of integers in "
                               f"[0, 2**31 - 1], got {_short(self.stop_token_ids)}", field="stop_token_ids")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= 20):
            raise RequestError(f"logprobs must be None or an integer in [0, 20], got {self.logprobs!r}",
                               field="logprobs")
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError(f"stop must be a non-empty string or a tuple of them, got {self.stop!r}", field="stop")
        if not isinstance(self.skip_special_tokens, bool):
            raise RequestError(f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}",
                               field="skip_special_tokens")
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be a bool, got {self.ignore_eos!r}", field="ignore_eos")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (_is_num(v) and -2 <= v <= 2):
                raise RequestError(f"{name} must be a number in [-2, 2] (0: off), got {v!r}", field=name)
        v = self.repetition_penalty
        if not (_is_num(v) and 1e-4 <= v <= 1e4):  # (past these, a logit divided by it overflows float32)
            raise RequestError(f"repetition_penalty must be a number in [0.0001, 10000] (1: off), got {v!r}",
                               field="repetition_penalty")
        if not (_is_num(self.min_p) and 0 <= self.min_p <= 1):
            raise RequestError(f"min_p must be a number in [0, 1] (0: off), got {self.min_p!r}", field="min_p")
        if not (_is_int(self.n) and 1 <= self.n <= MAX_N):
            raise RequestError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}", field="n")
        if self.n > 1 and self.seed is not None and self.seed > 2**63 - self.n:
            raise RequestError(f"seed must be at most 2**63 - n with n = {self.n} (sample i takes seed + i), "
                               f"got {self.seed}", field="seed")
        if self.prompt_logprobs is not None and not (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20):
            raise RequestError(f"prompt_logprobs must be None or an integer in [0, 20], got {self.prompt_logprobs!r}",
                               field="prompt_logprobs")
        if not (_is_int(self.min_tokens) and 0 <= self.min_tokens <= (self.max_tokens or INT32_MAX)):
            raise RequestError(f"min_tokens must be an integer in [0, max_tokens ({self.max_tokens})], "
                               f"got {self.min_tokens!r}", field="min_tokens")
        bias = self.logit_bias
        if bias is not None and not (isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS and all(
                _is_int(t) and 0 <= t <= INT32_MAX and _is_num(b) and -100 <= b <= 100 for t, b in bias.items())):
            raise RequestError(f"logit_bias must be None or a dict of at most {MAX_LOGIT_BIAS} token ids (integers "
                               f"in [0, 2**31 - 1]) to biases (numbers in [-100, 100]), got {_short(bias)}",
                               field="logit_bias")
        ids = self.allowed_token_ids
        if ids is not None and not (isinstance(ids, tuple) and ids and all(
                _is_int(t) and 0 <= t <= INT32_MAX for t in ids)):
            raise RequestError(f"allowed_token_ids must be None or a non-empty tuple (or list, range or 1-D array) of "
                               f"integers in "
                               f"[0, 2**31 - 1], got {_short(ids)}", field="allowed_token_ids")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise RequestError(f"structured_outputs must be None, a StructuredOutputsParams or a dict of its fields "
                               f"({', '.join(sorted(_STRUCTURED_FIELDS))}), got {_short(so)}",
                               field="structured_outputs")
        for name in ("include_stop_str_in_output", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be a bool, got {getattr(self, name)!r}", field=name)
        k = self.truncate_prompt_tokens
        if k is not None and not (_is_int(k) and (k == -1 or 1 <= k <= INT32_MAX)):
            raise RequestError(f"truncate_prompt_tokens must be None, -1 (what the context holds) or an integer in "
                               f"[1, 2**31 - 1], got {k!r}", field="truncate_prompt_tokens")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError(f"best_of must be None or n ({self.n}): the best of more samples than are returned is "
                               f"not drawn here (vLLM's V1 engine refuses it too), got {self.best_of!r}",
                               field="best_of")
        if so is not None and self.min_tokens:  # the grammar may allow only end of sequence, which it holds
            raise RequestError("min_tokens cannot be combined with structured_outputs (the output's grammar may allow "
                               "only the end of sequence before min_tokens): leave it 0", field="min_tokens")

    def check_vocab(self, vocab_size: int, eos_token_id: int = -1) -> None:
        """The token ids of logit_bias, allowed_token_ids and stop_token_ids against the
        model's vocabulary and end-of-sequence id (known to the engine, not here)."""
        for name, ids in (("logit_bias", self.logit_bias), ("allowed_token_ids", self.allowed_token_ids),
                          ("stop_token_ids", self.stop_token_ids)):
            out = sorted(t for t in ids or () if t >= vocab_size)
            if out:
                raise RequestError(f"{name} holds token ids outside the model's vocabulary of {vocab_size}: "
                                   f"{out[:8]}{' ...' if len(out) > 8 else ''}", field=name)
        held = set(self.stop_token_ids) | ({eos_token_id} if eos_token_id >= 0 and not self.ignore_eos else set())
        if self.min_tokens and self.allowed_token_ids and held.issuperset(self.allowed_token_ids):
            raise RequestError(f"allowed_token_ids {_short(self.allowed_token_ids)} are all stop or end-of-sequence "
                               f"ids, which min_tokens ({self.min_tokens}) holds off: no token could be drawn",
                               field="allowed_token_ids")


@attrs.define(eq=False, slots=True)
class Request:
    """One request inside a SchedulerCore.

    Token accounting: ``num_known`` counts prompt tokens plus output tokens sampled or in
    flight (placeholders of a plan not yet answered); ``num_computed`` counts tokens whose KV
    is computed or scheduled. A request decodes when ``num_known - num_computed == 1``.
    """

    id: int
    prompt: np.ndarray  # int32
    params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    block_hashes: np.ndarray = attrs.field(factory=lambda: np.empty((0, 2), np.uint64))
    hash_acc: np.ndarray | None = None  # chain accumulator after the last hashed block
    cache_salt: str | None = None
    remote_kv_tokens: int = 0  # prompt tokens whose KV arrives from another pool
    hold_kv: bool = False  # P/D prefill side: keep the blocks after finishing, for a pull
    eos_token_id: int = -1
    # No other request will look up this one's block hashes (a simulator knows its whole
    # workload; the engine never does): its blocks may be cached unindexed (BlockPool). The
    # core clears it when the request is preempted, since it then looks up its own blocks.
    private_prefix: bool = False
    # -- owned by the core ---------------------------------------------------------------
    state: RequestState = RequestState.WAITING
    seq: int = 0  # admission order, the FCFS tie-breaker
    blocks: list[int] = attrs.field(factory=list)
    num_computed: int = 0
    num_known: int = 0
    num_output: int = 0  # confirmed output tokens
    num_cached_tokens: int = -1  # prefix-cache hit on first admission (-1: not yet)
    num_preemptions: int = 0
    host_load_first: int = -1  # first block of a host-tier load not yet reported done
    prefix_hint: list[int] = attrs.field(factory=list)  # last prefix match, while waiting
    slot: int = -1
    output: np.ndarray = attrs.field(factory=lambda: np.empty(0, np.int32))
    finish_reason: FinishReason | None = None

    def __attrs_post_init__(self) -> None:
        self.num_known = len(self.prompt)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def max_total(self) -> int:
        return len(self.prompt) + self.params.max_tokens
