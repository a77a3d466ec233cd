"""Output delivery: each step's tokens leave the Scheduler as arrays and land in one
``RequestStream`` per request, without ever blocking the Scheduler.

A stream is a buffer of deltas that the Scheduler appends to (``push``, never awaits) and
that the request's consumer drains, coalesced, at its own pace: a slow consumer slows only
itself. The consumer side also keeps the request's timings.
"""

from __future__ import annotations

import numpy as np
import trio

from lockstep.policy.request import FinishReason

_NO_TOKENS = np.zeros(0, dtype=np.int32)


class RequestStream:
    __slots__ = ("req_id", "num_prompt_tokens", "num_cached_tokens", "arrival", "scheduled_at",
                 "first_token_at", "finished_at", "_chunks", "_finish", "_error", "_wakeup", "_logprobs",
                 "abandoned", "_prompt_logprobs", "pushed_at", "prompt_ids", "prompt_text", "__weakref__")

    def __init__(self, req_id: int, num_prompt_tokens: int, arrival: float):
        self.req_id = req_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.arrival = arrival
        self.scheduled_at: float | None = None  # first step that computed any of it
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._chunks: list[np.ndarray] = []
        self._finish: FinishReason | None = None
        self._error: BaseException | None = None
        self._wakeup: trio.Event | None = None
        self._logprobs: list = []  # (logprob, (top ids, top logprobs) or None) per token
        # The consumer went away before the end. Set before its abort is sent, so a request
        # still on its way (tokenizing, or its Submit queued behind the abort) is dropped
        # where it arrives instead of running for nobody.
        self.abandoned = False
        self.prompt_ids = None  # the prompt's token ids, once tokenized (RequestOutput.prompt_token_ids)
        self.prompt_text = None  # a text prompt as given (RequestOutput.prompt)
        # Prompt logprobs (requests that asked): prompt index -> (token, logprob, top pairs);
        # a recompute after a preemption scores the prompt again: the first row stays.
        self._prompt_logprobs: dict | None = None
        self.pushed_at: float | None = None  # when the last tokens came

    # -- producer (the Scheduler): never blocks ---------------------------------------------------
    def push(self, tokens: np.ndarray, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
        self.pushed_at = now
        self._chunks.append(tokens)
        self._wake()

    def push_logprobs(self, logprob: float, top) -> None:
        self._logprobs.append((logprob, top))

    def take_logprobs(self) -> list:
        """The logprobs of the tokens the last ``next_delta`` returned (requests that asked)."""
        out, self._logprobs = self._logprobs, []
        return out

    def push_prompt_logprob(self, index: int, row: tuple) -> None:
        if self._prompt_logprobs is None:
            self._prompt_logprobs = {}
        self._prompt_logprobs.setdefault(index, row)

    def take_prompt_logprobs(self) -> list | None:
        """Every prompt token's row by index, the first one's (token, None, [], None); once."""
        got, self._prompt_logprobs = self._prompt_logprobs, None
        return None if got is None else [got[i] for i in sorted(got)]

    def finish(self, reason: FinishReason, now: float) -> None:
        if self._finish is None and self._error is None:
            self._finish, self.finished_at = reason, now
            self._wake()

    def fail(self, error: BaseException, now: float) -> None:
        if self._finish is None and self._error is None:
            self._error, self.finished_at = error, now
            self._wake()

    @property
    def done(self) -> bool:
        return self._finish is not None or self._error is not None

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

    # -- consumer -------------------------------------------------------------------------
    async def next_delta(self) -> tuple[np.ndarray, FinishReason | None]:
        """Every token pushed since the last call (at least one, unless the request ended),
        and the finish reason once it has. Raises the error a failed request ended with."""
        while not self._chunks and not self.done:
            self._wakeup = trio.Event()
            await self._wakeup.wait()
        chunks, self._chunks = self._chunks, []
        if self._error is not None and not chunks:
            raise self._error
        tokens = chunks[0] if len(chunks) == 1 else (np.concatenate(chunks) if chunks else _NO_TOKENS)
        return tokens, self._finish


def deliver(streams: dict[int, RequestStream], req_ids: np.ndarray, num_tokens: np.ndarray,
            token_ids: np.ndarray, finished: tuple, now: float) -> None:
    """Hand one step's outputs to their streams; forget the streams of finished requests."""
    offs = np.zeros(len(num_tokens) + 1, dtype=np.int64)
    np.cumsum(num_tokens, out=offs[1:])
    for i, rid in enumerate(req_ids.tolist()):
        s = streams.get(rid)
        if s is not None:
            s.push(token_ids[offs[i] : offs[i + 1]], now)
    for rid, reason in finished:
        s = streams.pop(rid, None)
        if s is not None:
            s.finish(reason, now)
