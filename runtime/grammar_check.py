"""Structured outputs at intake: a request's grammar (JSON schema, regex, choice, EBNF) is
checked when the request is made (``check``: xgrammar parses it, no tokenizer needed, no
torch), so a bad one is a RequestError naming the field where it was typed, not a runtime's
failure; and written as xgrammar should compile it (``prepare_schema``, ``choice_ebnf``).
The runtime's matchers are ``lockstep.runtime.grammar``'s.
"""

from __future__ import annotations

import functools
import json
import re

from lockstep.policy.request import RequestError


def load_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        if e.name == "xgrammar":
            raise RequestError("structured_outputs need the xgrammar package, which is not installed: "
                               "pip install xgrammar", field="structured_outputs") from None
        # (installed, but something it needs is not: say what, not "install xgrammar")
        raise RequestError(f"structured_outputs need the xgrammar package, which did not import: {e} "
                           f"(pip install xgrammar installs what it needs)", field="structured_outputs") from None
    return xgrammar


def xgrammar_message(e: Exception) -> str:
    """xgrammar's error without its '[time] /project/cpp/file.cc:123: ' prefix."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip()).strip()


def choice_ebnf(choices: list[str]) -> str:
    # (JSON string literals are EBNF string literals: the same escapes)
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


# JSON Schema keywords xgrammar 0.2.9 drops without a word (it compiles the schema as if they
# were not there): a schema using one is refused, since its output would not be held to it
# (vLLM falls back to another backend for most of them).
_IGNORED = ("multipleOf", "uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
            "dependentRequired", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems")
# A JSON string's characters as a pattern: xgrammar 0.2.9 writes a string with minLength or
# maxLength as a rule that lets raw control characters through (not JSON); its pattern rule
# keeps them escaped, so such strings become this pattern with their bounds.
_JSON_CHARS = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'


_NAMED = ("properties", "$defs", "definitions", "patternProperties")  # maps from names to schemas
_DATA = ("enum", "const", "default", "examples", "required", "description", "title")  # values, not schemas


def _ignored(node, path: str = "") -> str | None:
    """The first keyword xgrammar would ignore in a schema, with its path, or None."""
    if isinstance(node, list):
        return next((f for i, v in enumerate(node) if (f := _ignored(v, f"{path}/{i}"))), None)
    if not isinstance(node, dict):
        return None
    for key, value in node.items():
        if key in _IGNORED and not (key == "uniqueItems" and value is False):
            return f"{key!r} (at {path or '/'})"
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            return f"'allOf' with {len(value)} schemas (at {path or '/'})"
        if key in _DATA:
            continue
        if key in _NAMED and isinstance(value, dict):
            found = next((f for name, v in value.items() if (f := _ignored(v, f"{path}/{key}/{name}"))), None)
        else:
            found = _ignored(value, f"{path}/{key}")
        if found:
            return found
    return None


def _bounded_strings(node):
    """The schema with each string's minLength / maxLength as a pattern (see _JSON_CHARS)."""
    if isinstance(node, list):
        return [_bounded_strings(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _bounded_strings(v) for k, v in node.items()}
    if node.get("type") == "string" and ("minLength" in node or "maxLength" in node) and not (
            {"pattern", "format", "enum", "const"} & set(node)):
        lo, hi = int(node.pop("minLength", 0)), node.pop("maxLength", None)
        node["pattern"] = f"^{_JSON_CHARS}{{{lo},{'' if hi is None else int(hi)}}}$"
    return node


def prepare_schema(text: str) -> str:
    """A JSON schema's text as xgrammar should compile it (strings' length bounds as patterns)."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text  # (xgrammar names what is wrong with it)
    return json.dumps(_bounded_strings(schema))


@functools.lru_cache(maxsize=256)
def check(kind: str, text: str, whitespace: str) -> None:
    """Raise RequestError (naming ``structured_outputs.<kind>``) where xgrammar cannot read
    this grammar. (Cached: clients send the same schema again and again.)"""
    xgr = load_xgrammar()
    try:
        if kind == "json":
            try:
                ignored = _ignored(json.loads(text))
            except ValueError as e:
                raise RequestError(f"structured_outputs.json: not valid JSON: {e}", field="structured_outputs.json") \
                    from None
            if ignored:
                raise RequestError(f"structured_outputs.json: the schema uses {ignored}, which xgrammar does not "
                                   "enforce (the output would not be held to it): leave it out",
                                   field="structured_outputs.json")
            xgr.Grammar.from_json_schema(prepare_schema(text), any_whitespace=whitespace == "any")
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(text)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(json.loads(text)))
        elif kind != "json_object":
            raise RequestError(f"structured_outputs: unknown kind {kind!r}", field="structured_outputs")
    except RequestError:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar's RuntimeError / InvalidJSONError: the user's input
        what = {"json": "a JSON schema", "regex": "a regular expression", "grammar": "an EBNF grammar",
                "choice": "a choice"}[kind]
        raise RequestError(f"structured_outputs.{kind}: not {what} xgrammar can use: {xgrammar_message(e)}",
                           field=f"structured_outputs.{kind}") from None
