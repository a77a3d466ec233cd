"""SchedulerCore's decode scheduling: one token for every slot that is decoding.

A decode step takes a block for each slot whose fed position opens one, preempting (newest
first) while the pool cannot cover them. Big batches take vector operations over the slot
arrays; a few running requests take a per-slot Python path over the active slots, since
numpy charges microseconds per call. Both choose the same slots and blocks.
"""

from __future__ import annotations

import numpy as np

from .step import EMPTY_I64
from .update import SMALL_BATCH


class DecodeScheduling:
    def active_slots(self) -> np.ndarray:
        """Slots holding a request, ascending (``flatnonzero(s_active)``, without a pass)."""
        return np.array(self._active, dtype=np.int64)

    @staticmethod
    def _still_owned(grown: tuple[np.ndarray, np.ndarray], slots: np.ndarray):
        if len(grown[0]) == 0:
            return grown
        keep = set(slots.tolist())  # np.isin costs ~100 us even for a handful of slots
        mask = np.fromiter((s in keep for s in grown[0].tolist()), bool, len(grown[0]))
        return grown[0][mask], grown[1][mask]

    def _schedule_decodes(self, budget: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """One token for every decoding slot; returns the slots and (slots grown, new blocks)."""
        if not self._active:  # nothing running
            return EMPTY_I64, (EMPTY_I64, EMPTY_I64)
        if len(self._active) <= SMALL_BATCH:
            return self._schedule_few_decodes(budget)
        ready = self.s_decodable & (self.s_nknown - self.s_ncomp == 1)
        ready &= (self.s_ncomp >= self.s_prefill_end) & (self.s_nknown < self.s_maxtotal)
        slots = np.flatnonzero(ready)[:budget]
        if len(slots) == 0:
            return slots, (EMPTY_I64, EMPTY_I64)
        need = (self.s_ncomp[slots] + self.bs) // self.bs > self.s_nblocks[slots]
        grow = slots[need]
        got = EMPTY_I64
        if len(grow):
            while len(grow) > self.pool.num_free:
                self._preempt(self._pick_victim())
                slots, grow = slots[self.s_active[slots]], grow[self.s_active[grow]]
            got_list = self.pool.allocate(len(grow))
            for slot, block in zip(grow.tolist(), got_list):
                self.s_req[slot].blocks.append(block)
            got = np.asarray(got_list, dtype=np.int64)
            self.s_nblocks[grow] += 1
        self.s_ncomp[slots] += 1
        self.s_nknown[slots] += 1
        return slots, (grow, got)

    def _schedule_few_decodes(self, budget: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        nknown, ncomp, nblocks, active = self.s_nknown, self.s_ncomp, self.s_nblocks, self.s_active
        dec, pend, maxtotal = self.s_decodable, self.s_prefill_end, self.s_maxtotal
        slots = [s for s in self._active
                 if dec.item(s) and nknown.item(s) - ncomp.item(s) == 1
                 and ncomp.item(s) >= pend.item(s) and nknown.item(s) < maxtotal.item(s)][:budget]
        if not slots:
            return EMPTY_I64, (EMPTY_I64, EMPTY_I64)
        bs = self.bs
        grow = [s for s in slots if (ncomp.item(s) + bs) // bs > nblocks.item(s)]
        got = EMPTY_I64
        if grow:
            while len(grow) > self.pool.num_free:
                self._preempt(self._pick_victim())
                slots, grow = [s for s in slots if active.item(s)], [s for s in grow if active.item(s)]
            got_list = self.pool.allocate(len(grow))
            for slot, block in zip(grow, got_list):
                self.s_req[slot].blocks.append(block)
                nblocks[slot] += 1
            got = np.asarray(got_list, dtype=np.int64)
        for s in slots:
            ncomp[s] += 1
            nknown[s] += 1
        return np.array(slots, dtype=np.int64), (np.array(grow, dtype=np.int64), got)
