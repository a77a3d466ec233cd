"""The runtime process: receive its two rings, load the runtime, then execute plans.

Started by the engine's RuntimeClient from a forkserver that already imported torch, with
one end of a socketpair. Over that socket come the two rings (SCM_RIGHTS); the socket then
only tells the runtime that the engine is gone (EOF), so a runtime never outlives it: the
serving loop returns when it sees that, and a watcher thread ends the process outright if
the main thread has not finished ``ORPHAN_GRACE_S`` later (it may be stuck in a load or in
a collective with a peer that died with the engine), first removing the files it tracked
(``runtime.leftovers``). A runtime that raises sends a ``Failure`` with the traceback and
exits.
"""

from __future__ import annotations

import gc
import os
import select
import signal
import socket
import threading
import traceback
from collections import deque

import attrs
import msgspec

from lockstep.transports.shm_ring import Ring, recv_ring
from lockstep.transports.step_codec import decode_frame, encode

from . import leftovers
from .base import (FAILURE, FORGET, KV_CONNECT, KV_PULL, NEW_PLACEMENT, NEW_REQUESTS, PLAN, READY, SHUTDOWN,
                   Forget, Failure, KVConnect, KVPull, NewPlacement, NewRequests, RuntimeSpec, create)

_ENC = msgspec.msgpack.Encoder()
_NEW = msgspec.msgpack.Decoder(NewRequests)
_FORGET = msgspec.msgpack.Decoder(Forget)
_PLACEMENT = msgspec.msgpack.Decoder(NewPlacement)
_CONNECT = msgspec.msgpack.Decoder(KVConnect)
_PULL = msgspec.msgpack.Decoder(KVPull)
ORPHAN_GRACE_S = 10.0  # the engine gone: how long the main thread has to wind down by itself


def run(sock: socket.socket, spec_bytes: bytes, stderr: socket.socket | None = None) -> None:
    """``stderr``: where this process's fd 2 goes (the engine logs each line it reads there:
    a server logging JSON keeps its log JSON, a Python traceback and native libraries' lines
    included); None: the engine's own stderr."""
    if stderr is not None:
        os.dup2(stderr.fileno(), 2)
        stderr.close()
    # The engine owns shutdown: a Ctrl-C or a service manager's SIGTERM to the whole group
    # must not kill the runtime under in-flight requests while the server drains.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inbox, outbox = recv_ring(sock), recv_ring(sock)
    runtime = None
    done = threading.Event()
    threading.Thread(target=_watch_engine, args=(sock, done), name="lockstep-engine-watch", daemon=True).start()
    try:
        spec = msgspec.msgpack.decode(spec_bytes, type=RuntimeSpec)
        runtime = create(spec.runtime)
        info = runtime.load(spec)
        # What exists now (torch and the model, from the forkserver and the load) lives as long
        # as the process: out of the collector's sight, a full collection no longer walks it
        # mid-run (a 100-200 ms stall every so many steps with torch imported; vLLM freezes too).
        gc.collect()
        gc.freeze()
        outbox.send(READY, _ENC.encode(info))
        _serve(runtime, inbox, outbox, sock)
    except BaseException:
        try:
            outbox.send(FAILURE, _ENC.encode(Failure(traceback.format_exc())))
        finally:
            raise
    finally:
        try:
            if runtime is not None:
                runtime.shutdown()
            inbox.close()
            outbox.close()
        finally:
            done.set()  # before the socket closes under the watcher
            sock.close()


def _watch_engine(sock: socket.socket, done: threading.Event) -> None:
    """End the process if the engine is gone and the main thread, ``ORPHAN_GRACE_S`` later,
    has still not finished (blocked where it never looks at the socket)."""
    try:
        while not done.wait(0.5):
            if _peer_gone(sock):
                if not done.wait(ORPHAN_GRACE_S):
                    leftovers.remove_all()  # what the stuck thread's finally blocks would remove
                    os._exit(70)
                return
    except (OSError, ValueError):  # the socket closed as the main thread finished
        return


def _serve(runtime, inbox: Ring, outbox: Ring, sock: socket.socket) -> None:
    """Messages are taken without a copy (``recv_frame``): a plan's arrays view the ring and
    stay valid until the next message is taken, and ``execute`` is done with them by then.

    A runtime with ``launch``/``finish`` (the torch runtime's fast path) runs one step ahead:
    a launched step's result is sent once the next plan is launched behind it (the engine
    plans step N+1 before step N's result: async scheduling), or once the device is done
    with it and no plan came. Results go out in plan order; a plan that cannot be launched
    (None) first waits for those in flight."""
    idle = getattr(runtime, "idle", None)
    launch = getattr(runtime, "launch", None)
    in_flight: deque = deque()

    ready = getattr(runtime, "grammars_ready", None)

    def send(result) -> None:
        if ready is not None and (done := ready()) is not None:  # (the engine waits to schedule them)
            result = attrs.evolve(result, grammars_ready=done)
        k, parts = encode(result)
        outbox.send(k, *parts)

    def drain(keep: int = 0) -> None:
        while len(in_flight) > keep:
            send(runtime.finish(in_flight.popleft()))

    while True:
        if in_flight:
            msg = inbox.poll_frame()
            if msg is None:
                if in_flight[0].ready():
                    drain()
                else:
                    os.sched_yield()
                continue
        else:
            msg = _next(inbox, sock, idle)
            if msg is None:
                return
        kind, _, start, end = msg
        match kind:
            case 1:  # PLAN
                plan = decode_frame(inbox, msg)
                started = None if launch is None else launch(plan)
                if started is None:
                    drain()
                    send(runtime.execute(plan))
                else:
                    in_flight.append(started)
                    drain(keep=1)
            case 4:  # NEW_REQUESTS
                runtime.add_requests(_NEW.decode(inbox.buffer[start:end]))
            case 5:  # FORGET
                runtime.forget(_FORGET.decode(inbox.buffer[start:end]).req_ids)
            case 7:  # NEW_PLACEMENT
                drain()
                runtime.new_placement(_PLACEMENT.decode(inbox.buffer[start:end]))
            case 8:  # KV_CONNECT
                runtime.kv_connect(_CONNECT.decode(inbox.buffer[start:end]))
            case 9:  # KV_PULL
                runtime.kv_pull(_PULL.decode(inbox.buffer[start:end]))
            case 0:  # SHUTDOWN
                drain()
                return
            case _:
                raise ValueError(f"runtime got message kind {kind}; expected one of "
                                 f"{[SHUTDOWN, PLAN, NEW_REQUESTS, FORGET, NEW_PLACEMENT, KV_CONNECT, KV_PULL]}")


def _next(inbox: Ring, sock: socket.socket, idle=None):
    """The next message, or None once the engine is gone (its socket end closed). With an
    ``idle`` hook (a KV transport to keep moving), wake every millisecond to call it."""
    tick = 0.5 if idle is None else 0.001
    waited, spin = 0.0, {}
    while True:
        try:
            return inbox.recv_frame(timeout=tick, **spin)
        except TimeoutError:
            spin = {"spin_s": 0.0, "yield_s": 0.0}  # spun once already: now only sleep
            waited += tick
            if idle is not None:
                idle()
            if waited >= 0.5:
                waited = 0.0
                if _peer_gone(sock):
                    return None


def _peer_gone(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


__all__ = ["run", "FORGET", "NEW_REQUESTS", "FAILURE"]
