"""The simulator: replays a workload against a deployment in virtual time.

It drives the same ``SchedulerCore`` objects the engine does, in the engine's order
(async scheduling: step N+1 is planned when step N is dispatched, so a request arriving
during step N starts in step N+2), with an analytic cost model in place of the GPU. Each
DEP instance's ranks step together; the step costs what its slowest rank costs.

Runs of identical decode steps are applied at once with ``SchedulerCore.advance(k)``: the
simulator's cost grows with events (arrivals, admissions, block boundaries, completions),
not with steps. Plans skipped by an advance are not materialized.
"""

from __future__ import annotations

import heapq
from typing import Callable, Sequence

import numpy as np

from lockstep.policy.config import SchedulerConfig
from lockstep.policy.core import SchedulerCore
from lockstep.policy.deployment import Deployment, PoolSpec
from lockstep.policy.hashing import BlockHasher
from lockstep.policy.request import Request, RequestError, SamplingParams
from lockstep.policy.router import PrefixAffinityRouter
from lockstep.policy.step import StepPlan, StepResult

from .cost import AnalyticCost, StepLoad
from .metrics import Metrics, clean
from .traces import TraceRequest, segment_tokens

OUTPUT_SEG_BASE = 1 << 42  # output content ids for trace requests (disjoint from prompts)


class Instance:
    """One DEP instance: n ranks, each a SchedulerCore, stepping in lockstep."""

    def __init__(self, name: str, pool: PoolSpec, config: SchedulerConfig, hasher: BlockHasher,
                 cost: AnalyticCost):
        self.name, self.pool, self.cost = name, pool, cost
        self.cores = [SchedulerCore(config, hasher) for _ in range(pool.dep)]
        self.executing: list[StepPlan] | None = None
        self.planned: list[StepPlan] | None = None
        self.t_end = 0.0

    @property
    def busy(self) -> bool:
        return self.executing is not None

    def load(self) -> int:
        return sum(c.load() for c in self.cores)

    def plan(self, now: float) -> list[StepPlan] | None:
        plans = [c.schedule(now) for c in self.cores]
        return None if all(p.is_empty() for p in plans) else plans


