"""OpenAI request bodies in, lockstep values out: parsing and checking at the HTTP boundary.

Every problem raises ``BadRequest`` naming the field and what is allowed, so the server can
answer a 400 in OpenAI's error shape before anything is queued. Token-id prompts become
int32 arrays here, once.
"""

from __future__ import annotations

import attrs
import msgspec
import numpy as np

from lockstep.policy.request import RequestError, SamplingParams, StructuredOutputsParams

from .openai_tools import ToolError, parse_tools, tool_structured_outputs

MAX_N = 16


class BadRequest(ValueError):
    """A request refused: 400, or ``status`` (404 for a model not served, as OpenAI's)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@attrs.frozen
class Job:
    """One parsed completion request: prompts (text or token arrays) x n samples."""

    model: str
    prompts: tuple  # str or np.ndarray (int32) each
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    priority: int
    cache_salt: str | None
    chat: bool
    # The body gave no max_tokens: params carries the server's default, which each prompt
    # caps at what the context leaves it (``capped``), as vLLM fills the context.
    default_max_tokens: bool = False
    # Completions' echo: each choice's text starts with its prompt's (``echoes``, per prompt,
    # filled in where the prompts are tokenized).
    echo: bool = False
    echoes: tuple = ()
    # echo with max_tokens 0 (vLLM's echo without generation, how lm-evaluation-harness
    # scores a text): one token is generated and not returned; the answer is the prompt
    # (and its logprobs)
    echo_only: bool = False
    # vLLM's prompt_logprobs field was given: the response carries its prompt_logprobs
    prompt_logprobs: bool = False
    # structured outputs: the field they came from, and the path errors name their value by
    # (response_format.json_schema.schema, guided_json, structured_outputs.regex, ...)
    structured_from: tuple[str, str] | None = None
    # chat's tool_choice where it constrains the answer: "required" or a function's name
    # (lockstep.openai_tools); None: a plain answer
    tool_choice: str | None = None
    # the prompt closed the thinking already (--reasoning-parser: the answer is all content)
    thinking_closed: bool = False
    # vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far
    continuous_usage: bool = False
    tools: tuple = ()  # chat's functions (a "required" answer's schema is made of theirs)

    def capped(self, prompt, max_model_len: int) -> SamplingParams:
        """The params for one token-id ``prompt``: with no max_tokens given, the default or
        what the context leaves after the prompt, whichever is less (at least 1)."""
        if not self.default_max_tokens or isinstance(prompt, str):
            return self.params
        room = max_model_len - len(prompt)
        # room < 1: the prompt alone is too long; room < min_tokens: so is the prompt with them
        if room >= self.params.max_tokens or room < max(1, self.params.min_tokens):
            return self.params
        return attrs.evolve(self.params, max_tokens=room)


def parse_body(raw: bytes) -> dict:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    except RecursionError:  # (msgspec's decoder recurses per level of nesting)
        raise BadRequest("request body is not valid JSON here: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


# The fields each endpoint reads. Fields of OpenAI's API (and vLLM's extras) that lockstep does
# not implement are accepted only at their no-op value (a 400 otherwise: nothing asked for is
# dropped silently); any other field is a 400.
_COMMON = {"model", "n", "stream", "stream_options", "stop", "max_tokens", "temperature", "top_p", "top_k",
           "seed", "stop_token_ids", "ignore_eos", "logprobs", "priority", "cache_salt", "user",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "prompt_logprobs",
           "logit_bias", "allowed_token_ids", "skip_special_tokens", "response_format", "structured_outputs",
           "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
           "guided_whitespace_pattern", "include_stop_str_in_output", "truncate_prompt_tokens"}
_FIELDS = {False: _COMMON | {"prompt", "echo"},
           True: _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                            "parallel_tool_calls", "add_generation_prompt", "continue_final_message",
                            "chat_template_kwargs"}}
_NO_OP = {  # field -> is the value the no-op one
    "best_of": lambda v: v == 1, "suffix": lambda v: not v,
    # vLLM's extras at their defaults (clients built for vLLM send them)
    "spaces_between_special_tokens": lambda v: v is True, "use_beam_search": lambda v: v is False,
    "length_penalty": lambda v: v == 1, "return_tokens_as_token_ids": lambda v: v is False,
    "echo": lambda v: v is False,  # (chat's; completions implement it)
    "tools": lambda v: not v, "tool_choice": lambda v: v in ("none", "auto"), "parallel_tool_calls": lambda v: True,
    "functions": lambda v: not v,
    # OpenAI's bookkeeping fields (clients such as the openai package's send them): nothing stored,
    # one tier, text only, and metadata, which asks for nothing, taken as given.
    "store": lambda v: v is False, "service_tier": lambda v: v in ("auto", "default"),
    "modalities": lambda v: v == ["text"], "metadata": lambda v: isinstance(v, dict),
}


def _check_fields(body: dict, chat: bool) -> None:
    for name, v in body.items():
        if name in _FIELDS[chat] or v is None:
            continue
        no_op = _NO_OP.get(name)
        if no_op is None:
            other = "prompt (a completions field: chat takes messages)" if chat and name == "prompt" else \
                "messages (a chat field: completions take prompt)" if not chat and name == "messages" else None
            raise BadRequest(f"unknown field {other or name!r} for {'chat completions' if chat else 'completions'}", name)
        try:
            ok = no_op(v)
        except Exception:  # noqa: BLE001 - a value of a type the check cannot compare
            ok = False
        if not ok:
            raise BadRequest(f"{name} is not supported; it may only be given at its no-op value, got {v!r}", name)


def parse_completion(body: dict, *, chat: bool, default_max_tokens: int, chat_template, auto_tools: bool = False
                     ) -> Job:
    """``auto_tools``: the server reads the model's own tool calls (tool_choice "auto")."""
    _check_fields(body, chat)
    model = _get(body, "model", str, required=True)
    tools, tool_choice, parallel = None, None, True
    if chat:
        try:
            tools, tool_choice, parallel = parse_tools(body, auto=auto_tools)
        except ToolError as e:
            raise BadRequest(str(e), e.param) from None
        from .openai_chat import chat_prompt  # (it raises this module's BadRequest)

        prompts = (chat_prompt(body, chat_template, tools),)
    else:
        prompts = _prompts(body.get("prompt"))
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise BadRequest(f"n must be in [1, {MAX_N}], got {n}", "n")
    logprobs = _logprobs(body, chat)
    echo = False if chat else _get(body, "echo", bool, False)
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop) or len(stop) > 8:
        raise BadRequest("stop must be a string or a list of at most 8 strings", "stop")
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if max_name == "max_completion_tokens" and body.get("max_tokens") not in (None, body["max_completion_tokens"]):
        raise BadRequest("give max_completion_tokens or max_tokens, not both with different values", "max_tokens")
    max_tokens = body.get(max_name)
    echo_only = echo and max_tokens == 0 and not isinstance(max_tokens, bool)
    if max_tokens == 0 and not isinstance(max_tokens, bool) and not echo:
        raise BadRequest(f"{max_name} must be at least 1 (0 only with echo, which then returns the prompt alone)",
                         max_name)
    structured, structured_from = _structured(body)
    if tool_choice is not None and tool_choice != "auto":
        if structured is not None:
            raise BadRequest(f"tool_choice {tool_choice!r} constrains the answer to tool calls, and "
                             f"{structured_from[0]} constrains it too: give one", structured_from[0])
        structured = tool_structured_outputs(tools, tool_choice, parallel)
        at = next((i for i, t in enumerate(tools) if t["function"]["name"] == tool_choice), None)
        structured_from = ("tools", "tools" if at is None else f"tools[{at}].function.parameters")
    try:
        params = SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else 1 if echo_only else _int(max_name, max_tokens),
            temperature=_num(body, "temperature", 1.0), top_p=_num(body, "top_p", 1.0),
            top_k=_get(body, "top_k", int, -1), seed=_get(body, "seed", int, None),
            stop_token_ids=tuple(_int_list(body, "stop_token_ids")), stop=tuple(stop),
            ignore_eos=_get(body, "ignore_eos", bool, False), logprobs=logprobs,
            skip_special_tokens=_get(body, "skip_special_tokens", bool, True),
            presence_penalty=_num(body, "presence_penalty", 0.0),
            frequency_penalty=_num(body, "frequency_penalty", 0.0),
            repetition_penalty=_num(body, "repetition_penalty", 1.0), min_p=_num(body, "min_p", 0.0),
            min_tokens=_get(body, "min_tokens", int, 0), logit_bias=_logit_bias(body),
            allowed_token_ids=tuple(_int_list(body, "allowed_token_ids")) if body.get("allowed_token_ids") is not None
            else None,
            # echo with logprobs: the prompt's too, with as many top ones; or vLLM's own field
            prompt_logprobs=_prompt_logprobs(body, logprobs if echo else None),
            structured_outputs=structured,
            include_stop_str_in_output=_get(body, "include_stop_str_in_output", bool, False),
            truncate_prompt_tokens=_get(body, "truncate_prompt_tokens", int, None),
        )
        if tool_choice == "auto":  # the calls' markers are special tokens: the parser reads them
            params = attrs.evolve(params, skip_special_tokens=False)
    except RequestError as e:  # (SamplingParams checks itself when made)
        param = e.field
        raise BadRequest(str(e).replace("max_tokens", max_name, 1) if param == "max_tokens" else str(e),
                         max_name if param == "max_tokens" else param) from None
    if n > 1 and params.seed is not None and params.seed > 2**63 - n:  # sample i takes seed + i
        raise BadRequest(f"seed must be at most 2**63 - n ({2**63 - n}) with n = {n}: sample i uses seed + i; "
                         f"got {params.seed}", "seed")
    stream = _get(body, "stream", bool, False)
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise BadRequest("stream_options must be an object with at most include_usage and "
                             "continuous_usage_stats", "stream_options")
        if not stream:
            raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    include_usage = _get(opts or {}, "include_usage", bool, False)
    continuous_usage = _get(opts or {}, "continuous_usage_stats", bool, False)  # vLLM's: usage in every chunk
    salt = _get(body, "cache_salt", str, None)
    _get(body, "user", str, None)  # accepted (an end-user id), and checked
    return Job(model=model, prompts=prompts, params=params, n=n, stream=stream,
               include_usage=include_usage, priority=_get(body, "priority", int, 0),
               cache_salt=salt, chat=chat, default_max_tokens=max_tokens is None, echo=echo, echo_only=echo_only,
               prompt_logprobs=body.get("prompt_logprobs") is not None, structured_from=structured_from,
               tool_choice=tool_choice, continuous_usage=continuous_usage, tools=tuple(tools or ()))


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _structured(body: dict) -> tuple[StructuredOutputsParams | None, tuple[str, str] | None]:
    """Structured outputs from OpenAI's response_format, vLLM's structured_outputs, or vLLM's
    older guided_* fields (one of them), and (the field, the path errors name the value by)."""
    given = [f for f in ("response_format", "structured_outputs", *_GUIDED) if body.get(f) is not None
             and not (f == "response_format" and body[f] == {"type": "text"})]
    if body.get("guided_decoding_backend") not in (None, "auto", "xgrammar"):
        raise BadRequest(f"guided_decoding_backend must be 'auto' or 'xgrammar' (the one lockstep has), got "
                         f"{body['guided_decoding_backend']!r}", "guided_decoding_backend")
    if body.get("guided_whitespace_pattern") is not None:
        raise BadRequest("guided_whitespace_pattern is not supported (xgrammar takes none): leave it out; "
                         "structured_outputs.disable_any_whitespace allows no whitespace", "guided_whitespace_pattern")
    if not given:
        return None, None
    if len(given) > 1:
        raise BadRequest(f"give structured outputs once: {' and '.join(given)} were both given", given[1])
    name = given[0]
    v = body[name]
    try:
        if name == "response_format":
            kind = v.get("type") if isinstance(v, dict) else None
            if kind == "json_object" and set(v) == {"type"}:
                return StructuredOutputsParams(json_object=True), (name, name)
            if kind == "json_schema" and set(v) == {"type", "json_schema"}:
                js = v["json_schema"]
                if not isinstance(js, dict) or not isinstance(js.get("name"), str) or \
                        set(js) - {"name", "schema", "strict", "description"}:
                    raise BadRequest("response_format.json_schema must be an object with a name (a string) and "
                                     "optionally schema, strict and description", name)
                schema = js.get("schema", {})  # (OpenAI: no schema is any JSON object)
                if not isinstance(schema, dict):
                    raise BadRequest(f"response_format.json_schema.schema must be a JSON schema (an object), got "
                                     f"{type(schema).__name__}", name)
                return StructuredOutputsParams(json=schema or {"type": "object"}), \
                    (name, "response_format.json_schema.schema")
            raise BadRequest("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                             "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}, "
                             f"got {str(v)[:120]}", name)
        if name == "structured_outputs":
            if not isinstance(v, dict):
                raise BadRequest(f"structured_outputs must be an object, got {type(v).__name__}", name)
            fields = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}
            if set(v) - fields:
                raise BadRequest(f"structured_outputs: unknown field(s) {sorted(set(v) - fields)}; allowed: "
                                 f"{', '.join(sorted(fields))}", name)
            so = StructuredOutputsParams(**v)
            return so, (name, f"structured_outputs.{so.kind}")
        return StructuredOutputsParams(**{_GUIDED[name]: v}), (name, name)
    except RequestError as e:
        raise BadRequest(str(e) if name == "structured_outputs" else str(e).replace(
            e.field or "structured_outputs", name, 1), name) from None


