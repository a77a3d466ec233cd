"""SchedulerCore: continuous batching for one DP rank, sans-I/O.

``schedule(now) -> StepPlan`` decides the next step; ``update(plan, result, now) ->
StepOutputs`` applies what the runtime did. With async scheduling the shell calls
``schedule`` for step N+1 before step N's result arrives: the core counts one placeholder
token per running request (``Request.num_known``) and reconciles in ``update``, where
results for requests that finished or were preempted meanwhile are dropped by checking the
slot's owner.

Decode is kept off the per-request Python path: running requests sit in stable batch slots
whose counters are numpy arrays, so a decode step is a handful of vector operations; Python
work per request happens only at events (admission, a block boundary, finishing).
``advance(k, tokens)`` applies k identical decode steps at once for the simulator.
"""

from __future__ import annotations

import bisect
import heapq

import numpy as np

from .admission import AdmissionCaps
from .block_pool import BlockPool
from .bulk import BulkDecode
from .config import SchedulerConfig
from .decode import DecodeScheduling
from .hashing import BlockHasher
from .plans import PlanAssembly, PlanConstants
from .request import FinishReason, Request, RequestError, RequestState, SamplingParams
from .spec import SpecDecoding
from .step import EMPTY_I64, StepPlan
from .update import UpdatePath


