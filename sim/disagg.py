"""Prefill/decode disaggregation in the simulator: hand-offs, KV pulls, held blocks.

A request runs on a prefill instance with one output token, the user's first: TTFT ends
when that prefill step ends, because lockstep's prefill streams it to the user. (vLLM's and
SGLang's P/D setups stream every token from the decode side, so their TTFT also holds the
hand-off and the pull; here that shows as the gap to the second token, reported as
``kv_transfer.second_token_gap_s``.) The prefill rank keeps the request's blocks
(``Request.hold_kv``); ``handoff_s`` later the request joins the least-loaded decode rank as
its prompt plus that first token, with ``remote_kv_tokens`` = the prompt's length, so the
decode side feeds the first token and samples the second. The decode core starts at most
``max_kv_loads_per_step`` pulls per step. A pull starts when the plan carrying it is
dispatched, runs on its GPU's link (``sim.link``), frees the prefill side's blocks when done,
and reaches the decode core in the result of the step running then (or at once when the
instance is idle); the plan after that step was made already, so the request decodes from
the one after it, as in the engine with async scheduling.

The step that starts pulls pays their host work (``start_s`` + descriptors ×
``per_descriptor_s`` each); the step a pulled request first runs in pays ``done_s`` for it
(completion handling, its block table, the scheduler's non-decode path) besides what any
request costs there: its token and its whole context's KV reads. Nothing charges the pull's
bytes to a step: the runtime pulls in the background. Without the cap a burst lands in one
step on both counts: the host work of many pulls, and many requests joining the batch.
"""

from __future__ import annotations

import collections
from array import array

import attrs
import numpy as np

from lockstep.policy.config import ConfigError
from lockstep.policy.request import Request, RequestError
from lockstep.policy.step import StepPlan, StepResult

from .link import Link, descriptors

STEP, HANDOFF, JOIN, LINK = range(4)  # event kinds


@attrs.define(slots=True)
class Pull:
    rid: int
    inst: int  # decode instance index
    rank: int
    src: tuple[int, int]  # (prefill instance index, rank) holding the blocks
    tokens: int
    nbytes: float
    descriptors: int
    t_handoff: float
    t_start: float


def check_pd_pools(deployment) -> None:
    roles = {p.role for p in deployment.pools}
    if "colocated" in roles or roles != {"prefill", "decode"}:
        raise ConfigError(
            f"{deployment.source}: [[pools]]: the simulator runs either colocated pools or a "
            f"prefill/decode split (at least one pool of role 'prefill' and one of role "
            f"'decode', nothing else); got roles {sorted(roles)}")
    models = {p.model for p in deployment.pools}
    if len(models) > 1:
        raise ConfigError(f"{deployment.source}: [[pools]]: prefill and decode pools must serve "
                          f"one model (decode reads the prefill's KV), got {sorted(models)}")


def _completions_only() -> StepPlan:
    """The plan of a step that only carries KV-load completions (an idle instance's)."""
    z32, z64 = np.zeros(0, np.int32), np.zeros(0, np.int64)
    return StepPlan(step_id=-1, req_ids=z64, slots=z32, num_new=z32, start_pos=z32,
                    samples=np.zeros(0, bool), token_ids=z32, token_offsets=np.zeros(1, np.int64),
                    block_start=z32, block_ids=z32, block_offsets=np.zeros(1, np.int64))


