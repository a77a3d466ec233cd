"""The Scheduler actor: owns one SchedulerCore and drives one runtime through its client.

Each step: apply the step that just ended (``update``), hand its tokens to the request
streams, dispatch the plan made while it ran, and plan the next one (async scheduling: step
N+1 is planned while step N executes, exactly as the simulator models it). Messages
(submissions, aborts) are taken at step boundaries. A structured-output request that arrives
while others run waits outside the core until a result says its runtime compiled its grammar
(vLLM's WAITING_FOR_FSM; ``lockstep.policy.grammar_holds``): scheduled at once, its first
sampling step would wait for the compile, and every request in that step with it. A runtime
that dies fails every request it held with a clear error; the actor then starts a fresh
runtime and a fresh core and goes on serving (``recovery``).

With expert load balancing, every step's expert counts go to the Balancer actor, whose new
placements go to the runtime with the next plan; the runtime's ready placement generation
joins the DP sync, whose minimum each plan carries (the runtime switches when it changes).

Time comes from a ``Pacer``: real time by default; the sim-parity test and trace replays use
step time (each step lasts what the runtime reports, and arrivals are released at step
boundaries).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable

import attrs
import numpy as np
import structlog
import trio

from lockstep.policy.core import SchedulerCore
from lockstep.policy.grammar_holds import GrammarHolds
from lockstep.policy.request import FinishReason, Request, RequestError
from lockstep.policy.step import StepPlan, StepResult

from lockstep.policy.dp_sync import decide, dummy, local_state, padded

from .balancer import Loads, Restarted
from .group import LocalGroup
from .output import RequestStream, deliver
from .pacing import Pacer, RealTime
from .recovery import Recovery
from .runtime_client import RuntimeClient, RuntimeDied, new_requests


log = structlog.get_logger("lockstep.scheduler")


@attrs.frozen
class Submit:
    req: Request
    stream: RequestStream


@attrs.frozen
class Abort:
    req_id: int
    reason: FinishReason = FinishReason.ABORT


@attrs.frozen
class Stop:
    """Finish the steps in flight, then return."""


@attrs.frozen
class StartHeld:
    """Nothing runs that a grammar's compile could hold up: start the requests held for one."""


@attrs.frozen
class Rebalance:
    """A new expert placement (from the balancer) for the runtime to stage."""

    gen: int
    phy2log: np.ndarray  # (MoE layers, slots) int64, read-only
    model: str = "target"  # or "draft"


@attrs.frozen
class PlacementStatus:
    running: int  # placement generation of the newest step sent to the runtime
    ready: int  # newest generation the runtime said it could switch to
    forwarded: int  # newest generation handed to the runtime