class SchedulerCore(PlanAssembly, DecodeScheduling, BulkDecode, UpdatePath, SpecDecoding):
    def __init__(self, config: SchedulerConfig, hasher: BlockHasher):
        if hasher.block_size != config.block_size:
            raise ValueError(f"the hasher hashes blocks of {hasher.block_size} tokens but "
                             f"scheduler.block_size is {config.block_size}: build both from one config")
        self.config = config
        self.hasher = hasher
        self.bs = config.block_size
        self.pool = BlockPool(config.num_blocks, enable_prefix_cache=config.enable_prefix_caching,
                              host_blocks=config.host_cache_blocks)
        self.caps = AdmissionCaps(config)
        self.requests: dict[int, Request] = {}
        self._waiting: list[tuple[tuple[int, int], Request]] = []
        self._seq = 0
        self._step = 0
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which were cached (on the GPU or in the host tier)
        self.host_hits = 0  # of which came from the host tier
        self._to_drop: list[int] = []  # tell the runtime: forget these requests
        # P/D prefill side: finished requests' blocks kept for the decode side to pull
        # (request id -> blocks, one reference each) until ``release_held``.
        self.held: dict[int, list[int]] = {}
        self._preempted_this_step = False
        self._scored_left = config.max_scored_tokens_per_step
        self._prefilling: set[int] = set()  # slots with prompt (or recompute) tokens left
        self._chunked_now: set[int] = set()  # slots given a prefill chunk in this schedule
        n = config.max_num_seqs
        self._free_slots = list(range(n - 1, -1, -1))
        self.s_req: list[Request | None] = [None] * n
        self.s_rid = np.full(n, -1, dtype=np.int64)
        self.s_epoch = np.zeros(n, dtype=np.int64)  # bumped when a slot is taken or released
        self._plan_epochs: dict[int, np.ndarray] = {}  # step id -> s_epoch of its slots
        self.s_active = np.zeros(n, dtype=bool)
        self._active: list[int] = []  # s_active's slots, ascending: batches are mostly small
        self.s_decodable = np.zeros(n, dtype=bool)  # RUNNING (not waiting for KV)
        self.s_ncomp = np.zeros(n, dtype=np.int64)
        # Tokens known when the request took its slot (prompt, plus output kept over a
        # preemption): positions below it are prefilled with their real ids; positions from
        # it on were sampled here and are fed as PLACEHOLDER by decode steps.
        self.s_prefill_end = np.zeros(n, dtype=np.int64)
        self.s_nknown = np.zeros(n, dtype=np.int64)
        self.s_nout = np.zeros(n, dtype=np.int64)
        self.s_nblocks = np.zeros(n, dtype=np.int64)
        self.s_maxtotal = np.zeros(n, dtype=np.int64)
        self.s_maxout = np.zeros(n, dtype=np.int64)
        self.s_stop = np.full(n, -2, dtype=np.int64)  # eos id, or -2 when ignored
        self.s_tail = np.zeros((n, self.bs), dtype=np.int32)  # tokens of the open block
        self._const = PlanConstants(n)
        self._init_spec()

    # -- intake --------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request, or raise RequestError naming what is wrong (nothing is queued)."""
        self.check_request(req)
        if req.hash_acc is None or len(req.block_hashes) != req.prompt_len // self.bs:
            req.block_hashes, req.hash_acc = self.hasher.hash_prompt(req.prompt, req.cache_salt)
        req.seq = self._seq
        self._seq += 1
        req.state = RequestState.WAITING
        req.output = np.empty(req.params.max_tokens, dtype=np.int32)
        self.requests[req.id] = req
        self._push_waiting(req)

    def check_request(self, req: Request) -> None:
        """Raise RequestError naming what is wrong with ``req`` here, as ``add_request`` would."""
        if req.id in self.requests:
            raise RequestError(f"request id {req.id} is already in this scheduler")
        prompt = req.prompt
        if not isinstance(prompt, np.ndarray) or prompt.dtype != np.int32 or prompt.ndim != 1:
            raise RequestError(f"request {req.id}: prompt must be a 1-D int32 numpy array, got "
                               f"{type(prompt).__name__} {getattr(prompt, 'dtype', '')}")
        if len(prompt) == 0:
            raise RequestError(f"request {req.id}: prompt must hold at least one token")
        if not isinstance(req.params, SamplingParams):  # (made, it was checked: it is frozen)
            raise RequestError(f"request {req.id}: params must be a SamplingParams, got {type(req.params).__name__}")
        if req.params.max_tokens is None:  # (the engine's Frontend fills it in from the context)
            raise RequestError(f"request {req.id}: max_tokens must be a number here (None is the engine's: "
                               "what the context leaves)", field="max_tokens")
        if not 0 <= req.remote_kv_tokens <= len(prompt):
            raise RequestError(f"request {req.id}: remote_kv_tokens must be in [0, prompt length "
                               f"{len(prompt)}], got {req.remote_kv_tokens}")
        blocks = -(-req.max_total // self.bs)
        room = self.config.request_blocks
        if blocks > room:
            raise RequestError(
                f"request {req.id}: prompt + max_tokens needs {blocks} KV blocks, but this rank "
                f"can give one request at most {room}; shorten it or add KV capacity",
                reason="kv_capacity",
            )
        if req.max_total > self.config.max_model_len:
            raise RequestError(
                f"request {req.id}: prompt ({req.prompt_len}) + max_tokens "
                f"({req.params.max_tokens}) exceeds max_model_len {self.config.max_model_len}",
                reason="context_length",
            )

    def abort(self, req_id: int) -> bool:
        req = self.requests.get(req_id)
        if req is None:
            return False
        if req.slot >= 0:
            self._release(req)
        else:
            self._waiting = [e for e in self._waiting if e[1] is not req]
            heapq.heapify(self._waiting)
        self._finish(req, FinishReason.ABORT)
        return True

    # -- queries -------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return self.config.max_num_seqs - len(self._free_slots)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return bool(self._waiting) or bool(self._active)

    @property
    def num_waiting_for_kv(self) -> int:
        """Requests whose blocks are allocated and whose KV is being pulled from elsewhere."""
        return int((self.s_active & ~self.s_decodable).sum()) if self.s_active.any() else 0

    def release_held(self, req_id: int) -> bool:
        """Free the blocks a finished ``hold_kv`` request kept (the decode side pulled them,
        gave up, or a timeout passed). False if nothing was held for it."""
        blocks = self.held.pop(req_id, None)
        if blocks is None:
            return False
        self.pool.free(blocks[::-1])
        return True

    def load(self) -> int:
        """Tokens this rank still has to hold: for least-loaded routing."""
        return int((self.s_nknown[self.s_active]).sum()) + sum(
            r.prompt_len for _, r in self._waiting
        )

    # -- schedule ------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        if not self._active and not self._waiting and not self.config.num_spec_tokens:
            self._preempted_this_step = False  # an idle rank (a DEP instance has many)
            self._chunked_now.clear()
            return self._idle_plan()
        budget = self.config.max_num_batched_tokens
        self._scored_left = self.config.max_scored_tokens_per_step  # prompt tokens scored (prompt logprobs)
        entries: list[tuple] = []  # (req, n_new, tokens, new_blocks, block_start)
        if self.config.num_spec_tokens:  # decodes with drafts: entries like prefill chunks
            dec_slots, grown = EMPTY_I64, (EMPTY_I64, EMPTY_I64)
            budget = self._schedule_spec_decodes(budget, entries)
        else:
            dec_slots, grown = self._schedule_decodes(budget)
            budget -= len(dec_slots)
        dec_rids = self.s_rid[dec_slots]
        budget = self._schedule_prefills(budget, entries)
        # No admissions in a step that preempted: they would take the blocks just freed.
        loads = [] if self._preempted_this_step else self._admit_waiting(budget, entries, now)
        if self._preempted_this_step:  # drop what was scheduled for requests preempted since
            keep = self.s_rid[dec_slots] == dec_rids
            dec_slots = dec_slots[keep]
            grown = self._still_owned(grown, dec_slots)
            assert all(e[0].slot >= 0 for e in entries), "a scheduled prefill was preempted"
        self._preempted_this_step = False
        self._chunked_now.clear()
        return self._build_plan(dec_slots, grown, entries, loads)

    def _schedule_prefills(self, budget: int, entries: list) -> int:
        if not self._prefilling:
            return budget
        for slot in sorted(self._prefilling, key=lambda s: self._key(self.s_req[s])):
            if budget <= 0:
                break
            req = self.s_req[slot]
            if req is None or not self.s_decodable[slot]:  # preempted, or waiting for KV
                continue
            n = min(budget, req.num_known - req.num_computed)
            scored = req.params.prompt_logprobs is not None
            if scored:  # its rows must fit the step's result
                n = min(n, self._scored_left)
                if n <= 0:
                    continue
            start = len(req.blocks)
            if not self._grow_blocks(req, req.num_computed + n, preempt=True):
                continue
            if scored:
                self._scored_left -= n
            # Its blocks are published now; preempting it later in this step would leave
            # hashes naming KV that is never computed.
            self._chunked_now.add(slot)
            entries.append(self._prefill_entry(req, n, start))
            budget -= n
        return budget

    def _admit_waiting(self, budget: int, entries: list, now: float) -> list[int]:
        loads: list[tuple[int, int, int]] = []  # (request id, first block, blocks) to load
        if not self._waiting:
            return loads
        self.caps.start_step()
        while self._waiting and self._free_slots:
            req = self._waiting[0][1]
            if req.remote_kv_tokens and req.num_cached_tokens < 0:
                if not self.caps.may_start_kv_load():
                    break
                if not self._start_kv_load(req):
                    break
                loads.append((req.id, 0, len(req.blocks)))
                continue
            if budget <= 0 or not self.caps.may_start_prefill():
                break
            scored = req.params.prompt_logprobs is not None
            if scored and self._scored_left <= 0:
                break
            n, host = self._admit_one(req, min(budget, self._scored_left) if scored else budget)
            if n == 0:
                break
            if scored:
                self._scored_left -= n
            if host:  # the host blocks sit right after the GPU-cached ones
                loads.append((req.id, req.num_computed // self.bs - host, host))
            entries.append(self._prefill_entry(req, n, 0))
            budget -= n
        return loads

    def _admit_one(self, req: Request, budget: int) -> tuple[int, int]:
        """Match the prefix cache and take blocks for the first chunk.

        Returns (tokens of the first chunk, blocks to load from the host tier); a chunk of
        0 means the request cannot start this step.
        """
        hit, host, n, need = self._admission_need(req, budget)
        if n == 0:
            return 0, 0
        heapq.heappop(self._waiting)
        cached = (len(hit) + host) * self.bs
        if req.num_cached_tokens < 0:  # count each request once, as vLLM does
            self.prefix_queries += req.num_known
            self.prefix_hits += cached
            self.host_hits += host * self.bs
        self.pool.touch(hit)
        if host:  # most recently used before allocating, whose evictions go to the host tier
            self.pool.match_host(req.block_hashes[: len(hit) + host], len(hit), touch=True)
        req.blocks = hit + self.pool.allocate(need)
        req.num_computed = cached
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = cached
        self._take_slot(req)
        self.caps.note_prefill()
        if host:
            self.caps.note_kv_load()
            req.host_load_first = len(hit)  # publication waits for the runtime's report
        return n, host

    def _admission_need(self, req: Request, budget: int) -> tuple[list[int], int, int, int]:
        """(GPU-cached blocks, host-cached blocks, first chunk, new blocks); chunk 0 if the
        request cannot start now.

        A request starts only if the blocks for its whole known sequence fit next to what the
        prefills already running still need (plus a watermark): starting prefills that later
        chunks cannot feed only leads to preemption and recompute. Blocks found in the host
        tier are loaded, which counts against ``max_kv_loads_per_step``.
        """
        bs = self.bs
        # The last token must be computed for logits; with prompt logprobs, every one.
        max_hit = (req.num_known - 1) // bs if req.params.prompt_logprobs is None else 0
        hashes = req.block_hashes[:max_hit]
        hit = req.prefix_hint = self.pool.match_prefix(hashes, req.prefix_hint)
        host = self.pool.match_host(hashes, len(hit))
        if host and not self.caps.may_start_kv_load():
            return hit, 0, 0, 0  # wait for the next step rather than recompute cached KV
        cached = len(hit) + host
        n = min(budget, req.num_known - cached * bs)
        need = -(-(cached * bs + n) // bs) - len(hit)
        need_all = -(-req.num_known // bs) - len(hit)
        reserve = int(self.config.watermark * self.pool.num_blocks) + self._prefill_debt()
        evictable_hits = int((self.pool.ref[hit] == 0).sum()) if hit else 0
        if need_all + evictable_hits + reserve > self.pool.num_free:
            return hit, 0, 0, 0
        return hit, host, n, need

    def _prefill_debt(self) -> int:
        """Blocks the running prefills still need to reach the end of their known tokens."""
        if not self._prefilling:
            return 0
        act = self.s_decodable & (self.s_ncomp < self.s_prefill_end)
        if not act.any():
            return 0
        return int((-(-self.s_nknown[act] // self.bs) - self.s_nblocks[act]).sum())

    def _start_kv_load(self, req: Request) -> bool:
        need = -(-req.remote_kv_tokens // self.bs)
        if need > self.pool.num_free:
            return False
        heapq.heappop(self._waiting)
        req.blocks = self.pool.allocate(need)
        req.num_cached_tokens = 0
        self._take_slot(req)
        req.state = RequestState.WAITING_FOR_KV  # after _take_slot, which marks it running
        self.s_decodable[req.slot] = False
        self.caps.note_kv_load()
        return True

    def _grow_blocks(self, req: Request, upto_tokens: int, *, preempt: bool) -> bool:
        need = -(-upto_tokens // self.bs) - len(req.blocks)
        while need > self.pool.num_free:
            victim = self._pick_victim(worse_than=req) if preempt else None
            if victim is None:
                return False
            self._preempt(victim)
        if need > 0:
            req.blocks.extend(self.pool.allocate(need))
            self.s_nblocks[req.slot] = len(req.blocks)
        return True

    def _prefill_entry(self, req: Request, n: int, block_start: int) -> tuple:
        start = req.num_computed
        tokens = self._known_tokens(req, start, start + n)
        req.num_computed += n
        slot = req.slot
        self.s_ncomp[slot] = req.num_computed
        self._publish_prompt_blocks(req, start)
        sampled = req.num_computed == req.num_known
        if sampled:
            self._prefilling.discard(slot)
            req.num_known += 1
            self.s_nknown[slot] = req.num_known
        return (req, n, start, tokens, req.blocks[block_start:], block_start, sampled)

    def _publish_prompt_blocks(self, req: Request, old_computed: int) -> None:
        if req.host_load_first >= 0:  # KV built on a load not yet confirmed: not yet
            return
        lo, hi = old_computed // self.bs, req.num_computed // self.bs
        if hi > lo and self.config.enable_prefix_caching:
            hashes = req.block_hashes  # prompt blocks, then output blocks as they close
            hi = min(hi, len(hashes))
            if self._hashes_deferred(req):
                self.pool.cache_unhashed(req.blocks[lo:hi])
            else:
                self.pool.cache(req.blocks[lo:hi], hashes[lo:hi], index=not req.private_prefix)

    # -- slots, preemption, finishing ----------------------------------------------------
    def _take_slot(self, req: Request) -> None:
        slot = self._free_slots.pop()
        req.slot = slot
        req.state = RequestState.RUNNING
        self.s_req[slot] = req
        self.s_rid[slot] = req.id
        self.s_epoch[slot] += 1
        self.s_active[slot] = True
        bisect.insort(self._active, slot)
        self.s_decodable[slot] = True
        self.s_ncomp[slot] = req.num_computed
        self.s_nknown[slot] = req.num_known
        self.s_prefill_end[slot] = req.num_known
        if req.num_computed < req.num_known:
            self._prefilling.add(slot)
        self.s_nout[slot] = req.num_output
        self.s_nblocks[slot] = len(req.blocks)
        self.s_maxout[slot] = req.params.max_tokens
        self.s_maxtotal[slot] = req.max_total
        ignore = req.params.ignore_eos or req.eos_token_id < 0
        self.s_stop[slot] = -2 if ignore else req.eos_token_id
        known = req.prompt_len + req.num_output
        lo = known - known % self.bs
        self.s_tail[slot, : known - lo] = self._known_tokens(req, lo, known)

    def _release(self, req: Request, *, flushed: bool = False) -> None:
        """Give back the slot and blocks; keep confirmed output in the request (``flushed``:
        it is there already, the open block's tokens included)."""
        slot = req.slot
        req.num_output = self.s_nout.item(slot)
        if not flushed:
            self._flush_tails([slot], [req], [req.prompt_len + req.num_output])
        self.pool.free(req.blocks[::-1], distinct=True)
        req.blocks = []
        self._prefilling.discard(slot)
        self.s_req[slot] = None
        self.s_rid[slot] = -1
        self.s_epoch[slot] += 1
        self.s_active[slot] = False
        self._active.remove(slot)
        self.s_decodable[slot] = False
        self._free_slots.append(slot)
        req.slot = -1
        self._to_drop.append(req.id)

    def _pick_victim(self, worse_than: Request | None = None) -> Request | None:
        best = None
        for slot in np.flatnonzero(self.s_active & self.s_decodable).tolist():
            if slot in self._chunked_now:
                continue
            req = self.s_req[slot]
            if best is None or self._key(req) > self._key(best):
                best = req
        if worse_than is not None and (best is None or self._key(best) <= self._key(worse_than)):
            return None
        if best is None:
            raise RuntimeError("out of KV blocks with nothing to preempt")
        return best

    def _preempt(self, req: Request) -> None:
        self._preempted_this_step = True
        if req.private_prefix:  # readmitted, it looks up its own cached blocks
            if self._hashes_deferred(req):
                self._fill_deferred_hashes(req)
            self.pool.index(req.blocks)
            req.private_prefix = False
        self._release(req)
        req.num_computed = 0
        req.num_known = req.prompt_len + req.num_output
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.state = RequestState.WAITING
        self._push_waiting(req)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.id, None)

    def _key(self, req: Request) -> tuple[int, int]:
        prio = req.priority if self.config.policy == "priority" else 0
        return (prio, req.seq)

    def _push_waiting(self, req: Request) -> None:
        heapq.heappush(self._waiting, (self._key(req), req))

    # -- token and hash views --------------------------------------------------------------
    def _known_tokens(self, req: Request, lo: int, hi: int) -> np.ndarray:
        p = req.prompt_len
        if hi <= p:
            return req.prompt[lo:hi]
        if lo >= p:  # a view, as the prompt's: no concatenate for an output-only range
            return req.output[lo - p : hi - p]
        head = req.prompt[lo:p] if lo < p else req.prompt[:0]
        return np.concatenate([head, req.output[max(lo - p, 0) : hi - p]])

    # -- invariants ------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs = np.zeros(self.pool.num_blocks, dtype=np.int64)
        assert self._active == np.flatnonzero(self.s_active).tolist(), "active slot list out of date"
        for slot in self._active:
            req = self.s_req[slot]
            assert req is not None and req.slot == slot and self.s_rid[slot] == req.id
            assert self.s_nblocks[slot] == len(req.blocks)
            assert len(req.blocks) * self.bs >= self.s_ncomp[slot], "tokens without KV blocks"
            assert self.s_ncomp[slot] <= self.s_nknown[slot] <= self.s_maxtotal[slot]
            np.add.at(refs, req.blocks, 1)
        for blocks in self.held.values():
            np.add.at(refs, blocks, 1)
        assert (refs == self.pool.refcounts()).all(), "block refcounts do not match request tables"
        assert len(self._free_slots) + int(self.s_active.sum()) == self.config.max_num_seqs
        prefilling = set(np.flatnonzero(self.s_active & (self.s_ncomp < self.s_prefill_end)).tolist())
        assert prefilling == self._prefilling, "prefilling set out of date"
        for _, req in self._waiting:
            assert req.slot == -1 and not req.blocks