class PDFlow:
    """The Simulator's P/D half (a mixin: it shares the simulator's instances, events and
    metrics)."""

    def _init_pd(self) -> None:
        d = self.d
        self.kvt = d.kv_transfer
        m = d.model(d.pools[0].model)
        self._block_bytes = m.kv_bytes_per_token * d.scheduler.block_size
        if d.speculative is not None:  # the draft's cache of the prompt comes along
            self._block_bytes += d.speculative.draft.kv_bytes_per_token * d.scheduler.block_size
        bw = self.kvt.bandwidth or d.hardware.link_bandwidth
        self._decode = [(i, r) for i, inst in enumerate(self.instances) if inst.role == "decode"
                        for r in range(len(inst.cores))]
        self._links = {key: Link(bw) for key in self._decode}
        self._held_prompts: dict[int, tuple] = {}  # rid -> (prompt, hashes, acc) until hand-off
        self._srcs: dict[int, tuple[int, int]] = {}  # rid -> prefill (instance, rank), until its pull
        self._prefill_insts = [inst for inst in self.instances if inst.role == "prefill"]
        self._handoffs: collections.deque[float] = collections.deque()  # due times, in order
        self._queued: dict[int, float] = {}  # rid -> hand-off time, until its pull starts
        self._pulls: dict[int, Pull] = {}
        self._done: dict[tuple[int, int], list[int]] = {k: [] for k in self._decode}
        self._joining: dict[tuple[int, int], set[int]] = {k: set() for k in self._decode}
        self.pd_stats = PDStats(self.instances)

    # -- prefill side --------------------------------------------------------------------------
    def _pd_request(self, rid: int, prompt, hashes, acc, now: float) -> Request:
        w = self.workload[rid]
        hold = w.output_len > 1
        if hold:
            self._held_prompts[rid] = (prompt, hashes, acc)
        return Request(id=rid, prompt=prompt, params=self.params_for(1),
                       arrival_time=now, block_hashes=hashes, hash_acc=acc, hold_kv=hold)

    def _prefill_finished(self, rid: int, idx: int, rank: int, t: float) -> None:
        """The prefill sampled the first token and kept the blocks: hand the request over."""
        self._srcs[rid] = (idx, rank)
        due = t + self.kvt.handoff_s
        self._handoffs.append(due)
        self._push(due, HANDOFF, rid)
        self.pd_stats.held(t, len(self.instances[idx].cores[rank].held[rid]))

    def _hand_off(self, rid: int, t: float) -> None:
        self._handoffs.popleft()
        prompt, hashes, acc = self._held_prompts.pop(rid)
        w, bs = self.workload[rid], self.d.scheduler.block_size
        first = self.out_tokens[self.out_base[rid]]
        full = np.concatenate([prompt, np.array([first], dtype=np.int32)])
        same = len(full) // bs == len(prompt) // bs  # else the core hashes the new block
        req = Request(id=rid, prompt=full, params=self.params_for(w.output_len - 1),
                      arrival_time=t, block_hashes=hashes if same else np.empty((0, 2), np.uint64),
                      hash_acc=acc if same else None, remote_kv_tokens=len(prompt))
        loads = [self.instances[i].cores[r].load() for i, r in self._decode]
        idx, rank = self._decode[min(range(len(loads)), key=loads.__getitem__)]
        inst = self.instances[idx]
        try:
            inst.cores[rank].add_request(req)
        except RequestError as e:  # counted with its reason; the prefill side lets go
            self.metrics.reject(rid, e.reason)
            self._release_prefill(self._srcs.pop(rid), rid, t)
            return
        self.out_skip[rid] = 1  # the decode side's first output is the request's second
        self._queued[rid] = t
        self.pd_stats.queue(t, +1)
        if not inst.busy:
            self._dispatch(idx, t, inst.plan(t))

    def _release_prefill(self, src: tuple[int, int], rid: int, t: float) -> None:
        idx, rank = src
        inst = self.instances[idx]
        n = len(inst.cores[rank].held.get(rid, ()))
        inst.cores[rank].release_held(rid)
        self.pd_stats.held(t, -n)
        if not inst.busy and any(c.has_work() for c in inst.cores):  # freed blocks may admit
            self._dispatch(idx, t, inst.plan(t))

    def _next_handoff(self) -> float:
        """The earliest a new request can reach a decode instance: a pending hand-off, or
        the end of a prefill step (an advance run must stop before it)."""
        t = self._handoffs[0] if self._handoffs else np.inf
        for inst in self._prefill_insts:
            if inst.busy and inst.t_end < t:
                t = inst.t_end
        return t

    # -- decode side -----------------------------------------------------------------------
    def _start_pulls(self, idx: int, plans: list[StepPlan], now: float) -> list[float] | None:
        """Start the pulls these plans carry; each rank's host seconds for this step (pulls
        started, pulled requests entering the batch), or None if there are none."""
        kvt, extra, any_work = self.kvt, [], False
        for rank, plan in enumerate(plans):
            host = 0.0
            joining = self._joining[(idx, rank)]
            if joining and plan.num_reqs:
                joined = joining.intersection(plan.req_ids.tolist())
                joining -= joined
                host += len(joined) * kvt.done_s
            if len(plan.kv_load_req_ids):
                host += self._pull_plan(idx, rank, plan, now)
            any_work = any_work or host > 0
            extra.append(host)
        return extra if any_work else None

    def _joins_in(self, idx: int, plans: list[StepPlan]) -> bool:
        """Whether a pulled request runs its first step in these plans (``_start_pulls``
        charges it)."""
        return any(self._joining[(idx, rank)] and not self._joining[(idx, rank)].isdisjoint(p.req_ids.tolist())
                   for rank, p in enumerate(plans))

    def _pull_plan(self, idx: int, rank: int, plan: StepPlan, now: float) -> float:
        kvt, host, started = self.kvt, 0.0, 0
        offs = plan.block_offsets.tolist()
        for i in np.flatnonzero(plan.num_new == 0).tolist():  # a remote entry: no tokens fed
            rid = int(plan.req_ids[i])
            src = self._srcs.pop(rid)
            held = self.instances[src[0]].cores[src[1]].held[rid]
            dst = plan.block_ids[offs[i] : offs[i + 1]].tolist()
            n_desc = descriptors(held, dst, kvt.merged)
            pull = Pull(rid, idx, rank, src, self.workload[rid].input_len, len(dst) * self._block_bytes,
                        n_desc, self._queued.pop(rid), now)
            self._pulls[rid] = pull
            self._push(now + kvt.setup_s + n_desc * kvt.per_descriptor_s, JOIN, rid)
            host += kvt.start_s + n_desc * kvt.per_descriptor_s
            self.pd_stats.pull_started(pull)
            started += 1
        self.pd_stats.pulls_per_step.append(started)
        return host

    def _pull_joins(self, rid: int, t: float) -> None:
        pull = self._pulls[rid]
        link = self._links[(pull.inst, pull.rank)]
        link.add(rid, pull.nbytes, t)
        self._push(link.next_done(), LINK, ((pull.inst, pull.rank), link.version))

    def _link_event(self, arg: tuple, t: float) -> None:
        key, version = arg
        link = self._links[key]
        if version != link.version:  # the link's pulls changed since: a later event stands
            return
        for rid in link.finish(t):
            self._pull_done(self._pulls.pop(rid), t)
        if link.left:
            self._push(link.next_done(), LINK, (key, link.version))

    def _pull_done(self, pull: Pull, t: float) -> None:
        self.pd_stats.pull_done(pull, t)
        self._release_prefill(pull.src, pull.rid, t)
        key = (pull.inst, pull.rank)
        self._joining[key].add(pull.rid)  # its first step pays ``done_s``
        inst = self.instances[pull.inst]
        if inst.busy:  # reported with the step running now
            self._done[key].append(pull.rid)
            return
        plan = _completions_only()
        done = StepResult(step_id=plan.step_id, num_sampled=plan.slots, token_ids=plan.slots,
                          kv_loads_done=np.array([pull.rid], dtype=np.int64))
        inst.cores[pull.rank].update(plan, done, t)
        self._dispatch(pull.inst, t, inst.plan(t))

    def _report_pulls(self, idx: int, t: float) -> None:
        """Report the pulls that finished during a step no plan of a rank stands for."""
        for rank, core in enumerate(self.instances[idx].cores):
            got, self._done[(idx, rank)] = self._done[(idx, rank)], []
            if got:
                plan = _completions_only()
                core.update(plan, StepResult(step_id=plan.step_id, num_sampled=plan.slots, token_ids=plan.slots,
                                             kv_loads_done=np.array(got, dtype=np.int64)), t)

    def _loads_done(self, idx: int, rank: int, plan: StepPlan) -> np.ndarray:
        """What the result of this rank's step reports done: host-tier loads the step ran,
        and the pulls that finished while it ran."""
        got = self._done[(idx, rank)]
        if not got and not len(plan.kv_load_req_ids):
            return plan.kv_load_req_ids
        remote = set(plan.req_ids[plan.num_new == 0].tolist())
        host = [r for r in plan.kv_load_req_ids.tolist() if r not in remote]
        self._done[(idx, rank)] = []
        return np.array(host + got, dtype=np.int64)

    def _check_pd_drained(self) -> None:
        held = sum(len(c.held) for inst in self.instances for c in inst.cores)
        if held or self._pulls or self._queued:
            raise RuntimeError(f"simulation ended with {held} prefill holds, {len(self._pulls)} pulls "
                               f"and {len(self._queued)} hand-offs not done")


