"""SchedulerCore's bulk path: k identical decode steps applied at once, for the simulator.

``identical_decode_steps`` says how many upcoming steps repeat the in-flight decode batch;
``decode_run`` adds the round in which the first requests finish, where it can;
``advance(k, tokens)`` applies them with work per round that takes or fills a block, never
per plain step, and is tested equal to k single steps (same tokens, same pool state).
"""

from __future__ import annotations

import numpy as np

from .request import Request
from .step import EMPTY_I64, StepOutputs, StepPlan
from .update import SMALL_BATCH



class BulkDecode:
    # Batches here are a few requests and runs a few blocks long: per-slot state is gathered
    # once into Python ints, since numpy's per-call cost would dominate arrays that short.
    def identical_decode_steps(self) -> int:
        """How many upcoming steps repeat the in-flight decode-only batch (0: none).

        Valid right after ``schedule`` produced a decode-only plan: every active slot is
        decoding, nothing waiting can start (blocks only shrink while nobody finishes), and
        no request reaches its last token sooner.
        """
        k, finishes = self.decode_run()
        return k - 1 if finishes else k

    def decode_run(self) -> tuple[int, bool]:
        """``identical_decode_steps``, and one round more where that round is the one in which
        the first requests finish (their last plan is in flight; the plan made in that round
        leaves them out): (rounds ``advance`` may apply, whether the last of them finishes
        requests). A caller that applies the completion this way needs no single step for it.
        """
        if self.config.num_spec_tokens:  # steps differ by how many drafts each accepts
            return 0, False
        slots = self._active
        if not slots:
            return 0, False
        if self._waiting and self._free_slots and self._could_admit_head():
            return 0, False  # the next schedule starts it (checked first: it is the usual miss)
        dec, nknown_a, ncomp_a, stop = self.s_decodable, self.s_nknown, self.s_ncomp, self.s_stop
        if len(slots) <= SMALL_BATCH:  # one pass, the same checks
            pend_a, maxtotal_a, nblk_a = self.s_prefill_end, self.s_maxtotal, self.s_nblocks
            ncomp, nblk, rem = [], [], []
            for s in slots:
                a, c = nknown_a.item(s), ncomp_a.item(s)
                # decoding, no stop token, one token known past the computed ones, and no
                # one-token prefill chunk left
                if not dec.item(s) or stop.item(s) != -2 or a - c != 1 or c < pend_a.item(s):
                    return 0, False
                ncomp.append(c)
                nblk.append(nblk_a.item(s))
                rem.append(maxtotal_a.item(s) - a)
        else:
            idx = np.array(slots, dtype=np.int64)
            if not dec[idx].all() or (stop[idx] != -2).any():
                return 0, False
            nknown, ncomp = nknown_a[idx].tolist(), ncomp_a[idx].tolist()
            pend, maxtotal = self.s_prefill_end[idx].tolist(), self.s_maxtotal[idx].tolist()
            nblk = self.s_nblocks[idx].tolist()
            if any(a - c != 1 for a, c in zip(nknown, ncomp)):
                return 0, False
            if any(c < e for c, e in zip(ncomp, pend)):
                return 0, False  # a one-token prefill chunk left
            rem = [t - a for t, a in zip(maxtotal, nknown)]
        k = min(rem)
        if k <= 0:
            return 0, False
        got = self._steps_blocks_allow(ncomp, nblk, k)
        if got < k or self._blocks_need(ncomp, nblk, [min(r, k + 1) for r in rem]) > self.pool.num_free:
            return got, False
        # The finishing round schedules only the others, which leaves token budget to a
        # waiting request: it must not be able to start there either (blocks only shrink
        # until then, so what cannot start now with that budget cannot start then).
        if self._waiting and self._free_slots and self._could_admit_head(self.num_running - rem.count(k)):
            return k, False
        return k + 1, True

    def _could_admit_head(self, decodes: int | None = None) -> bool:
        """Whether the next schedule could start the head of the queue, ``decodes`` tokens
        of its budget (all running requests by default) going to decodes."""
        req = self._waiting[0][1]
        if req.remote_kv_tokens and req.num_cached_tokens < 0:
            return True
        # As the next schedule sees it: with this step's caps, not what the last one used
        # (no one reads the caps between schedules; each resets them first).
        self.caps.start_step()
        budget = self.config.max_num_batched_tokens - (self.num_running if decodes is None else decodes)
        return budget > 0 and self._admission_need(req, budget)[2] > 0

    def _blocks_need(self, ncomp: list[int], nblk: list[int], rounds: list[int]) -> int:
        """Blocks the slots take when slot i is scheduled in ``rounds[i]`` more rounds."""
        bs = self.bs
        return sum(max(-(-(c + j) // bs) - b, 0) for c, b, j in zip(ncomp, nblk, rounds))

    def _steps_blocks_allow(self, ncomp: list[int], nblk: list[int], k: int) -> int:
        free = self.pool.num_free

        def need(j: int) -> int:
            return self._blocks_need(ncomp, nblk, [j] * len(ncomp))

        if need(k) <= free:
            return k  # the common case: plenty of free blocks
        lo, hi = 0, k  # largest j <= k whose allocations fit in the free blocks
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if need(mid) <= free:
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
        never per plain step. k may include the round in which requests finish (see
        ``decode_run``): that round's plan leaves them out, and they finish after it is made,
        as in a single step.
        """
        slots = list(self._active)
        n = len(slots)
        self._plan_epochs.clear()  # the one plan in flight is consumed; the new one replaces it
        reqs = [self.s_req[s] for s in slots]
        if n <= SMALL_BATCH:
            ncomp0, nblk0 = [self.s_ncomp.item(s) for s in slots], [self.s_nblocks.item(s) for s in slots]
            nout0, maxout = [self.s_nout.item(s) for s in slots], [self.s_maxout.item(s) for s in slots]
            maxtotal, rids = [self.s_maxtotal.item(s) for s in slots], [self.s_rid.item(s) for s in slots]
        else:
            slot_idx = np.array(slots, dtype=np.int64)
            ncomp0, nblk0 = self.s_ncomp[slot_idx].tolist(), self.s_nblocks[slot_idx].tolist()
            nout0, maxout = self.s_nout[slot_idx].tolist(), self.s_maxout[slot_idx].tolist()
            maxtotal, rids = self.s_maxtotal[slot_idx].tolist(), self.s_rid[slot_idx].tolist()
        pos0 = [t - m + o for t, m, o in zip(maxtotal, maxout, nout0)]
        # Rounds each slot is scheduled in: all k, but a request whose last token is in
        # flight in round k is not scheduled again.
        sched = [min(k, t - c - 1) for t, c in zip(maxtotal, ncomp0)]
        self._flush_tails(slots, reqs, pos0)  # outputs since the last block boundary
        for req, a, row in zip(reqs, nout0, tokens):
            req.output[a : a + k] = row
        bs = self.bs
        extra = [max(-(-(c + j) // bs) - b, 0) for c, b, j in zip(ncomp0, nblk0, sched)]
        last_new = self._advance_blocks(slots, reqs, ncomp0, nblk0, extra, pos0, k)
        if n <= SMALL_BATCH:
            s_nblocks, s_ncomp, s_nknown, s_nout = self.s_nblocks, self.s_ncomp, self.s_nknown, self.s_nout
            for s, e, j, b, c in zip(slots, extra, sched, nblk0, ncomp0):
                s_nblocks[s] = b + e
                s_ncomp[s] = c + j
                s_nknown[s] += j
                s_nout[s] += k
        else:
            self.s_nblocks[slot_idx] += extra
            self.s_ncomp[slot_idx] += sched
            self.s_nknown[slot_idx] += sched
            self.s_nout[slot_idx] += k
        self._step += k - 1
        done = [o + k >= m for o, m in zip(nout0, maxout)]
        # The plan of round k is made before that round's update finishes anyone.
        if any(done):
            keep = [i for i, d in enumerate(done) if not d]
            # A finishing request's output is complete in req.output: its tail is not refilled
            # (nor flushed back when its slot is released).
            self._refill_tails([slots[i] for i in keep], [reqs[i] for i in keep], [pos0[i] + k for i in keep])
            live = np.array([slots[i] for i in keep], dtype=np.int64)
            plan = self._build_plan(live, self._still_owned(last_new, live) if keep else (EMPTY_I64, EMPTY_I64),
                                    [], [])
            idx = [i for i, d in enumerate(done) if d]
            finished = self._finish_slots(np.array([slots[i] for i in idx], dtype=np.int64), tokens[idx, -1],
                                          flushed=True)
        else:
            self._refill_tails(slots, reqs, [p + k for p in pos0])
            plan = self._build_plan(np.array(slots, dtype=np.int64), last_new, [], [])
            finished = ()
        rid_arr = np.array(rids, dtype=np.int64)
        first = [i for i, o in enumerate(nout0) if o == 0]
        out = StepOutputs(
            req_ids=rid_arr, num_tokens=np.full(n, k, np.int32), token_ids=tokens.ravel(),
            finished=finished, first_token_ids=rid_arr[first] if first else EMPTY_I64,
        )
        return out, plan

    def _advance_blocks(self, slots, reqs, ncomp0, nblk0, extra, pos0, k):
        """Take and fill the blocks of k decode steps. In round r a single step first takes
        the blocks plan r feeds into, then closes the blocks the token confirmed for plan
        r-1 fills; returns (slots, blocks) taken in round k: the new plan's block deltas."""
        bs = self.bs
        # (round, owner): plan r is the first to feed a slot of the block
        allocs = sorted((b * bs - c + 1, i) for i, (c, nb, e) in enumerate(zip(ncomp0, nblk0, extra))
                        for b in range(nb, nb + e))
        closes: list[tuple[int, int]] = []  # (round, owner): the token confirmed in round r ends a block
        chains = {}
        if self.config.enable_prefix_caching:
            for i, p in enumerate(pos0):
                c0 = (bs - (p + 1) % bs) % bs
                if c0 < k:
                    cols = range(c0, k, bs)
                    closes += [(col + 1, i) for col in cols]
                    first = (p + c0 + 1) // bs - 1
                    chains[i] = [None, None, first, 0, []] if self._hashes_deferred(reqs[i]) else \
                        self._close_chain(reqs[i], first, len(cols))
            closes.sort()
        last_owners, last_blocks = [], []
        ai = ci = 0
        while ai < len(allocs) or ci < len(closes):
            r = min(allocs[ai][0] if ai < len(allocs) else k + 1, closes[ci][0] if ci < len(closes) else k + 1)
            aj = ai
            while aj < len(allocs) and allocs[aj][0] == r:
                aj += 1
            if aj > ai:
                got = self.pool.allocate(aj - ai)
                for (_, i), block in zip(allocs[ai:aj], got):
                    reqs[i].blocks.append(block)
                if r == k:
                    last_owners, last_blocks = [slots[i] for _, i in allocs[ai:aj]], got
                ai = aj
            while ci < len(closes) and closes[ci][0] == r:
                self._close_next(reqs[closes[ci][1]], chains[closes[ci][1]])
                ci += 1
        for req, chain in zip([reqs[i] for i in chains], chains.values()):
            if chain[4]:  # the rows appended, a contiguous run of the chain's hashes
                req.block_hashes = np.concatenate([req.block_hashes, chain[0][chain[4][0] : chain[4][-1] + 1]])
        return np.array(last_owners, dtype=np.int64), np.array(last_blocks, dtype=np.int64)

    def _close_chain(self, req: Request, first: int, m: int) -> list:
        """Hashes of the m consecutive blocks from ``first`` that decoding closes, as
        ``_publish_generated`` would compute them one at a time; returns the state
        ``_close_next`` walks: [hashes, accumulators, first index, next position, positions
        of the hashes appended to the request's chain]."""
        bs = self.bs
        blocks = self._known_tokens(req, first * bs, (first + m) * bs).reshape(m, bs)
        if first == len(req.block_hashes):  # the usual case: each block extends the chain
            hashes, accs = self.hasher.extend_chain(req.hash_acc, blocks, first)
            return [hashes, accs, first, 0, []]
        # A recompute re-closing known blocks: each from the accumulator of the time.
        hashes, accs, acc, n = [], [], req.hash_acc, len(req.block_hashes)
        for j in range(m):
            h, a = self.hasher.extend(acc[None], blocks[j : j + 1], np.array([first + j]))
            hashes.append(h[0])
            accs.append(a[0])
            if first + j == n:
                acc, n = a[0], n + 1
        return [np.array(hashes), accs, first, 0, []]

    def _close_next(self, req: Request, chain: list) -> None:
        hashes, accs, first, j, appended = chain
        chain[3] = j + 1
        index = first + j
        if hashes is None:  # hashed when the request is preempted (``_hashes_deferred``)
            if index < len(req.blocks):
                self.pool.cache_unhashed([req.blocks[index]])
            return
        if index < len(req.blocks):
            self.pool.cache([req.blocks[index]], hashes[j][None], index=not req.private_prefix)
        if index == len(req.block_hashes) + len(appended):  # block_hashes grows at the end
            appended.append(j)
            req.hash_acc = accs[j]

    def _flush_tails(self, slots: list[int], reqs: list[Request], end: list[int]) -> None:
        """Copy the confirmed outputs of each open block from s_tail into req.output."""
        for slot, req, e in zip(slots, reqs, end):
            lo = max(e - e % self.bs, req.prompt_len)
            if e > lo:
                req.output[lo - req.prompt_len : e - req.prompt_len] = self.s_tail[
                    slot, lo % self.bs : lo % self.bs + e - lo
                ]

    def _refill_tails(self, slots: list[int], reqs: list[Request], end: list[int]) -> None:
        for slot, req, e in zip(slots, reqs, end):
            lo = e - e % self.bs
            self.s_tail[slot, : e - lo] = self._known_tokens(req, lo, e)

    def _hashes_deferred(self, req: Request) -> bool:
        """Whether ``req``'s blocks are cached before the pool learns their hashes (and its
        output blocks before they are hashed at all): a private request's are looked up by
        nobody, and only a host tier (which offloads evicted blocks by hash) or the request's
        own readmission after a preemption (``_fill_deferred_hashes``) reads them."""
        return req.private_prefix and self.pool.host is None

    def _fill_deferred_hashes(self, req: Request) -> None:
        """Hash the output blocks ``req`` closed, as closing them would have, and give the
        pool the hashes of every block it cached for it."""
        slot, bs = req.slot, self.bs
        first, n = len(req.block_hashes), (self.s_maxtotal.item(slot) - self.s_maxout.item(slot)
                                           + self.s_nout.item(slot)) // bs
        if n > first:
            blocks = self._known_tokens(req, first * bs, n * bs).reshape(n - first, bs)
            hashes, accs = self.hasher.extend_chain(req.hash_acc, blocks, first)
            req.block_hashes = np.concatenate([req.block_hashes, hashes])
            req.hash_acc = accs[-1]
        held = req.blocks[: len(req.block_hashes)]
        self.pool.fill_hashes(held, req.block_hashes[: len(held)])

    def _publish_generated(self, reqs: list[Request], index: np.ndarray, blocks: np.ndarray) -> None:
        deferred = [self._hashes_deferred(r) for r in reqs]
        if any(deferred):  # hashed if their request is preempted
            for r, i, later in zip(reqs, index.tolist(), deferred):
                if later and i < len(r.blocks):
                    self.pool.cache_unhashed([r.blocks[i]])
            keep = [not later for later in deferred]
            if not any(keep):
                return
            reqs, index, blocks = [r for r, k in zip(reqs, keep) if k], index[keep], blocks[keep]
        # Blocks close in order, so each chain extends from the accumulator of its last block.
        parents = np.array([r.hash_acc for r in reqs])  # np.stack's checks cost ~5 us more
        hashes, accs = self.hasher.extend(parents, blocks, index)
        for r, i, h, a in zip(reqs, index.tolist(), hashes, accs):
            if i < len(r.blocks):
                self.pool.cache([r.blocks[i]], h[None], index=not r.private_prefix)
            if i == len(r.block_hashes):  # a recompute after preemption re-closes known blocks
                r.block_hashes = np.concatenate([r.block_hashes, h[None]])
                r.hash_acc = a
