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
    def __init__(self, size: int):
        self.size = size
        self._rounds: dict[int, list] = {}  # round -> [values per rank, reduced, event]
        self._next = [0] * size  # each rank's next round number
        self.wake_gen = 0
        self._woken = trio.Event()

    async def allreduce(self, rank: int, values: np.ndarray) -> np.ndarray:
        """Element-wise max over the ranks (sums and mins are carried by the caller)."""
        r = self._next[rank]
        self._next[rank] += 1
        entry = self._rounds.setdefault(r, [[None] * self.size, None, trio.Event()])
        entry[0][rank] = values
        if all(v is not None for v in entry[0]):
            entry[1] = np.max(np.stack(entry[0]), axis=0)
            entry[2].set()
        else:
            await entry[2].wait()
        reduced = entry[1]
        if all(n > r for n in self._next):
            self._rounds.pop(r, None)
        return reduced

    def wake(self) -> None:
        self.wake_gen += 1
        self._woken.set()
        self._woken = trio.Event()

    async def wait_woken(self, seen: int) -> None:
        while self.wake_gen == seen:
            await self._woken.wait()
