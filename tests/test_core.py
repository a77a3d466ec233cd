"""SchedulerCore driven by a fake runtime that really keeps a KV cache.

The fake runtime executes every plan the way a GPU worker would: it keeps each request's
block table from the plans, resolves PLACEHOLDER to the token it sampled last, writes "KV"
(the token id itself) into the blocks at the fed positions, and checks that every position a
fed token attends to holds the right token. Its "model" is deterministic: the token sampled
after position p is ``truth[p + 1]``, a function of the prefix, so requests with equal
prompts generate equal outputs (and equal generated blocks, which the prefix cache shares).
A prefix-cache hit on wrong content, a wrong block table, a token fed twice or a lost token
all show up as a mismatch against ``truth``.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockstep.policy.config import SchedulerConfig
from lockstep.policy.core import SchedulerCore
from lockstep.policy.hashing import BlockHasher
from lockstep.policy.request import FinishReason, Request, RequestError, RequestState, SamplingParams
from lockstep.policy.step import EMPTY_I64, PLACEHOLDER, StepPlan, StepResult

VOCAB = 50_000
EOS = 1  # never produced by the model except where a spec puts it


# --- workload --------------------------------------------------------------------------------


@attrs.frozen
class Spec:
    rid: int
    prompt: np.ndarray = attrs.field(eq=False)
    max_tokens: int
    arrival: int = 0  # the step (schedule call) before which it is added
    priority: int = 0
    eos_at: int | None = None  # output index where the model emits EOS (request stops there)
    remote_kv: int = 0
    salt: str | None = None
    abort_at: int | None = None
    private: bool = False  # Request.private_prefix

    def request(self) -> Request:
        params = SamplingParams(max_tokens=self.max_tokens, ignore_eos=self.eos_at is None)
        return Request(
            id=self.rid, prompt=self.prompt.astype(np.int32), params=params, priority=self.priority,
            eos_token_id=EOS if self.eos_at is not None else -1, remote_kv_tokens=self.remote_kv,
            cache_salt=self.salt, private_prefix=self.private,
        )

    def truth(self) -> np.ndarray:
        """Prompt then the model's output: each token a function of the two before it."""
        out = list(self.prompt.tolist())
        for j in range(self.max_tokens):
            a, b = out[-1] if out else 7, out[-2] if len(out) > 1 else 11
            out.append((a * 1_000_003 + b * 7_919 + len(out) * 31) % (VOCAB - 2) + 2)
            if j == self.eos_at:
                out[-1] = EOS
        return np.asarray(out, dtype=np.int64)

    def expected_outputs(self) -> int:
        return self.max_tokens if self.eos_at is None else self.eos_at + 1


# --- the fake runtime ------------------------------------------------------------------------