class PDStats:
    """What the report says about P/D: step times per pool, pulls, requests waiting for KV."""

    def __init__(self, instances):
        self.pools = [inst.pool.name for inst in instances]
        self.steps = [array("d") for _ in instances]  # forward steps' durations, in order
        self.pull_only_steps = [0] * len(instances)
        self.transfer = array("d")  # pull start -> done
        self.queue_wait = array("d")  # hand-off -> pull start (the cap shows here)
        self.pull_tokens = array("d")
        self.pull_desc = array("d")
        self.pulls_per_step = array("d")  # pulls one rank started in one step, over such steps
        self.rate = array("d")  # tokens/s of each pull
        self._counts = {"queued": [], "pulling": [], "held_blocks": []}  # (t, delta) events

    def step(self, idx: int, duration: float, forward: bool) -> None:
        """A step of one instance; steps that only start pulls (no tokens on any rank, so
        no forward pass) are counted apart: next to forward passes they would read as jumps."""
        if forward:
            self.steps[idx].append(duration)
        else:
            self.pull_only_steps[idx] += 1

    def queue(self, t: float, delta: int) -> None:
        self._counts["queued"].append((t, delta))

    def held(self, t: float, blocks: int) -> None:
        self._counts["held_blocks"].append((t, blocks))

    def pull_started(self, pull: Pull) -> None:
        self.queue(pull.t_start, -1)
        self._counts["pulling"].append((pull.t_start, 1))
        self.queue_wait.append(pull.t_start - pull.t_handoff)
        self.pull_desc.append(pull.descriptors)

    def pull_done(self, pull: Pull, t: float) -> None:
        self._counts["pulling"].append((t, -1))
        self.transfer.append(t - pull.t_start)
        self.pull_tokens.append(pull.tokens)
        self.rate.append(pull.tokens / max(t - pull.t_start, 1e-12))

    def counts(self, key: str, start: float, end: float) -> dict:
        """Time-weighted mean and max of a count over [start, end]."""
        ev = sorted(self._counts[key], key=lambda e: e[0])
        if not ev:
            return {"mean": 0.0, "max": 0}
        t = np.array([e[0] for e in ev])
        level = np.cumsum([e[1] for e in ev])
        dt = np.diff(np.append(np.clip(t, start, end), end))
        span = max(end - start, 1e-12)
        return {"mean": float((level * dt).sum() / span), "max": int(level.max())}


