"""The Balancer actor: expert loads in from every rank's Scheduler, expert placements out.

One per DEP instance (and one for a single rank that balances its experts). Each Scheduler
sends every step's expert counts without waiting (``Loads``: an unbounded mailbox, one
message per rank per step, drained as they come); the policy (``Rebalancer``) sums them over
a window and says when to plan; the planner runs in a worker process, so no step waits on
it and it never waits for the engine's interpreter lock (in a thread of the engine process,
an 11 ms plan took 1.2 s on two H200s decoding 1.6 ms steps:
``benchmarks/results/2026-11-30-h200x2-session13.md``). A new placement goes to every rank's Scheduler, which hands it to its runtime with the
next plan; the runtimes copy the weights in the background, and the ranks switch together
once the DP sync says every one of them has it ready.
"""

from __future__ import annotations

import functools
import math
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

import attrs
import numpy as np
import structlog
import trio

from lockstep.policy.eplb import Topology
from lockstep.policy.rebalance import EplbConfig, Rebalancer, plan_placement, warm_up
from lockstep.runtime.base import Ready


@attrs.frozen
class Loads:
    rank: int
    counts: np.ndarray | None  # (layers, experts) tokens per expert in the step; None: dummy step
    active_gen: int  # the placement generation the step ran with
    model: str = "target"  # or "draft": a speculative draft's sharded experts, planned apart


@attrs.frozen
class Restarted:
    """The group restarted: its runtimes are back at the initial placement."""


@attrs.frozen
class BalancerStats:
    plans: int  # planner runs
    generation: int  # newest placement generation handed out
    moved_experts: int  # slots whose expert changed, over all generations
    active: tuple[int, ...]  # generation each rank last ran a step with
    balancedness: float | None  # the newest plan's, on its window
    planner_restarts: int = 0  # times its planner process died and was started again


Deliver = Callable[..., None]  # (generation, phy2log, model): to one rank's Scheduler


SHUTDOWN_S = 10.0  # how long the planner process may take to finish at exit before it is killed
MAX_PLANNER_RESTARTS = 3  # a planner that dies more often: rebalancing stops, serving goes on

log = structlog.get_logger("lockstep.balancer")


def _watch_parent() -> None:
    """In the planner process: exit when the engine's process does. It is forked from the
    forkserver, which only exits once the engine has gone, so a killed engine would leave it
    waiting for work."""
    import multiprocessing.connection
    import os
    import signal
    import threading

    # The engine owns shutdown, as the runtimes do: a terminal's Ctrl-C (or a service
    # manager's SIGTERM) to the whole process group must not kill the planner mid-drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return

    def wait() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)
    threading.Thread(target=wait, name="lockstep-planner-watch", daemon=True).start()


def _start_planner() -> ProcessPoolExecutor:
    from .runtime_client import forkserver_context, main_not_rerun

    pool = ProcessPoolExecutor(max_workers=1, mp_context=forkserver_context(), initializer=_watch_parent)
    try:
        with main_not_rerun():  # (the worker process starts on the first submit)
            future = pool.submit(warm_up)
        future.result()  # the process is up and has imported the planner
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    return pool


