"""SchedulerCore's plan assembly: turning one step's decisions into a StepPlan.

A plan is a structure of arrays; decode-only plans (the common case) are built from a few
gathers and the contract's shared read-only constants (``decode_constants``), which the step
codec sends as a flag rather than as bytes.
"""

from __future__ import annotations

import itertools

import numpy as np

from .request import RequestState
from .step import EMPTY_I32, EMPTY_I64, StepPlan, decode_constants
from .update import SMALL_BATCH


class PlanConstants:
    """Read-only arrays that plans share (never copied): the contract's empties. Decode-only
    plans take the rest from ``decode_constants(n)``, the same objects for every plan of n
    requests (``n`` here, the most a plan holds, is not needed any more)."""

    def __init__(self, n: int):
        self.empty_i32, self.empty_i64 = EMPTY_I32, EMPTY_I64


class PlanAssembly:
    def _take_drops(self, n: int) -> list[int]:
        """Drop notices ride on the next plan that has requests: an empty plan may never
        reach the runtime, and only a plan with requests can reuse the dropped blocks."""
        if n == 0:
            return []
        dropped, self._to_drop = self._to_drop, []
        return dropped

    def _build_plan(self, dec_slots, grown, entries, loads) -> StepPlan:
        """Assemble the StepPlan: decodes first (slot order), then prefill chunks, then the
        requests whose whole KV arrives from elsewhere (entries with no tokens)."""
        if not entries and not loads:
            return self._decode_plan(dec_slots, grown)
        remote = [ld for ld in loads if self.requests[ld[0]].state is RequestState.WAITING_FOR_KV]
        n_dec, n_pre = len(dec_slots), len(entries)
        n = n_dec + n_pre + len(remote)
        self._step += 1
        # Python lists, one array each at the end: a handful of requests (most such plans)
        # would pay numpy's per-call cost on every field.
        dec = dec_slots.tolist()
        if n_dec <= SMALL_BATCH:
            req_ids = [self.s_rid.item(s) for s in dec]
            start_pos = [self.s_ncomp.item(s) - 1 for s in dec]
            block_start = [self.s_nblocks.item(s) - 1 for s in dec]
        else:
            req_ids = self.s_rid[dec_slots].tolist()
            start_pos = (self.s_ncomp[dec_slots] - 1).tolist()
            block_start = (self.s_nblocks[dec_slots] - 1).tolist()
        slots, num_new, samples = list(dec), [1] * n_dec, [True] * n_dec
        tok_parts = [decode_constants(n_dec).placeholders]
        counts = [0] * n_dec
        blk_parts: list[list[int]] = []
        if len(grown[0]):  # grown slots are a subsequence of dec_slots, both ascending
            grew = set(grown[0].tolist())
            counts = [int(s in grew) for s in dec]
            blk_parts.append(grown[1].tolist())
        drafts = None
        for i, e in enumerate(entries, n_dec):
            req, k, start, toks, blks, bstart, sampled = e[:7]
            if len(e) > 7 and e[7]:  # a speculative decode
                if drafts is None:
                    drafts = np.zeros(n, dtype=np.int32)
                drafts[i] = e[7]
            req_ids.append(req.id)
            slots.append(req.slot)
            num_new.append(k)
            start_pos.append(start)
            samples.append(sampled)
            block_start.append(bstart)
            counts.append(len(blks))
            tok_parts.append(toks)
            blk_parts.append(blks)
        for rid, _, _ in remote:
            req = self.requests[rid]
            req_ids.append(rid)
            slots.append(req.slot)
            num_new.append(0)
            start_pos.append(0)
            samples.append(False)
            block_start.append(0)
            counts.append(len(req.blocks))
            blk_parts.append(req.blocks)
        slots_arr = np.array(slots, dtype=np.int32)
        tok_offsets = np.array(list(itertools.accumulate(num_new, initial=0)), dtype=np.int64)
        blk_offsets = np.array(list(itertools.accumulate(counts, initial=0)), dtype=np.int64)
        flat_blocks = blk_parts[0] if len(blk_parts) == 1 else list(itertools.chain.from_iterable(blk_parts))
        dropped = self._take_drops(n)
        total = tok_offsets.item(n)
        if n:  # every plan with requests must be applied; empty ones need not be
            self._plan_epochs[self._step] = self.s_epoch[slots_arr]
            if drafts is not None:
                self._plan_spec[self._step] = drafts
        c = self._const
        if loads:
            load_arr = np.array(loads, dtype=np.int64).reshape(-1, 3)
            load_ids, load_first, load_num = (load_arr[:, 0].copy(), load_arr[:, 1].astype(np.int32),
                                              load_arr[:, 2].astype(np.int32))
        else:
            load_ids, load_first, load_num = c.empty_i64, c.empty_i32, c.empty_i32
        return StepPlan(
            step_id=self._step, req_ids=np.array(req_ids, dtype=np.int64), slots=slots_arr,
            num_new=np.array(num_new, dtype=np.int32), start_pos=np.array(start_pos, dtype=np.int32),
            samples=np.array(samples, dtype=bool),
            token_ids=np.concatenate(tok_parts) if len(tok_parts) > 1 else tok_parts[0].copy(),
            token_offsets=tok_offsets, block_start=np.array(block_start, dtype=np.int32),
            block_ids=np.array(flat_blocks, dtype=np.int32), block_offsets=blk_offsets,
            kv_load_req_ids=load_ids, kv_load_first_block=load_first, kv_load_num_blocks=load_num,
            finished_req_ids=np.array(dropped, dtype=np.int64) if dropped else c.empty_i64,
            num_tokens=total, num_padded_tokens=total,
        )

    def _idle_plan(self) -> StepPlan:
        """The plan ``_decode_plan`` builds for no requests, from shared constants alone."""
        self._step += 1
        k, c = decode_constants(0), self._const
        return StepPlan(
            step_id=self._step, req_ids=c.empty_i64, slots=c.empty_i32, num_new=k.ones,
            start_pos=c.empty_i32, samples=k.trues, token_ids=k.placeholders, token_offsets=k.arange,
            block_start=c.empty_i32, block_ids=c.empty_i32, block_offsets=k.zeros,
        )

    def _decode_plan(self, slots: np.ndarray, grown) -> StepPlan:
        """The common plan, decodes only, from a few gathers and read-only constants."""
        n, c = len(slots), self._const
        if n == 0:  # the same plan, from the constants alone (no drops ride on it)
            return self._idle_plan()
        k = decode_constants(n)
        self._step += 1
        counts_off = k.zeros
        block_ids = c.empty_i32
        if len(grown[0]):  # grown slots are a subsequence of slots, both ascending
            if n <= SMALL_BATCH:  # a running count of membership: no numpy calls
                grew = set(grown[0].tolist())
                counts_off = np.array(list(itertools.accumulate(
                    (s in grew for s in slots.tolist()), initial=0)), dtype=np.int64)
            else:
                counts = np.zeros(n, dtype=np.int64)
                counts[np.searchsorted(slots, grown[0])] = 1
                counts_off = np.zeros(n + 1, dtype=np.int64)
                np.cumsum(counts, out=counts_off[1:])
            block_ids = grown[1].astype(np.int32)
        dropped = self._take_drops(n)
        slots32 = slots.astype(np.int32)
        if n:  # every plan with requests must be applied; empty ones need not be
            self._plan_epochs[self._step] = self.s_epoch[slots]
        if n <= SMALL_BATCH:  # Python ints: three numpy calls fewer
            sl = slots.tolist()
            ncomp, nblocks = self.s_ncomp, self.s_nblocks
            start_pos = np.array([ncomp.item(s) - 1 for s in sl], dtype=np.int32)
            block_start = np.array([nblocks.item(s) - 1 for s in sl], dtype=np.int32)
        else:
            start_pos = self.s_ncomp[slots].astype(np.int32)
            block_start = self.s_nblocks[slots].astype(np.int32)
            start_pos -= 1  # in place on the fresh int32 copies: one temporary fewer
            block_start -= 1
        return StepPlan(
            step_id=self._step, req_ids=self.s_rid[slots], slots=slots32, num_new=k.ones,
            start_pos=start_pos, samples=k.trues, token_ids=k.placeholders, token_offsets=k.arange,
            block_start=block_start, block_ids=block_ids,
            block_offsets=counts_off, spec_tokens=c.empty_i32, spec_offsets=c.empty_i64,
            kv_load_req_ids=c.empty_i64, kv_load_first_block=c.empty_i32, kv_load_num_blocks=c.empty_i32,
            kv_send_req_ids=c.empty_i64,
            finished_req_ids=np.asarray(dropped, dtype=np.int64) if dropped else c.empty_i64,
            num_tokens=n, num_padded_tokens=n,
        )
