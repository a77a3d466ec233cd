"""Logits processing before sampling, per request, as vLLM's: a structured output's grammar
(``lockstep.runtime.grammar``), allowed_token_ids, logit_bias, min_tokens, the repetition,
frequency and presence penalties, and min_p, in that order (``LogitsRules``, sent with
``NewRequests``). A request's allowed ids and biases go to the
device once, when it arrives; a step gathers those of its rows.

Penalties count a request's output tokens, per slot, in a (slots, vocab) table on the
runtime's device: a sampled token is counted there right after it is drawn (the next step,
which a fast runtime launches before this one's tokens reach the host, sees it), and its
id and output index are kept on the host once they arrive. A slot's row is rebuilt from
that record (and the prompt's ids, for a repetition penalty) whenever the slot holds
another request than the row counts for, or its request was dropped by the core
(preempted: readmitted, it may sit elsewhere); the output tokens a plan feeds (a
recompute's, a P/D decode side's first token) are counted unless the record has them.

The logits a request's logprobs are read from stay the model's: processing works on a copy.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import torch

from lockstep.policy.step import PLACEHOLDER, StepPlan

from .base import LogitsRules
from .models.batch import to_device


def _counts(r: LogitsRules) -> bool:
    return bool(r.presence_penalty or r.frequency_penalty or r.repetition_penalty != 1)


def grammar_only(r: LogitsRules) -> bool:
    """Whether the rules hold a structured output and nothing else (what speculative decoding runs)."""
    return not (_counts(r) or r.min_p or r.min_tokens or r.bias_ids or r.allowed)


def penalize_torch(x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                   seen: torch.Tensor, params: torch.Tensor) -> None:
    """The penalties on rows ``rows`` of ``x``, in place, from slot ``slots[i]``'s output counts
    and prompt marks, with ``params[i]`` = (repetition, frequency, presence): a token seen has a
    positive logit divided by the repetition penalty and a negative one multiplied; an output
    token loses frequency x its count and presence once. (On CUDA ``kernels.penalties`` does
    the same in one pass.)"""
    rep, freq, pres = params.to(x.dtype).T[:, :, None]
    n = counts[slots]
    used = n > 0
    y = x[rows]
    y = torch.where(used | seen[slots], torch.where(y > 0, y / rep, y * rep), y)
    x[rows] = y - freq * n - pres * used


class Pending:
    """The counted rows of one step's samples, until their ids reach the host."""

    __slots__ = ("rows", "slots", "rids", "index", "guided")

    def __init__(self, rows: list[int], slots: list[int], rids: list[int], index: list[int],
                 guided: list[tuple[int, int, int]] = ()):
        self.rows, self.slots, self.rids, self.index = rows, slots, rids, index
        self.guided = guided  # (row, request, output index) of structured outputs' rows


