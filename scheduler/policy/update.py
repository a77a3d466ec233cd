"""SchedulerCore's update path: applying what the runtime did in a step.

``update(plan, result, now)`` confirms one sampled token per live request, closes (hashes
and publishes) the blocks those tokens fill, and finishes requests that reached their end.
Results for slots whose owner changed since the plan was made are dropped by epoch.

A batch of a few requests takes a per-slot Python path: numpy charges microseconds per
call, which a step of one to four requests (most steps of a sparse trace) would pay a
dozen times over. Both paths make the same state changes in the same order.
"""

from __future__ import annotations

import numpy as np

from .request import FinishReason, RequestState
from .step import EMPTY_I64, StepOutputs, StepPlan, StepResult, decode_constants

SMALL_BATCH = 8  # requests up to which per-slot Python beats vector operations


class UpdatePath:
    def update(self, plan: StepPlan, result: StepResult, now: float) -> StepOutputs:
        if result.step_id != plan.step_id:
            raise ValueError(f"result for step {result.step_id} applied to plan {plan.step_id}")
        if len(result.kv_loads_done):
            for rid in result.kv_loads_done.tolist():
                self._kv_load_finished(rid, ok=True)
        if len(result.kv_loads_failed):
            for rid in result.kv_loads_failed.tolist():
                self._kv_load_finished(rid, ok=False)
        ns = result.num_sampled
        epochs = self._plan_epochs.pop(plan.step_id, None)
        drafts = self._plan_spec.pop(plan.step_id, None) if self._plan_spec else None
        if plan.num_reqs == 0:  # a step that only carried KV-load completions
            e = EMPTY_I64
            return StepOutputs(req_ids=e, num_tokens=e.astype(np.int32),
                               token_ids=e.astype(np.int32), finished=(), first_token_ids=e)
        if epochs is None:
            raise ValueError(f"step {plan.step_id} was not planned by this core, or was applied twice")
        if drafts is not None:
            return self._update_spec(plan, result, drafts, epochs)
        slots = plan.slots.astype(np.int64)
        # A slot's owner may have finished, been preempted or even re-admitted meanwhile.
        n = len(slots)
        if n <= SMALL_BATCH:
            s_epoch = self.s_epoch
            all_live = len(result.token_ids) == n and len(ns) == n and all(
                s_epoch.item(s) == e and sm and k > 0
                for s, e, sm, k in zip(slots.tolist(), epochs.tolist(), plan.samples.tolist(), ns.tolist()))
            if all_live:
                return self._confirm(slots, result.token_ids, plan.req_ids)
        live = (self.s_epoch[slots] == epochs) & plan.samples & (ns > 0)
        if live.all() and len(result.token_ids) == len(slots) and len(ns) == len(slots):
            return self._confirm(slots, result.token_ids, plan.req_ids)
        idx = np.flatnonzero(live)
        offs = np.zeros(len(ns) + 1, dtype=np.int64)
        np.cumsum(ns, out=offs[1:])
        if (ns > plan.samples).any():  # more than one token needs speculative decoding
            raise ValueError(f"step {plan.step_id}: a request sampled {int(ns.max())} tokens; "
                             "without speculative tokens in the plan each may sample at most 1")
        return self._confirm(slots[idx], result.token_ids[offs[idx]], plan.req_ids[idx])

    def _confirm(self, slots: np.ndarray, tokens: np.ndarray, req_ids: np.ndarray) -> StepOutputs:
        """One confirmed token for each slot (the fast path)."""
        if len(slots) <= SMALL_BATCH:
            return self._confirm_few(slots, tokens, req_ids)
        nout = self.s_nout[slots]
        pos = self.s_nknown_confirmed(slots)
        self.s_tail[slots, pos % self.bs] = tokens
        nout += 1
        self.s_nout[slots] = nout
        first = req_ids[nout == 1]
        full = slots[(pos + 1) % self.bs == 0]
        if len(full):
            self._close_blocks(full)
        done = (nout >= self.s_maxout[slots]) | (tokens == self.s_stop[slots])
        finished = ()
        if done.any():
            finished = self._finish_slots(slots[done], tokens[done])
        return StepOutputs(
            req_ids=req_ids, num_tokens=np.ones(len(slots), dtype=np.int32),
            token_ids=tokens, finished=finished, first_token_ids=first,
        )

    def _confirm_few(self, slots: np.ndarray, tokens: np.ndarray, req_ids: np.ndarray) -> StepOutputs:
        """``_confirm`` one slot at a time."""
        bs, s_nout, s_maxout, s_tail = self.bs, self.s_nout, self.s_maxout, self.s_tail
        first, full, done = [], [], []
        for i, (slot, tok) in enumerate(zip(slots.tolist(), tokens.tolist())):
            nout = s_nout.item(slot)
            pos = self.s_maxtotal.item(slot) - s_maxout.item(slot) + nout
            s_tail[slot, pos % bs] = tok
            nout += 1
            s_nout[slot] = nout
            if nout == 1:
                first.append(i)
            if (pos + 1) % bs == 0:
                full.append(slot)
            if nout >= s_maxout.item(slot) or tok == self.s_stop.item(slot):
                done.append(i)
        if full:
            self._close_blocks(np.array(full, dtype=np.int64))
        finished = self._finish_slots(slots[done], tokens[done]) if done else ()
        return StepOutputs(
            req_ids=req_ids, num_tokens=decode_constants(len(slots)).ones,
            token_ids=tokens, finished=finished, first_token_ids=req_ids[first] if first else EMPTY_I64,
        )

    def s_nknown_confirmed(self, slots: np.ndarray) -> np.ndarray:
        """Position of the next confirmed token: prompt length + confirmed outputs."""
        return self.s_maxtotal[slots] - self.s_maxout[slots] + self.s_nout[slots]

    def _close_blocks(self, slots: np.ndarray) -> None:
        """Blocks just filled by confirmed output: save their tokens, hash and publish them."""
        reqs = [self.s_req[s] for s in slots.tolist()]
        ends = self.s_nknown_confirmed(slots)
        for req, slot, end in zip(reqs, slots.tolist(), ends.tolist()):
            lo = max(end - self.bs, req.prompt_len)
            req.output[lo - req.prompt_len : end - req.prompt_len] = self.s_tail[slot, lo % self.bs :]
        if self.config.enable_prefix_caching:
            self._publish_generated(reqs, ends // self.bs - 1, self.s_tail[slots])

    def _finish_slots(self, slots: np.ndarray, tokens: np.ndarray, *, flushed: bool = False) -> tuple:
        """Finish the requests in ``slots``; ``flushed``: their outputs are all in req.output
        already (see ``_release``)."""
        out = []
        for slot, tok in zip(slots.tolist(), tokens.tolist()):
            req = self.s_req[slot]
            reason = FinishReason.STOP if tok == self.s_stop.item(slot) else FinishReason.LENGTH
            if self.s_nout.item(slot) >= self.s_maxout.item(slot):
                reason = FinishReason.LENGTH  # length first, as vLLM's check_stop
            if req.hold_kv and reason is FinishReason.LENGTH:  # P/D: the decode side pulls them
                self.held[req.id] = list(req.blocks)
                self.pool.touch(req.blocks)
            self._release(req, flushed=flushed)
            self._finish(req, reason)
            out.append((req.id, reason))
        return tuple(out)

    def _kv_load_finished(self, rid: int, *, ok: bool) -> None:
        req = self.requests.get(rid)
        if req is None:
            return
        if req.host_load_first >= 0:  # a host-tier prefix load
            first, req.host_load_first = req.host_load_first, -1
            if req.slot < 0:
                return
            if ok:  # now the loaded blocks, and what was computed on them, can be shared
                self._publish_prompt_blocks(req, first * self.bs)
            else:  # nothing was published: recompute from scratch
                self._preempt(req)
            return
        if req.state is not RequestState.WAITING_FOR_KV:
            return
        req.state = RequestState.RUNNING
        req.num_computed = min(req.remote_kv_tokens, req.num_known - 1) if ok else 0
        self.s_ncomp[req.slot] = req.num_computed
        if ok:  # the pulled prompt blocks can be shared from now on
            self._publish_prompt_blocks(req, 0)
        self.s_decodable[req.slot] = True
