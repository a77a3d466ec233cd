"""A stand-in runtime for tests and benchmarks: answers each StepPlan with a StepResult.

It receives its two rings over a Unix socket, as a real runtime process does, and exits on
a message of kind 0.
"""

from __future__ import annotations

import socket

import numpy as np

from lockstep.policy.step import StepResult

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
            n = int(plan.samples.sum())
            result = StepResult(step_id=plan.step_id, num_sampled=plan.samples.astype(np.int32),
                                token_ids=np.arange(n, dtype=np.int32))
            outbox.send(*_flat(encode(result)))
    finally:
        inbox.close()
        outbox.close()
        sock.close()


def _flat(kind_parts):
    kind, parts = kind_parts
    return (kind, *parts)