class LogitsProcessors:
    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device, grammar_info=None):
        """``grammar_info``: makes xgrammar's TokenizerInfo of the model (structured outputs)."""
        self.max_num_seqs, self.vocab, self.device = max_num_seqs, vocab_size, device
        self._grammar_info = grammar_info
        self.grammars = None  # lockstep.runtime.grammar.Grammars, made for the first guided request
        self.rules: dict[int, LogitsRules] = {}
        self.prompts: dict[int, bytes] = {}  # rid -> its prompt's int32 ids (a repetition penalty's)
        self.record: dict[int, np.ndarray] = {}  # rid -> its output ids by index (-1: not seen), counted ones
        self.last: dict[int, int] = {}  # rid -> the highest index its record holds (-1: none)
        self.owner = np.full(max_num_seqs, -1, np.int64)  # the request each row counts for
        self.counts: torch.Tensor | None = None  # (slots, vocab) int32, made for the first counted request
        self.seen: torch.Tensor | None = None  # (slots, vocab) bool: the prompt's ids (repetition penalty)
        self.bias: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # rid -> (ids, biases) on the device
        self.allowed: dict[int, torch.Tensor] = {}  # rid -> its allowed ids on the device
        # The last step's gathered (row, id[, bias]) tensors, by the (row, request) pairs they
        # came from: a steady decode batch reuses them instead of gathering 256 tensors a step.
        self._gathered: dict[str, tuple] = {}

    def __bool__(self) -> bool:
        return bool(self.rules)

    def add(self, rid: int, rules: LogitsRules | None, prompt: bytes = b"") -> None:
        """``prompt``: its int32 ids, which a repetition penalty counts."""
        if rules is None:
            return
        if rules.suppress and max(rules.suppress) >= self.vocab:  # ids it can never draw anyway
            rules = msgspec.structs.replace(rules, suppress=[t for t in rules.suppress if 0 <= t < self.vocab])
        self.rules[rid] = rules
        if rules.grammar:
            if self.grammars is None:
                if self._grammar_info is None:
                    raise ValueError(f"request {rid}: structured outputs need the model's vocabulary, and this "
                                     "runtime was given none")
                from .grammar import Grammars

                self.grammars = Grammars(self._grammar_info, self.vocab, self.max_num_seqs)
            self.grammars.add(rid, list(rules.grammar), list(rules.grammar_after))
        if rules.bias_ids:
            keep = [(t, b) for t, b in zip(rules.bias_ids, rules.bias) if 0 <= t < self.vocab]
            self.bias[rid] = (to_device(np.array([t for t, _ in keep], np.int64), self.device),
                              to_device(np.array([b for _, b in keep], np.float32), self.device))
        if rules.allowed:
            self.allowed[rid] = to_device(np.unique(np.array(rules.allowed, np.int64)), self.device)
        if rules.repetition_penalty != 1:
            self.prompts[rid] = prompt
        if _counts(rules):
            self.record[rid] = np.full(16, -1, np.int32)
            self.last[rid] = -1
            if self.counts is None:
                self.counts = torch.zeros((self.max_num_seqs, self.vocab), dtype=torch.int32, device=self.device)
                self.seen = torch.zeros((self.max_num_seqs, self.vocab), dtype=torch.bool, device=self.device)

    def forget(self, rids) -> None:
        for rid in rids:
            if self.rules.pop(rid, None) is not None:
                self.record.pop(rid, None)
                self.last.pop(rid, None)
                self.prompts.pop(rid, None)
                self.bias.pop(rid, None)
                self.allowed.pop(rid, None)
                if self.grammars is not None:
                    self.grammars.forget(rid)
                self._gathered.clear()  # (keyed by request ids: none may outlive its request)
                self.owner[self.owner == rid] = -1

    def apply(self, plan: StepPlan, logits: torch.Tensor, positions: np.ndarray,
              temperature: np.ndarray) -> tuple[torch.Tensor, Pending | None]:
        """The logits to sample from (rows: the plan's sampled entries, in order;
        ``positions``: each one's last fed position) and what ``sampled`` counts."""
        if not self.rules:
            return logits, None
        if len(plan.finished_req_ids) and (self.owner >= 0).any():
            self.owner[np.isin(self.owner, plan.finished_req_ids)] = -1
        rids, slots = plan.req_ids.tolist(), plan.slots.tolist()
        fed = [i for i, r in enumerate(rids) if r in self.record]
        guides = self.grammars
        if fed or guides:  # (Python ints once: a batch of 256 paid numpy's per-item cost several times a row)
            offs, starts = plan.token_offsets.tolist(), plan.start_pos.tolist()
        for i in fed:
            self._feed(plan, i, rids[i], slots[i], offs[i], offs[i + 1], starts[i])
        if guides:  # the outputs a plan feeds (a recompute's, a P/D decode side's first token)
            for i, rid in enumerate(rids):
                if rid in guides:
                    self._feed_grammar(plan, rid, offs[i], offs[i + 1], starts[i])
        entries = np.flatnonzero(plan.samples).tolist()
        rows = [j for j, i in enumerate(entries) if rids[i] in self.rules]
        if not rows:
            return logits, None
        # a copy (the model's logits stay as they are, for logprobs), at least float32
        x = logits.clone() if logits.dtype in (torch.float32, torch.float64) else logits.float()
        counted = []  # (row, rules, slot, rid, output index of the token drawn) of counting requests
        narrow = []  # (row, min_p)
        held_rows, held_ids = [], []  # min_tokens not reached: the ids masked in each row
        pos = positions.tolist()
        guided = [(j, rids[entries[j]], pos[j] + 1 - self.rules[rids[entries[j]]].prompt_len) for j in rows
                  if guides and rids[entries[j]] in guides]
        if guided:
            guides.mask(x, guided)
        allow = [(j, rids[entries[j]]) for j in rows if rids[entries[j]] in self.allowed]
        if allow:
            self._allow(x, allow)
        biased = [(j, rids[entries[j]]) for j in rows if rids[entries[j]] in self.bias]
        if biased:
            self._bias(x, biased)
        for j in rows:
            i = entries[j]
            r = self.rules[rids[i]]
            k = pos[j] + 1 - r.prompt_len
            if k < r.min_tokens and r.suppress:
                held_rows += [j] * len(r.suppress)
                held_ids += r.suppress
            if _counts(r):
                self._drop_from(rids[i], slots[i], k)
                counted.append((j, r, slots[i], rids[i], k))
            if r.min_p > 0 and temperature[j] > 0:
                narrow.append((j, r.min_p))
        if held_rows:
            at = to_device(np.array([held_rows, held_ids], np.int64), x.device)
            # (an index_put of a device tensor: a Python scalar's setitem made the host wait,
            # 12% of decode throughput at batch 64-256 on the H200)
            x.index_put_((at[0], at[1]), torch.full((len(held_rows),), float("-inf"), dtype=x.dtype, device=x.device))
        if counted:
            self._penalize(x, counted)
        if narrow:
            self._min_p(x, narrow, temperature)
        if not counted and not guided:
            return x, None
        return x, Pending(*([c[n] for c in counted] for n in (0, 2, 3, 4)), guided)

    def mask_drafts(self, plan: StepPlan, logits: torch.Tensor,
                    spans: list[tuple[int, int, int, list[int]]]) -> tuple[torch.Tensor, dict[int, tuple[int, int]]]:
        """Speculative decoding's structured outputs: the logits to accept drafts and draw from
        (a masked copy where a request of ``plan`` has a grammar; the model's own stay for
        logprobs), and {plan index: (request, output index of its first row)} of those, whose
        tokens ``drawn`` then takes. ``spans``: (plan index, first row of ``logits``, position
        of the token fed before that row, drafts verified after it)."""
        g = self.grammars
        if not g:
            return logits, {}
        rids = plan.req_ids.tolist()
        guided = {i: (rids[i], pos + 1 - self.rules[rids[i]].prompt_len) for i, _, pos, _ in spans if rids[i] in g}
        if not guided:
            return logits, {}
        x = logits.clone() if logits.dtype in (torch.float32, torch.float64) else logits.float()
        g.mask_drafts(x, [(r0, *guided[i], drafts) for i, r0, _, drafts in spans if i in guided])
        return x, guided

    def feed_guided(self, plan: StepPlan) -> None:
        """The outputs ``plan`` feeds (a recompute's, a P/D decode side's first), to their
        grammars (speculative decoding: ``apply`` does this for the other steps)."""
        g = self.grammars
        if not g:
            return
        rids = plan.req_ids.tolist()
        offs, starts = plan.token_offsets.tolist(), plan.start_pos.tolist()
        for i, rid in enumerate(rids):
            if rid in g:
                self._feed_grammar(plan, rid, offs[i], offs[i + 1], starts[i])

    def mask_next_draft(self, plan: StepPlan, logits: torch.Tensor,
                        rows: list[tuple[int, int, int, list[int]]]) -> torch.Tensor:
        """A draft model's logits to propose from: a masked copy where a request has a grammar
        (the next draft after ``drafts``). ``rows``: (row, plan index, position of the last
        true token, drafts so far)."""
        g = self.grammars
        if not g:
            return logits
        rids = plan.req_ids.tolist()
        guided = [(row, rids[i], pos + 1 - self.rules[rids[i]].prompt_len, drafts) for row, i, pos, drafts in rows
                  if rids[i] in g]
        if not guided:
            return logits
        x = logits.clone() if logits.dtype in (torch.float32, torch.float64) else logits.float()
        g.mask_next_draft(x, guided)
        return x

    def drawn(self, rid: int, k: int, tokens: list[int]) -> None:
        """A speculative step's tokens for ``rid`` from its output ``k`` on (its grammar's)."""
        for j, t in enumerate(tokens):
            self.grammars.output(rid, k + j, t)

    def guides(self, plan: StepPlan) -> bool:
        """Whether a request of ``plan`` has a structured output (its masks wait for the tokens
        of the steps in flight)."""
        g = self.grammars
        return bool(g) and any(r in g for r in plan.req_ids.tolist())

    def sampled(self, pending: Pending | None, tokens) -> None:
        """Count the tokens just drawn (a device tensor, or host ids) in their rows."""
        if pending is None or not pending.rows:
            return
        at = to_device(np.array([pending.rows, pending.slots], np.int64), self.device)
        tok = (tokens if isinstance(tokens, torch.Tensor) else to_device(np.asarray(tokens), self.device))[at[0]]
        slots = at[1]
        self.counts.index_put_((slots, tok.to(torch.int64)), torch.ones_like(tok, dtype=torch.int32),
                               accumulate=True)

    def confirm_guided(self, pending: Pending | None, tokens: np.ndarray) -> None:
        """The drawn ids of a step's guided rows, ahead of its ``confirm`` (the next step's
        masks need them; ``confirm`` then finds them known)."""
        if pending is not None:
            for j, rid, k in pending.guided:
                if rid in self.grammars:
                    self.grammars.output(rid, k, int(tokens[j]))

    def confirm(self, pending: Pending | None, tokens: np.ndarray) -> None:
        """The drawn ids, now on the host: into the records (already counted)."""
        if pending is None:
            return
        self.confirm_guided(pending, tokens)
        for j, rid, k in zip(pending.rows, pending.rids, pending.index):
            if rid in self.record:
                self._remember(rid, k, int(tokens[j]))

    # -- internals -----------------------------------------------------------------------------
    def _remember(self, rid: int, k: int, token: int) -> bool:
        """Note output k of ``rid``; whether it was new."""
        rec = self.record[rid]
        if k >= len(rec):
            rec = self.record[rid] = np.concatenate([rec, np.full(max(k + 1, 2 * len(rec)) - len(rec), -1, np.int32)])
        if rec[k] >= 0:
            return False
        rec[k] = token
        if k > self.last[rid]:
            self.last[rid] = k
        return True

    def _drop_from(self, rid: int, slot: int, k: int) -> None:
        """Token k is drawn now: outputs from k on that the record holds were drawn for a
        step the core dropped (preempted while it ran) and are not the request's."""
        if k > self.last[rid]:  # the usual case: nothing recorded from k on (no numpy call)
            return
        rec = self.record[rid]
        stale = rec[k:]
        if (stale >= 0).any():
            gone = to_device(stale[stale >= 0].astype(np.int64), self.device)
            self.counts[slot].index_put_((gone,), torch.full((len(gone),), -1, dtype=torch.int32, device=self.device),
                                         accumulate=True)
            stale[:] = -1
        kept = np.flatnonzero(rec >= 0)
        self.last[rid] = int(kept[-1]) if len(kept) else -1

    def _feed(self, plan: StepPlan, i: int, rid: int, slot: int, lo: int, hi: int, start: int) -> None:
        """Own ``slot``'s row for ``rid`` and count the output tokens entry i (its tokens
        ``lo:hi`` of the plan, from position ``start``) feeds that the record lacks."""
        r = self.rules[rid]
        if self.owner[slot] != rid:
            self._rebuild(slot, rid, r)
        if start + hi - lo <= r.prompt_len:
            return
        if hi - lo == 1 and plan.token_ids[lo] == PLACEHOLDER:  # a decode: its token was counted when drawn
            return
        ids = plan.token_ids[lo:hi]
        new = [t for k, t in enumerate(ids.tolist()) if start + k >= r.prompt_len and t != PLACEHOLDER
               and self._remember(rid, start + k - r.prompt_len, t)]
        if new:
            t = to_device(np.array(new, np.int64), self.device)
            self.counts[slot].index_put_((t,), torch.ones(len(new), dtype=torch.int32, device=self.device),
                                         accumulate=True)

    def _feed_grammar(self, plan: StepPlan, rid: int, lo: int, hi: int, start: int) -> None:
        n = self.rules[rid].prompt_len
        if start + hi - lo <= n or (hi - lo == 1 and plan.token_ids[lo] == PLACEHOLDER):
            return
        for k, t in enumerate(plan.token_ids[lo:hi].tolist()):
            if start + k >= n and t != PLACEHOLDER:
                self.grammars.output(rid, start + k - n, t)

    def _rebuild(self, slot: int, rid: int, r: LogitsRules) -> None:
        rec = self.record[rid]
        known = rec[rec >= 0].astype(np.int64)
        self.counts[slot] = to_device(np.bincount(known, minlength=self.vocab).astype(np.int32), self.device)
        self.seen[slot].zero_()
        prompt = self.prompts.get(rid, b"")
        if prompt:
            ids = to_device(np.frombuffer(prompt, np.int32).astype(np.int64), self.device)
            self.seen[slot].index_fill_(0, ids, True)
        self.owner[slot] = rid

    def _penalize(self, x: torch.Tensor, counted: list[tuple]) -> None:
        dev = x.device
        at = to_device(np.array([[c[0] for c in counted], [c[2] for c in counted]], np.int64), dev)
        params = to_device(np.array([[c[1].repetition_penalty, c[1].frequency_penalty, c[1].presence_penalty]
                                     for c in counted], np.float32), dev)
        if x.is_cuda and x.dtype == torch.float32:  # one pass a row, not the torch ops' temporaries
            from lockstep.kernels.penalties import penalize
        else:
            penalize = penalize_torch
        penalize(x, at[0], at[1], self.counts, self.seen, params)

    def _allow(self, x: torch.Tensor, allow: list[tuple[int, int]]) -> None:
        """Mask every id of each (row, request) but the request's allowed ones."""
        key = tuple(allow)
        got = self._gathered.get("allow")
        if got is None or got[0] != key:
            dev = x.device
            ids = [self.allowed[rid] for _, rid in allow]
            at = to_device(np.repeat(np.arange(len(allow)), [len(t) for t in ids]), dev)
            got = self._gathered["allow"] = (key, to_device(np.array([j for j, _ in allow], np.int64), dev), at,
                                             ids[0] if len(ids) == 1 else torch.cat(ids))
        _, rows, at, ids = got
        banned = torch.ones((len(allow), x.shape[-1]), dtype=torch.bool, device=x.device)
        banned.index_put_((at, ids), torch.zeros(len(ids), dtype=torch.bool, device=x.device))
        x[rows] = x[rows].masked_fill(banned, float("-inf"))

    def _bias(self, x: torch.Tensor, biased: list[tuple[int, int]]) -> None:
        key = tuple(biased)
        got = self._gathered.get("bias")
        if got is None or got[0] != key:
            pairs = [self.bias[rid] for _, rid in biased]
            rows = to_device(np.repeat(np.array([j for j, _ in biased], np.int64), [len(t) for t, _ in pairs]),
                             x.device)
            got = self._gathered["bias"] = (key, rows, torch.cat([t for t, _ in pairs]),
                                            torch.cat([b for _, b in pairs]))
        _, rows, ids, add = got
        x.index_put_((rows, ids), add.to(x.dtype), accumulate=True)

    @staticmethod
    def _min_p(x: torch.Tensor, narrow: list[tuple[int, float]], temperature: np.ndarray) -> None:
        """Drop tokens whose probability (after temperature) is below min_p times the
        largest: (logit - max) / t < log(min_p)."""
        dev = x.device
        rows = to_device(np.array([j for j, _ in narrow], np.int64), dev)
        floor = to_device(np.array([float(temperature[j]) * math.log(p) for j, p in narrow]), dev, x.dtype)[:, None]
        if x.is_cuda and x.dtype == torch.float32:  # one program a row, not eight passes of torch ops
            from lockstep.kernels.min_p import min_p_

            return min_p_(x, rows, floor[:, 0])
        y = x[rows]
        x[rows] = y.masked_fill(y - y.max(dim=-1, keepdim=True).values < floor, float("-inf"))
