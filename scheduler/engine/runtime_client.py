"""RuntimeClient: owns one runtime process and the two rings to it.

The process starts from a forkserver that has already imported torch and the runtimes, so
a start costs a fork, not an import. The rings are handed over a socketpair (SCM_RIGHTS);
the socket then stays open only so the runtime sees EOF when the engine goes away. A dead
runtime is noticed through its process sentinel while a step is awaited, and surfaces as
``RuntimeDied`` naming the exit code and, when the runtime said them, its last words.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import socket
import sys
import threading

import msgspec
import numpy as np
import trio

from lockstep.policy.request import Request
from lockstep.policy.step import StepPlan, StepResult
from lockstep.runtime import main as runtime_main
from lockstep.runtime.base import (FAILURE, FORGET, KV_CONNECT, KV_PULL, NEW_PLACEMENT, NEW_REQUESTS, READY, RESULT,
                                   SHUTDOWN, Failure, Forget, KVConnect, KVPull, LogitsRules, NewPlacement,
                                   NewRequests, Ready, RuntimeSpec)
from lockstep.transports import trio_ring
from lockstep.transports.shm_ring import Ring, send_ring
from lockstep.transports.step_codec import decode, encode

_ENC = msgspec.msgpack.Encoder()
_PRELOAD = ["lockstep.runtime._forkserver", "lockstep.runtime.main", "lockstep.runtime.timing",
            "lockstep.runtime.torch_runtime"]


def new_requests(req: Request, outputs_in_prompt: int = 0) -> NewRequests:
    """What a runtime must know of ``req`` to sample for it; ``outputs_in_prompt``: the last
    tokens of its prompt are its own output (a P/D decode side's request starts with the
    token the prefill side sampled), which penalties and min_tokens count."""
    p = req.params
    rules = None
    if p.processes_logits:
        n = req.prompt_len - outputs_in_prompt
        stop = list(p.stop_token_ids) + ([req.eos_token_id] if req.eos_token_id >= 0 and not p.ignore_eos else [])
        rules = LogitsRules(
            prompt_len=n, presence_penalty=float(p.presence_penalty), frequency_penalty=float(p.frequency_penalty),
            repetition_penalty=float(p.repetition_penalty), min_p=float(p.min_p),
            # the request's min_tokens less the outputs in its prompt, counted from n again
            min_tokens=p.min_tokens + outputs_in_prompt if p.min_tokens else 0, suppress=stop,
            bias_ids=list(p.logit_bias or ()), bias=[float(b) for b in (p.logit_bias or {}).values()],
            allowed=list(p.allowed_token_ids or ()),
            grammar=p.structured_outputs.spec() if p.structured_outputs is not None else [],
            grammar_after=list(p.structured_outputs.after_tokens) if p.structured_outputs is not None else [])
    # Prompt logprobs are the prefill's: not a decode side's, whose prompt's KV arrives computed
    k = -1 if p.prompt_logprobs is None or outputs_in_prompt else p.prompt_logprobs
    n = req.prompt_len - outputs_in_prompt  # the prompt proper, sent once for either reader
    ids = req.prompt[:n].astype(np.int32).tobytes() if k >= 0 or p.repetition_penalty != 1 else b""
    return NewRequests([req.id], [p.temperature], [p.top_p], [p.top_k], [-1 if p.seed is None else p.seed],
                       [-1 if p.logprobs is None else p.logprobs], [rules], [k], [ids])


def stop_forkserver() -> None:
    """Stop the forkserver the runtimes started from, and multiprocessing's resource
    tracker, and wait for both (a command ending without this leaves them behind for a
    moment, until they notice their parent is gone, and then as zombies where nothing
    reaps orphans)."""
    from multiprocessing import active_children, forkserver, resource_tracker

    if active_children():  # something started from it still runs: stopping would wait for it
        return
    for server, pid in ((forkserver._forkserver, "_forkserver_pid"), (resource_tracker._resource_tracker, "_pid")):
        if getattr(server, pid, None) is None:
            continue
        try:
            server._stop()
        except (OSError, ChildProcessError):  # already gone
            pass


# Where runtime processes' stderr lines go: None, the engine's own stderr (inherited); else a
# callable (pid, line) that a server logging JSON sets (``capture_runtime_stderr``).
_STDERR_SINK = None


def capture_runtime_stderr(sink) -> None:
    """Runtimes started from now on write their stderr (tracebacks, native libraries' lines)
    to ``sink(pid, line)``, one call a line, from a thread of this process; None: inherit."""
    global _STDERR_SINK
    _STDERR_SINK = sink


def _pump(sock: socket.socket, pid: int, sink) -> None:
    with sock, sock.makefile("rb") as lines:
        for raw in lines:  # until every copy of the other end is closed: the runtime has exited
            sink(pid, raw.decode("utf-8", "replace").rstrip("\n"))


class RuntimeDied(RuntimeError):
    """The runtime process exited or failed; in-flight steps are lost."""


_STARTING = threading.Lock()


@contextlib.contextmanager
def main_not_rerun():
    """Start processes (from the forkserver) inside this: they will not import the caller's
    main script, as multiprocessing otherwise does in the forkserver and in each child. A
    script without ``if __name__ == "__main__":`` would start a second engine there (and fail
    with multiprocessing's bootstrapping error), and one read from standard input (``python -``)
    has no file to import. Runtime processes need nothing of it: their target and arguments
    are lockstep's. (Starts are serialized: the main module is shared.)"""
    main = sys.modules.get("__main__")
    with _STARTING:
        if main is None:
            yield
            return
        had_file, file, spec = hasattr(main, "__file__"), getattr(main, "__file__", None), main.__spec__
        if had_file:
            del main.__file__
        main.__spec__ = None
        try:
            yield
        finally:
            main.__spec__ = spec
            if had_file:
                main.__file__ = file


def forkserver_context() -> multiprocessing.context.BaseContext:
    """The forkserver every runtime starts from (torch imported once, in the server)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # a module that fails to import is skipped
    return ctx


class RuntimeClient:
    def __init__(self, spec: RuntimeSpec, *, ring_bytes: int = 1 << 22, start_timeout: float = 120.0):
        self.spec = spec
        self.ring_bytes = ring_bytes
        self.start_timeout = start_timeout
        self.proc = None
        self.ready: Ready | None = None
        self._to: Ring | None = None
        self._from: Ring | None = None
        self._sock: socket.socket | None = None
        self._pending: list[tuple[int, bytes]] = []  # control messages sent with the next plan

    # -- life cycle ----------------------------------------------------------------------------
    async def start(self) -> Ready:
        ctx = forkserver_context()
        mine, theirs = socket.socketpair()
        self._to, self._from = Ring.create(self.ring_bytes), Ring.create(self.ring_bytes)
        self._sock = mine
        sink, err = _STDERR_SINK, None
        if sink is not None:
            err_here, err = socket.socketpair()
        self.proc = ctx.Process(target=runtime_main.run, name=f"lockstep-runtime-{self.spec.runtime}",
                                args=(theirs, _ENC.encode(self.spec), err), daemon=True)
        try:
            try:
                await trio.to_thread.run_sync(self._start_process)
            except BaseException:
                if err is not None:
                    err_here.close()
                raise
            if sink is not None:
                threading.Thread(target=_pump, args=(err_here, self.proc.pid, sink), daemon=True,
                                 name=f"lockstep-runtime-{self.proc.pid}-stderr").start()
            send_ring(mine, self._to)
            send_ring(mine, self._from)
        finally:
            theirs.close()
            if err is not None:
                err.close()
        with trio.move_on_after(self.start_timeout) as waited:
            kind, _, payload = await self._recv()
        if waited.cancelled_caught:
            self.proc.kill()
            raise RuntimeDied(f"runtime {self.spec.runtime!r} ({self.spec.model} on {self.spec.device}) did not "
                              f"load and report ready within {self.start_timeout:g} s; a larger model may need a "
                              "longer engine start_timeout_s (serve --start-timeout)")
        if kind != READY:
            raise RuntimeDied(f"runtime sent message kind {kind} before READY")
        self.ready = msgspec.msgpack.decode(payload, type=Ready)
        return self.ready

    def _start_process(self) -> None:
        with main_not_rerun():
            self.proc.start()

    async def aclose(self, timeout: float = 5.0) -> None:
        """Ask the runtime to stop, wait up to ``timeout``, then kill it; release the rings."""
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.is_alive():
                try:
                    self._to.send(SHUTDOWN)
                except Exception:
                    pass
                with trio.move_on_after(timeout):
                    await trio.to_thread.run_sync(proc.join, abandon_on_cancel=True)
                if proc.is_alive():
                    proc.kill()
                    await trio.to_thread.run_sync(proc.join)
            proc.close()
        for ring in (self._to, self._from):
            if ring is not None:
                ring.close()
        self._to = self._from = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    # -- messages ------------------------------------------------------------------------------
    def add_requests(self, msg: NewRequests) -> None:
        self._pending.append((NEW_REQUESTS, _ENC.encode(msg)))

    def forget(self, req_ids: list[int]) -> None:
        self._pending.append((FORGET, _ENC.encode(Forget(req_ids))))

    def new_placement(self, gen: int, phy2log: np.ndarray, model: str = "target") -> None:
        """An expert placement to stage; the runtime switches when a plan names ``gen`` (for
        ``model`` "draft": when its ``draft_placement_gen`` does)."""
        p = np.ascontiguousarray(phy2log, dtype="<i8")
        self._pending.append((NEW_PLACEMENT, _ENC.encode(NewPlacement(gen, p.shape[0], p.shape[1], p.tobytes(),
                                                                      model))))

    def kv_connect(self, peer: bytes) -> None:
        """Connect to a P/D peer's KV pool (its ``Ready.kv_peer``)."""
        self._pending.append((KV_CONNECT, _ENC.encode(KVConnect(peer))))

    def kv_pull(self, req_id: int, peer: str, remote: list[int], local: list[int]) -> None:
        """Start pulling a request's KV (an empty ``peer``: report it failed)."""
        self._pending.append((KV_PULL, _ENC.encode(KVPull(req_id, peer, remote, local))))

    def send_plan(self, plan: StepPlan) -> None:
        for kind, payload in self._pending:
            self._to.send(kind, payload)
        self._pending.clear()
        kind, parts = encode(plan)
        self._to.send(kind, *parts)

    async def receive_result(self) -> StepResult:
        kind, _, payload = await self._recv()
        if kind != RESULT:
            raise RuntimeDied(f"runtime sent message kind {kind} (seq {_}, {len(payload)} bytes), expected a StepResult")
        return decode(kind, payload)

    async def _recv(self) -> tuple[int, int, bytes]:
        try:
            msg = await trio_ring.recv(self._from, self.alive)
        except EOFError:
            code = None if self.proc is None else self.proc.exitcode
            raise RuntimeDied(f"runtime process {self.spec.runtime!r} exited (code {code})") from None
        if msg[0] == FAILURE:
            raise RuntimeDied(f"runtime process {self.spec.runtime!r} failed:\n"
                              + msgspec.msgpack.decode(msg[2], type=Failure).error)
        return msg
