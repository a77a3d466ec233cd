"""SchedulerCore's bulk path: k identical decode steps applied at once, for the simulator.

``identical_decode_steps`` says how many upcoming steps repeat the in-flight decode batch;
``advance(k, tokens)`` applies them with work per round that takes or fills a block, never
per plain step, and is tested equal to k single steps (same tokens, same pool state).
"""

from __future__ import annotations

import numpy as np

from .request import Request
from .step import EMPTY_I64, StepOutputs, StepPlan



class BulkDecode:
    def identical_decode_steps(self) -> int:
        """How many upcoming steps repeat the in-flight decode-only batch (0: none).

        Valid right after ``schedule`` produced a decode-only plan: every active slot is
        decoding, nothing waiting can start (blocks only shrink while nobody finishes), and
        no request reaches its last token sooner.
        """
        act = self.s_active
        if not act.any() or not (self.s_decodable[act]).all():
            return 0
        if ((self.s_nknown - self.s_ncomp)[act] != 1).any() or (self.s_stop[act] != -2).any():
            return 0
        if (self.s_ncomp[act] < self.s_prefill_end[act]).any():  # a one-token prefill chunk left
            return 0
        if self._waiting and self._free_slots and self._could_admit_head():
            return 0
        k = int((self.s_maxtotal - self.s_nknown)[act].min())
        if k <= 0:
            return 0
        return self._steps_blocks_allow(np.flatnonzero(act), k)

    def _could_admit_head(self) -> bool:
        req = self._waiting[0][1]
        if req.remote_kv_tokens and req.num_cached_tokens < 0:
            return True
        budget = self.config.max_num_batched_tokens - self.num_running
        return budget > 0 and self._admission_need(req, budget)[2] > 0

    def _steps_blocks_allow(self, slots: np.ndarray, k: int) -> int:
        free = self.pool.num_free
        ncomp, nblk = self.s_ncomp[slots], self.s_nblocks[slots]
        if int((-(-(ncomp + k) // self.bs) - nblk).clip(0).sum()) <= free:
            return k  # the common case: plenty of free blocks
        lo, hi = 0, k  # largest j <= k whose allocations fit in the free blocks
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if int((-(-(ncomp + mid) // self.bs) - nblk).clip(0).sum()) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def advance(self, k: int, tokens: np.ndarray) -> tuple[StepOutputs, StepPlan]:
        """Apply k identical decode steps at once (async mode, one decode plan in flight).

        Equal to k rounds of: schedule the next plan, then update the in-flight one with
        ``tokens[:, j]`` (shape (n_active, k), slots ascending). Returns the tokens confirmed
        and the plan left in flight. Work is done per round that takes or fills a block (in
        the order single steps would do it, so evictions and publications interleave alike),
        never per plain step.
        """
        slots = np.flatnonzero(self.s_active)
        self._plan_epochs.clear()  # the one plan in flight is consumed; the new one replaces it
        reqs = [self.s_req[s] for s in slots.tolist()]
        ncomp0, nblk0 = self.s_ncomp[slots].copy(), self.s_nblocks[slots].copy()
        nout0, rids = self.s_nout[slots].copy(), self.s_rid[slots].copy()
        pos0 = self.s_nknown_confirmed(slots)
        self._flush_tails(slots, reqs, pos0)  # outputs since the last block boundary
        for req, a, row in zip(reqs, nout0.tolist(), tokens):
            req.output[a : a + k] = row
        extra = (-(-(ncomp0 + k) // self.bs) - nblk0).clip(0)
        last_new = self._advance_blocks(slots, reqs, ncomp0, nblk0, extra, pos0, k)
        self.s_ncomp[slots] += k
        self.s_nknown[slots] += k
        self.s_nout[slots] += k
        self._step += k - 1
        self.s_tail[slots, :] = 0
        self._refill_tails(slots, reqs, pos0 + k)
        done = self.s_nout[slots] >= self.s_maxout[slots]
        finished = self._finish_slots(slots[done], tokens[done, -1]) if done.any() else ()
        out = StepOutputs(
            req_ids=rids, num_tokens=np.full(len(slots), k, np.int32), token_ids=tokens.ravel(),
            finished=finished, first_token_ids=rids[nout0 == 0],
        )
        live = slots[~done]
        plan = self._build_plan(live, self._still_owned(last_new, live), [], [])
        return out, plan

    def _advance_blocks(self, slots, reqs, ncomp0, nblk0, extra, pos0, k):
        """Take and fill the blocks of k decode steps. In round r a single step first takes
        the blocks plan r feeds into, then closes the blocks the token confirmed for plan
        r-1 fills; returns (slots, blocks) taken in round k: the new plan's block deltas."""
        bs = self.bs
        total = int(extra.sum())
        owner = np.repeat(np.arange(len(slots)), extra)
        first = np.repeat(np.cumsum(extra) - extra, extra)
        block_no = np.repeat(nblk0, extra) + np.arange(total) - first
        a_round = block_no * bs - np.repeat(ncomp0, extra) + 1  # the plan feeding its first slot
        order = np.lexsort((owner, a_round))
        a_owner, a_round = owner[order], a_round[order]
        if self.config.enable_prefix_caching:  # the token confirmed in round c + 1 ends a block
            c0 = (bs - (pos0 + 1) % bs) % bs
            n_close = np.where(c0 < k, (k - 1 - c0) // bs + 1, 0)
            c_owner = np.repeat(np.arange(len(slots)), n_close)
            rank = np.arange(int(n_close.sum())) - np.repeat(np.cumsum(n_close) - n_close, n_close)
            c_col = np.repeat(c0, n_close) + rank * bs
            c_round = c_col + 1
            c_index = (np.repeat(pos0, n_close) + c_col + 1) // bs - 1
            corder = np.lexsort((c_owner, c_round))
            c_owner, c_round, c_index = c_owner[corder], c_round[corder], c_index[corder]
        else:
            c_round = EMPTY_I64
        got_all = []
        for r in sorted(set(a_round.tolist()) | set(c_round.tolist())):
            lo, hi = np.searchsorted(a_round, [r, r + 1])
            if hi > lo:
                got = self.pool.allocate(int(hi - lo))
                for i, block in zip(a_owner[lo:hi].tolist(), got):
                    reqs[i].blocks.append(block)
                got_all.extend(got)
            lo, hi = np.searchsorted(c_round, [r, r + 1])
            if hi > lo:
                sel = [reqs[i] for i in c_owner[lo:hi].tolist()]
                index = c_index[lo:hi]
                blocks = np.stack([self._known_tokens(q, i * bs, (i + 1) * bs)
                                   for q, i in zip(sel, index.tolist())])
                self._publish_generated(sel, index, blocks)
        self.s_nblocks[slots] += extra
        in_last = a_round == k
        return slots[a_owner[in_last]], np.asarray(got_all, dtype=np.int64)[in_last]

    def _flush_tails(self, slots: np.ndarray, reqs: list[Request], end: np.ndarray) -> None:
        """Copy the confirmed outputs of each open block from s_tail into req.output."""
        for slot, req, e in zip(slots.tolist(), reqs, end.tolist()):
            lo = max(e - e % self.bs, req.prompt_len)
            if e > lo:
                req.output[lo - req.prompt_len : e - req.prompt_len] = self.s_tail[
                    slot, lo % self.bs : lo % self.bs + e - lo
                ]

    def _refill_tails(self, slots: np.ndarray, reqs: list[Request], end: np.ndarray) -> None:
        for slot, req, e in zip(slots.tolist(), reqs, end.tolist()):
            lo = e - e % self.bs
            self.s_tail[slot, : e - lo] = self._known_tokens(req, lo, e)

    def _publish_generated(self, reqs: list[Request], index: np.ndarray, blocks: np.ndarray) -> None:
        # Blocks close in order, so each chain extends from the accumulator of its last block.
        parents = np.stack([r.hash_acc for r in reqs])
        hashes, accs = self.hasher.extend(parents, blocks, index)
        for r, i, h, a in zip(reqs, index.tolist(), hashes, accs):
            if i < len(r.blocks):
                self.pool.cache([r.blocks[i]], h[None])
            if i == len(r.block_hashes):  # a recompute after preemption re-closes known blocks
                r.block_hashes = np.concatenate([r.block_hashes, h[None]])
                r.hash_acc = a