def _pcts(values, qs=(50, 99)) -> dict:
    v = np.asarray(values, dtype=np.float64)
    if len(v) == 0:
        return {f"p{q}": None for q in qs} | {"max": None}
    out = {f"p{q}": float(np.percentile(v, q)) for q in qs}
    out["max"] = float(v.max())
    return out


def pd_report(stats: PDStats, deployment, start: float, end: float, second_gaps: np.ndarray) -> dict:
    """The report's P/D sections; ``second_gaps``: first -> second token of each request
    that went through a pull (the hand-off, the wait under the cap, the pull, joining)."""
    pools = {}
    for pool in deployment.pools:
        steps = [np.asarray(s) for s, name in zip(stats.steps, stats.pools) if name == pool.name]
        every = np.concatenate(steps) if steps else np.zeros(0)
        jumps = np.concatenate([np.diff(s) for s in steps]) if steps else np.zeros(0)
        pull_only = sum(n for n, name in zip(stats.pull_only_steps, stats.pools) if name == pool.name)
        pools[pool.name] = {
            "role": pool.role, "gpus": pool.num_gpus, "steps": int(len(every)), "pull_only_steps": pull_only,
            "step_s": _pcts(every), "step_jump_s": _pcts(jumps[jumps > 0] if len(jumps) else jumps),
        }
    decode_gpus = sum(p.num_gpus for p in deployment.pools if p.role == "decode")
    span = max(end - start, 1e-12)
    n = len(stats.transfer)
    return {
        "pools": pools,
        "kv_transfer": {
            "pulls": n, "tokens": int(sum(stats.pull_tokens)),
            "tokens_per_s_per_gpu": float(sum(stats.pull_tokens)) / span / decode_gpus,
            "pull_tokens_per_s": _pcts(stats.rate, (50,)),
            "transfer_s": _pcts(stats.transfer), "queue_wait_s": _pcts(stats.queue_wait),
            "second_token_gap_s": _pcts(second_gaps),
            "descriptors_per_pull": float(np.mean(stats.pull_desc)) if n else None,
            "pulls_started_per_rank_step": _pcts(stats.pulls_per_step),
            "queued_for_kv": stats.counts("queued", start, end),
            "waiting_for_kv": stats.counts("pulling", start, end),
            "prefill_held_blocks": stats.counts("held_blocks", start, end),
        },
    }
