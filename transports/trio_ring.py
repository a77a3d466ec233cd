"""Waiting on a ring from trio: poll, yield to other tasks, then sleep on the eventfd.

The ring's own ``recv`` blocks the thread; inside the engine the wait must let other trio
tasks run, and must notice a dead producer (``alive`` is checked whenever the wait sleeps).
"""

from __future__ import annotations

import time
from typing import Callable

import trio

from .shm_ring import Ring

_SAFETY_S = 0.001  # a wake-up lost to store reordering costs at most this


async def recv(ring: Ring, alive: Callable[[], bool], *, spin_s: float = 200e-6) -> tuple[int, int, bytes]:
    msg = ring.poll()
    if msg is not None:
        await trio.lowlevel.checkpoint()
        return msg
    end = time.perf_counter() + spin_s
    while time.perf_counter() < end:  # the answer is usually microseconds away
        await trio.lowlevel.checkpoint()
        msg = ring.poll()
        if msg is not None:
            return msg
    while True:
        ring.set_sleeping(True)
        msg = ring.poll()
        if msg is not None:
            ring.set_sleeping(False)
            return msg
        if not alive():
            ring.set_sleeping(False)
            raise EOFError("the producer of this ring is gone")
        with trio.move_on_after(_SAFETY_S):
            await trio.lowlevel.wait_readable(ring.fileno())
        ring.set_sleeping(False)
        ring.clear_wakeup()
