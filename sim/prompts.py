"""The workload's prompts as the simulator admits them: tokens, block hashes, and which
requests are private.

Prompt tokens come from the trace's segments (``segment_tokens``), materialized for the next
arrivals together: one numpy pass for many prompts instead of one per prompt. A request is
private (``Request.private_prefix``) when no block hash of its prompt and output appears in
any other request of the workload: its blocks then stay out of the block pool's table. That
needs every request's hashes before the first arrival, so with ``find_private`` prompts are
hashed ahead, once, together with their outputs, and their hashes (and, where the workload
fits in KEEP_PROMPT_TOKENS, their tokens) kept for admission.
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

import numpy as np

from lockstep.policy.hashing import BlockHasher

from .traces import TraceRequest, segment_tokens

PROMPT_BATCH = 64  # prompts materialized in one pass, up to this many tokens:
PROMPT_BATCH_TOKENS = 1 << 20
KEEP_PROMPT_TOKENS = 1 << 25  # up to this many in a workload, prompts hashed ahead are kept


class Prompts:
    def __init__(self, workload: Sequence[TraceRequest], hasher: BlockHasher, *, vocab_size: int, seed: int,
                 max_model_len: int):
        self.workload, self.hasher = workload, hasher
        self.vocab_size, self.seed, self.max_model_len = vocab_size, seed, max_model_len
        self._ready: dict[int, tuple] = {}  # rid -> (tokens, hashes, accumulator), ahead of arrival
        self._hashes: dict[int, tuple[np.ndarray, np.ndarray]] | None = None  # hashed ahead, no tokens
        self.private = [False] * len(workload)

    def too_long(self, w: TraceRequest) -> bool:
        return w.input_len + w.output_len > self.max_model_len

    def take(self, rid: int, upcoming: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, block hashes, chain accumulator) of a prompt; ``upcoming``: the next
        arrivals, from ``rid`` on, to materialize with it."""
        got = self._ready.pop(rid, None)
        if got is not None:
            return got
        batch = self._batch(upcoming, lambda r: r not in self._ready, PROMPT_BATCH)
        prompts = self._tokens(batch)
        if self._hashes is not None:  # hashed ahead (find_private)
            for (r, _, _), p in zip(batch, prompts):
                self._ready[r] = (p, *self._hashes.pop(r))
        else:
            for (r, _, _), p, (h, acc) in zip(batch, prompts, self.hasher.hash_prompts(prompts)):
                self._ready[r] = (p, h, acc)
        return self._ready.pop(rid)

    def find_private(self, out_tokens: np.ndarray, out_base: np.ndarray) -> None:
        """Which requests share no block hash with any other: every request's prompt and
        output (``out_tokens[out_base[r]:out_base[r + 1]]``) hashed ahead, and the lane-0
        keys (what the block pool's table is keyed by) of their first blocks counted over the
        whole workload. The first block's key stands for all of them: a block's hash chains
        every block before it and its position, so two requests that share any block share
        their first."""
        bs = self.hasher.block_size
        self._hashes = {}
        keep = sum(w.input_len for w in self.workload) <= KEEP_PROMPT_TOKENS
        keys, owners = [], []  # the first block's lane-0 key of each request that has one
        todo = list(range(len(self.workload)))
        while todo:
            batch = self._batch(todo, lambda r: True, PROMPT_BATCH)
            if not batch:
                break
            todo = todo[todo.index(batch[-1][0]) + 1 :]
            seqs = [np.concatenate([p, out_tokens[out_base.item(r) : out_base.item(r + 1)]])
                    for (r, _, _), p in zip(batch, self._tokens(batch))]
            at = [n // bs for _, _, n in batch]
            for (r, _, n), seq, (h, acc), a in zip(batch, seqs, self.hasher.hash_prompts(seqs, at), at):
                if keep:
                    self._ready[r] = (seq[:n], h[:a], acc)
                else:
                    self._hashes[r] = (h[:a], acc)
                if len(h):
                    keys.append(h.item(0, 0))
                    owners.append(r)
                else:  # no full block: nothing to share
                    self.private[r] = True
        if not keys:
            return
        lane0 = np.array(keys, dtype=np.uint64)
        _, where, counts = np.unique(lane0, return_inverse=True, return_counts=True)
        private = np.array(self.private, dtype=bool)
        private[owners] = counts[where] == 1
        self.private = private.tolist()

    def _batch(self, rids: Sequence[int], want: Callable[[int], bool], most: int) -> list[tuple]:
        """The next (rid, request, prompt length) of ``rids`` to materialize together: those
        ``want`` takes and no longer than the model's context, up to ``most`` of them and
        PROMPT_BATCH_TOKENS tokens (at least one)."""
        batch, total = [], 0
        for r in rids:
            w = self.workload[r]
            if not want(r) or self.too_long(w):
                continue
            n = w.input_len  # the sum of its segment lengths (TraceRequest checks it)
            if batch and (len(batch) == most or total + n > PROMPT_BATCH_TOKENS):
                break
            batch.append((r, w, n))
            total += n
        return batch

    def _tokens(self, batch: list[tuple]) -> list[np.ndarray]:
        flat = segment_tokens(np.concatenate([w.seg_ids for _, w, _ in batch]),
                              np.concatenate([w.seg_lens for _, w, _ in batch]),
                              vocab_size=self.vocab_size, seed=self.seed)
        ends = list(itertools.accumulate(n for _, _, n in batch))
        return [flat[e - n : e] for (_, _, n), e in zip(batch, ends)]
