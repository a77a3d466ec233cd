"""Reasoning models' thinking apart from their answer (vLLM's ``--reasoning-parser``): the
chat response's ``reasoning_content`` and ``content``.

``deepseek_r1``, as vLLM's parser of that name: the answer starts thinking (DeepSeek-R1's
template opens ``<think>`` in the prompt; a ``<think>`` the model writes at the start is
dropped), everything before ``</think>`` is reasoning and everything after it the answer;
an answer that never closes its thinking is all reasoning (content null, as is an empty
answer after it). Streamed, a piece
of text that may be the start of a marker is held until the next one says whether it is.
"""

from __future__ import annotations

PARSERS = ("deepseek_r1",)
_OPEN, _CLOSE = "<think>", "</think>"
THINK_END = _CLOSE  # (structured outputs apply after it)


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may begin ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ThinkSplitter:
    """One choice's text, split as it streams: ``feed`` returns (reasoning, content) pieces;
    ``closed``: the prompt closed the thinking already (all is content)."""

    def __init__(self, closed: bool = False):
        self.started = closed  # past a leading <think> (or sure there is none)
        self.thinking = not closed
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        buf, self._held = self._held + text, ""
        if not self.thinking:
            return "", buf
        if not self.started:
            if not final and len(buf) < len(_OPEN) and _OPEN.startswith(buf):
                self._held = buf  # (may still be a leading <think>)
                return "", ""
            self.started = True
            if buf.startswith(_OPEN):
                buf = buf[len(_OPEN):]
        at = buf.find(_CLOSE)
        if at >= 0:
            self.thinking = False
            return buf[:at], buf[at + len(_CLOSE):]
        keep = 0 if final else held_back(buf, _CLOSE)
        if keep:
            buf, self._held = buf[:-keep], buf[-keep:]
        return buf, ""


def thinking_closed(tokenizer, prompt_ids) -> bool:
    """Whether the prompt itself closes the thinking (DeepSeek-V3.1's template with thinking
    off ends with ``</think>``; Qwen3's with enable_thinking false writes an empty one): its
    last ``</think>`` comes after its last ``<think>``, as vLLM's parsers read the prompt."""
    ids = [int(t) for t in prompt_ids]

    def last(marker: str) -> int:
        m = [int(t) for t in tokenizer.encode(marker)]
        return max((i for i in range(len(ids) - len(m) + 1) if ids[i:i + len(m)] == m), default=-1)

    end = last(_CLOSE)
    return end >= 0 and end > last(_OPEN)


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """A whole answer's (reasoning_content, content): None for a part it has none of (content
    is None where the thinking never closed)."""
    s = ThinkSplitter()
    reasoning, content = s.feed(text, final=True)
    return reasoning or None, content or None  # (vLLM's: nothing after </think> is null too)
