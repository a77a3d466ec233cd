"""OpenAI tool calling on the chat endpoint, as vLLM serves it without a model-specific parser:
``tool_choice`` "required" or a named function, enforced by structured outputs.

- A named function (``{"type": "function", "function": {"name": ...}}``): the answer is that
  function's arguments, constrained to its ``parameters`` schema, returned as one tool call
  (finish_reason "stop", as OpenAI's forced calls).
- "required": the answer is a (compact) JSON array of one or more ``{"name", "parameters"}`` objects,
  each a listed function with its schema (one at most with ``parallel_tool_calls: false``),
  returned as tool calls (finish_reason "tool_calls").
- "none" (or no tools): a plain answer; the tools still reach the chat template.
- "auto" needs a parser of the model's own tool-call format; there is none, so it is refused
  by name (vLLM refuses it too unless started with a parser), with what to use instead.

The tools go to the chat template as ``tools`` (Hugging Face's convention); earlier turns'
``tool_calls`` and tool results reach it as given.
"""

from __future__ import annotations

import json
import re
import secrets

from lockstep.policy.request import StructuredOutputsParams

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ToolError(ValueError):
    """A tools field that cannot be served (the parser turns it into a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def parse_tools(body: dict, auto: bool = False) -> tuple[list[dict] | None, str | None, bool]:
    """(the tools for the template, the choice: None (plain answers), "required", "auto" (with
    ``auto``: the server parses the model's own calls) or a function's name, whether
    parallel calls are allowed)."""
    choice, parallel = body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(f"parallel_tool_calls must be a bool, got {parallel!r}", "parallel_tool_calls")
    tools = check_tools(body.get("tools"))
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice needs tools: give the functions in tools", "tool_choice")
        return None, None, parallel is not False
    names = [t["function"]["name"] for t in tools]
    if (choice is None or choice == "auto") and auto:
        return tools, "auto", parallel is not False
    if choice is None or choice == "auto":
        raise ToolError('tool_choice "auto" (the default with tools) needs a parser of the model\'s own tool-call '
                        'format (lockstep serve --enable-auto-tool-choice --tool-call-parser NAME), which this '
                        'server was not started with: ask for "required", a named function '
                        '({"type": "function", "function": {"name": ...}}) or "none"', "tool_choice")
    if choice == "none":
        return tools, None, parallel is not False
    if choice == "required":
        return tools, "required", parallel is not False
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(fn, dict)
            and isinstance(fn.get("name"), str)):
        raise ToolError('tool_choice must be "none", "required" or {"type": "function", "function": {"name": ...}}, '
                        f"got {str(choice)[:120]}", "tool_choice")
    if fn["name"] not in names:
        raise ToolError(f"tool_choice names function {fn['name']!r}, which is not among tools ({', '.join(names)})",
                        "tool_choice")
    return tools, fn["name"], parallel is not False


def check_tools(tools) -> list[dict] | None:
    """``tools`` checked (None where none are given)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or len(tools) > 128:
        raise ToolError("tools must be a list of at most 128 functions", "tools")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) or set(t) - {
                "type", "function"}:
            raise ToolError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., ...}}}}', "tools")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ToolError(f"tools[{i}].function: unknown field(s) {sorted(unknown)}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}", "tools")
        if name in names:
            raise ToolError(f"tools[{i}].function.name {name!r} is given twice", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
        if not isinstance(fn.get("description", ""), str):
            raise ToolError(f"tools[{i}].function.description must be a string", "tools")
        names.append(name)
    return tools


def _parameters(tool: dict) -> dict:
    # (OpenAI's: a function without parameters takes none)
    return tool["function"].get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}


def tool_structured_outputs(tools: list[dict], choice: str, parallel: bool) -> StructuredOutputsParams:
    """The grammar a choice puts on the answer (vLLM's schemas), as compact JSON (the calls are
    read by programs: whitespace between tokens would only cost tokens, and a model stuck
    on it would fill max_tokens)."""
    if choice != "required":
        tool = next(t for t in tools if t["function"]["name"] == choice)
        return StructuredOutputsParams(json=_parameters(tool), disable_any_whitespace=True)
    items = {"anyOf": [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [t["function"]["name"]]}, "parameters": _parameters(t)},
        "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}
    schema = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def call_id() -> str:
    return "chatcmpl-tool-" + secrets.token_hex(12)  # (vLLM's form)


def tool_calls(text: str, choice: str) -> list[dict]:
    """The tool calls an answer holds: a named function's text is its call's arguments (cut at
    max_tokens too, as vLLM's); a "required" answer's JSON array of calls, and where it was
    cut at max_tokens its whole calls, then the one it was cut in if its name came whole,
    with its arguments as far as they came (``_cut_calls``)."""
    if choice != "required":
        return [{"id": call_id(), "type": "function", "function": {"name": choice, "arguments": text.strip()}}]
    try:
        value = json.loads(text, strict=False)  # (control characters in strings: the grammar's, not the client's)
    except ValueError:
        calls = _cut_calls(text)
    else:
        calls = [(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in value] \
            if isinstance(value, list) and all(isinstance(c, dict) and "name" in c for c in value) else []
    return [{"id": call_id(), "type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]


_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*')


def _cut_calls(text: str) -> list[tuple[str, str]]:
    """(name, arguments) of a "required" answer cut short: ``[{"name": ..., "parameters": ...}, {"na``."""
    dec, s = json.JSONDecoder(strict=False), text.strip()
    if not s.startswith("["):
        return []
    out, i = [], 1
    while True:
        while i < len(s) and s[i] in " \t\r\n,":
            i += 1
        if i >= len(s) or s[i] == "]":
            return out
        try:
            value, i = dec.raw_decode(s, i)
        except ValueError:  # the call it was cut in
            m = _CALL_HEAD.match(s, i)
            if m is not None:
                out.append((json.loads(f'"{m[1]}"'), s[m.end():]))
            return out
        if not (isinstance(value, dict) and "name" in value):
            return out
        out.append((value["name"], json.dumps(value.get("parameters", {}), ensure_ascii=False)))


class ToolStream:
    """A streamed choice's deltas as tool calls: a named function's arguments stream as they
    come (the first delta carries its id and name); "required" answers arrive whole, as one
    delta at the end (their JSON must be complete to split into calls)."""

    def __init__(self, choice: str):
        self.choice, self.started, self.text = choice, False, []

    def delta(self, text: str, finished: bool) -> dict | None:
        """The chat delta for this piece of text (None: nothing to send yet)."""
        if self.choice != "required":
            if not text:  # (a call starts with its first text: none, no call)
                return None
            if self.started:
                return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
            self.started = True
            return {"tool_calls": [{"index": 0, "id": call_id(), "type": "function",
                                    "function": {"name": self.choice, "arguments": text}}]}
        self.text.append(text)
        if not finished:
            return None
        calls = tool_calls("".join(self.text), "required")  # (cut at max_tokens: its whole calls and the last's start)
        return {"tool_calls": [dict(c, index=i) for i, c in enumerate(calls)]} if calls else None
