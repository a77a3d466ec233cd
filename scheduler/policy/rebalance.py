"""When the expert load balancer plans, and from what: a window of expert loads summed over
the DEP ranks, the placement in use, and the generation in flight.

Sans-I/O: the engine's balancer actor (``lockstep.engine.balancer``) feeds it each rank's
per-step expert counts and runs ``plan_placement(*plan_args(window))`` (in a worker process:
at full scale it takes tens of milliseconds, and a thread of the busy engine process waited
for the interpreter lock for a second) when ``due``; a simulator can drive the same object. A new generation goes
out only once the previous one runs on every rank, so a runtime stages one placement at a
time. Generations only grow, also across a group restart (the runtimes then start again at
the initial placement, generation 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from .config import ConfigError, int_at_least
from .eplb import Placement, Plan, Topology, naive, plan


_non_negative = int_at_least("eplb", 0)
_positive = int_at_least("eplb", 1)


def _one_of(attribute, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"eplb.{attribute.name} must be one of {allowed}, got {value!r}")


def _eps(v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
        raise ConfigError(f"eplb.eps must be a number in [0, 1), got {v!r}")


@attrs.frozen
class EplbConfig:
    # Physical expert slots per MoE layer beyond one per logical expert, over all ranks
    # (a multiple of the DEP size: every rank has as many slots).
    redundant_experts: int = attrs.field(default=0, validator=_non_negative)
    window_steps: int = attrs.field(default=64, validator=_positive)  # plan on this many steps' loads
    incremental: bool = True  # repair the placement in use (few moves) rather than plan afresh
    eps: float = attrs.field(default=0.01, validator=lambda i, a, v: _eps(v))  # incremental: how close to a
    # fresh plan's heaviest GPU is close enough
    # How a replicated expert's tokens split among its replicas in each batch: "even", or
    # "proportional" (the GPUs holding them come out level; one more all-reduce per layer).
    token_split: str = attrs.field(default="even", validator=lambda i, a, v: _one_of(a, v, ("even", "proportional")))


def plan_placement(load: np.ndarray, topo: Topology, current: Placement, incremental: bool, eps: float) -> Plan:
    """``eplb.plan`` with the balancer's settings: a module-level function, so that a worker
    process can run it."""
    return plan(load, topo, current, incremental=incremental, eps=eps)


def warm_up() -> None:
    """Nothing: a worker process that runs it has imported this module (and the planner's)."""


class Rebalancer:
    def __init__(self, config: EplbConfig, topo: Topology, moe_layers: Sequence[int]):
        self.config, self.topo = config, topo
        self.rows = np.asarray(moe_layers, dtype=np.int64)  # rows of the runtimes' expert counts
        self.initial = naive(topo, len(self.rows))  # what a runtime starts with: generation 0
        self.placement: Placement = self.initial
        self.gen = 0  # the newest generation handed out
        self.pending: int | None = None  # handed out, not yet running on every rank
        self.active = np.zeros(topo.ranks, dtype=np.int64)  # generation each rank last ran
        self.plans = self.moved = 0
        self.balancedness: float | None = None  # of the newest plan, on its window
        self._clear_window()

    def _clear_window(self) -> None:
        self.window = np.zeros((len(self.rows), self.topo.experts), dtype=np.int64)
        self.steps = 0

    def add(self, rank: int, counts: np.ndarray | None, active_gen: int) -> None:
        """One step of one rank: its tokens per expert (None for a dummy step) and the
        placement generation it ran with. Steps are counted on rank 0."""
        self.active[rank] = active_gen
        if self.pending is not None and self.active.min() >= self.pending:
            self.pending = None
        if counts is not None:
            self.window += counts[self.rows]
        self.steps += rank == 0

    def due(self) -> bool:
        return self.pending is None and self.steps >= self.config.window_steps and bool(self.window.any())

    def take_window(self) -> np.ndarray:
        window = self.window
        self._clear_window()
        return window

    def plan_args(self, load: np.ndarray) -> tuple:
        """What ``plan_placement`` needs to plan for ``load`` from the placement in use (all
        of it picklable: the engine plans in another process)."""
        c = self.config
        return load, self.topo, self.placement, c.incremental, c.eps

    def plan(self, load: np.ndarray) -> Plan:
        """Pure (any thread): a placement for ``load``, from the one in use."""
        return plan_placement(*self.plan_args(load))

    def adopt(self, new: Plan) -> int | None:
        """Make ``new`` the next generation and return its number; None when it moves
        nothing (there is then nothing to hand out)."""
        self.plans += 1
        self.balancedness = new.balancedness.mean
        if not len(new.moves):
            return None
        self.gen += 1
        self.pending, self.placement = self.gen, new.placement
        self.moved += len(new.moves)
        return self.gen

    def restarted(self) -> None:
        """The ranks restarted at the initial placement: what was in flight is lost."""
        self.placement, self.pending = self.initial, None
        self.active[:] = 0
        self._clear_window()
