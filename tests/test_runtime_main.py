"""The runtime process's main loop: it never outlives the engine that started it."""

import multiprocessing as mp
import os
import socket
import time

import msgspec

from lockstep.runtime import main as runtime_main
from lockstep.runtime.base import RuntimeSpec
from lockstep.transports.shm_ring import Ring, send_ring


class _StuckInLoad:
    """A runtime whose load never returns (as one blocked in a collective with a dead peer)."""

    def load(self, spec):
        time.sleep(3600)

    def shutdown(self):
        pass


def _stuck_runtime(sock: socket.socket, engine_end: socket.socket) -> None:
    engine_end.close()  # forked with it: only the engine holds that end (as from a forkserver)
    runtime_main.create = lambda name: _StuckInLoad()
    runtime_main.ORPHAN_GRACE_S = 0.2
    runtime_main.run(sock, msgspec.msgpack.encode(RuntimeSpec()))


def test_a_runtime_stuck_in_its_load_ends_when_the_engine_is_gone():
    shm_before = set(os.listdir("/dev/shm"))
    ctx = mp.get_context("fork")  # the stub runtime lives in this module
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = ctx.Process(target=_stuck_runtime, args=(child, parent), daemon=True)
    proc.start()
    child.close()
    to_rt, from_rt = Ring.create(1 << 16), Ring.create(1 << 16)
    try:
        send_ring(parent, to_rt)
        send_ring(parent, from_rt)
        time.sleep(0.2)  # (not needed for the outcome: lets the child reach its load)
        parent.close()  # the engine is gone
        proc.join(30)
        assert proc.exitcode == 70, proc.exitcode  # ended by the watcher, not by a kill here
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        proc.close()
        to_rt.close()
        from_rt.close()
        if parent.fileno() >= 0:
            parent.close()
    assert not [f for f in set(os.listdir("/dev/shm")) - shm_before if "lockstep" in f]
