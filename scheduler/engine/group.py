"""The ranks of one DEP instance hosted in this engine process: their per-step all-reduce
and their shared wake-up.

Every rank's Scheduler calls ``allreduce`` once per step round, in the same order, so a
round completes when the last rank arrives. A request reaching any rank wakes the whole
group (as vLLM's DP coordinator does), so no rank waits in an all-reduce for a peer parked on
its mailbox. Ranks in other processes or hosts use the shared-memory or TCP links of
``lockstep.transports`` instead of this in-process barrier.
"""

from __future__ import annotations

import numpy as np
import trio


class LocalGroup:
    """Failure is all or nothing: when one rank's runtime dies, the others' runtimes may be
    stuck in a collective with it, so every rank tears down (``fail`` cancels them all) and
    the group restarts together, with a fresh rendezvous for the runtimes' process group."""

    def __init__(self, size: int, new_dist_init=lambda: None):
        self.size = size
        self.new_dist_init = new_dist_init
        self.dist_init = new_dist_init()
        self.epoch = 0
        self.failure: BaseException | None = None
        self._failed = trio.Event()
        self._barriers: dict[tuple, list] = {}
        self._reset_rounds()
        self.wake_gen = 0
        self._woken = trio.Event()

    def _reset_rounds(self) -> None:
        self._rounds: dict[int, list] = {}  # round -> [values per rank, reduced, event]
        self._next = [0] * self.size  # each rank's next round number

    def fail(self, error: BaseException) -> None:
        if self.failure is None:
            self.failure = error
            self._failed.set()

    async def cancel_on_failure(self, scope: trio.CancelScope) -> None:
        await self._failed.wait()
        scope.cancel()

    async def barrier(self, name: str, on_last=None) -> None:
        """Wait until every rank arrives; the last one runs ``on_last`` first."""
        entry = self._barriers.setdefault((name, self.epoch), [0, trio.Event()])
        entry[0] += 1
        if entry[0] == self.size:
            if on_last is not None:
                on_last()
            entry[1].set()
        await entry[1].wait()

    def restarted(self) -> None:
        """After every rank tore down: a new epoch, new rounds, a new rendezvous."""
        self._barriers = {k: v for k, v in self._barriers.items() if k[1] == self.epoch}
        self.epoch += 1
        self._reset_rounds()
        self.failure = None
        self._failed = trio.Event()
        self.dist_init = self.new_dist_init()

    async def rejoined(self) -> None:
        """After ``restarted``: wait until the group can run again (at once, in-process)."""

    async def allreduce(self, rank: int, values: np.ndarray) -> np.ndarray:
        """Element-wise max over the ranks (sums and mins are carried by the caller)."""
        r = self._next[rank]
        self._next[rank] += 1
        entry = self._rounds.setdefault(r, [[None] * self.size, None, trio.Event()])
        entry[0][rank] = values
        if all(v is not None for v in entry[0]):  # the last rank to arrive reduces for all
            entry[1] = await self._reduce(np.max(np.stack(entry[0]), axis=0))
            entry[2].set()
        else:
            await entry[2].wait()
        reduced = entry[1]
        if all(n > r for n in self._next):
            self._rounds.pop(r, None)
        return reduced

    async def _reduce(self, local: np.ndarray) -> np.ndarray:
        """The group's result from this process's ranks' (all of them, here)."""
        return local

    def wake(self) -> None:
        self.wake_gen += 1
        self._woken.set()
        self._woken = trio.Event()

    async def wait_woken(self, seen: int) -> None:
        while self.wake_gen == seen:
            await self._woken.wait()