class Balancer:
    def __init__(self, config: EplbConfig):
        self.config = config
        self.send_channel, self._inbox = trio.open_memory_channel(math.inf)
        self.policy: Rebalancer | None = None
        self.draft_policy: Rebalancer | None = None  # a speculative draft's sharded experts
        self._pool: ProcessPoolExecutor | None = None  # the planner's process, while running
        self.planner_restarts = 0
        self._planner_deaths = 0

    async def run(self, ready: Ready, deliver: list[Deliver], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._run(ready, deliver, task_status)
        finally:
            if self._pool is not None:  # the planner process goes with the actor
                pool, self._pool, done = self._pool, None, False
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(SHUTDOWN_S):
                        await trio.to_thread.run_sync(functools.partial(pool.shutdown, wait=True,
                                                                        cancel_futures=True),
                                                      abandon_on_cancel=True)
                        done = True
                if not done:  # stuck: there is no public way to kill the pool's process
                    for proc in list((pool._processes or {}).values()):
                        proc.kill()

    async def _run(self, ready: Ready, deliver: list[Deliver], task_status) -> None:
        # One worker, forked from the runtimes' forkserver (off the trio thread: the server
        # may still have to start), up with its imports made before the actor reports started,
        # so that the first plan does not wait for them.
        self._pool = await trio.to_thread.run_sync(_start_planner)
        e, n = ready.num_experts, len(deliver)
        self.policy = Rebalancer(self.config, Topology(e, e + self.config.redundant_experts, n), ready.moe_layers)
        if ready.draft_num_experts:  # the draft's own planner: moves its experts between ranks
            d = ready.draft_num_experts
            self.draft_policy = Rebalancer(self.config, Topology(d, d, n), ready.draft_moe_layers)
        task_status.started()
        async for msg in self._inbox:
            match msg:
                case Loads(rank=rank, counts=counts, active_gen=gen, model=model):
                    policy = self.policy if model == "target" else self.draft_policy
                    if policy is None:
                        raise ValueError(f"Balancer got {model} expert loads, but has no {model} placement")
                    policy.add(rank, counts, gen)
                case Restarted():
                    for policy in (self.policy, self.draft_policy):
                        if policy is not None:
                            policy.restarted()
                case _:
                    raise TypeError(f"Balancer got an unknown message {msg!r}")
            for model, policy in (("target", self.policy), ("draft", self.draft_policy)):
                if policy is not None and policy.due():
                    await self._rebalance(policy, model, deliver)

    async def _rebalance(self, policy: Rebalancer, model: str, deliver: list[Deliver]) -> None:
        if self._pool is None:  # the planner could not be restarted: placements stay as they are
            policy.take_window()
            return
        try:
            future = self._pool.submit(plan_placement, *policy.plan_args(policy.take_window()))
            try:
                plan = await trio.to_thread.run_sync(future.result, abandon_on_cancel=True)
            finally:
                future.cancel()
        except BrokenProcessPool:
            # The planner's process died (the OOM killer's pick, say): this window's plan is
            # lost, generation goes on; a new planner takes the next window.
            await self._restart_planner()
            return
        for a in (plan.placement.phy2log, plan.placement.log2phy, plan.placement.replicas):
            a.setflags(write=False)  # read-only as built (a process round trip made them writable)
        gen = policy.adopt(plan)
        if gen is not None:
            for d in deliver:
                d(gen, plan.placement.phy2log, model)

    async def _restart_planner(self) -> None:
        old, self._pool = self._pool, None
        old.shutdown(wait=False, cancel_futures=True)
        self._planner_deaths += 1
        if self._planner_deaths > MAX_PLANNER_RESTARTS:
            log.warning("expert balancer: planner process died again; rebalancing stops (placements stay)",
                        restarts=self.planner_restarts)
            return
        log.warning("expert balancer: planner process died; starting a new one (this window's plan is lost)",
                    deaths=self._planner_deaths)
        try:
            self._pool = await trio.to_thread.run_sync(_start_planner)
        except Exception as e:  # noqa: BLE001 - serving goes on without rebalancing
            log.warning("expert balancer: could not start a new planner; rebalancing stops (placements stay)",
                        error=repr(e))
            return
        self.planner_restarts += 1  # (replaced: what the metric counts)

    def statistics(self, model: str = "target") -> BalancerStats | None:
        p = self.policy if model == "target" else self.draft_policy
        if p is None:
            return None
        return BalancerStats(plans=p.plans, generation=p.gen, moved_experts=p.moved,
                             active=tuple(p.active.tolist()), balancedness=p.balancedness,
                             planner_restarts=self.planner_restarts)
