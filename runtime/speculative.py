"""Speculative decoding inside the torch runtime: a draft model proposes, the target verifies.

A speculative decode entry feeds ``1 + d`` PLACEHOLDERs: the last sampled token and ``d``
drafts this runtime proposes itself. Each step:

1. the draft model catches up on the true tokens it has not seen (one, or two when every
   draft of the last step was accepted) and proposes ``d`` tokens, one forward per draft;
   prefill chunks go through the draft too, so its cache holds the prompt;
2. the target runs once over every entry: prefill chunks, and for each decode the last token
   and its drafts, with logits at every one of those positions;
3. greedy requests accept the longest prefix of drafts equal to the target's argmax, plus the
   target's next token (a structured output's rows masked first, each as if the drafts before
   it were accepted: a draft outside the grammar is never accepted); sampled requests accept draft ``x`` with probability
   ``min(1, p(x) / q(x))`` and on a rejection draw from ``max(p - q, 0)`` renormalized, so the
   output is distributed exactly as the target's (Leviathan et al., Chen et al.).

The scheduler plans as if every draft were accepted and rolls back on the result, so a plan
can name a decode's position too far ahead; this runtime places each decode at its own
count (``pos``), which is exact. Rejected drafts leave KV behind in both caches at positions
that the next step overwrites.

The draft is a preset (random weights), a checkpoint directory, or ``layers:N``: the target's
own first N layers with its embeddings and head (self-speculation; shares the weights).

On the fast path (CUDA) the target, and a draft whose experts it holds itself (not a
lockstep draft under DEP), run through their ``FastRunner``s: every token of a verify or of
a draft pass attends as a decode query of its own, so a pass whose sequences each feed at
most ``DECODE_MAX_NEW`` tokens replays a CUDA graph sized by tokens, as a plain decode step
does (where the runner has graphs: not with exact expert dispatch); longer chunks and passes
larger than the largest graph run eagerly. The argmax of every row of a pass reaches the
host in one transfer (the greedy rows read it).

With expert parallelism (DEP) the draft's routed experts are replicated on every rank
(runtime option ``draft_experts`` "replicated", the default: a rank drafts on its own), or
sharded over the ranks like the target's ("sharded", and always for ``layers:N``): then each
draft pass has all-to-alls, so every rank runs the step's agreed ``draft_passes`` (the DP
sync's maximum), padding with empty passes.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from lockstep.policy.step import EMPTY_I32, PLACEHOLDER, StepPlan, StepResult

from .models.batch import ForwardBatch, HostBatch
from .sampling import _probs, _row_seed, logprobs as _logprobs


def load_draft(name: str, target, *, dtype: torch.dtype, device: torch.device, seed: int):
    """The draft model named by the runtime option ``draft_model``."""
    if name.startswith("layers:"):
        n = int(name.split(":", 1)[1])
        if not 1 <= n < target.cfg.num_hidden_layers:
            raise ValueError(f"draft_model {name!r}: N must be in [1, {target.cfg.num_hidden_layers})")
        return target.truncated(n)
    from .models import load_model

    draft = load_model(name, dtype=dtype, device=device, seed=seed)
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"draft_model {name!r} has a vocabulary of {draft.cfg.vocab_size}, the target "
                         f"{target.cfg.vocab_size}: a draft must share the target's tokenizer")
    return draft


class Speculator:
    ADAPT_WEIGHT = 1 / 16  # how far each speculative decode moves the running mean

    def __init__(self, runtime, draft, num_blocks: int, block_size: int, max_num_seqs: int, seed: int,
                 adaptive: bool = False, lockstep: bool = False, placements=None, fast_runner=None):
        self.rt, self.draft, self.bs = runtime, draft, block_size
        # The draft's own expert placement (sharded draft experts), and its tokens per
        # (layer, expert) summed over this step's passes, for the balancer's draft planner.
        self.placements, self._counts = placements, None
        # A draft with sharded experts: each pass has all-to-alls, so every rank runs the
        # plan's draft_passes, padding its own with empty ones.
        self.lockstep = lockstep
        self.gen = torch.Generator().manual_seed(seed)  # unseeded requests' draws, on the host
        self.kv_pool, self.kv = draft.make_kv_pool(num_blocks, block_size)
        # The draft's fast path: ``fast_runner(draft, kv)`` makes its FastRunner (None: the
        # draft's own forward), which reads the target runner's device tables.
        self.runner = None if fast_runner is None else fast_runner(draft, self.kv)
        self.pos = np.full(max_num_seqs, -1, dtype=np.int64)  # position of each slot's last sampled token
        # Adaptive k: propose clamp(round(m) + 1, 1, d) drafts, m the running mean of drafts
        # accepted per speculative decode (one more than it expects to keep). The core still
        # reserves d; it rolls back whatever was not proposed or not accepted.
        self.adaptive, self.mean_accepted = adaptive, None
        self.pending: list[list[int]] = [[] for _ in range(max_num_seqs)]  # true tokens the draft has not seen
        self.draft_passes = 0  # draft forwards run, in all

    # -- one step -----------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        offs, slots = plan.token_offsets, plan.slots.astype(np.int64)
        default = (1.0, 1.0, -1, -1, -1)
        entries = []  # (plan index, slot, fed tokens or None for a decode, first position, drafts, params)
        for i in range(plan.num_reqs):
            k = int(plan.num_new[i])
            if k == 0:  # a table-only entry (KV being pulled in)
                continue
            slot, params = int(slots[i]), self.rt.params.get(int(plan.req_ids[i]), default)
            toks = plan.token_ids[offs[i] : offs[i + 1]].astype(np.int64)
            if toks[0] == PLACEHOLDER:  # a decode, at this runtime's own count
                entries.append((i, slot, None, int(self.pos[slot]), self._drafts(k - 1), params))
            else:
                entries.append((i, slot, toks, int(plan.start_pos[i]), 0, params))
        passes = self.draft_passes
        self.rt.processors.feed_guided(plan)  # (structured outputs: the outputs the plan feeds)
        proposals, qs = self._propose(entries, plan)
        self.pad_passes(self.draft_passes - passes, plan.draft_passes)
        ns = np.zeros(plan.num_reqs, dtype=np.int32)
        out, counts, lp = self._verify(plan, entries, proposals, qs, ns)
        proposed = EMPTY_I32
        if self.adaptive:  # fewer drafts than planned, maybe: say how many
            proposed = np.zeros(plan.num_reqs, dtype=np.int32)
            for i, got in proposals.items():
                proposed[i] = len(got)
        return StepResult(step_id=plan.step_id, num_sampled=ns, token_ids=np.asarray(out, dtype=np.int32),
                          expert_counts=counts, num_drafts=proposed, gpu_s=time.perf_counter() - t0,
                          logprobs=lp[0], top_ids=lp[1], top_logprobs=lp[2])

    def _propose(self, entries, plan) -> tuple[dict[int, list[int]], dict[int, list[torch.Tensor]]]:
        """Drafts per plan index, and the draft's distributions where they were sampled.
        The first draft forward also feeds prefill chunks and the tokens the draft missed.
        A structured output's drafts are drawn from its grammar's tokens."""
        proposals: dict[int, list[int]] = {}
        qs: dict[int, list[torch.Tensor]] = {}
        feed, drafting = [], []  # drafting: (plan index, slot, first position, drafts, params, feed row)
        for i, slot, toks, start, d, params in entries:
            if toks is not None:
                feed.append((slot, toks, start))
                continue
            pend = self.pending[slot] or [int(self.rt.last[slot])]
            self.pending[slot] = []
            feed.append((slot, np.asarray(pend, dtype=np.int64), start - len(pend) + 1))
            if d:
                drafting.append((i, slot, start, d, params, len(feed) - 1))
        if not drafting:
            if feed:  # keep the draft's cache in step even when nobody drafts
                self._forward(self.draft, self.kv, feed, [])
            return proposals, qs
        ends = np.cumsum([len(t) for _, t, _ in feed]) - 1
        logits, _ = self._forward(self.draft, self.kv, feed, [int(ends[r]) for *_, r in drafting])
        step = 0
        while True:
            logits = self.rt.processors.mask_next_draft(plan, logits, [(row, i, start, proposals.get(i, []))
                                                                       for row, (i, _, start, *_) in enumerate(drafting)])
            top = _argmax_rows(logits, [e[4] for e in drafting])
            for row, (i, slot, start, d, params, _) in enumerate(drafting):
                tok, q = self._draw(logits[row], params, start + step + 1, top[row])
                proposals.setdefault(i, []).append(tok)
                if q is not None:
                    qs.setdefault(i, []).append(q)
            step += 1
            drafting = [e for e in drafting if e[3] > step]
            if not drafting:
                return proposals, qs
            feed = [(slot, np.array([proposals[i][-1]], np.int64), start + step)
                    for i, slot, start, *_ in drafting]
            logits, _ = self._forward(self.draft, self.kv, feed, list(range(len(feed))))

    def _verify(self, plan, entries, proposals, qs, ns) -> tuple[list[int], np.ndarray | None, tuple]:
        """One target forward over everything: the tokens each sampling entry gets, and the
        target's tokens per (layer, expert). With expert parallelism the forward runs even with
        nothing to verify, since the other ranks' all-to-alls wait for this rank's. (A draft
        with replicated experts drafts as many passes as this rank's requests need, waiting for
        nobody; one with sharded experts runs the plan's draft_passes, see ``pad_passes``.)"""
        rt = self.rt
        feed, rows, spans = [], [], []
        n_rows = 0
        for i, slot, toks, start, d, params in entries:
            decode = toks is None
            if decode:
                toks = np.asarray([int(rt.last[slot])] + proposals.get(i, []), dtype=np.int64)
            feed.append((slot, toks, start))
            if decode or plan.samples[i]:
                m = len(toks) if decode else 1
                spans.append((i, slot, start + len(toks) - m, len(rows), m, params))
                rows += range(n_rows + len(toks) - m, n_rows + len(toks))
            n_rows += len(toks)
        if not feed:
            if rt.world > 1:
                rt.model(rt._empty_batch(), rt.kv)
            return [], None, (None, None, None)
        logits, counts = self._forward(rt.forward_model, rt.kv, feed, rows)
        # Structured outputs: each guided row masked as if the drafts before it were accepted
        x, guided = rt.processors.mask_drafts(plan, logits, [(i, r0, pos0, proposals.get(i, []))
                                                             for i, _, pos0, r0, _, _ in spans])
        # One transfer for the expert counts and the argmax of every row (greedy acceptance).
        host = torch.cat([x.argmax(dim=-1).to(torch.int32), counts.flatten().to(torch.int32)]).cpu().numpy()
        top, counts = host[: len(rows)].tolist(), host[len(rows):].reshape(counts.shape)
        out: list[int] = []
        scored: list[int] = []  # the logits row each token of ``out`` was drawn from
        for i, slot, pos0, r0, m, params in spans:
            drafts = proposals.get(i, [])
            got = self._accept(x[r0 : r0 + m], drafts, qs.get(i), params, pos0, top[r0 : r0 + m])
            if i in guided:
                rt.processors.drawn(*guided[i], got)
            ns[i] = len(got)
            out += got
            scored += range(r0, r0 + len(got))
            self.pos[slot] = pos0 + len(got)
            rt.last[slot] = got[-1]
            # The draft saw the fed token and drafts 1..d-1: with all d accepted it misses d_d.
            self.pending[slot] = ([drafts[-1]] if drafts and len(got) - 1 == len(drafts) else []) + [got[-1]]
            if self.adaptive and drafts:
                m = self.mean_accepted if self.mean_accepted is not None else float(len(drafts))
                self.mean_accepted = m + self.ADAPT_WEIGHT * (len(got) - 1 - m)
        want = max((sp[5][4] for sp in spans), default=-1)  # the most top logprobs a request asked for
        lp = (None, None, None) if want < 0 else _logprobs(logits[torch.as_tensor(scored, device=logits.device)],
                                                            np.asarray(out, np.int64), want)
        return out, counts, lp

    def pad_passes(self, ran: int, agreed: int) -> None:
        """Empty draft forwards up to the ``agreed`` passes of this step (lockstep drafts)."""
        if not self.lockstep:
            return
        if ran > agreed:
            raise RuntimeError(f"this rank ran {ran} draft passes, the ranks agreed on {agreed}")
        for _ in range(agreed - ran):
            self.draft(self.rt._empty_batch(), self.kv)
            self.draft_passes += 1

    def _drafts(self, planned: int) -> int:
        """Drafts to propose for a decode the core planned with ``planned``."""
        if not self.adaptive or self.mean_accepted is None or planned == 0:
            return planned
        return max(1, min(planned, int(self.mean_accepted + 1.5)))

    # -- pieces -------------------------------------------------------------------------------
    def _forward(self, model, kv, feed, sample_rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``model`` over [(slot, tokens, first position)] through the slots' tables:
        (logits of ``sample_rows``, tokens per (layer, expert))."""
        if model is self.draft:
            self.draft_passes += 1
            if self.placements is not None:
                logits, counts = self._run(model, kv, feed, sample_rows)
                counts = counts.clone()  # a graph's output buffer, overwritten by its next replay
                self._counts = counts if self._counts is None else self._counts + counts
                return logits, counts
        return self._run(model, kv, feed, sample_rows)

    def take_counts(self) -> np.ndarray | None:
        """The draft's tokens per (layer, expert) since the last call."""
        counts, self._counts = self._counts, None
        return None if counts is None else counts.cpu().numpy().astype(np.int32)

    def _run(self, model, kv, feed, sample_rows) -> tuple[torch.Tensor, torch.Tensor]:
        rt, bs = self.rt, self.bs
        runner = self.runner if model is self.draft else rt.runner if model is rt.forward_model else None
        lens = np.array([len(t) for _, t, _ in feed], dtype=np.int64)
        ids = np.concatenate([t for _, t, _ in feed])
        starts = np.array([s for _, _, s in feed], dtype=np.int64)
        entry = np.repeat(np.arange(len(feed)), lens)
        qs = np.zeros(len(feed) + 1, dtype=np.int64)
        np.cumsum(lens, out=qs[1:])
        pos = starts[entry] + np.arange(len(ids)) - qs[entry]
        seq_lens = starts + lens
        width = int(-(-seq_lens.max() // bs))
        table = rt.tables[np.array([s for s, _, _ in feed], dtype=np.int64), :width]
        slot_mapping = table[entry, pos // bs].astype(np.int64) * bs + pos % bs
        if runner is not None:
            rows = np.array([s for s, _, _ in feed], dtype=np.int64)
            return runner.forward(HostBatch(input_ids=ids.astype(np.int64), positions=pos, query_start=qs,
                                            seq_lens=seq_lens, rows=rows, width=width, slot_mapping=slot_mapping,
                                            sample_index=np.asarray(sample_rows, dtype=np.int64)))
        d = rt.device
        batch = ForwardBatch(
            input_ids=torch.from_numpy(ids).to(d), positions=torch.from_numpy(pos).to(d),
            query_start=torch.from_numpy(qs).to(d), seq_lens=torch.from_numpy(seq_lens).to(d),
            block_tables=torch.from_numpy(np.ascontiguousarray(table)).to(d),
            slot_mapping=torch.from_numpy(slot_mapping).to(d),
            sample_index=torch.as_tensor(sample_rows, dtype=torch.int64).to(d))
        return model(batch, kv)

    def _draw(self, logits: torch.Tensor, params, pos: int, top: int) -> tuple[int, torch.Tensor | None]:
        """A draft token: the argmax for greedy requests (``top``, the row's argmax), else a
        draw from q (kept for the acceptance test)."""
        temp, top_p, top_k, seed, _ = params
        if temp <= 0:
            return top, None
        q = _probs(logits[None], np.array([temp]), np.array([top_p]), np.array([top_k]))[0].cpu()
        return int(torch.multinomial(q, 1, generator=self._gen(seed, pos, 1)).item()), q

    def _accept(self, logits, drafts: list[int], q, params, pos0: int, target: list[int] | None = None) -> list[int]:
        """Tokens an entry gets: its accepted drafts, then one from the target. ``pos0`` is
        the position of the fed token the first row of ``logits`` follows; ``target``: the
        argmax of each row (greedy acceptance)."""
        temp, top_p, top_k, seed, _ = params
        if temp <= 0:
            target = logits.argmax(dim=-1).tolist() if target is None else target
            got = []
            for j, x in enumerate(drafts):
                if target[j] != x:
                    break
                got.append(x)
            return got + [int(target[len(got)])]
        m = len(logits)
        p = _probs(logits, np.full(m, temp), np.full(m, top_p), np.full(m, top_k)).cpu()
        got = []
        for j, x in enumerate(drafts):
            g = self._gen(seed, pos0 + j + 1, 2)
            pj, qj = p[j], q[j]
            if torch.rand(1, generator=g).item() * float(qj[x]) < float(pj[x]):  # min(1, p/q)
                got.append(x)
                continue
            resid = torch.clamp(pj - qj, min=0)
            total = float(resid.sum())
            return got + [int(torch.multinomial(resid / total if total > 0 else pj, 1, generator=g).item())]
        g = self._gen(seed, pos0 + len(drafts) + 1, 3)
        return got + [int(torch.multinomial(p[len(drafts)], 1, generator=g).item())]

    def _gen(self, seed: int, pos: int, salt: int) -> torch.Generator:
        """Seeded requests draw from (seed, position, purpose); others share one generator."""
        if seed < 0:
            return self.gen
        return torch.Generator().manual_seed(_row_seed(seed * 4 + salt, pos))


def _argmax_rows(logits: torch.Tensor, params: list) -> list[int]:
    """Each row's argmax in one transfer, when some row is greedy (else zeros, unread)."""
    if not any(p[0] <= 0 for p in params):
        return [0] * len(params)
    return logits.argmax(dim=-1).tolist()
