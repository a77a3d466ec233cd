"""Where the Scheduler's clock and arrivals come from.

``RealTime`` is the engine's normal clock: trio's, with arrivals from the mailbox.
``StepTime`` replays a list of arrivals in step time, as the simulator does: each step lasts
what the runtime reports (``StepResult.gpu_s``; the ``timing`` runtime reports its modelled
cost), arrivals are released at step boundaries, and an idle engine jumps to the next one.
The sim-parity test and trace replays against real processes use it.
"""

from __future__ import annotations


from collections import deque
from typing import Protocol

import trio

from lockstep.policy.step import StepResult


class Pacer(Protocol):
    def now(self) -> float: ...

    def step_done(self, result: StepResult) -> None: ...

    def due(self, now: float) -> list: ...

    def wake(self) -> object | None:
        """For an idle engine: the next arrival (time jumps to it), or None to wait on the
        mailbox."""


class RealTime:
    def now(self) -> float:
        return trio.current_time()

    def step_done(self, result: StepResult) -> None:
        pass

    def due(self, now: float) -> list:
        return []

    def wake(self) -> None:
        return None


class StepTime:
    def __init__(self, arrivals: list[tuple[float, object]]):
        self.t = 0.0
        self._arrivals = deque(sorted(arrivals, key=lambda a: a[0]))

    def now(self) -> float:
        return self.t

    def step_done(self, result: StepResult) -> None:
        self.t = self.t + float(result.gpu_s)

    def due(self, now: float) -> list:
        out = []
        while self._arrivals and self._arrivals[0][0] <= now:
            out.append(self._arrivals.popleft()[1])
        return out

    def wake(self) -> object | None:
        if not self._arrivals:
            return None
        t, msg = self._arrivals.popleft()
        self.t = max(self.t, t)
        return msg

    @property
    def pending(self) -> int:
        return len(self._arrivals)