class Simulator:
    def __init__(self, deployment: Deployment, workload: Sequence[TraceRequest], *,
                 seed: int = 0, slo_ttft: float = 2.0, slo_tpot: float = 0.1,
                 use_advance: bool = True, on_plan: Callable | None = None):
        self.d = deployment
        self.workload = list(workload)
        self.seed = seed
        self.slo = (slo_ttft, slo_tpot)
        self.use_advance = use_advance
        self.on_plan = on_plan  # observer for parity tests: on_plan(instance, rank, plan)
        self.hasher = BlockHasher(deployment.hash_secret.encode(), deployment.scheduler.block_size)
        self.router = PrefixAffinityRouter()
        self.instances: list[Instance] = []
        for pool in deployment.pools:
            if pool.role != "colocated":
                raise NotImplementedError(
                    f"pool {pool.name!r} has role {pool.role!r}: the simulator runs colocated "
                    "pools; prefill/decode pools arrive with disaggregation"
                )
            model = deployment.model(pool.model)
            cost = AnalyticCost(model, deployment.hardware, deployment.cost, pool.dep)
            cfg = deployment.scheduler_for(pool)
            for i in range(pool.instances):
                self.instances.append(Instance(f"{pool.name}/{i}", pool, cfg, self.hasher, cost))
        self.model = deployment.model(deployment.pools[0].model)
        self._ranks = [(i, c) for i, inst in enumerate(self.instances) for c in inst.cores]
        total_blocks = sum(len(i.cores) * i.cores[0].config.num_blocks for i in self.instances)
        self.metrics = Metrics(len(self.workload), total_blocks)
        self._events: list[tuple[float, int, int]] = []  # (time, seq, instance index)
        self._seq = 0
        self._build_outputs()

    # -- workload ------------------------------------------------------------------------------
    def _build_outputs(self) -> None:
        """All output tokens in one flat array: the token a request samples is a lookup."""
        ids = np.array([w.output_seg if w.output_seg >= 0 else OUTPUT_SEG_BASE + i
                        for i, w in enumerate(self.workload)], dtype=np.int64)
        lens = np.array([w.output_len for w in self.workload], dtype=np.int32)
        self.out_base = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=self.out_base[1:])
        self.out_tokens = segment_tokens(ids, lens, vocab_size=self.model.vocab_size, seed=self.seed)

    def _admit(self, rid: int, now: float) -> None:
        w = self.workload[rid]
        self.metrics.arrival[rid] = w.arrival_s
        limit = self.instances[0].cores[0].config.max_model_len
        if w.input_len + w.output_len > limit:  # before materializing a prompt that long
            self.metrics.reject(rid, "context_length")
            return
        prompt = segment_tokens(w.seg_ids, w.seg_lens, vocab_size=self.model.vocab_size, seed=self.seed)
        hashes, acc = self.hasher.hash_prompt(prompt)
        req = Request(id=rid, prompt=prompt, params=SamplingParams(max_tokens=w.output_len, ignore_eos=True),
                      arrival_time=now, block_hashes=hashes, hash_acc=acc)
        # One router over every rank of every instance: prefix affinity, then least loaded.
        if len(self._ranks) > 1:
            pick = self.router.choose(hashes, [c.pool for _, c in self._ranks], [c.load() for _, c in self._ranks])
        else:
            pick = 0
        idx, core = self._ranks[pick]
        inst = self.instances[idx]
        try:
            core.add_request(req)
        except RequestError as e:  # counted with its reason, never dropped silently
            self.metrics.reject(rid, e.reason)
            return
        if not inst.busy:
            self._dispatch(idx, now, inst.plan(now))

    # -- the loop ------------------------------------------------------------------------------
    def run(self, progress: Callable[[int], None] | None = None) -> dict:
        order = sorted(range(len(self.workload)), key=lambda i: (self.workload[i].arrival_s, i))
        i = 0
        while i < len(order) or self._events:
            t_arr = self.workload[order[i]].arrival_s if i < len(order) else np.inf
            if self._events and self._events[0][0] < t_arr:
                t, _, idx = heapq.heappop(self._events)
                self._step_done(idx, t, t_arr)
            else:
                self._admit(order[i], t_arr)
                i += 1
                if progress is not None:
                    progress(i)
        stuck = len(self.workload) - int((~np.isnan(self.metrics.finish)).sum()) - sum(self.metrics.rejected.values())
        if stuck:  # every request ends completed or rejected with a reason, never lost
            raise RuntimeError(f"simulation ended with {stuck} requests neither completed nor rejected")
        return self.report()

    def _dispatch(self, idx: int, now: float, plans: list[StepPlan] | None) -> None:
        inst = self.instances[idx]
        inst.executing = plans
        if plans is None:
            inst.planned = None
            return
        if self.on_plan is not None:
            for rank, p in enumerate(plans):
                self.on_plan(inst, rank, p)
        t_end = now + float(inst.cost.step_time(self._load(inst, plans)))
        inst.t_end = t_end
        self.metrics.steps += 1
        heapq.heappush(self._events, (t_end, self._seq, idx))
        self._seq += 1
        inst.planned = inst.plan(now)  # async: plan N+1 while N runs

    def _step_done(self, idx: int, t: float, next_arrival: float) -> None:
        inst = self.instances[idx]
        for core, plan in zip(inst.cores, inst.executing):
            if plan.num_reqs:
                self._apply(core, plan, t)
        self.metrics.kv_sample(idx, t, sum(c.pool.num_used for c in inst.cores))
        plans = inst.planned
        if plans is None and any(c.has_work() for c in inst.cores):
            plans = inst.plan(t)
        if plans is not None and self.use_advance:
            plans, t = self._try_advance(inst, plans, t, next_arrival)
        self._dispatch(idx, t, plans)

    def _apply(self, core: SchedulerCore, plan: StepPlan, t: float) -> None:
        slots = plan.slots.astype(np.int64)
        live = (core.s_rid[slots] == plan.req_ids) & plan.samples
        rids = plan.req_ids[live]
        tokens = self.out_tokens[self.out_base[rids] + core.s_nout[slots[live]]]
        # Host-tier loads are charged inside the step, so they are done when it ends.
        result = StepResult(step_id=plan.step_id, num_sampled=live.astype(np.int32), token_ids=tokens,
                            kv_loads_done=plan.kv_load_req_ids)
        out = core.update(plan, result, t)
        self.metrics.tokens(out.req_ids, t)
        for rid, _ in out.finished:
            self.metrics.finish[rid] = t

    # -- advance ------------------------------------------------------------------------------
    def _try_advance(self, inst: Instance, plans: list[StepPlan], t: float, next_arrival: float):
        k = self._identical_steps(inst, plans)
        if k < 2:
            return plans, t
        # Sequential sums, as stepping adds one step time at a time: bit-identical ends.
        ends = np.cumsum(np.concatenate([[t], inst.cost.step_time(self._decode_loads(inst, k))]))[1:]
        # Every boundary inside the run, and the one at its end (where the next plan is
        # made), must come before the next arrival, or that plan would miss it.
        k = int(min(k, np.searchsorted(ends, next_arrival, side="left")))
        if k < 2:
            return plans, t
        ends = ends[:k]
        # KV use at each step end of the run: plan r takes the blocks its fed position needs.
        j = np.arange(1, k + 1)
        used = sum(c.pool.num_used for c in inst.cores) + sum(
            (-(-(c.s_ncomp[c.s_active][:, None] + j) // c.bs) - c.s_nblocks[c.s_active][:, None])
            .clip(0).sum(axis=0) for c in inst.cores)
        self.metrics.kv_sample(self.instances.index(inst), ends, used)
        new_plans = []
        for core, plan in zip(inst.cores, plans):
            if not plan.num_reqs:  # an idle rank: its dummy steps change nothing
                new_plans.append(plan)
                continue
            slots = np.flatnonzero(core.s_active)
            rids = core.s_rid[slots]
            idx = self.out_base[rids][:, None] + core.s_nout[slots][:, None] + np.arange(k)
            out, nxt = core.advance(k, self.out_tokens[idx])
            self.metrics.token_run(out.req_ids, ends)
            for rid, _ in out.finished:
                self.metrics.finish[rid] = ends[-1]
            new_plans.append(nxt)
        self.metrics.steps += k
        return new_plans, float(ends[-1])

    def _identical_steps(self, inst: Instance, plans: list[StepPlan]) -> int:
        k = 1 << 62
        for core, plan in zip(inst.cores, plans):
            n = core.num_running
            if n == 0:
                if core.num_waiting:
                    return 0
                continue
            decode_only = plan.num_reqs == n and plan.samples.all() and (plan.num_new == 1).all()
            if not decode_only or len(plan.kv_load_req_ids):
                return 0
            k = min(k, core.identical_decode_steps())
        return 0 if k == 1 << 62 else k

    # -- cost inputs --------------------------------------------------------------------------
    def _load(self, inst: Instance, plans: list[StepPlan]) -> StepLoad:
        tokens = np.array([p.num_tokens for p in plans], dtype=np.float64)
        ctx = np.zeros(len(plans))
        pairs = np.zeros(len(plans))
        loaded = np.array([float(p.kv_load_num_blocks.sum()) * self.d.scheduler.block_size
                           for p in plans])
        for r, p in enumerate(plans):
            if p.num_reqs:
                c = p.num_new.astype(np.float64)
                s = p.start_pos.astype(np.float64)
                ctx[r] = float((s + c).sum())
                pairs[r] = float((c * s + c * (c + 1) / 2).sum())
        return StepLoad(tokens=tokens, ctx=ctx, pairs=pairs, loaded=loaded)

    def _decode_loads(self, inst: Instance, k: int) -> StepLoad:
        j = np.arange(k, dtype=np.float64)
        tokens, ctx = [], []
        for core in inst.cores:
            act = core.s_active
            n = float(act.sum())
            base = float(core.s_ncomp[act].sum())  # plan j feeds positions ncomp-1+j
            tokens.append(np.full(k, n))
            ctx.append(base + n * j)
        tokens, ctx = np.array(tokens), np.array(ctx)
        return StepLoad(tokens=tokens, ctx=ctx, pairs=ctx)

    # -- report ---------------------------------------------------------------------------------
    def report(self) -> dict:
        cores = [c for i in self.instances for c in i.cores]
        queries = sum(c.prefix_queries for c in cores)
        hits = sum(c.prefix_hits for c in cores)
        host_hits = sum(c.host_hits for c in cores)
        extra = {"deployment": self.d.name, "num_gpus": self.d.num_gpus, "seed": self.seed}
        rep = self.metrics.report(
            num_gpus=self.d.num_gpus, slo_ttft=self.slo[0], slo_tpot=self.slo[1],
            prefix=(queries, hits, host_hits), preemptions=sum(c.num_preemptions for c in cores), extra=extra,
        )
        return clean(rep)
