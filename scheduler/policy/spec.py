"""SchedulerCore's speculative decoding: k draft tokens per decode, verified in one step.

The runtime drafts and verifies inside one step (the draft model lives next to the target),
so the plan only reserves room: a speculative decode feeds ``1 + k`` tokens, the first the
PLACEHOLDER for the last sampled token and the rest PLACEHOLDERs for the runtime's own
drafts. The core counts all ``1 + k`` in the token budget and takes KV blocks for them up
front; the result says how many tokens each request got (``1 + accepted``).

Planning assumes every draft is accepted (the tentative counters run ahead by ``k`` per
step), which is what async scheduling needs: step N+1 is planned before step N's result.
On the result the core rolls the counters back by the ``k - accepted`` rejected positions.
A plan made before that rollback names positions too far ahead, so the runtime places a
speculative decode at its own count of the slot's tokens, which it always knows exactly;
the blocks the core reserved cover the tentative positions, a superset.

Counters per request: drafts proposed, accepted, and accepted at each draft position.
"""

from __future__ import annotations

import numpy as np

from .step import PLACEHOLDER, EMPTY_I64, StepOutputs, StepPlan, StepResult


class SpecDecoding:
    def _init_spec(self) -> None:
        k = self.config.num_spec_tokens
        self._plan_spec: dict[int, np.ndarray] = {}  # step id -> drafts per plan entry
        self.spec_drafts = 0  # speculative decodes (requests x steps) with at least one draft
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_accepted_per_pos = np.zeros(k, dtype=np.int64)

    def _schedule_spec_decodes(self, budget: int, entries: list) -> int:
        """A speculative decode for every decoding slot that fits the budget; returns the
        budget left. Entries have the prefill entries' shape (see ``_prefill_entry``)."""
        k = self.config.num_spec_tokens
        bs = self.bs
        nknown, ncomp, maxtotal = self.s_nknown, self.s_ncomp, self.s_maxtotal
        for slot in list(self._active):
            if budget <= 0:
                break
            if not (self.s_decodable.item(slot) and nknown.item(slot) - ncomp.item(slot) == 1
                    and ncomp.item(slot) >= self.s_prefill_end.item(slot) and nknown.item(slot) < maxtotal.item(slot)):
                continue
            req = self.s_req[slot]
            if req is None:  # preempted for an earlier slot's blocks in this loop
                continue
            drafts = max(0, min(k, maxtotal.item(slot) - nknown.item(slot) - 1, budget - 1))
            start = ncomp.item(slot)
            first_new = len(req.blocks)
            if not self._grow_blocks(req, start + 1 + drafts, preempt=True):
                continue
            self._chunked_now.add(slot)  # not a victim for later slots of this step
            ncomp[slot] = start + 1 + drafts
            nknown[slot] = start + 2 + drafts
            req.num_computed = start + 1 + drafts
            tokens = np.full(1 + drafts, PLACEHOLDER, dtype=np.int32)
            bstart = min(first_new, start // bs)
            entries.append((req, 1 + drafts, start, tokens, req.blocks[bstart:], bstart, True, drafts))
            budget -= 1 + drafts
        return budget

    def _update_spec(self, plan: StepPlan, result: StepResult, drafts: np.ndarray, epochs: np.ndarray) -> StepOutputs:
        """Confirm each live entry's tokens in order (stopping at its end), then roll back
        the positions of rejected drafts."""
        ns = result.num_sampled
        offs = np.zeros(len(ns) + 1, dtype=np.int64)
        np.cumsum(ns, out=offs[1:])
        slots = plan.slots.astype(np.int64)
        live = (self.s_epoch[slots] == epochs) & plan.samples & (ns > 0)
        bs = self.bs
        out_ids, out_n, out_tok, first, finished = [], [], [], [], []
        for i in np.flatnonzero(live).tolist():
            slot, rid = int(slots[i]), int(plan.req_ids[i])
            toks = result.token_ids[offs[i] : offs[i + 1]]
            d = int(drafts[i])  # positions reserved
            proposed = int(result.num_drafts[i]) if len(result.num_drafts) else d
            if len(toks) > proposed + 1 or proposed > d:
                raise ValueError(f"step {plan.step_id}: request {rid} got {len(toks)} tokens for {proposed} "
                                 f"drafts proposed of {d} planned")
            if proposed:
                acc = len(toks) - 1
                self.spec_drafts += 1
                self.spec_draft_tokens += proposed
                self.spec_accepted_tokens += acc
                self.spec_accepted_per_pos[:acc] += 1
            taken, reason = 0, None
            for tok in toks.tolist():
                nout = self.s_nout.item(slot)
                pos = self.s_maxtotal.item(slot) - self.s_maxout.item(slot) + nout
                self.s_tail[slot, pos % bs] = tok
                self.s_nout[slot] = nout + 1
                taken += 1
                if nout == 0:
                    first.append(rid)
                if (pos + 1) % bs == 0:
                    self._close_blocks(np.array([slot], dtype=np.int64))
                if nout + 1 >= self.s_maxout.item(slot) or tok == self.s_stop.item(slot):
                    reason = True
                    break
            out_ids.append(rid)
            out_n.append(taken)
            out_tok.append(toks[:taken])
            if reason is not None:
                finished += self._finish_slots(np.array([slot], dtype=np.int64), toks[taken - 1 : taken])
                continue
            back = d - (len(toks) - 1)  # rejected drafts: their positions are free again
            if back:
                self.s_ncomp[slot] -= back
                self.s_nknown[slot] -= back
                self.s_req[slot].num_computed = int(self.s_ncomp[slot])
        return StepOutputs(
            req_ids=np.asarray(out_ids, dtype=np.int64), num_tokens=np.asarray(out_n, dtype=np.int32),
            token_ids=np.concatenate(out_tok).astype(np.int32) if out_tok else np.zeros(0, np.int32),
            finished=tuple(finished), first_token_ids=np.asarray(first, dtype=np.int64) if first else EMPTY_I64,
        )

    def spec_stats(self) -> dict:
        d = self.spec_drafts
        return {"drafts": d, "draft_tokens": self.spec_draft_tokens, "accepted_tokens": self.spec_accepted_tokens,
                "accepted_per_position": self.spec_accepted_per_pos.tolist(),
                "mean_accepted_length": 1 + self.spec_accepted_tokens / d if d else 0.0}