@attrs.frozen
class SchedulerStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    steps: int
    generated_tokens: int
    runtime_restarts: int
    waiting_for_kv: int = 0  # P/D decode: requests whose prompt KV is being pulled
    kv_held: int = 0  # P/D prefill: finished prefills whose blocks wait for a pull
    kv_pulls: int = 0  # P/D decode: pulls done
    kv_pull_failures: int = 0  # of which fell back to prefilling on the decode side
    spec_drafts: int = 0  # speculative decodes (a request's step with drafts)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class Scheduler(Recovery):
    def __init__(self, make_core: Callable[[], SchedulerCore], make_client: Callable[[], RuntimeClient],
                 *, pacer: Pacer | None = None, on_plan: Callable[[StepPlan], None] | None = None,
                 on_result: Callable[[StepPlan, StepResult], None] | None = None,
                 group: LocalGroup | None = None, rank: int = 0,
                 loads: trio.MemorySendChannel | None = None, role=None):
        self.make_core, self.make_client = make_core, make_client
        self.core = make_core()
        self.client: RuntimeClient | None = None
        self.pacer = pacer or RealTime()
        self.on_plan, self.on_result = on_plan, on_result  # observers (tests, benchmarks)
        self.group, self.rank = group, rank  # the DEP instance this rank steps with, if any
        self.loads = loads  # the expert load balancer's mailbox, when it runs
        self.role = role  # the P/D side this rank plays (lockstep.engine.disagg), or None
        # Prompt tokens the Frontend routed here that are not in the core yet (in the mailbox,
        # or held by the pacer): the router counts them, or a burst of requests all see the
        # same stale loads and go to one rank.
        self.inbound = 0
        self._placement = PlacementStatus(0, 0, 0)
        self._draft_placement = PlacementStatus(0, 0, 0)  # a speculative draft's sharded experts
        self.streams: dict[int, RequestStream] = {}
        self._unscheduled: set[int] = set()  # admitted, not yet in any plan (for queue time)
        self._want_logprobs: set[int] = set()
        # Structured-output requests whose grammar the runtime is compiling: out of the core
        # until a result says it is done (their prompts stay in ``inbound`` for the router).
        self.holds = GrammarHolds()
        self.send_channel, self._inbox = trio.open_memory_channel(math.inf)
        # Plans sent and not yet answered, oldest first: with async scheduling the next plan
        # is sent as soon as it is made, so the runtime starts it the moment it finishes
        # the current one and never waits on the host.
        self._in_flight: deque[StepPlan] = deque()
        self._stopping = False
        self.steps = self.generated = self.restarts = 0
        self.down = False  # its runtime (or its DEP group) is being restarted: requests wait
        self._failed_starts = 0  # group restarts in a row whose runtime did not start
        self._old = (0, 0, 0)  # prefix queries, hits, preemptions of cores replaced on restarts
        self._old_spec = (0, 0, 0)  # drafts, draft tokens, accepted tokens of replaced cores
        self._old_per_pos = np.zeros_like(self.core.spec_accepted_per_pos)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.client = self.make_client()
        try:
            await self.client.start()
            self._started()
            task_status.started()
            while True:
                if self.group is None:
                    return await self._loop()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self.group.cancel_on_failure, nursery.cancel_scope)
                    await self._loop()
                    nursery.cancel_scope.cancel()
                if self.group.failure is None:
                    return
                await self._restart_with_group()
        finally:
            with trio.CancelScope(shield=True):
                self._fail_all(RuntimeError("the engine shut down"))
                self._fail_inbox(RuntimeError("the engine shut down"))
                await self.client.aclose()

    # -- the loop ------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while not (self._stopping and not self._in_flight):
            if not self._in_flight:
                await self._idle()
                continue
            try:
                result = await self.client.receive_result()
            except RuntimeDied as e:
                if self.group is not None:  # the others may be stuck in a collective with it
                    self.group.fail(e)
                    await trio.sleep_forever()
                await self._restart(e)
                continue
            plan = self._in_flight.popleft()
            if len(result.grammars_ready):
                self._start(self.holds.compiled(result.grammars_ready.tolist()))
            self._note_placement(plan, result)
            self.pacer.step_done(result)
            if self.on_result is not None:
                self.on_result(plan, result)
            now = self.pacer.now()
            self._take_messages(now)
            if not plan.is_dummy:
                self._apply(plan, result, now)
            if self._in_flight:
                await self._plan_ahead(now)
            elif self.group is not None or self.core.has_work():
                await self._dispatch(now)

    async def _idle(self) -> None:
        """Nothing in flight: wait for a message (in step time: jump to the next arrival,
        which is planned alone, as the simulator does). In a DEP group, a message to any
        rank wakes every rank, and all of them run the next round together."""
        if self.holds:  # (a message, so that a DEP group wakes as for any other)
            self.send_channel.send_nowait(StartHeld())
        sub = self.pacer.wake()
        if sub is not None:
            now = self.pacer.now()
            self._handle(sub, now)
        elif self.group is None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._until_runtime_exits, nursery.cancel_scope)
                with trio.move_on_after(self._role_wait()):
                    msg = await self._inbox.receive()
                    self._handle(msg, self.pacer.now())
                nursery.cancel_scope.cancel()
            if not self.client.alive():  # died while idle: restart now, not on the next request
                code = None if self.client.proc is None else self.client.proc.exitcode
                return await self._restart(RuntimeDied(f"runtime process exited while idle (code {code})"))
            now = self.pacer.now()
            self._take_messages(now)
        else:
            await self._wait_group()
            if not self.client.alive():  # died while idle: the group restarts now, not on the next request
                code = None if self.client.proc is None else self.client.proc.exitcode
                self.group.fail(RuntimeDied(f"the runtime process of rank {self.rank} exited while idle (code {code})"))
                await trio.sleep_forever()  # cancelled by the group's failure
            now = self.pacer.now()
            self._take_messages(now)
        if self.group is not None or self.core.has_work():
            await self._dispatch(now)

    async def _wait_group(self) -> None:
        seen = self.group.wake_gen
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._until_runtime_exits, nursery.cancel_scope)
            async def on_message():
                msg = await self._inbox.receive()
                self._handle(msg, self.pacer.now())
                self.group.wake()
            nursery.start_soon(on_message)
            with trio.move_on_after(self._role_wait()):
                await self.group.wait_woken(seen)
            if self.group.wake_gen == seen:  # this rank's own timer: the others step with it
                self.group.wake()
            nursery.cancel_scope.cancel()

    async def _until_runtime_exits(self, scope: trio.CancelScope) -> None:
        proc = self.client.proc
        if proc is not None:
            await trio.lowlevel.wait_readable(proc.sentinel)
            scope.cancel()

    def _role_wait(self) -> float:
        """How long an idle rank may sleep: forever, unless its P/D side has a deadline
        (a hold to expire) or KV loads to poll."""
        if self.role is None:
            return math.inf
        t = self.role.wake_after(self.pacer.now())
        return math.inf if t is None else t

    def _take_messages(self, now: float) -> None:
        if self.role is not None:
            self.role.tick(self, now)
        for sub in self.pacer.due(now):
            self._handle(sub, now)
        while True:
            try:
                msg = self._inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                return
            self._handle(msg, now)

    def _handle(self, msg, now: float) -> None:
        match msg:
            case Submit(req=req, stream=stream):
                if stream.abandoned:  # its abort may have arrived first and found nothing
                    self.inbound -= req.prompt_len
                    stream.finish(FinishReason.ABORT, now)
                    return
                if self.role is not None:
                    req = self.role.on_submit(req)
                try:
                    self.core.check_request(req)
                except RequestError as e:
                    self.inbound -= req.prompt_len
                    stream.fail(e, now)
                    return
                self.streams[req.id] = stream
                self._unscheduled.add(req.id)
                p = req.params
                if p.logprobs is not None:
                    self._want_logprobs.add(req.id)
                if p.prompt_logprobs is not None:  # nothing scores the first prompt token
                    stream.push_prompt_logprob(0, (int(req.prompt[0]), None, [], None))
                self.client.add_requests(new_requests(req))  # (a grammar starts compiling there)
                if not self.holds.arrive(req, busy=bool(self._in_flight) or self.core.has_work()):
                    self._start([req])
            case Abort(req_id=rid, reason=reason):
                self._unscheduled.discard(rid)
                self._want_logprobs.discard(rid)
                held = self.holds.drop(rid)
                if held is not None:
                    self.inbound -= held.prompt_len
                if self.core.abort(rid) or held is not None:
                    self.client.forget([rid])
                if self.role is not None:
                    self.role.on_abort(self, rid)
                s = self.streams.pop(rid, None)
                if s is not None:
                    s.finish(reason, now)
            case StartHeld():
                self._start(self.holds.release_all())
            case Stop():
                self._stopping = True
            case Rebalance(gen=gen, phy2log=phy2log, model="draft"):
                self.client.new_placement(gen, phy2log, "draft")
                self._draft_placement = attrs.evolve(self._draft_placement, forwarded=gen)
            case Rebalance(gen=gen, phy2log=phy2log):
                self.client.new_placement(gen, phy2log)
                self._placement = attrs.evolve(self._placement, forwarded=gen)
            case _:
                if self.role is None or not self.role.handle(self, msg, now):
                    raise TypeError(f"Scheduler got an unknown message {msg!r}")

    def _start(self, reqs: list[Request]) -> None:
        """Into the core (their prompts leave ``inbound``: the core's load counts them now)."""
        for req in reqs:
            self.inbound -= req.prompt_len
            self.core.add_request(req)

    def _plan(self, now: float) -> StepPlan | None:
        plan = self.core.schedule(now)
        if plan.is_empty():  # an empty plan still collects KV-load completions (P/D decode)
            return plan if self.role is not None and self.role.wants_poll(self, now) else None
        return plan

    async def _dispatch(self, now: float) -> None:
        """One round; if it sent a plan, (async scheduling) plan the step after it too."""
        if await self._round(now):
            await self._plan_ahead(now)

    async def _plan_ahead(self, now: float) -> None:
        if self.core.config.async_scheduling:
            await self._round(now)

    async def _round(self, now: float) -> bool:
        """Plan a step and send it; in a DEP group, first agree with the other ranks
        (padding, or a dummy plan when only others have work). True if a plan went out."""
        plan = self._plan(now)
        ready, draft_ready = self._placement.ready, self._draft_placement.ready
        if self.group is None:
            if plan is not None:
                # What the DP sync sets on one rank: the placement to run and, with expert
                # slots (the balancer on), whether the step only decodes (padded expert
                # dispatch then runs it, as a CUDA graph on the fast path).
                uniform = self.loads is not None and plan.num_reqs > 0 and int(plan.num_new.max()) <= 1
                if (plan.placement_gen, plan.draft_placement_gen, plan.uniform_decode) != (ready, draft_ready,
                                                                                          uniform):
                    plan = attrs.evolve(plan, placement_gen=ready, draft_placement_gen=draft_ready,
                                        uniform_decode=uniform)
                self._send(plan)
            return plan is not None
        d = decide(await self.group.allreduce(self.rank, local_state(plan, ready_gen=ready,
                                                                     draft_ready_gen=draft_ready)))
        if d.run:
            self._send(padded(plan, d) if plan is not None else dummy(d))
        return d.run

    def _send(self, plan: StepPlan) -> None:
        if self._unscheduled and not plan.is_dummy:
            self._mark_scheduled(plan)
        if self.role is not None and len(plan.kv_load_req_ids):
            self.role.before_send(self, plan)  # the pulls go out ahead of the plan
        if self.on_plan is not None:
            self.on_plan(plan)
        self.client.send_plan(plan)  # after the control messages queued since the last one
        self._in_flight.append(plan)
        if plan.placement_gen != self._placement.running:
            self._placement = attrs.evolve(self._placement, running=plan.placement_gen)
        if plan.draft_placement_gen != self._draft_placement.running:
            self._draft_placement = attrs.evolve(self._draft_placement, running=plan.draft_placement_gen)
        self.steps += 1

    def _deliver_logprobs(self, plan: StepPlan, result: StepResult, out) -> None:
        """Logprob rows follow the sampled tokens, in plan order (several for an entry that
        verified drafts); hand each asking request the rows of the tokens it kept this step
        (before the tokens, which close the delta)."""
        first = np.concatenate([[0], np.cumsum(result.num_sampled)]).tolist()
        entry = {rid: i for i, rid in enumerate(plan.req_ids.tolist()) if rid in self._want_logprobs}
        for rid, n in zip(out.req_ids.tolist(), out.num_tokens.tolist()):
            i = entry.get(rid)
            s = self.streams.get(rid)
            if i is None or s is None:
                continue
            for r in range(first[i], first[i] + n):
                top = None if result.top_ids is None else (result.top_ids[r], result.top_logprobs[r])
                s.push_logprobs(float(result.logprobs[r]), top)
        for rid, _ in out.finished:
            self._want_logprobs.discard(rid)

    def _mark_scheduled(self, plan: StepPlan) -> None:
        now = self.pacer.now()
        for rid in plan.req_ids.tolist():
            if rid in self._unscheduled:
                self._unscheduled.discard(rid)
                s = self.streams.get(rid)
                if s is not None:
                    s.scheduled_at = now
                    req = self.core.requests.get(rid)  # admitted: its prefix-cache hit is known
                    if req is not None and req.num_cached_tokens > 0:
                        s.num_cached_tokens = req.num_cached_tokens

    def _note_placement(self, plan: StepPlan, result: StepResult) -> None:
        """The runtime's ready placement goes into the next DP sync; the step's expert
        loads go to the balancer."""
        if result.placement_ready != self._placement.ready:
            self._placement = attrs.evolve(self._placement, ready=result.placement_ready)
        if result.draft_placement_ready != self._draft_placement.ready:
            self._draft_placement = attrs.evolve(self._draft_placement, ready=result.draft_placement_ready)
        if self.loads is not None:
            self.loads.send_nowait(Loads(self.rank, result.expert_counts, plan.placement_gen))
            if self.client.ready.draft_num_experts:
                self.loads.send_nowait(Loads(self.rank, result.draft_expert_counts, plan.draft_placement_gen,
                                             "draft"))

    def _deliver_prompt_logprobs(self, result: StepResult) -> None:
        """Each scored prompt token's row to its request's stream."""
        top_ids, top_lps = result.prompt_top_ids, result.prompt_top_logprobs
        for j, (rid, index) in enumerate(zip(result.prompt_req_ids.tolist(), result.prompt_index.tolist())):
            s, req = self.streams.get(rid), self.core.requests.get(rid)
            if s is None or req is None:
                continue
            k = req.params.prompt_logprobs or 0
            top = [] if top_ids is None else list(zip(top_ids[j, :k].tolist(), top_lps[j, :k].tolist()))
            rank = None if result.prompt_token_ranks is None else int(result.prompt_token_ranks[j])
            s.push_prompt_logprob(index, (int(req.prompt[index]), float(result.prompt_token_logprobs[j]), top, rank))

    def _apply(self, plan: StepPlan, result: StepResult, now: float) -> None:
        if len(result.prompt_req_ids):  # before the update, which may finish the requests
            self._deliver_prompt_logprobs(result)
        out = self.core.update(plan, result, now)
        self.generated += int(out.num_tokens.sum())
        if self._want_logprobs and result.logprobs is not None:
            self._deliver_logprobs(plan, result, out)
        finished = out.finished
        if self.role is not None:  # P/D prefill: hand-offs leave with their first token
            finished = self.role.after_update(self, plan, result, out, now)
        deliver(self.streams, out.req_ids, out.num_tokens, out.token_ids, finished, now)
        if out.finished:
            gone = [rid for rid, _ in out.finished]
            self.client.forget(gone)
            self.holds.forget(gone)

    # -- faults --------------------------------------------------------------------------------
    def _new_core(self) -> None:
        """After a restart: a fresh core, and a fresh runtime at the initial placement."""
        self._placement = PlacementStatus(0, 0, 0)
        self._draft_placement = PlacementStatus(0, 0, 0)  # a speculative draft's sharded experts
        if self.loads is not None:
            self.loads.send_nowait(Restarted())
        old = self.core
        self._old = (self._old[0] + old.prefix_queries, self._old[1] + old.prefix_hits,
                     self._old[2] + old.num_preemptions)
        self._old_spec = (self._old_spec[0] + old.spec_drafts, self._old_spec[1] + old.spec_draft_tokens,
                          self._old_spec[2] + old.spec_accepted_tokens)
        self._old_per_pos = self._old_per_pos + old.spec_accepted_per_pos
        self.core = self.make_core()
        self._in_flight.clear()

    # -- commands and queries --------------------------------------------------------------------
    def place_nowait(self, gen: int, phy2log: np.ndarray, model: str = "target") -> None:
        """Hand expert placement ``gen`` (of the target, or of the speculative draft) to this
        rank's runtime at the next step boundary."""
        self.send_channel.send_nowait(Rebalance(gen, phy2log, model))

    def placement_status(self, model: str = "target") -> PlacementStatus:
        return self._placement if model == "target" else self._draft_placement

    def statistics(self) -> SchedulerStats:
        c = self.core
        return SchedulerStats(
            running=c.num_running, waiting=c.num_waiting + len(self.holds), kv_blocks_used=c.pool.num_used,
            kv_blocks_total=c.pool.num_blocks, prefix_queries=self._old[0] + c.prefix_queries,
            prefix_hits=self._old[1] + c.prefix_hits, preemptions=self._old[2] + c.num_preemptions,
            steps=self.steps, generated_tokens=self.generated, runtime_restarts=self.restarts,
            waiting_for_kv=c.num_waiting_for_kv, kv_held=len(c.held),
            kv_pulls=getattr(self.role, "pulled", 0), kv_pull_failures=getattr(self.role, "pull_failed", 0),
            spec_drafts=self._old_spec[0] + c.spec_drafts, spec_draft_tokens=self._old_spec[1] + c.spec_draft_tokens,
            spec_accepted_tokens=self._old_spec[2] + c.spec_accepted_tokens,
        )

    def spec_accepted_per_position(self) -> np.ndarray:
        """Speculative decodes that accepted at least j + 1 drafts, per j."""
        return self._old_per_pos + self.core.spec_accepted_per_pos
