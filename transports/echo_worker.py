"""A stand-in runtime for tests and benchmarks: answers each StepPlan with a StepResult.

It receives its two rings over a Unix socket, as a real runtime process does, and exits on
a message of kind 0.
"""

from __future__ import annotations

import socket

import numpy as np

from lockstep.policy.step import EMPTY_I64, StepResult

from .shm_ring import recv_ring
from .step_codec import decode, encode


def serve(sock: socket.socket) -> None:
    """Run until told to stop; ``sock`` is one end of a socketpair (multiprocessing passes
    it to a spawned child by duplicating the fd)."""
    inbox, outbox = recv_ring(sock), recv_ring(sock)
    try:
        while True:
            kind, _, payload = inbox.recv()
            if kind == 0:
                return
            plan = decode(kind, payload)
            # A stand-in should cost little next to the ring it is there to measure:
            # count_nonzero, shared empties and positional arguments save ~3 us of the
            # obvious version (sum() on bools, two zeros() from the defaults, kwargs).
            samples = plan.samples
            result = StepResult(plan.step_id, samples.astype(np.int32),  # num_sampled
                                np.arange(np.count_nonzero(samples), dtype=np.int32),  # token_ids
                                EMPTY_I64, EMPTY_I64)  # kv_loads_done, kv_loads_failed
            k, parts = encode(result)
            outbox.send(k, *parts)
    finally:
        inbox.close()
        outbox.close()
        sock.close()
