"""Admission caps: how much new work one step may start.

Host work bursts when many requests start at once (each KV load is descriptors to build and
completions to track; each new prefill is prefix matching and block allocation), so the core
asks this policy before starting each one. Caps of 0 mean no cap.
"""

from __future__ import annotations

from .config import SchedulerConfig


class AdmissionCaps:
    def __init__(self, config: SchedulerConfig):
        self.max_kv_loads = config.max_kv_loads_per_step
        self.max_prefills = config.max_new_prefills_per_step
        self._loads = 0
        self._prefills = 0

    def start_step(self) -> None:
        self._loads = 0
        self._prefills = 0

    def may_start_kv_load(self) -> bool:
        return self.max_kv_loads == 0 or self._loads < self.max_kv_loads

    def may_start_prefill(self) -> bool:
        return self.max_prefills == 0 or self._prefills < self.max_prefills

    def note_kv_load(self) -> None:
        self._loads += 1

    def note_prefill(self) -> None:
        self._prefills += 1
