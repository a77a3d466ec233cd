"""A stand-in runtime for tests and benchmarks: answers each StepPlan with a StepResult.

It receives its two rings over a Unix socket, and takes plans without a copy, as a real
runtime process does (``lockstep.runtime.main``), and exits on a message of kind 0.
"""

from __future__ import annotations

import socket

import numpy as np

from lockstep.policy.step import StepResult

from .shm_ring import recv_ring
from .step_codec import builder, decode_frame, encode


def serve(sock: socket.socket) -> None:
    """Run until told to stop; ``sock`` is one end of a socketpair (multiprocessing passes
    it to a spawned child by duplicating the fd)."""
    inbox, outbox = recv_ring(sock), recv_ring(sock)
    # A stand-in should cost little next to the ring it is there to measure: its answers are
    # slices of two read-only arrays (one token per sampling entry, ids 0, 1, 2, ...), made
    # into a StepResult by the codec's builder (a third of StepResult.__init__'s cost).
    ones = arange = np.zeros(0, np.int32)
    result_of = builder(StepResult)
    try:
        while True:
            frame = inbox.recv_frame()
            if frame[0] == 0:
                return
            plan = decode_frame(inbox, frame)
            samples = plan.samples
            n, k = len(samples), np.count_nonzero(samples)
            if n > len(ones):
                ones, arange = np.ones(2 * n, np.int32), np.arange(2 * n, dtype=np.int32)
                ones.setflags(write=False)
                arange.setflags(write=False)
            result = result_of(plan.step_id, ones[:n] if k == n else samples.astype(np.int32),  # num_sampled
                               arange[:k])  # token_ids
            kind, parts = encode(result)
            outbox.send(kind, *parts)
    finally:
        inbox.close()
        outbox.close()
        sock.close()