class FakeRuntime:
    def __init__(self, cfg: SchedulerConfig, specs: dict[int, Spec], hasher: BlockHasher, *,
                 check_kv: bool, load_delay: int = 1, fail_loads: frozenset = frozenset(), spec_seed: int = 0):
        self.bs = cfg.block_size
        # Speculative decodes: this runtime "drafts" the true tokens and accepts a random
        # number of them, writing garbage KV where rejected drafts sat.
        self.spec_rng = np.random.default_rng(spec_seed)
        self.spec_accepted: dict[int, int] = {}  # plan entry -> drafts accepted, this step
        self.cfg = cfg
        self.specs = specs
        self.truth = {rid: s.truth() for rid, s in specs.items()}
        # block hashes of each request's whole sequence, to look up host-tier content
        self.hashes = {rid: [tuple(h) for h in hasher.hash_prompt(t, specs[rid].salt)[0].tolist()]
                       for rid, t in self.truth.items()}
        # The host tier's bytes: every full block ever computed, by hash. A superset of what
        # the core's HostTier holds; a load must find its hash here with the right content.
        self.host_store: dict[tuple[int, int], np.ndarray] = {}
        self.host_loads = 0
        self.check_kv = check_kv
        self.load_delay = load_delay
        self.fail_loads = fail_loads
        self.kv = np.full((cfg.num_blocks, self.bs), -1, dtype=np.int64)
        self.tables: dict[int, list[int]] = {}
        self.last: dict[int, tuple[int, int]] = {}  # rid -> (position, token) last sampled
        self.loading: dict[int, int] = {}  # rid -> plans left until its load completes
        self.loads_started: list[int] = []

    def _write(self, rid: int, lo: int, hi: int) -> None:
        table = np.asarray(self.tables[rid], dtype=np.int64)
        pos = np.arange(lo, hi)
        assert len(table) * self.bs >= hi, f"request {rid}: positions up to {hi} without blocks"
        self.kv[table[pos // self.bs], pos % self.bs] = self.truth[rid][pos]

    def _read_ok(self, rid: int, hi: int) -> None:
        table = np.asarray(self.tables[rid], dtype=np.int64)
        pos = np.arange(hi)
        got = self.kv[table[pos // self.bs], pos % self.bs]
        bad = np.flatnonzero(got != self.truth[rid][:hi])
        assert not len(bad), (
            f"request {rid} attends to wrong KV at positions {bad[:8].tolist()}: "
            f"got {got[bad[:8]].tolist()}, want {self.truth[rid][bad[:8]].tolist()}"
        )

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished_req_ids.tolist():
            self.tables.pop(rid, None)
            self.last.pop(rid, None)
            # a dropped request's transfer is cancelled: this runtime can, a real one must
            # wait for it before the freed blocks are written by anyone else
            self.loading.pop(rid, None)
        to, bo = plan.token_offsets, plan.block_offsets
        loads = dict(zip(plan.kv_load_req_ids.tolist(),
                         zip(plan.kv_load_first_block.tolist(), plan.kv_load_num_blocks.tolist())))
        fed = []
        for i in range(plan.num_reqs):  # block tables first
            rid = int(plan.req_ids[i])
            blocks = plan.block_ids[bo[i] : bo[i + 1]].tolist()
            start, k = int(plan.start_pos[i]), int(plan.num_new[i])
            if k == 0:  # a request whose whole KV arrives from elsewhere
                assert rid in loads, f"request {rid}: an entry with no tokens and no load"
                assert loads.pop(rid) == (0, len(blocks))
                self.tables[rid] = blocks
                self.loading[rid] = self.load_delay
                self.loads_started.append(rid)
                continue
            if self.check_kv:
                table = self.tables.setdefault(rid, [])
                bstart = int(plan.block_start[i])
                if blocks:
                    assert bstart <= len(table), f"request {rid}: block_start {bstart} past its table"
                    table[bstart : bstart + len(blocks)] = blocks
            toks0 = plan.token_ids[to[i] : to[i + 1]]
            if self.cfg.num_spec_tokens and k and toks0[0] == PLACEHOLDER and rid in self.last:
                # With speculation a decode goes where the runtime's own count says (the
                # plan may predate the rollback of drafts rejected in the step before).
                actual = self.last[rid][0]
                assert actual <= start, f"request {rid}: tentative start {start} behind {actual}"
                start = actual
            if k > 1 and toks0[0] == PLACEHOLDER:  # a speculative decode with k - 1 drafts
                assert (toks0 == PLACEHOLDER).all()
                actual = start
                acc = int(self.spec_rng.integers(0, k))
                self.spec_accepted[i] = acc
                if self.check_kv:
                    table = self.tables[rid]
                    assert len(table) * self.bs >= actual + k, f"request {rid}: drafts without blocks"
                    pos = np.arange(actual + 1 + acc, actual + k)
                    tb = np.asarray(table, dtype=np.int64)
                    self.kv[tb[pos // self.bs], pos % self.bs] = -7  # rejected drafts' KV
                start, k = actual, 1 + acc
            fed.append((i, rid, start, k))
        for rid, (first, num) in loads.items():  # host-tier loads land before the step runs
            self.host_loads += 1
            if not self.check_kv:
                continue
            assert rid in self.tables and len(self.tables[rid]) >= first + num
            for j in range(first, first + num):
                h = self.hashes[rid][j]
                assert h in self.host_store, f"request {rid}: block {j} loaded from the host tier was never computed"
                self.kv[self.tables[rid][j]] = self.host_store[h]
        for i, rid, start, k in fed:
            if not self.check_kv:
                continue
            toks = plan.token_ids[to[i] : to[i + 1]].astype(np.int64)
            if i in self.spec_accepted:  # the fed token and the accepted drafts: true ones
                toks = self.truth[rid][start : start + k].copy()
                toks[0] = PLACEHOLDER
            if k and toks[0] == PLACEHOLDER:
                # "the token this request sampled in the previous step": there must be one
                assert self.last.get(rid, (-1, 0))[0] == start, (
                    f"request {rid}: PLACEHOLDER at position {start}, but the runtime sampled "
                    f"nothing for that position (last sample: {self.last.get(rid)})")
                toks[0] = self.last[rid][1]
            assert not (toks[1:] == PLACEHOLDER).any()
            want = self.truth[rid][start : start + k]
            assert (toks == want).all(), f"request {rid} fed {toks.tolist()} at {start}, want {want.tolist()}"
            self._write(rid, start, start + k)
            table = self.tables[rid]
            for j in range(start // self.bs, (start + k) // self.bs):
                if j < len(self.hashes[rid]):
                    self.host_store.setdefault(self.hashes[rid][j], self.kv[table[j]].copy())
        done, failed = [], []
        for rid, left in list(self.loading.items()):
            if left > 0:
                self.loading[rid] = left - 1
                continue
            del self.loading[rid]
            if rid in self.fail_loads:
                failed.append(rid)
                continue
            if self.check_kv:
                self._write(rid, 0, self.specs[rid].remote_kv)
                table = self.tables[rid]  # pulled full blocks are published like computed ones
                for j in range(min(self.specs[rid].remote_kv // self.bs, len(self.hashes[rid]))):
                    self.host_store.setdefault(self.hashes[rid][j], self.kv[table[j]].copy())
            done.append(rid)
        if self.check_kv:
            for _, rid, start, k in fed:  # writes of a step precede its reads
                self._read_ok(rid, start + k)
        ns = np.zeros(plan.num_reqs, dtype=np.int32)
        toks = []
        for i, rid, start, k in fed:
            if plan.samples[i]:
                got = [int(self.truth[rid][start + k])]
                if i in self.spec_accepted:  # accepted drafts, then the bonus token
                    got = self.truth[rid][start + 1 : start + k + 1].tolist()
                ns[i] = len(got)
                toks += got
                self.last[rid] = (start + k, got[-1])
        self.spec_accepted.clear()
        return StepResult(
            step_id=plan.step_id, num_sampled=ns, token_ids=np.asarray(toks, dtype=np.int32),
            kv_loads_done=np.asarray(done, dtype=np.int64),
            kv_loads_failed=np.asarray(failed, dtype=np.int64),
        )


# --- the driver --------------------------------------------------------------------------------


@attrs.define
class Run:
    core: SchedulerCore
    reqs: dict[int, Request]
    finished: list[tuple[int, FinishReason, int]]  # (rid, reason, step), in order
    plans: list[StepPlan]
    advanced_steps: int = 0
    steps: int = 0
    runtime: FakeRuntime | None = None


def check_plan(plan: StepPlan, cfg: SchedulerConfig) -> None:
    n = plan.num_reqs
    assert plan.num_tokens <= cfg.max_num_batched_tokens
    assert n <= cfg.max_num_seqs
    assert plan.num_tokens == int(plan.token_offsets[-1]) == int(plan.num_new.sum())
    assert len(plan.token_ids) == plan.num_tokens
    assert len(plan.block_ids) == int(plan.block_offsets[-1])
    assert len(set(plan.req_ids.tolist())) == n, f"a request twice in one plan: {plan.req_ids}"
    assert len(set(plan.slots.tolist())) == n and ((0 <= plan.slots) & (plan.slots < cfg.max_num_seqs)).all()
    if cfg.max_kv_loads_per_step:
        assert len(plan.kv_load_req_ids) <= cfg.max_kv_loads_per_step
    assert (plan.num_new >= 0).all() and (plan.start_pos >= 0).all()


def decode_only(core: SchedulerCore, plan: StepPlan, rt: FakeRuntime) -> bool:
    return (plan.num_reqs == core.num_running and plan.num_reqs > 0 and bool(plan.samples.all())
            and bool((plan.num_new == 1).all()) and not len(plan.kv_load_req_ids) and not rt.loading)


def drive(cfg: SchedulerConfig, specs: list[Spec], *, use_advance=False, sync=False, check_kv=True,
          load_delay=1, fail_loads=frozenset(), max_idle=200, spec_seed=0) -> Run:
    core = SchedulerCore(cfg, BlockHasher(b"test-secret", cfg.block_size))
    by_id = {s.rid: s for s in specs}
    rt = FakeRuntime(cfg, by_id, core.hasher, check_kv=check_kv and not use_advance,
                     load_delay=load_delay, fail_loads=fail_loads, spec_seed=spec_seed)
    arrivals = sorted(specs, key=lambda s: (s.arrival, s.rid))
    aborts = sorted((s.abort_at, s.rid) for s in specs if s.abort_at is not None)
    run = Run(core, {}, [], [])
    run.runtime = rt
    step, infl, idle = 0, None, 0

    def apply(plan: StepPlan) -> None:
        out = core.update(plan, rt.execute(plan), float(step))
        for rid, why in out.finished:
            run.finished.append((rid, why, step))

    while arrivals or aborts or core.has_work() or infl is not None:
        assert idle < max_idle, f"stalled at step {step}: {core.num_running} running, {core.num_waiting} waiting"
        while arrivals and arrivals[0].arrival <= step:
            s = arrivals.pop(0)
            run.reqs[s.rid] = s.request()
            core.add_request(run.reqs[s.rid])
        while aborts and aborts[0][0] <= step:
            rid = aborts.pop(0)[1]
            if core.abort(rid):
                run.finished.append((rid, FinishReason.ABORT, step))
            core.check_integrity()
        if not core.has_work() and infl is None and not rt.loading:
            nxt = [a.arrival for a in arrivals[:1]] + [a[0] for a in aborts[:1]]
            if nxt:
                step = max(step + 1, min(nxt))
            continue
        if use_advance and infl is not None and decode_only(core, infl, rt):
            nxt = [a.arrival for a in arrivals[:1]] + [a[0] for a in aborts[:1]]
            k = core.identical_decode_steps()
            if nxt:
                k = min(k, min(nxt) - step)
            if k >= 2:
                slots = np.flatnonzero(core.s_active)
                idx = np.arange(k)
                tokens = np.stack([
                    rt.truth[int(core.s_rid[s])][core.s_req[s].prompt_len + core.s_nout[s] + idx]
                    for s in slots
                ]).astype(np.int32)
                out, infl = core.advance(k, tokens)
                step += k
                for rid, why in out.finished:
                    run.finished.append((rid, why, step - 1))
                run.advanced_steps += k
                core.check_integrity()
                check_plan(infl, cfg)
                continue
        plan = core.schedule(float(step))
        check_plan(plan, cfg)
        run.plans.append(plan)
        idle = idle + 1 if plan.is_empty() and not rt.loading else 0
        if sync:
            apply(plan)
        else:
            if infl is not None:
                apply(infl)
            # empty plans are not executed, unless the runtime has loads to report
            infl = plan if not (plan.is_empty() and not rt.loading) else None
        step += 1
        core.check_integrity()
    run.steps = step
    return run


def check_outcome(run: Run, specs: list[Spec], cfg: SchedulerConfig) -> None:
    core = run.core
    assert not core.has_work() and core.num_running == 0 and core.num_waiting == 0
    assert core.pool.num_free == cfg.num_blocks, "blocks leaked"
    assert (core.pool.ref == 0).all()
    reasons = {rid: why for rid, why, _ in run.finished}
    assert len(reasons) == len(run.finished) == len(specs), "a request finished twice or never"
    for s in specs:
        req = run.reqs[s.rid]
        truth = s.truth()[len(s.prompt):]
        assert req.state is RequestState.FINISHED and req.finish_reason is reasons[s.rid]
        got = req.output[: req.num_output]
        assert (got == truth[: req.num_output]).all(), f"request {s.rid} output differs from the model's"
        if reasons[s.rid] is FinishReason.ABORT:
            assert s.abort_at is not None
            continue
        # EOS on the last allowed token reports LENGTH (max_tokens was reached too)
        want = FinishReason.STOP if s.eos_at is not None and s.eos_at < s.max_tokens - 1 else FinishReason.LENGTH
        assert reasons[s.rid] is want, (s.rid, reasons[s.rid], want)
        assert req.num_output == s.expected_outputs()
    assert 0 <= core.prefix_hits <= core.prefix_queries


# --- workloads --------------------------------------------------------------------------------


@st.composite
def workloads(draw, *, eos=True, aborts=True, kv=True, max_requests=10):
    bs = draw(st.sampled_from([4, 16]))
    n = draw(st.integers(1, max_requests))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    bases = [rng.integers(2, VOCAB, int(rng.integers(0, 3 * bs))) for _ in range(draw(st.integers(1, 3)))]
    specs = []
    for rid in range(n):
        base = bases[int(rng.integers(len(bases)))]
        suffix = rng.integers(2, VOCAB, int(rng.integers(0 if len(base) else 1, 2 * bs)))
        if rng.random() < 0.2:
            suffix = suffix[:0] if len(base) else suffix  # an exact repeat of a shared prompt
        prompt = np.concatenate([base, suffix]).astype(np.int64)
        max_tokens = int(rng.integers(1, 3 * bs))
        specs.append(Spec(
            rid=rid, prompt=prompt, max_tokens=max_tokens,
            arrival=int(rng.integers(0, 20)) if rng.random() < 0.6 else 0,
            priority=int(rng.integers(0, 3)),
            eos_at=int(rng.integers(0, max_tokens)) if eos and rng.random() < 0.3 else None,
            remote_kv=int(rng.integers(1, len(prompt) - 1)) if kv and len(prompt) >= 3 and rng.random() < 0.25 else 0,
            salt=[None, None, "tenant-a"][int(rng.integers(3))],
            abort_at=int(rng.integers(0, 40)) if aborts and rng.random() < 0.2 else None,
        ))
    need = max(-(-(len(s.prompt) + s.max_tokens) // bs) for s in specs)
    num_blocks = draw(st.integers(need, 3 * need + 8))  # the low end forces preemption
    cfg = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=bs,
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.sampled_from([2, 3, 5, 8, 16, 33, 64, 256])),
        max_model_len=4096,
        enable_prefix_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        max_new_prefills_per_step=draw(st.integers(0, 2)),
        max_kv_loads_per_step=draw(st.integers(0, 3)),
        host_cache_blocks=draw(st.sampled_from([0, 0, 2, 4])) * num_blocks,
        watermark=draw(st.sampled_from([0.0, 0.01])),
    )
    return cfg, specs


FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --- properties --------------------------------------------------------------------------------


@FAST
@given(workloads(), st.integers(0, 2))
def test_random_workloads_async(wl, load_delay):
    cfg, specs = wl
    run = drive(cfg, specs, load_delay=load_delay)
    check_outcome(run, specs, cfg)


@FAST
@given(workloads())
def test_random_workloads_sync(wl):
    cfg, specs = wl
    run = drive(cfg, specs, sync=True)
    check_outcome(run, specs, cfg)


@FAST
@given(workloads(), st.integers(1, 5), st.booleans(), st.integers(0, 2**16))
def test_random_workloads_with_speculative_decoding(wl, k, sync, seed):
    """Speculative decodes (k drafts, a random number accepted, rejected drafts' KV left as
    garbage) with chunked prefill, prefix caching, preemption and async scheduling: every
    request gets exactly its tokens, and every position it attends to holds the right KV."""
    cfg, specs = wl
    cfg = attrs.evolve(cfg, num_spec_tokens=k)
    run = drive(cfg, specs, sync=sync, spec_seed=seed)
    check_outcome(run, specs, cfg)
    st_ = run.core.spec_stats()
    assert st_["accepted_tokens"] <= st_["draft_tokens"] <= k * st_["drafts"]


def pool_state(run: Run, specs: list[Spec]) -> tuple:
    pool = run.core.pool
    hasher = run.core.hasher
    cached = [pool.match_prefix(hasher.hash_prompt(s.truth(), s.salt)[0]) for s in specs]
    return pool.refcounts().tolist(), pool.free_blocks().tolist(), cached


def same_schedule(a: Run, b: Run, specs: list[Spec]) -> None:
    assert a.finished == b.finished  # same order, reasons and steps
    assert a.steps == b.steps
    assert [a.reqs[s.rid].num_output for s in specs] == [b.reqs[s.rid].num_output for s in specs]
    assert a.core.pool.refcounts().tolist() == b.core.pool.refcounts().tolist()
    assert a.core.pool.free_blocks().tolist() == b.core.pool.free_blocks().tolist()
    ca, cb = a.core, b.core
    assert (ca.num_preemptions, ca.prefix_queries, ca.prefix_hits) == (
        cb.num_preemptions, cb.prefix_queries, cb.prefix_hits)


@FAST
@given(workloads())
def test_advance_equals_stepping(wl):
    """k rounds of schedule + update == one advance(k): same finish order and steps, same
    tokens, same preemptions and cache counters, same block pool down to the free order."""
    cfg, specs = wl
    stepped = drive(cfg, specs)
    advanced = drive(cfg, specs, use_advance=True)
    check_outcome(advanced, specs, cfg)
    same_schedule(advanced, stepped, specs)
    for s in specs:
        a, b = advanced.reqs[s.rid], stepped.reqs[s.rid]
        assert (a.output[: a.num_output] == b.output[: b.num_output]).all()
    assert pool_state(advanced, specs) == pool_state(stepped, specs)


def test_advance_keeps_tokens_confirmed_before_it():
    """Regression: advance zeroed s_tail and rebuilt it (and hashed the blocks it closed)
    from req.output, where the outputs confirmed since the last block boundary had not been
    written yet (np.empty garbage): wrong output tokens, wrong generated-block hashes."""
    cfg = SchedulerConfig(num_blocks=16, block_size=16, max_num_seqs=1, max_num_batched_tokens=64)
    # output 0 (position 20) is confirmed before the advance; a prompt used nowhere else, so
    # that no freed buffer holding the right tokens can mask an uninitialized read
    spec = Spec(rid=0, prompt=np.arange(7000, 7020), max_tokens=30)
    run = drive(cfg, [spec], use_advance=True)
    assert run.advanced_steps > 0
    check_outcome(run, [spec], cfg)


# --- directed ----------------------------------------------------------------------------------


def simple(n, prompt_len=20, max_tokens=30, **kw) -> list[Spec]:
    rng = np.random.default_rng(5)
    return [Spec(rid=i, prompt=rng.integers(2, VOCAB, prompt_len), max_tokens=max_tokens, **kw)
            for i in range(n)]


def test_advance_skips_steps_and_matches():
    cfg = SchedulerConfig(num_blocks=200, block_size=16, max_num_seqs=8, max_num_batched_tokens=64)
    specs = simple(6, max_tokens=60)
    stepped, advanced = drive(cfg, specs), drive(cfg, specs, use_advance=True)
    assert advanced.advanced_steps > advanced.steps // 2  # most decode steps were skipped
    check_outcome(advanced, specs, cfg)
    same_schedule(advanced, stepped, specs)
    assert pool_state(advanced, specs) == pool_state(stepped, specs)


def test_advance_under_preemption_matches():
    cfg = SchedulerConfig(num_blocks=14, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    specs = simple(5, prompt_len=9, max_tokens=40)
    stepped, advanced = drive(cfg, specs), drive(cfg, specs, use_advance=True)
    assert stepped.core.num_preemptions > 0
    assert advanced.advanced_steps > 0
    check_outcome(advanced, specs, cfg)
    same_schedule(advanced, stepped, specs)
    assert pool_state(advanced, specs) == pool_state(stepped, specs)


def test_eos_stops_a_request():
    cfg = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=64)
    specs = [Spec(rid=0, prompt=np.arange(2, 30), max_tokens=50, eos_at=7),
             Spec(rid=1, prompt=np.arange(2, 30), max_tokens=12)]
    for sync in (False, True):
        run = drive(cfg, specs, sync=sync)
        check_outcome(run, specs, cfg)
        assert run.reqs[0].finish_reason is FinishReason.STOP and run.reqs[0].num_output == 8
        assert run.reqs[0].output[7] == EOS
        assert run.reqs[1].finish_reason is FinishReason.LENGTH and run.reqs[1].num_output == 12


def test_eos_on_the_last_allowed_token_is_length():
    cfg = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=64)
    spec = Spec(rid=0, prompt=np.arange(2, 30), max_tokens=5, eos_at=4)
    run = drive(cfg, [spec])
    assert run.reqs[0].num_output == 5 and run.reqs[0].finish_reason is FinishReason.LENGTH


def test_eos_ignored_with_ignore_eos():
    core = SchedulerCore(SchedulerConfig(num_blocks=16, block_size=16), BlockHasher(b"k", 16))
    req = Request(id=0, prompt=np.arange(2, 10, dtype=np.int32),
                  params=SamplingParams(max_tokens=3, ignore_eos=True), eos_token_id=EOS)
    core.add_request(req)
    fin = []
    for _ in range(3):
        plan = core.schedule(0.0)
        out = core.update(plan, StepResult(plan.step_id, np.ones(1, np.int32), np.array([EOS], np.int32)), 0.0)
        fin += out.finished
    assert fin == [(0, FinishReason.LENGTH)]


def test_abort_waiting_running_and_unknown():
    cfg = SchedulerConfig(num_blocks=40, block_size=16, max_num_seqs=2, max_num_batched_tokens=64)
    specs = simple(4, prompt_len=40, max_tokens=20)
    specs[1] = attrs.evolve(specs[1], abort_at=3)  # running by then
    specs[3] = attrs.evolve(specs[3], abort_at=1)  # still waiting (2 seqs max)
    run = drive(cfg, specs)
    check_outcome(run, specs, cfg)
    assert run.reqs[1].finish_reason is FinishReason.ABORT and 0 < run.reqs[1].num_output < 20
    assert run.reqs[3].finish_reason is FinishReason.ABORT and run.reqs[3].num_output == 0
    assert run.core.abort(3) is False and run.core.abort(999) is False


@FAST
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_abort_at_random_points_frees_blocks(seed, sync):
    rng = np.random.default_rng(seed)
    cfg = SchedulerConfig(num_blocks=30, block_size=4, max_num_seqs=4, max_num_batched_tokens=12)
    specs = [Spec(rid=i, prompt=rng.integers(2, VOCAB, int(rng.integers(1, 40))),
                  max_tokens=int(rng.integers(1, 40)), arrival=int(rng.integers(0, 10)),
                  abort_at=int(rng.integers(0, 60)) if rng.random() < 0.6 else None)
             for i in range(8)]
    specs = [s for s in specs if -(-(len(s.prompt) + s.max_tokens) // 4) <= 30]
    run = drive(cfg, specs, sync=sync)
    check_outcome(run, specs, cfg)


def test_request_validation():
    core = SchedulerCore(SchedulerConfig(num_blocks=16, block_size=16, max_model_len=100),
                         BlockHasher(b"k", 16))
    ok = Request(id=1, prompt=np.arange(60, dtype=np.int32), params=SamplingParams(max_tokens=40))
    core.add_request(ok)  # exactly max_model_len
    with pytest.raises(RequestError, match="max_model_len"):
        core.add_request(Request(id=2, prompt=np.arange(60, dtype=np.int32),
                                 params=SamplingParams(max_tokens=41)))
    with pytest.raises(RequestError, match="max_model_len"):
        core.add_request(Request(id=3, prompt=np.arange(101, dtype=np.int32),
                                 params=SamplingParams(max_tokens=1)))
    with pytest.raises(RequestError, match="already"):
        core.add_request(Request(id=1, prompt=np.arange(5, dtype=np.int32), params=SamplingParams()))
    assert core.num_waiting == 1
    core.check_integrity()


def test_hasher_block_size_must_match():
    with pytest.raises(ValueError):
        SchedulerCore(SchedulerConfig(block_size=16), BlockHasher(b"k", 32))


def test_update_rejects_a_result_for_another_step():
    core = SchedulerCore(SchedulerConfig(num_blocks=16, block_size=16), BlockHasher(b"k", 16))
    core.add_request(Request(id=0, prompt=np.arange(2, 10, dtype=np.int32), params=SamplingParams(max_tokens=3)))
    plan = core.schedule(0.0)
    with pytest.raises(ValueError):
        core.update(plan, StepResult(plan.step_id + 1, np.ones(1, np.int32), np.array([5], np.int32)), 0.0)


def test_chunked_prefill_respects_budget():
    cfg = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=16)
    specs = [Spec(rid=0, prompt=np.arange(2, 102), max_tokens=3)]  # 100 tokens
    run = drive(cfg, specs)
    check_outcome(run, specs, cfg)
    chunks = [int(p.num_new[0]) for p in run.plans if p.num_reqs and p.num_new[0] > 1]
    assert chunks == [16] * 6 + [4]
    assert [int(p.start_pos[0]) for p in run.plans if p.num_reqs][:7] == [0, 16, 32, 48, 64, 80, 96]


def test_prefix_cache_hits_are_counted():
    cfg = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256)
    prompt = np.arange(2, 66)  # 64 tokens: 4 blocks, the last one recomputed for its logits
    specs = [Spec(rid=0, prompt=prompt, max_tokens=4), Spec(rid=1, prompt=prompt, max_tokens=4, arrival=10),
             Spec(rid=2, prompt=np.concatenate([prompt[:40], [9, 9]]), max_tokens=4, arrival=20),
             Spec(rid=3, prompt=prompt, max_tokens=4, arrival=30, salt="other-tenant")]
    run = drive(cfg, specs)
    check_outcome(run, specs, cfg)
    core = run.core
    assert core.prefix_queries == 64 + 64 + 42 + 64
    assert core.prefix_hits == 0 + 48 + 32 + 0
    assert [run.reqs[i].num_cached_tokens for i in range(4)] == [0, 48, 32, 0]


def test_prefix_caching_disabled_counts_no_hits():
    cfg = SchedulerConfig(num_blocks=64, block_size=16, max_num_batched_tokens=256, enable_prefix_caching=False)
    prompt = np.arange(2, 66)
    specs = [Spec(rid=0, prompt=prompt, max_tokens=4), Spec(rid=1, prompt=prompt, max_tokens=4, arrival=10)]
    run = drive(cfg, specs)
    check_outcome(run, specs, cfg)
    assert run.core.prefix_hits == 0


def next_turn(use_advance: bool) -> Run:
    cfg = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256)
    base = 9000 if use_advance else 2  # distinct content per variant: see the advance test
    first = Spec(rid=0, prompt=np.arange(base, base + 20), max_tokens=50)  # 70 tokens: 4 full blocks
    follow = Spec(rid=1, prompt=np.concatenate([first.truth(), [5, 6, 7]]), max_tokens=3, arrival=80)
    run = drive(cfg, [first, follow], use_advance=use_advance)
    check_outcome(run, [first, follow], cfg)
    return run


def test_next_turn_hits_the_blocks_generated_by_the_last():
    """A follow-up turn re-sends prompt + output: decoding published those blocks too."""
    assert next_turn(use_advance=False).reqs[1].num_cached_tokens == 64


def test_next_turn_hits_the_blocks_generated_during_advance():
    """Regression: blocks closed inside an advance were hashed from unwritten outputs."""
    run = next_turn(use_advance=True)
    assert run.advanced_steps > 0
    assert run.reqs[1].num_cached_tokens == 64


def test_priority_policy_admits_best_first_and_preempts_worst():
    cfg = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=1, max_num_batched_tokens=256,
                          policy="priority")
    specs = [Spec(rid=i, prompt=np.arange(2, 20) + i, max_tokens=3, priority=p)
             for i, p in enumerate([2, 0, 1, 0])]
    run = drive(cfg, specs)
    check_outcome(run, specs, cfg)
    assert [rid for rid, _, _ in run.finished] == [1, 3, 2, 0]
    fcfs = drive(attrs.evolve(cfg, policy="fcfs"), specs)
    assert [rid for rid, _, _ in fcfs.finished] == [0, 1, 2, 3]


def test_preemption_recomputes_and_keeps_outputs():
    cfg = SchedulerConfig(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    specs = simple(4, prompt_len=10, max_tokens=30)
    for sync in (False, True):
        run = drive(cfg, specs, sync=sync)
        check_outcome(run, specs, cfg)
        assert run.core.num_preemptions > 0
        assert any(r.num_preemptions for r in run.reqs.values())


def test_budget_smaller_than_running_decodes():
    cfg = SchedulerConfig(num_blocks=100, block_size=4, max_num_seqs=6, max_num_batched_tokens=2)
    specs = simple(6, prompt_len=3, max_tokens=10)
    run = drive(cfg, specs)
    check_outcome(run, specs, cfg)
    assert max(p.num_tokens for p in run.plans) == 2


# --- one-token prefill chunks ------------------------------------------------------------------


@pytest.mark.parametrize("prompt_len,budget", [(11, 2), (17, 16), (8193, 8192)])
def test_one_token_last_prefill_chunk_carries_its_token(prompt_len, budget):
    """Regression: a prefill whose last chunk was one token (nknown - ncomp == 1) was
    scheduled as a decode, fed as PLACEHOLDER though nothing had been sampled."""
    cfg = SchedulerConfig(num_blocks=1024, block_size=16, max_num_seqs=4, max_num_batched_tokens=budget)
    specs = [Spec(rid=0, prompt=np.arange(prompt_len) % 1000 + 2, max_tokens=3)]
    run = drive(cfg, specs)
    check_outcome(run, specs, cfg)  # the fake runtime checks every PLACEHOLDER it is fed


def test_one_token_last_recompute_chunk_carries_its_token():
    """Regression: the same after a preemption (the runtime had dropped the request)."""
    cfg = SchedulerConfig(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=4,
                          enable_prefix_caching=False)
    specs = simple(4, prompt_len=10, max_tokens=20)
    run = drive(cfg, specs)
    check_outcome(run, specs, cfg)
    assert run.core.num_preemptions > 0  # the fake runtime checks every PLACEHOLDER it is fed


# --- KV loads ----------------------------------------------------------------------------------

def kv_specs(n, prompt_len=40, remote=32, max_tokens=5) -> list[Spec]:
    rng = np.random.default_rng(9)
    return [Spec(rid=i, prompt=rng.integers(2, VOCAB, prompt_len), max_tokens=max_tokens,
                 remote_kv=remote) for i in range(n)]


def empty_result(plan: StepPlan, **kw) -> StepResult:
    return StepResult(plan.step_id, np.zeros(plan.num_reqs, np.int32), np.zeros(0, np.int32), **kw)


@pytest.mark.parametrize("cap", [1, 4])
def test_kv_load_burst_is_capped_per_step(cap):
    cfg = SchedulerConfig(num_blocks=2000, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192,
                          max_kv_loads_per_step=cap)
    core = SchedulerCore(cfg, BlockHasher(b"k", 16))
    for s in kv_specs(100):
        core.add_request(s.request())
    started = []
    for _ in range(-(-100 // cap) + 3):
        plan = core.schedule(0.0)
        check_plan(plan, cfg)
        assert len(plan.kv_load_req_ids) <= cap and plan.num_tokens == 0
        started += plan.kv_load_req_ids.tolist()
        core.update(plan, empty_result(plan), 0.0)
        core.check_integrity()
    assert started == list(range(100))  # each once, in arrival order
    assert core.pool.num_used == 100 * 2  # 32 remote tokens: 2 blocks each


def test_kv_load_holds_blocks_and_waits():
    cfg = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256)
    core = SchedulerCore(cfg, BlockHasher(b"k", 16))
    req = kv_specs(1)[0].request()
    core.add_request(req)
    plan = core.schedule(0.0)
    assert plan.kv_load_req_ids.tolist() == [0] and plan.num_tokens == 0
    assert plan.kv_load_first_block.tolist() == [0] and plan.kv_load_num_blocks.tolist() == [2]
    assert len(req.blocks) == 2
    for _ in range(3):  # nothing is computed for it until the load is reported done
        core.update(plan, empty_result(plan), 0.0)
        plan = core.schedule(0.0)
        assert plan.num_tokens == 0
        core.check_integrity()
    assert core.abort(0) and core.pool.num_free == 64


def test_kv_load_resumes_after_done():
    """Regression: _start_kv_load set WAITING_FOR_KV before _take_slot marked the request
    RUNNING, so kv_loads_done was ignored and the request never ran."""
    cfg = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256)
    core = SchedulerCore(cfg, BlockHasher(b"k", 16))
    req = kv_specs(1)[0].request()
    core.add_request(req)
    plan = core.schedule(0.0)
    assert req.state is RequestState.WAITING_FOR_KV
    # the runtime learns the table to fill from an entry with no tokens
    assert plan.req_ids.tolist() == [0] and plan.num_new.tolist() == [0]
    assert plan.block_ids.tolist() == req.blocks
    core.update(plan, empty_result(plan, kv_loads_done=np.array([0])), 0.0)
    assert req.state is RequestState.RUNNING
    plan = core.schedule(0.0)
    assert plan.num_new.tolist() == [8] and plan.start_pos.tolist() == [32]  # only the rest


def test_kv_load_burst_completes_after_done():
    cfg = SchedulerConfig(num_blocks=2000, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192,
                          max_kv_loads_per_step=4)
    specs = kv_specs(100)
    run = drive(cfg, specs, load_delay=2)
    check_outcome(run, specs, cfg)  # all 100 finish: each ran only after its kv_loads_done
    assert run.runtime.loads_started == list(range(100))
    assert max(len(p.kv_load_req_ids) for p in run.plans) == 4
    assert all(r.num_cached_tokens == 0 for r in run.reqs.values())


def test_kv_load_failure_recomputes():
    cfg = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256)
    specs = kv_specs(3)
    run = drive(cfg, specs, fail_loads=frozenset({1}))
    check_outcome(run, specs, cfg)
    p1 = [p for p in run.plans if 1 in p.req_ids.tolist() and p.num_tokens]
    assert int(p1[0].start_pos[list(p1[0].req_ids).index(1)]) == 0  # recomputed from the start


@pytest.mark.parametrize("remote", [39, 40])
def test_kv_load_of_the_whole_prompt(remote):
    """The last prompt token is recomputed for its logits, fed with its real id."""
    cfg = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256)
    specs = kv_specs(2, prompt_len=40, remote=remote)
    run = drive(cfg, specs)
    check_outcome(run, specs, cfg)  # the fake runtime checks every PLACEHOLDER it is fed


# --- host tier ---------------------------------------------------------------------------------


def test_host_tier_serves_blocks_evicted_from_the_gpu():
    """Blocks evicted from the GPU cache go to the host tier; a later hit loads them (the fake
    runtime fills them with what it computed for that hash, and checks every read)."""
    cfg = SchedulerConfig(num_blocks=8, block_size=16, max_num_seqs=1, max_num_batched_tokens=256,
                          host_cache_blocks=16, watermark=0.0)
    rng = np.random.default_rng(11)
    a = rng.integers(2, VOCAB, 64)
    specs = [Spec(rid=0, prompt=a, max_tokens=2),
             Spec(rid=1, prompt=rng.integers(2, VOCAB, 64), max_tokens=2, arrival=10),
             Spec(rid=2, prompt=rng.integers(2, VOCAB, 64), max_tokens=2, arrival=20),
             Spec(rid=3, prompt=a, max_tokens=2, arrival=30)]
    run = drive(cfg, specs)
    check_outcome(run, specs, cfg)
    core = run.core
    assert run.reqs[3].num_cached_tokens == 48  # the last block is recomputed for its logits
    assert core.host_hits > 0 and run.runtime.host_loads == 1
    assert core.prefix_hits == 48


def test_host_tier_loads_count_against_the_load_cap():
    cfg = SchedulerConfig(num_blocks=8, block_size=16, max_num_seqs=8, max_num_batched_tokens=512,
                          host_cache_blocks=64, max_kv_loads_per_step=1, watermark=0.0)
    rng = np.random.default_rng(12)
    prefixes = [rng.integers(2, VOCAB, 48) for _ in range(3)]
    first = [Spec(rid=i, prompt=np.concatenate([p, [5]]), max_tokens=1, arrival=5 * i)
             for i, p in enumerate(prefixes)]
    flush = [Spec(rid=10 + i, prompt=rng.integers(2, VOCAB, 100), max_tokens=1, arrival=20 + 5 * i)
             for i in range(3)]
    again = [Spec(rid=20 + i, prompt=np.concatenate([p, [6]]), max_tokens=1, arrival=50)
             for i, p in enumerate(prefixes)]
    specs = first + flush + again
    run = drive(cfg, specs)  # check_plan asserts at most one load per plan
    check_outcome(run, specs, cfg)
    assert run.runtime.host_loads == 3 and run.core.host_hits == 3 * 48
    assert all(run.reqs[20 + i].num_cached_tokens == 48 for i in range(3))


# --- per-plan state -------------------------------------------------------------------------------


def test_empty_plans_leave_no_per_plan_state():
    core = SchedulerCore(SchedulerConfig(num_blocks=16, block_size=16), BlockHasher(b"k", 16))
    for _ in range(100):
        assert core.schedule(0.0).is_empty()
    assert len(core._plan_epochs) <= 1  # private, but the only observable of the leak


@pytest.mark.parametrize("method", ["keyed", "sha256"])
@pytest.mark.parametrize("m", [1, 3, 9])
def test_extend_chain_equals_chained_extend(method, m):
    """advance hashes the blocks a request closes as one chain: as extend, block by block."""
    h = BlockHasher(b"test-secret", 16, method=method)
    rng = np.random.default_rng(m)
    blocks = rng.integers(0, 50_000, (m, 16), dtype=np.int32)
    parent = h.hash_prompt(rng.integers(0, 50_000, 16 * 7, dtype=np.int32))[1]
    hashes, accs = h.extend_chain(parent, blocks, 7)
    for j in range(m):
        hj, aj = h.extend(parent[None], blocks[j : j + 1], np.array([7 + j]))
        assert (hj[0] == hashes[j]).all() and (aj[0] == accs[j]).all()
        parent = aj[0]


def test_prefill_side_holds_blocks_until_released():
    """P/D prefill side: a hold_kv request that finishes by length keeps its blocks (the
    decode side pulls them) until release_held."""
    cfg = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256)
    core = SchedulerCore(cfg, BlockHasher(b"k", 16))
    rng = np.random.default_rng(3)
    held = Request(id=0, prompt=rng.integers(2, VOCAB, 40).astype(np.int32),
                   params=SamplingParams(max_tokens=1), hold_kv=True)
    stopped = Request(id=1, prompt=rng.integers(2, VOCAB, 40).astype(np.int32),
                      params=SamplingParams(max_tokens=1), hold_kv=True, eos_token_id=EOS)
    core.add_request(held)
    core.add_request(stopped)
    plan = core.schedule(0.0)
    out = core.update(plan, StepResult(plan.step_id, np.ones(2, np.int32), np.array([7, EOS], np.int32)), 0.0)
    assert sorted(out.finished) == [(0, FinishReason.LENGTH), (1, FinishReason.LENGTH)]
    # Both kept theirs (length first, as vLLM): the engine sees the EOS and releases at once.
    assert sorted(core.held) == [0, 1] and len(core.held[0]) == 3  # ceil(40 / 16)
    assert core.release_held(1)
    core.check_integrity()
    assert core.pool.num_used == 3 and not core.has_work()
    assert core.release_held(0) and not core.release_held(0)
    assert core.pool.num_used == 0
    core.check_integrity()


def test_pulled_prompt_blocks_are_published():
    cfg = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256)
    core = SchedulerCore(cfg, BlockHasher(b"k", 16))
    req = kv_specs(1, prompt_len=33, remote=32)[0].request()
    core.add_request(req)
    plan = core.schedule(0.0)
    assert core.num_waiting_for_kv == 1
    core.update(plan, empty_result(plan, kv_loads_done=np.array([0])), 0.0)
    assert core.num_waiting_for_kv == 0
    assert core.pool.cached_prefix_len(req.block_hashes) == 2  # both pulled blocks can be shared


def test_an_idle_rank_plans_as_the_full_path_would():
    """schedule() on a core with nothing running or queued takes a shortcut; its empty plan
    equals the one the full path builds, field by field, and step ids still advance."""
    cfg = SchedulerConfig(num_blocks=16, block_size=16, max_num_seqs=2, max_num_batched_tokens=64)
    core = SchedulerCore(cfg, BlockHasher(b"test-secret", 16))
    fast = core.schedule(0.0)
    full = core._decode_plan(EMPTY_I64, (EMPTY_I64, EMPTY_I64))
    assert (fast.step_id, full.step_id) == (1, 2)
    for f in attrs.fields(StepPlan):
        a, b = getattr(fast, f.name), getattr(full, f.name)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all(), f.name
        elif f.name != "step_id":
            assert a == b, f.name
