"""The KV link of one decode GPU in a P/D deployment: the pulls that fill its blocks.

A pull first waits its fixed latency (``setup_s`` plus posting its descriptors, see
KVTransferSpec), then moves its bytes. Pulls moving bytes at the same time share the GPU's
bandwidth equally (processor sharing, roughly what concurrent RDMA reads through one NIC or
NVLink port get), so a burst of n equal pulls started together ends together, n times later
than one alone. The prefill side's send bandwidth is not modelled: the decode GPU is the
bottleneck when many prefill ranks feed one decode rank.

The simulator asks ``next_done`` for the time of the next completion and calls ``finish``
then; ``version`` changes whenever the set of pulls changes, so an event scheduled for an
older set is recognised as stale.
"""

from __future__ import annotations

import math

import numpy as np

DONE_BYTES = 1.0  # bytes left that count as done: float rounding of a shared rate


class Link:
    def __init__(self, bandwidth: float):
        if not bandwidth > 0:
            raise ValueError(f"a KV link needs a bandwidth > 0 bytes/s, got {bandwidth!r}")
        self.bandwidth = bandwidth
        self.left: dict[int, float] = {}  # pull id -> bytes still to move
        self.t = 0.0  # when ``left`` was last brought up to date
        self.version = 0

    def _catch_up(self, t: float) -> None:
        if self.left and t > self.t:
            moved = (t - self.t) * self.bandwidth / len(self.left)
            for key in self.left:
                self.left[key] -= moved
        self.t = max(self.t, t)

    def add(self, key: int, nbytes: float, t: float) -> None:
        """A pull's bytes start moving at t."""
        self._catch_up(t)
        self.left[key] = float(nbytes)
        self.version += 1

    def next_done(self) -> float:
        if not self.left:
            return math.inf
        return self.t + min(self.left.values()) * len(self.left) / self.bandwidth

    def finish(self, t: float) -> list[int]:
        """The pulls whose bytes have all moved by t (at least one: t is ``next_done``)."""
        self._catch_up(t)
        done = [k for k, left in self.left.items() if left <= DONE_BYTES]
        if not done:
            done = [min(self.left, key=lambda k: (self.left[k], k))]
        for k in done:
            del self.left[k]
        self.version += 1
        return done


def descriptors(src: list[int], dst: list[int], merged: bool) -> int:
    """Descriptors a pull of blocks ``src`` (prefill side) into ``dst`` (decode side) posts:
    one per block, or with ``merged`` one per run of blocks contiguous on both sides."""
    n = min(len(src), len(dst))
    if not merged or n <= 1:
        return n
    s, d = np.asarray(src[:n], dtype=np.int64), np.asarray(dst[:n], dtype=np.int64)
    return 1 + int(((np.diff(s) != 1) | (np.diff(d) != 1)).sum())
