"""tool_choice "auto": a model's own tool-call format read back from its answer (vLLM's
``--enable-auto-tool-choice --tool-call-parser``).

``deepseek_v3``: DeepSeek-V3's and V3.1's special-token format. The calls follow the answer's
text (its ``content``) between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``, each
``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`` holding either (V3, R1)
``function<｜tool▁sep｜>NAME`` + a fenced JSON block of the arguments, or (V3.1)
``NAME<｜tool▁sep｜>ARGUMENTS``. The markers are special tokens, so such requests are
detokenized with them (skip_special_tokens false). Streamed, text that may begin the first
marker is held until the next piece says whether it does, and each call goes out as one
delta once its end marker has come.
"""

from __future__ import annotations

import re

from .openai_reasoning import held_back
from .openai_tools import call_id

PARSERS = ("deepseek_v3",)
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(re.escape(CALL_BEGIN) + "(.*?)" + re.escape(CALL_END), re.DOTALL)
_FENCED = re.compile(r"(?P<name>.*?)\n```(?:json)?\n(?P<args>.*)\n```\s*$", re.DOTALL)


def _call(body: str) -> dict | None:
    """One call block's (between its markers) tool call, or None where it is malformed."""
    left, sep, right = body.partition(SEP)
    if not sep:
        return None
    fenced = _FENCED.match(right)
    name, args = (fenced["name"], fenced["args"]) if fenced else (left, right)
    name = name.strip()
    if not name:
        return None
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args.strip()}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """A whole answer's (content, tool calls): no calls where it has no calls marker."""
    at = text.find(CALLS_BEGIN)
    if at < 0:
        return text, []
    calls = [c for c in (_call(m) for m in _CALL.findall(text, at)) if c is not None]
    if not calls:  # a marker and nothing readable after it: the text as it is
        return text, []
    content = text[:at]
    return (content if content.strip() else None), calls


class AutoToolStream:
    """One streamed choice: content deltas until the calls begin, then one tool-call delta
    per complete call."""

    def __init__(self):
        self.in_calls = False
        self._buf = ""
        self.n = 0  # calls sent

    def delta(self, text: str, finished: bool) -> dict | None:
        self._buf += text
        out: dict = {}
        if not self.in_calls:
            at = self._buf.find(CALLS_BEGIN)
            if at < 0:
                keep = 0 if finished else held_back(self._buf, CALLS_BEGIN)
                content, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return {"content": content} if content else None
            if at:
                out["content"] = self._buf[:at]
            self.in_calls, self._buf = True, self._buf[at + len(CALLS_BEGIN):]
        calls = []
        while (m := _CALL.search(self._buf)) is not None:
            call = _call(m[1])
            self._buf = self._buf[m.end():]
            if call is not None:
                calls.append(dict(call, index=self.n))
                self.n += 1
        if calls:
            out["tool_calls"] = calls
        return out or None
