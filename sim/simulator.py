"""The simulator: replays a workload against a deployment in virtual time.

It drives the same ``SchedulerCore`` objects the engine does, in the engine's order
(async scheduling: step N+1 is planned when step N is dispatched, so a request arriving
during step N starts in step N+2), with an analytic cost model in place of the GPU. Each
DEP instance's ranks step together; the step costs what its slowest rank costs.

Runs of identical decode steps are applied at once with ``SchedulerCore.advance(k)``: the
simulator's cost grows with events (arrivals, admissions, block boundaries, completions),
not with steps. Plans skipped by an advance are not materialized. A run reaches through the
step in which its first requests finish (``SchedulerCore.decode_run``), or through the step
in which the next arrival falls (planned before it, that step is still identical; where
routing reads the instance, only if its update changes nothing routing reads): that step is
applied with the run, not planned, dispatched and updated on its own, but its end stays an
event at the time a single step would end, so everything is recorded in the order stepping
records it. With one instance of one rank, a run's end that comes before the next arrival
is handled at once, without a trip through the event heap.

Pools are all colocated, or split into prefill and decode pools (``sim.disagg``: hand-offs,
KV pulls over a link, the prefill side's held blocks).

With a [speculative] table each instance also plays the runtime's side of speculative
decoding (``sim.spec``: draws of accepted drafts, the draft model's passes in the step
time); those steps run one by one (no advance: each accepts its own number of drafts).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Sequence

import numpy as np

from lockstep.policy.config import ConfigError, SchedulerConfig
from lockstep.policy.core import SchedulerCore
from lockstep.policy.deployment import UNMODELED_ACCEPTANCE, Deployment, PoolSpec
from lockstep.policy.hashing import BlockHasher
from lockstep.policy.request import Request, RequestError, SamplingParams
from lockstep.policy.router import PrefixAffinityRouter
from lockstep.policy.step import StepPlan, StepResult, decode_constants

from .cost import AnalyticCost
from .disagg import HANDOFF, JOIN, LINK, STEP, PDFlow, check_pd_pools, pd_report
from .experts import ExpertLoads
from .load import host_loaded_tokens
from .metrics import Metrics, clean
from .profile import ProfiledCost, load_profile, step_mix
from .prompts import PROMPT_BATCH, Prompts
from .spec import DraftCost, Speculation, SpecRuntime
from .traces import TraceRequest, segment_tokens

OUTPUT_SEG_BASE = 1 << 42  # output content ids for trace requests (disjoint from prompts)


class Folded:
    """What an instance runs after an advance applied its last step too: that step's
    outputs per rank, recorded when it ends."""

    def __init__(self, outs: list):
        self.outs = outs


class Instance:
    """One DEP instance: n ranks, each a SchedulerCore, stepping in lockstep."""

    def __init__(self, name: str, pool: PoolSpec, config: SchedulerConfig, hasher: BlockHasher,
                 cost: AnalyticCost):
        self.name, self.pool, self.cost, self.role = name, pool, cost, pool.role
        self.cores = [SchedulerCore(config, hasher) for _ in range(pool.dep)]
        self.executing: list[StepPlan] | None = None
        self.planned: list[StepPlan] | None = None
        self.t_end = 0.0
        self.spec: SpecRuntime | None = None  # with [speculative]: the runtime's side of it

    @property
    def busy(self) -> bool:
        return self.executing is not None

    def load(self) -> int:
        return sum(c.load() for c in self.cores)

    def plan(self, now: float) -> list[StepPlan] | None:
        plans = [c.schedule(now) for c in self.cores]
        return None if all(p.is_empty() for p in plans) else plans


class Simulator(PDFlow):
    def __init__(self, deployment: Deployment, workload: Sequence[TraceRequest], *,
                 seed: int | None = None, slo_ttft: float = 2.0, slo_tpot: float = 0.1,
                 use_advance: bool = True, on_plan: Callable | None = None, eplb: bool = True,
                 private_prefixes: bool = True, profile_from: str | None = None):
        self.d = deployment
        self.workload = list(workload)
        self.seed = deployment.seed if seed is None else seed  # None: the deployment's
        self.slo = (slo_ttft, slo_tpot)
        self.use_advance = use_advance
        self.on_plan = on_plan  # observer for parity tests: on_plan(instance, rank, plan)
        self.hasher = BlockHasher(deployment.hash_secret.encode(), deployment.scheduler.block_size)
        self.router = PrefixAffinityRouter()
        self.instances: list[Instance] = []
        # Drifting expert loads per DEP pool ([cost] expert_skew > 0), balanced by [eplb] if on.
        self._experts: list[tuple[ExpertLoads, AnalyticCost]] = []
        self._next_window = np.inf
        self.pd = any(pool.role != "colocated" for pool in deployment.pools)
        if self.pd:
            check_pd_pools(deployment)
        if deployment.speculative and deployment.speculative.acceptance == "measured":
            raise ConfigError(UNMODELED_ACCEPTANCE.format(source=deployment.source))
        self.spec = Speculation(deployment.speculative, self.seed) if deployment.speculative else None
        # who named the profile, for its errors: the file's [cost] profile, or a flag (--profile)
        self._profile_from = profile_from or f"{deployment.source}: [cost] profile"
        profile = load_profile(deployment.cost.profile, self._profile_from) if deployment.cost.profile else None
        for pool in deployment.pools:
            model = deployment.model(pool.model)
            cost = self._cost(pool, model, profile)
            if deployment.cost.expert_skew > 0 and pool.dep > 1:
                loads = ExpertLoads(model, pool.dep, deployment.cost, deployment.eplb, self.seed, balance=eplb,
                                    gpus_per_node=deployment.hardware.gpus_per_node)
                self._experts.append((loads, cost))
                self._next_window = 0.0
            cfg = deployment.scheduler_for(pool)
            if self.spec is not None:
                draft = DraftCost(deployment.speculative.draft, deployment.hardware, deployment.cost, pool.dep)
            for i in range(pool.instances):
                self.instances.append(Instance(f"{pool.name}/{i}", pool, cfg, self.hasher, cost))
                if self.spec is not None:
                    self.instances[-1].spec = SpecRuntime(self.spec, cost, draft, pool.dep, cfg.block_size)
        self.model = deployment.model(deployment.pools[0].model)
        # Where arrivals go: every rank, or with P/D the prefill ranks.
        self._ranks = [(i, c) for i, inst in enumerate(self.instances) if inst.role != "decode"
                       for c in inst.cores]
        self._one_rank = sum(len(i.cores) for i in self.instances) == 1
        total_blocks = sum(len(i.cores) * i.cores[0].config.num_blocks for i in self.instances)
        self.metrics = Metrics(len(self.workload), total_blocks)
        self._events: list[tuple[float, int, int, object]] = []  # (time, seq, kind, argument)
        self._params: dict[int, SamplingParams] = {}  # by max_tokens (``params_for``)
        self._seq = 0
        self._build_outputs()
        # Output tokens a request's core skips: a decode core starts at the second token.
        self.out_skip = np.zeros(len(self.workload), dtype=np.int64)
        if self.pd:
            self._init_pd()
        # Too long for every pool that takes arrivals: rejected before its prompt is built. One
        # too long only for some pools is routed to the others (``_admit``).
        longest = max(c.config.max_model_len for _, c in self._ranks)
        self._mixed_context = any(c.config.max_model_len != longest for _, c in self._ranks)
        self.prompts = Prompts(self.workload, self.hasher, vocab_size=self.model.vocab_size, seed=self.seed,
                               max_model_len=longest)
        if private_prefixes and not self.pd and deployment.scheduler.enable_prefix_caching:
            self.prompts.find_private(self.out_tokens, self.out_base)

    def _cost(self, pool: PoolSpec, model, profile) -> AnalyticCost:
        d = self.d
        if profile is None:
            return AnalyticCost(model, d.hardware, d.cost, pool.dep, d.host)
        try:
            return ProfiledCost(model, d.hardware, d.cost, pool.dep, d.host, profile, pool.name)
        except ConfigError as e:
            drop = "leave it out" if "[cost] profile" not in self._profile_from else "drop [cost] profile"
            raise ConfigError(f"{self._profile_from}: {str(e).replace('drop [cost] profile', drop)}") from None

    # -- workload ------------------------------------------------------------------------------
    def _build_outputs(self) -> None:
        """All output tokens in one flat array: the token a request samples is a lookup."""
        ids = np.array([w.output_seg if w.output_seg >= 0 else OUTPUT_SEG_BASE + i
                        for i, w in enumerate(self.workload)], dtype=np.int64)
        lens = np.array([w.output_len for w in self.workload], dtype=np.int32)
        self.out_base = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=self.out_base[1:])
        self.out_tokens = segment_tokens(ids, lens, vocab_size=self.model.vocab_size, seed=self.seed)

    def params_for(self, max_tokens: int) -> SamplingParams:
        """A trace request's sampling parameters: frozen, so one per output length is shared
        (building and checking them is ~10 us, a few percent of a simulated request)."""
        got = self._params.get(max_tokens)
        if got is None:
            got = self._params[max_tokens] = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return got

    def _too_long(self, w: TraceRequest) -> bool:
        return self.prompts.too_long(w)

    def _admit(self, rid: int, now: float, upcoming: Sequence[int] = ()) -> None:
        w = self.workload[rid]
        self.metrics.arrival[rid] = w.arrival_s
        if self._too_long(w):  # before materializing a prompt that long
            self.metrics.reject(rid, "context_length")
            return
        prompt, hashes, acc = self.prompts.take(rid, upcoming or (rid,))
        if self.pd:
            req = self._pd_request(rid, prompt, hashes, acc, now)
        else:
            req = Request(id=rid, prompt=prompt, params=self.params_for(w.output_len),
                          arrival_time=now, block_hashes=hashes, hash_acc=acc,
                          private_prefix=self.prompts.private[rid])
        # One router over every rank of every instance: prefix affinity, then least loaded;
        # only ranks whose model's context holds the request (pools may serve different models).
        ranks = self._ranks
        if self._mixed_context:
            need = w.input_len + w.output_len
            ranks = [rc for rc in ranks if rc[1].config.max_model_len >= need]
        if len(ranks) > 1:
            pick = self.router.choose(hashes, [c.pool for _, c in ranks], [c.load() for _, c in ranks])
        else:
            pick = 0
        idx, core = ranks[pick]
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
            t_next = min(self._events[0][0] if self._events else np.inf, t_arr)
            if not t_next < np.inf:  # work is left, at no finite time: it would never end
                raise RuntimeError(f"simulated time became {t_next} (an infinite or NaN step time or arrival): "
                                   "check the deployment's hardware and cost numbers")
            while self._next_window <= t_next:  # expert loads move at window boundaries
                self._roll_window()
            if self._events and self._events[0][0] < t_arr:
                t, _, kind, arg = heapq.heappop(self._events)
                if kind == STEP:
                    self._step_done(arg, t, t_arr)
                elif kind == HANDOFF:
                    self._hand_off(arg, t)
                elif kind == JOIN:
                    self._pull_joins(arg, t)
                else:
                    assert kind == LINK
                    self._link_event(arg, t)
            else:
                self._admit(order[i], t_arr, order[i : i + PROMPT_BATCH])
                i += 1
                if progress is not None:
                    progress(i)
        stuck = len(self.workload) - int((~np.isnan(self.metrics.finish)).sum()) - sum(self.metrics.rejected.values())
        if stuck:  # every request ends completed or rejected with a reason, never lost
            raise RuntimeError(f"simulation ended with {stuck} requests neither completed nor rejected")
        if self.pd:
            self._check_pd_drained()
        return self.report()

    def _push(self, t: float, kind: int, arg) -> None:
        heapq.heappush(self._events, (t, self._seq, kind, arg))
        self._seq += 1

    def _dispatch(self, idx: int, now: float, plans: list[StepPlan] | None, t_end: float | None = None) -> None:
        """Start a step; ``t_end``: its end where ``_try_advance`` already priced it."""
        inst = self.instances[idx]
        inst.executing = plans
        if plans is None:
            inst.planned = None
            return
        if self.on_plan is not None:
            for rank, p in enumerate(plans):
                self.on_plan(inst, rank, p)
        host = self._start_pulls(idx, plans, now) if inst.role == "decode" else None
        if t_end is not None and host is None:
            pass
        elif inst.spec is not None:  # runs the step as the runtime would: draws, draft passes
            t_end = now + inst.spec.step(plans, host)
        else:
            t_end = now + self._step_time(inst, plans, host)
        inst.t_end = t_end
        self.metrics.steps += 1
        if self.pd:
            self.pd_stats.step(idx, t_end - now, any(p.num_tokens for p in plans))
        self._push(t_end, STEP, idx)
        inst.planned = inst.plan(now)  # async: plan N+1 while N runs

    def _roll_window(self) -> None:
        t = self._next_window
        for loads, cost in self._experts:
            cost.balancedness = loads.window(t)
        self._next_window = t + self.d.cost.expert_window_s

    def _step_done(self, idx: int, t: float, next_arrival: float) -> None:
        while True:
            t_fold = self._step_end(idx, t, next_arrival)
            if t_fold is None:
                return
            if not (self._one_rank and t_fold < next_arrival):
                self._push(t_fold, STEP, idx)
                return
            # One instance, one rank: the run's end is the next event, whatever a heap says.
            t = t_fold

    def _step_end(self, idx: int, t: float, next_arrival: float) -> float | None:
        """Apply the step that ends at t and start the next; the end of a run applied with
        it (``Folded``) if that is what the instance runs now, else None."""
        inst = self.instances[idx]
        if isinstance(inst.executing, Folded):  # the last step of a run, applied with it
            for rank, out in inst.executing.outs:
                self.metrics.tokens(out.req_ids, t)
                self._finished(idx, rank, out, t)
            if inst.role == "decode":  # (a run stops before hand-offs: none are expected)
                self._report_pulls(idx, t)
        else:
            for rank, (core, plan) in enumerate(zip(inst.cores, inst.executing)):
                # Host-tier loads are charged inside the step, so they are done when it ends;
                # a decode rank also reports the pulls that finished meanwhile.
                done = self._loads_done(idx, rank, plan) if inst.role == "decode" else plan.kv_load_req_ids
                if plan.num_reqs or len(done):
                    self._apply(idx, rank, core, plan, t, done)
        self.metrics.kv_sample(idx, t, sum(c.pool.num_used for c in inst.cores))
        plans = inst.planned
        if plans is None and any(c.has_work() for c in inst.cores):
            plans = inst.plan(t)
        t_end = None
        if plans is not None and self.use_advance:
            # An advance run must not cross a window boundary: its steps' costs would change,
            # nor a hand-off's arrival on a decode instance.
            until = min(next_arrival, self._next_window)
            if inst.role == "decode":
                until = min(until, self._next_handoff())
            got = self._try_advance(idx, plans, t, until)
            if got is not None:
                plans, t, t_end = got
                if plans is None:  # the run's last step is applied: its end is the next event
                    return t
        self._dispatch(idx, t, plans, t_end)
        return None

    def _apply(self, idx: int, rank: int, core: SchedulerCore, plan: StepPlan, t: float,
               done: np.ndarray) -> None:
        spec = self.instances[idx].spec
        if spec is not None:
            result = spec.result(rank, plan, core.s_rid, core.s_nout, self.out_tokens, self.out_base,
                                 self.out_skip, done)
            out = core.update(plan, result, t)
            self.metrics.token_counts(out.req_ids, out.num_tokens, t)
            self._finished(idx, rank, out, t)
            return
        slots, rids, samples = plan.slots.tolist(), plan.req_ids.tolist(), plan.samples.tolist()
        s_rid, s_nout, base, out_tokens = core.s_rid, core.s_nout, self.out_base, self.out_tokens
        skip = self.out_skip
        live = [s_rid.item(s) == r and m for s, r, m in zip(slots, rids, samples)]
        tokens = [out_tokens.item(base.item(r) + s_nout.item(s) + skip.item(r))
                  for s, r, ok in zip(slots, rids, live) if ok]
        result = StepResult(step_id=plan.step_id, num_sampled=np.array(live, dtype=np.int32),
                            token_ids=np.array(tokens, dtype=np.int32), kv_loads_done=done)
        out = core.update(plan, result, t)
        self.metrics.tokens(out.req_ids, t)
        self._finished(idx, rank, out, t)

    def _finished(self, idx: int, rank: int, out, t: float) -> None:
        role = self.instances[idx].role
        for rid, _ in out.finished:
            if role == "prefill" and self.workload[rid].output_len > 1:
                self._prefill_finished(rid, idx, rank, t)
            else:
                self.metrics.finish[rid] = t

    # -- advance ------------------------------------------------------------------------------
    def _try_advance(self, idx: int, plans: list[StepPlan], t: float, until: float):
        """Apply the run of identical decode steps that starts with ``plans`` in flight;
        None if there is none of at least two steps (as stepping would find it). Returns
        (plans left in flight, time, the end of the next step if already priced, else
        None), or (None, time, None) where the run's last step is applied with it: the one
        in which requests finish, or the one in which ``until`` falls (the instance runs
        ``Folded``). Its end is then the caller's event, as a single step's is, and the
        step after it is planned there."""
        inst = self.instances[idx]
        k, finishes = self._identical_steps(inst, plans)
        if finishes and inst.role == "decode" and self._joins_in(idx, plans):
            # A pulled request's first step pays host time when a step is dispatched with it
            # (``_start_pulls``), which the run's steps are not: its last step stays single.
            k, finishes = k - 1, False
        if k < 2:
            return None
        # Every boundary inside the run, and the one at its end (where the next plan is
        # made), must come before the next arrival, or that plan would miss it. The step in
        # which ``until`` falls may end the run: its plan was made before, and its end is an
        # event after it (the instance runs ``Folded``). A finishing round is priced as the
        # single step it stands for, which may end later.
        through = inst.role == "colocated" and (self._one_rank or until < self._next_window)
        ends = self._decode_ends(inst, k, t, until, last_free=finishes, through=through)
        fold, priced = False, None
        if ends and ends[-1] >= until:
            # Applied early, that step's update must not change what routing reads there.
            if self._one_rank or self._unseen_round(inst, len(ends), k, finishes):
                fold = True
            elif finishes and len(ends) == k:
                priced = ends.pop()
            else:
                ends.pop()
        elif finishes and len(ends) == k:
            fold = True
        if len(ends) < 2:
            return None
        k = len(ends)
        used = self._decode_kv_use(inst, k - fold)
        new_plans, outs = [], []
        for rank, (core, plan) in enumerate(zip(inst.cores, plans)):
            if not plan.num_reqs:  # an idle rank: its dummy steps change nothing
                new_plans.append(plan)
                continue
            if len(core._active) == 1:  # a lone request's next k tokens: a slice
                s = core._active[0]
                r = core.s_rid.item(s)
                first = self.out_base.item(r) + core.s_nout.item(s) + self.out_skip.item(r)
                tokens = self.out_tokens[first : first + k].reshape(1, k).copy()
            else:
                slots = core.active_slots()
                rids = core.s_rid[slots]
                tok = self.out_base[rids] + core.s_nout[slots] + self.out_skip[rids]
                tokens = self.out_tokens[tok[:, None] + np.arange(k)]
            out, nxt = core.advance(k, tokens)
            outs.append((rank, out))
            new_plans.append(nxt)
        body = ends[:-1] if fold else ends
        for _, out in outs:
            self.metrics.token_run(out.req_ids, body)
        self.metrics.kv_sample(idx, body, used)
        self.metrics.steps += k
        if self.pd:
            self.pd_stats.steps[idx].extend([b - a for a, b in zip([t] + ends, ends)])
        if not fold:
            return new_plans, ends[-1], priced
        inst.executing = Folded(outs)
        inst.planned = None if all(p.is_empty() for p in new_plans) else new_plans
        inst.t_end = ends[-1]
        return None, ends[-1], None

    def _unseen_round(self, inst: Instance, r: int, k: int, finishes: bool) -> bool:
        """Whether round r of a run applied before an arrival changes nothing the arrival's
        routing reads (each rank's load and indexed prefix blocks): nobody finishes in it,
        and the tokens it confirms close no block that others may look up."""
        if finishes and r == k:
            return False
        for c in inst.cores:
            if not c.config.enable_prefix_caching:
                continue
            maxtotal, maxout, nout = c.s_maxtotal, c.s_maxout, c.s_nout
            for s in c._active:  # round r confirms position maxtotal - maxout + nout + r - 1
                if (maxtotal.item(s) - maxout.item(s) + nout.item(s) + r) % c.bs == 0 \
                        and not c.s_req[s].private_prefix:
                    return False
        return True

    def _identical_steps(self, inst: Instance, plans: list[StepPlan]) -> tuple[int, bool]:
        """(rounds of the run, whether its last round finishes requests) over the ranks."""
        k, finishing = 1 << 62, []
        for core, plan in zip(inst.cores, plans):
            n = core.num_running
            if n == 0:
                if core.num_waiting:
                    return 0, False
                continue
            if plan.num_reqs != n or len(plan.kv_load_req_ids):
                return 0, False
            shared = decode_constants(n)  # what a decode-only plan is made of, mostly
            if not (plan.num_new is shared.ones and plan.samples is shared.trues) and not (
                    all(plan.samples.tolist()) and set(plan.num_new.tolist()) == {1}):
                return 0, False
            kc, fc = core.decode_run()
            k = min(k, kc)
            finishing.append((kc, fc))
        if k == 1 << 62:
            return 0, False
        return k, any(fc and kc == k for kc, fc in finishing)

    # -- cost inputs --------------------------------------------------------------------------
    def _step_time(self, inst: Instance, plans: list[StepPlan], host: list[float] | None = None) -> float:
        """What ``plan_load`` then ``step_time`` give, in Python ints and floats: the sums are
        of integers, exact in any order, so the floats are the same."""
        bs = self.d.scheduler.block_size
        tokens, ctx, pairs, loaded = [], [], [], []
        mix = [step_mix(p.num_new.tolist(), p.start_pos.tolist()) for p in plans] if inst.cost.needs_mix else None
        for p in plans:
            tokens.append(float(p.num_tokens))
            loaded.append(host_loaded_tokens(p, bs))
            if p.num_reqs:
                c, s = p.num_new.tolist(), p.start_pos.tolist()
                ctx.append(float(sum(s) + sum(c)))
                pairs.append(float(sum(ci * si + ci * (ci + 1) // 2 for ci, si in zip(c, s))))
            else:
                ctx.append(0.0)
                pairs.append(0.0)
        return inst.cost.rank_step_time(tokens, ctx, pairs, loaded, host, mix=mix)

    def _decode_ends(self, inst: Instance, k: int, t: float, until: float, last_free: bool = False,
                     through: bool = False) -> list[float]:
        ns, bases = [], []
        for core in inst.cores:
            act, ncomp = core._active, core.s_ncomp
            ns.append(float(len(act)))
            bases.append(float(sum(ncomp.item(s) for s in act)))  # plan j feeds positions ncomp-1+j
        return inst.cost.decode_run_ends(t, ns, bases, k, until, last_free=last_free, through=through)

    def _decode_kv_use(self, inst: Instance, k: int) -> list[int]:
        """Blocks in use at each step end of the run: plan j takes the blocks its fed
        position needs."""
        steps = [sum(c.pool.num_used for c in inst.cores)] + [0] * k
        for c in inst.cores:
            for ncomp, nblk in ((c.s_ncomp.item(s), c.s_nblocks.item(s)) for s in c._active):
                # from step j on the slot holds ceil((ncomp + j) / bs) blocks
                for j in range(nblk * c.bs - ncomp + 1, k + 1, c.bs):
                    steps[max(j, 1)] += 1
        return list(itertools.accumulate(steps))[1:]

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
        if len(self.d.pools) > 1:  # (the deployment-wide figure hides a small pool's pressure)
            rep["kv_cache_use_per_pool"] = {
                pool.name: self.metrics.kv_stats(
                    {j for j, inst in enumerate(self.instances) if inst.pool is pool},
                    sum(len(inst.cores) * inst.cores[0].config.num_blocks
                        for inst in self.instances if inst.pool is pool))
                for pool in self.d.pools}
        if self._experts:
            # one DEP pool with expert loads (pools of one model drift alike): a decode pool's
            # where there is one (its steps make TPOT), else the first
            skewed = [p for p in self.d.pools if p.dep > 1]
            i = next((j for j, p in enumerate(skewed) if p.role == "decode"), 0)
            rep["balancedness"] = {**self._experts[i][0].report(), "pool": skewed[i].name}
        if self.spec is not None:
            rep["spec_decode"] = self.spec.report()
        measured = [i.cost.statistics() for i in self.instances if isinstance(i.cost, ProfiledCost)]
        if measured:  # lookups summed over the instances (they share one profile)
            rep["cost_profile"] = {**measured[0], "lookups": sum(m["lookups"] for m in measured),
                                   "lookups_outside_grid": sum(m["lookups_outside_grid"] for m in measured)}
        if self.pd:
            start = float(np.nanmin(self.metrics.arrival)) if len(self.workload) else 0.0
            m = self.metrics
            gaps = (m.second - m.first)[(self.out_skip == 1) & ~np.isnan(m.second)]
            rep.update(pd_report(self.pd_stats, self.d, start, start + rep["duration_s"], gaps))
        return clean(rep)