def _logprobs(body: dict, chat: bool) -> int | None:
    """Completions: ``logprobs`` is the number of top tokens; chat: ``logprobs`` is a switch
    and ``top_logprobs`` the number."""
    if chat:
        on = _get(body, "logprobs", bool, False)
        k = _get(body, "top_logprobs", int, None)
        if k is not None and not on:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        n = (k or 0) if on else None
    else:
        n = _get(body, "logprobs", int, None)
    if n is not None and not 0 <= n <= 20:
        raise BadRequest(f"{'top_logprobs' if chat else 'logprobs'} must be in [0, 20], got {n}",
                         "top_logprobs" if chat else "logprobs")
    return n


def _prompt_logprobs(body: dict, echoed: int | None) -> int | None:
    """vLLM's prompt_logprobs (top k, 0 to 20), or echo with logprobs' k; the larger of both."""
    k = _get(body, "prompt_logprobs", int, None)
    if k is not None and not 0 <= k <= 20:
        raise BadRequest(f"prompt_logprobs must be in [0, 20], got {k}", "prompt_logprobs")
    return echoed if k is None else k if echoed is None else max(k, echoed)


def _prompts(p) -> tuple:
    if isinstance(p, str):
        return (p,)
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return tuple(p)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return (_ids(p),)
        if all(isinstance(x, list) for x in p):
            return tuple(_ids(x) for x in p)
    raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a list "
                     "of lists of token ids (and not empty)", "prompt")


