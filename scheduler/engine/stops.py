"""Stop conditions applied where a request's tokens are read (``Engine.generate``): stop
token ids and stop strings, as vLLM applies them, with ``min_tokens`` holding both off."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def cut_at_stop_ids(tokens: np.ndarray, stops: set[int], skip: int = 0) -> tuple[np.ndarray, bool]:
    """``tokens`` up to the first stop id past the first ``skip`` (min_tokens not reached)."""
    hits = np.flatnonzero(np.isin(tokens, list(stops))) if stops else ()
    hits = [h for h in hits.tolist() if h >= skip] if len(hits) else ()
    if hits:
        return tokens[: hits[0] + 1], True
    return tokens, False


def feed_stop_strings(cut: StopStrings, detok, tokens: np.ndarray, final: bool,
                       skip: int = 0) -> tuple[str, int | None]:
    """A delta's text through ``cut`` one token at a time: (text, how many of the tokens to
    keep where a stop string completed in them, else None), as vLLM, which checks after each
    token, reports the tokens and their usage. No stop string ends the output in the first
    ``skip`` tokens (min_tokens not reached), as in vLLM."""
    out = []
    for k, t in enumerate(tokens.tolist()):
        piece, hit = cut.feed(detok.push([t]), armed=k >= skip)
        out.append(piece)
        if hit:
            return "".join(out), k + 1
    if final:
        piece, hit = cut.feed(detok.finish(), final=True, armed=len(tokens) > skip)
        out.append(piece)
        if hit:
            return "".join(out), len(tokens)
    return "".join(out), None


class StopStrings:
    """Stop strings over streamed text, as vLLM applies them: generation stops where the first
    stop string is complete (of two ending together, the longer), cut at its start, and the
    stop string itself is not returned (as in OpenAI's API; with ``include``, vLLM's
    include_stop_str_in_output, it is). The last (longest - 1)
    characters are held back until what follows shows no stop string starts in them, so a
    stop string spanning deltas is never partly returned, and the text returned is the
    same however the output was split into deltas."""

    def __init__(self, stops: Sequence[str], include: bool = False):
        self.stops, self.include = tuple(stops), include
        self.hold = max(len(s) for s in self.stops) - 1
        self.held = ""
        self.matched: str | None = None  # the stop string that ended the output

    def feed(self, text: str, final: bool = False, armed: bool = True) -> tuple[str, bool]:
        """The text to return now, and whether a stop string ended the output: one that ends
        in ``text`` (the held text was searched when it came), and only when ``armed``."""
        held = len(self.held)
        text, self.held = self.held + text, ""
        found = [(i + len(s), i, s) for s in (self.stops if armed else ())
                 for i in (text.find(s, max(held - len(s) + 1, 0)),) if i >= 0]
        if found:
            end, start, self.matched = min(found)
            return text[: end if self.include else start], True
        keep = 0 if final else min(self.hold, len(text))
        text, self.held = text[: len(text) - keep], text[len(text) - keep :]
        return text, False
