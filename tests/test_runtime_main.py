"""The runtime process's main loop: it never outlives the engine that started it."""

import multiprocessing as mp
import os
import socket
import time

import msgspec

from lockstep.runtime import main as runtime_main
from lockstep.runtime.base import RuntimeSpec
from lockstep.transports.shm_ring import Ring, send_ring
from leaks import leaked_shm, shm_names


class _StuckInLoad:
    """A runtime whose load never returns (as one blocked in a collective with a dead peer),
    after making a file that must not outlive the process (as the peer exchange's set-up)."""

    def load(self, spec):
        from lockstep.runtime import leftovers

        path = spec.options["scratch"]
        open(path, "w").close()
        leftovers.track(path)
        time.sleep(3600)

    def shutdown(self):
        pass


def _stuck_runtime(sock: socket.socket, engine_end: socket.socket, scratch: str) -> None:
    engine_end.close()  # forked with it: only the engine holds that end (as from a forkserver)
    runtime_main.create = lambda name: _StuckInLoad()
    runtime_main.ORPHAN_GRACE_S = 0.2
    runtime_main.run(sock, msgspec.msgpack.encode(RuntimeSpec(options={"scratch": scratch})))


def test_a_runtime_stuck_in_its_load_ends_when_the_engine_is_gone(tmp_path):
    """It exits by itself, and removes the files it tracked (``runtime.leftovers``)."""
    scratch = str(tmp_path / "lockstep-ep-scratch")
    shm_before = shm_names()
    ctx = mp.get_context("fork")  # the stub runtime lives in this module
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = ctx.Process(target=_stuck_runtime, args=(child, parent, scratch), daemon=True)
    proc.start()
    child.close()
    to_rt, from_rt = Ring.create(1 << 16), Ring.create(1 << 16)
    try:
        send_ring(parent, to_rt)
        send_ring(parent, from_rt)
        deadline = time.monotonic() + 30
        while not os.path.exists(scratch) and time.monotonic() < deadline:  # in its load now
            time.sleep(0.01)
        assert os.path.exists(scratch)
        parent.close()  # the engine is gone
        proc.join(30)
        assert proc.exitcode == 70, proc.exitcode  # ended by the watcher, not by a kill here
        assert not os.path.exists(scratch)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        proc.close()
        to_rt.close()
        from_rt.close()
        if parent.fileno() >= 0:
            parent.close()
    assert not leaked_shm(shm_before)