def _ids(p: list) -> np.ndarray:
    if not p or not all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        raise BadRequest("a token-id prompt must be a non-empty list of integers", "prompt")
    try:
        arr = np.array(p, dtype=np.int64)
    except OverflowError:  # an id past 64 bits
        raise BadRequest("prompt token ids must be non-negative 32-bit integers", "prompt") from None
    if arr.min() < 0 or arr.max() >= 2**31:
        raise BadRequest("prompt token ids must be non-negative 32-bit integers", "prompt")
    return arr.astype(np.int32)


_MISSING = object()


def _get(body: dict, name: str, typ, default=_MISSING, *, required: bool = False):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        if required:
            raise BadRequest(f"{name} is required", name)
        return None if default is _MISSING else default
    if typ is int and (not isinstance(v, int) or isinstance(v, bool)):
        raise BadRequest(f"{name} must be an integer, got {v!r}", name)
    if typ is not int and not isinstance(v, typ):
        raise BadRequest(f"{name} must be a {typ.__name__}, got {v!r}", name)
    return v


def _num(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"{name} must be a number, got {v!r}", name)
    try:
        return float(v)
    except OverflowError:  # an integer past float range
        raise BadRequest(f"{name} must be a number in float range", name) from None


def _int(name: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise BadRequest(f"{name} must be an integer, got {v!r}", name)
    return v


def _logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's logit_bias: an object from token ids (JSON keys, so strings) to biases."""
    v = body.get("logit_bias")
    if not v:
        return None
    if not isinstance(v, dict):
        raise BadRequest(f"logit_bias must be an object from token ids to numbers, got {v!r}", "logit_bias")
    out = {}
    for key, b in v.items():
        try:
            t = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias keys must be token ids (integers), got {key!r}", "logit_bias") from None
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise BadRequest(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {key}",
                             "logit_bias")
        out[t] = float(b)
    return out


def _int_list(body: dict, name: str) -> list[int]:
    v = body.get(name)
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise BadRequest(f"{name} must be a list of integers", name)
    return v
