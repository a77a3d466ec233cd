"""The Frontend actor: turns submissions into Requests (tokenize, check, hash) and hands
them to the Scheduler.

Tokenizing and hashing a long prompt costs milliseconds, so it runs in a worker thread
(``tokenizers`` and numpy release the GIL) and never in the Scheduler's task. A prompt that
cannot be served fails its stream with a ``RequestError`` naming the field; nothing of it is
queued.
"""

from __future__ import annotations

import attrs
import numpy as np
import trio

from lockstep.policy.hashing import BlockHasher
from lockstep.policy.request import FinishReason, Request, RequestError, SamplingParams
from lockstep.policy.router import PrefixAffinityRouter

from .output import RequestStream
from .scheduler import Submit


@attrs.frozen
class Prompt:
    req_id: int
    prompt: object  # str, or a 1-D int32 array of token ids
    params: SamplingParams
    stream: RequestStream
    priority: int = 0
    cache_salt: str | None = None


class Frontend:
    """With several DP ranks, it also picks each request's rank: least loaded, with prefix
    affinity (the rank whose cache already holds the prompt's leading blocks)."""

    def __init__(self, tokenizer, hasher: BlockHasher, schedulers: list,
                 *, max_model_len: int, vocab_size: int, eos_token_id: int, mailbox_size: int = 256):
        self.tokenizer, self.hasher = tokenizer, hasher
        self.schedulers = schedulers
        self.router = PrefixAffinityRouter()
        self.rank_of: dict[int, int] = {}  # request id -> rank, while the request lives
        self.max_model_len, self.vocab_size, self.eos = max_model_len, vocab_size, eos_token_id
        self.send_channel, self._inbox = trio.open_memory_channel(mailbox_size)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        msg = None
        async with self._inbox:
            try:
                async for msg in self._inbox:
                    match msg:
                        case Prompt():
                            await self._admit(msg)
                        case _:
                            raise TypeError(f"Frontend got an unknown message {msg!r}")
                    # handed on: not held here (Engine._made would keep its request id taken)
                    msg = None
            finally:  # the engine is stopping: the prompt being admitted and those queued end too
                error, now = RuntimeError("the engine shut down"), trio.current_time()
                if isinstance(msg, Prompt):
                    msg.stream.fail(error, now)  # no-op where it was handed on and finished
                while True:
                    try:
                        queued = self._inbox.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                    if isinstance(queued, Prompt):
                        queued.stream.fail(error, now)

    async def _admit(self, p: Prompt) -> None:
        if p.stream.abandoned:  # aborted while it waited here: not worth tokenizing
            p.stream.finish(FinishReason.ABORT, trio.current_time())
            return
        try:
            tokens, hashes, acc = await trio.to_thread.run_sync(self._prepare, p)
            p = fill_max_tokens(p, len(tokens), self.max_model_len)
        except RequestError as e:
            p.stream.fail(e, trio.current_time())
            return
        if p.stream.abandoned:  # its consumer left while it was tokenized and hashed
            p.stream.finish(FinishReason.ABORT, trio.current_time())
            return
        p.stream.num_prompt_tokens = len(tokens)
        p.stream.prompt_ids = tokens
        req = Request(id=p.req_id, prompt=tokens, params=p.params, arrival_time=p.stream.arrival,
                      priority=p.priority, block_hashes=hashes, hash_acc=acc,
                      cache_salt=p.cache_salt, eos_token_id=self.eos)
        rank = self._route(hashes)
        self.rank_of[p.req_id] = rank
        self.schedulers[rank].inbound += req.prompt_len  # the rank takes it off when it takes the request
        await self.schedulers[rank].send_channel.send(Submit(req, p.stream))

    def _route(self, hashes) -> int:
        """The rank for a prompt: by its ranks' loads counting what was routed to them and
        is not in their cores yet (a burst routed on the cores' loads alone goes to one rank)."""
        if len(self.schedulers) == 1:
            return 0
        # Ranks being restarted (a runtime died, a DEP group waits for a node) take nothing
        # new while others can: their fresh cores would look idle and attract everything.
        up = [i for i, s in enumerate(self.schedulers) if not s.down] or list(range(len(self.schedulers)))
        pick = self.router.choose(hashes, [self.schedulers[i].core.pool for i in up],
                                  [self.schedulers[i].core.load() + self.schedulers[i].inbound for i in up])
        return up[pick]

    def _prepare(self, p: Prompt):
        if isinstance(p.prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt: this engine has no tokenizer; pass token ids", field="prompt")
            tokens = truncated(np.asarray(self.tokenizer.encode(p.prompt, add_bos=self.tokenizer.add_bos),
                                          dtype=np.int32), p.params, self.max_model_len)
        else:
            tokens = p.prompt
        check_prompt(tokens, p.params, self.max_model_len, self.vocab_size, check_ids=False, eos_token_id=self.eos)
        # The token ids' range is checked inside the hashing pass: no extra pass over the prompt.
        hashes, acc = self.hasher.hash_prompt(tokens, p.cache_salt, vocab_size=self.vocab_size)
        return tokens, hashes, acc


_PROMPT_KEYS = ({"prompt"}, {"prompt_token_ids"})  # vLLM's TextPrompt and TokensPrompt


def as_token_array(prompt) -> object:
    """A text prompt stays text; token ids become a 1-D int32 array (checked: ids outside
    int32 are refused, not wrapped). A dict is vLLM's ``{"prompt": text}`` or
    ``{"prompt_token_ids": ids}`` (``Engine.generate`` takes its ``cache_salt`` first)."""
    if isinstance(prompt, dict):
        if set(prompt) not in _PROMPT_KEYS:
            raise RequestError(f"a dict prompt holds 'prompt' (text) or 'prompt_token_ids' (and may hold "
                               f"'cache_salt'), got keys "
                               f"{sorted(map(str, prompt))}", field="prompt")
        text = prompt.get("prompt")
        if "prompt" in prompt and not isinstance(text, str):
            raise RequestError(f"prompt['prompt'] must be a string, got {type(text).__name__}", field="prompt")
        return text if text is not None else as_token_array(prompt["prompt_token_ids"])
    if isinstance(prompt, str):
        return prompt
    try:
        arr = np.asarray(prompt)
    except (ValueError, TypeError) as e:  # ragged nesting, and the like
        raise RequestError(f"prompt must be a string or a 1-D sequence of integer token ids: {e}",
                           field="prompt") from None
    if arr.ndim == 1 and arr.size == 0:  # [] is float64 to numpy: say what is wrong with it
        raise RequestError("prompt must hold at least one token", field="prompt")
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        what = (f"{type(prompt).__name__} of shape {arr.shape} and dtype {arr.dtype}"
                if isinstance(prompt, (np.ndarray, list, tuple)) else f"a {type(prompt).__name__}")
        raise RequestError(f"prompt must be a string, a dict of vLLM's ('prompt' or 'prompt_token_ids') or a 1-D "
                           f"sequence of integer token ids, got {what}", field="prompt")
    if arr.dtype != np.int32:  # wider ids must not wrap into range
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > np.iinfo(np.int32).max:
            raise RequestError(f"prompt token ids must be in [0, 2**31 - 1], got {lo if lo < 0 else hi}",
                               field="prompt")
    return arr.astype(np.int32, copy=False)


def fill_max_tokens(p: Prompt, prompt_len: int, max_model_len: int) -> Prompt:
    """max_tokens None: what the context leaves after the prompt (vLLM's), at least min_tokens."""
    if p.params.max_tokens is not None:
        return p
    room = max_model_len - prompt_len
    if room < max(p.params.min_tokens, 1):
        raise RequestError(f"prompt ({_tokens(prompt_len)}) leaves {room} of the model's context of {max_model_len} "
                           f"tokens, fewer than min_tokens ({p.params.min_tokens})", reason="context_length",
                           field="min_tokens")
    return attrs.evolve(p, params=attrs.evolve(p.params, max_tokens=room))


def _tokens(n: int) -> str:
    return "1 token" if n == 1 else f"{n} tokens"


def truncated(tokens: np.ndarray, params: SamplingParams, max_model_len: int) -> np.ndarray:
    """The prompt's last ``truncate_prompt_tokens`` tokens (-1: as many as leave the context
    room for max_tokens, or for one token), as vLLM keeps them."""
    k = params.truncate_prompt_tokens
    if k is None:
        return tokens
    if k == -1:
        k = max(max_model_len - (params.max_tokens or 1), 1)
    return tokens[-k:] if len(tokens) > k else tokens


def check_prompt(tokens: np.ndarray, params: SamplingParams, max_model_len: int, vocab_size: int, *,
                 check_ids: bool = True, eos_token_id: int = -1) -> None:
    params.check_vocab(vocab_size, eos_token_id)
    if len(tokens) == 0:
        raise RequestError("prompt must hold at least one token", field="prompt")
    if len(tokens) >= max_model_len:  # whatever max_tokens says (a server may have filled it in)
        raise RequestError(f"prompt ({_tokens(len(tokens))}) leaves no room for output in the model's context "
                           f"of {max_model_len} tokens", reason="context_length", field="prompt")
    if params.max_tokens is not None and len(tokens) + params.max_tokens > max_model_len:
        raise RequestError(f"prompt ({_tokens(len(tokens))}) + max_tokens ({params.max_tokens}) exceeds "
                           f"the model's context of {max_model_len} tokens", reason="context_length",
                           field="max_tokens")
    if not check_ids:
        return
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        raise RequestError(f"prompt token ids must be in [0, {vocab_size}), got one of {lo if lo < 0 else hi}",
                           field="prompt")
