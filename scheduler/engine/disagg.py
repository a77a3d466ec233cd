"""Prefill/decode disaggregation: the two sides a Scheduler actor can play, and the hand-off.

A request first goes to a prefill rank (prefix affinity), as a one-token request whose
blocks the core keeps when it finishes (``Request.hold_kv``). Its first token streams to the
user from there; then the request moves, with its stream, to the least loaded decode rank
(``Adopt``), where it waits in the queue as a request whose prompt KV lives elsewhere
(``remote_kv_tokens``). The decode core starts at most ``max_kv_loads_per_step`` such loads per
step; for each, the decode side *claims* the prefill side's blocks and sends its runtime a
``KVPull`` ahead of the plan. The decode runtime pulls over its transport (NIXL or shared
memory) and reports the load done or failed in a step result; either way the decode side
tells the prefill side to release the blocks (``ReleaseKV``). A failed pull is not an error:
the decode side prefills the request itself.

Blocks are freed on both sides on every path: a hold nobody claims expires after
``hold_timeout_s``; an abort or a failure on the decode side releases what it claimed or
was handed; a prefill runtime that dies takes its holds with it, and its generation number
changes, so a later claim of its blocks fails instead of reading reused memory.

Both sides live in one engine process, so a claim is a plain call between actors of one
trio thread: it cannot race with the hold's expiry.
"""

from __future__ import annotations

import itertools

import attrs
import msgspec
import numpy as np
import structlog
import trio

from lockstep.policy.request import FinishReason, Request, RequestError
from lockstep.runtime.kv import KVPeer

from .runtime_client import new_requests

log = structlog.get_logger("lockstep.disagg")

POLL_S = 0.001  # how often a decode rank with only KV loads pending asks its runtime


@attrs.frozen
class Adopt:
    """A prefilled request, moving to a decode rank with its stream."""

    req: Request  # prompt + first token; remote_kv_tokens = the original prompt
    stream: object
    source: object  # the prefill rank's Scheduler
    gen: int  # its runtime generation when the blocks were held


@attrs.frozen
class ReleaseKV:
    """The decode side is done with a request's held blocks (pulled, failed or gone)."""

    req_id: int
    gen: int


@attrs.frozen
class ConnectPeer:
    """A prefill runtime (re)started: decode runtimes connect to its KV pool."""

    peer: bytes


def peer_name(kv_peer: bytes) -> str:
    return msgspec.msgpack.decode(kv_peer, type=KVPeer).name if kv_peer else ""


class Disagg:
    """The P/D deployment inside one engine: which ranks prefill, which decode, the
    prefill runtimes' KV peers, and where each request went."""

    def __init__(self, kind: str, hold_timeout_s: float, on_moved=None):
        self.kind, self.hold_timeout_s = kind, hold_timeout_s
        self.prefill: list = []
        self.decode: list = []
        self.peers: dict[int, bytes] = {}  # prefill rank index -> its runtime's KV peer
        self.on_moved = on_moved  # on_moved(req_id, decode index): the engine's abort routing
        self._names = itertools.count()

    def runtime_options(self, role: str, options: dict) -> dict:
        """A fresh transport name per runtime start (NIXL agent names must be unique)."""
        return {**options, "kv_transport": self.kind, "kv_name": f"{role}-{next(self._names)}"}

    def choose_decode(self, tokens: int) -> int:
        """The least loaded decode rank, counting hand-offs still in its mailbox."""
        # (a rank being restarted has an empty core: it would take every hand-off meanwhile)
        loads = [s.core.load() + s.role.inbound + (0 if not s.down else 1 << 62) for s in self.decode]
        j = int(np.argmin(loads))
        self.decode[j].role.inbound += tokens
        return j


class PrefillSide:
    def __init__(self, disagg: Disagg, index: int):
        self.d, self.index = disagg, index
        self.gen = 0  # bumped by every runtime start: holds never outlive their runtime
        self.peer = ""
        self.params: dict[int, tuple[Request, object]] = {}  # request id -> (original request, params)
        self.held_at: dict[int, float] = {}  # unclaimed holds: request id -> when held
        self.claimed: set[int] = set()
        self.handed_off = self.expired = 0

    # -- hooks the Scheduler calls -----------------------------------------------------------
    def on_started(self, sched) -> None:
        self.gen += 1
        self.held_at.clear()
        self.claimed.clear()
        kv_peer = sched.client.ready.kv_peer
        self.peer = peer_name(kv_peer)
        self.d.peers[self.index] = kv_peer
        for dec in self.d.decode:
            dec.send_channel.send_nowait(ConnectPeer(kv_peer))

    def on_submit(self, req: Request) -> Request:
        """The prefill-only copy: one output token, blocks kept for the decode side."""
        p = req.params
        self.params[req.id] = (req, p)
        return attrs.evolve(req, params=attrs.evolve(p, max_tokens=1, min_tokens=min(p.min_tokens, 1)),
                            hold_kv=p.max_tokens > 1)

    def handle(self, sched, msg, now: float) -> bool:
        if isinstance(msg, ReleaseKV):
            if msg.gen == self.gen:
                self.held_at.pop(msg.req_id, None)
                self.claimed.discard(msg.req_id)
                sched.core.release_held(msg.req_id)
            return True
        return False

    def on_abort(self, sched, req_id: int) -> None:
        self.params.pop(req_id, None)

    def after_update(self, sched, plan, result, out, now: float) -> tuple:
        """Hand finished prefills to the decode side; return what really finished (the
        hand-offs' streams are gone from ``sched.streams``: they now belong to a decode rank)."""
        if not out.finished:
            return out.finished
        tokens = dict(zip(out.req_ids.tolist(), out.token_ids.tolist())) if len(out.req_ids) else {}
        kept = []
        for rid, reason in out.finished:
            orig = self.params.pop(rid, None)
            if orig is None:
                kept.append((rid, reason))
                continue
            req, params = orig
            tok = tokens.get(rid)
            eos = tok is not None and tok == req.eos_token_id and not params.ignore_eos
            if reason is not FinishReason.LENGTH or params.max_tokens <= 1 or tok is None or eos:
                sched.core.release_held(rid)
                kept.append((rid, FinishReason.STOP if eos else reason))
                continue
            stream = sched.streams.pop(rid, None)
            if stream is None:  # aborted meanwhile
                sched.core.release_held(rid)
                continue
            stream.push(np.array([tok], np.int32), now)  # the first token, from here
            self._hand_off(sched, req, params, tok, stream, now)
        return tuple(kept)

    def _hand_off(self, sched, req: Request, params, tok: int, stream, now: float) -> None:
        prompt = np.concatenate([req.prompt, np.array([tok], np.int32)])
        moved = Request(id=req.id, prompt=prompt, params=attrs.evolve(params, max_tokens=params.max_tokens - 1,
                                                                      min_tokens=max(params.min_tokens - 1, 0),
                                                                      prompt_logprobs=None),  # the prefill's
                        arrival_time=req.arrival_time, priority=req.priority, cache_salt=req.cache_salt,
                        remote_kv_tokens=len(req.prompt), eos_token_id=req.eos_token_id)
        self.held_at[req.id] = now
        self.handed_off += 1
        j = self.d.choose_decode(len(moved.prompt))
        if self.d.on_moved is not None:
            self.d.on_moved(req.id, j)
        self.d.decode[j].send_channel.send_nowait(Adopt(moved, stream, sched, self.gen))

    def wants_poll(self, sched, now: float) -> bool:
        return False

    def claim(self, sched, req_id: int, gen: int) -> list[int] | None:
        """The held blocks, now being pulled (no expiry from here on); None if gone."""
        if gen != self.gen or req_id not in self.held_at:
            return None
        del self.held_at[req_id]
        self.claimed.add(req_id)
        return sched.core.held.get(req_id)

    def wake_after(self, now: float) -> float | None:
        if not self.held_at:
            return None
        return max(0.0, min(self.held_at.values()) + self.d.hold_timeout_s - now)

    def tick(self, sched, now: float) -> None:
        if not self.held_at:
            return
        late = [rid for rid, t in self.held_at.items() if now - t >= self.d.hold_timeout_s]
        for rid in late:
            del self.held_at[rid]
            sched.core.release_held(rid)
            self.expired += 1
        if late:
            log.warning("KV holds expired before the decode side pulled them", n=len(late),
                        timeout_s=self.d.hold_timeout_s)

    def on_fail(self, sched) -> None:
        self.params.clear()
        self.held_at.clear()
        self.claimed.clear()


class DecodeSide:
    def __init__(self, disagg: Disagg, index: int):
        self.d, self.index = disagg, index
        self.remote: dict[int, Adopt] = {}  # request id -> where its prompt KV is held
        self.inbound = 0  # prompt tokens handed to this rank, not yet in its core
        self.pulled = self.pull_failed = 0
        self._last_poll = -1.0

    def on_started(self, sched) -> None:
        for kv_peer in self.d.peers.values():
            sched.client.kv_connect(kv_peer)

    def handle(self, sched, msg, now: float) -> bool:
        match msg:
            case Adopt(req=req, stream=stream):
                self.inbound -= len(req.prompt)
                try:
                    sched.core.add_request(req)
                except RequestError as e:
                    self._release(msg)
                    stream.fail(e, now)
                    return True
                self.remote[req.id] = msg
                sched.streams[req.id] = stream
                p = req.params
                if p.logprobs is not None:
                    sched._want_logprobs.add(req.id)
                # its prompt ends with the prefill side's token: its first output
                sched.client.add_requests(new_requests(req, len(req.prompt) - req.remote_kv_tokens))
                return True
            case ConnectPeer(peer=peer):
                sched.client.kv_connect(peer)
                return True
        return False

    def before_send(self, sched, plan) -> None:
        """Each load this plan starts: claim the prefill side's blocks, tell the runtime."""
        for rid in plan.kv_load_req_ids.tolist():
            a = self.remote.get(rid)
            req = sched.core.requests.get(rid)
            held = None if a is None or req is None else a.source.role.claim(a.source, rid, a.gen)
            if held is None or len(held) < len(req.blocks):
                sched.client.kv_pull(rid, "", [], [])  # reported failed: prefilled here instead
                continue
            local = list(req.blocks)
            sched.client.kv_pull(rid, a.source.role.peer, held[: len(local)], local)

    def on_submit(self, req: Request) -> Request:
        return req

    def after_update(self, sched, plan, result, out, now: float) -> tuple:
        for rid in result.kv_loads_done.tolist():
            self.pulled += 1
            self._done_with(rid)
        for rid in result.kv_loads_failed.tolist():
            self.pull_failed += 1
            self._done_with(rid)
        return out.finished

    def on_abort(self, sched, req_id: int) -> None:
        self._done_with(req_id)

    def on_fail(self, sched) -> None:
        for a in list(self.remote.values()):
            self._release(a)
        self.remote.clear()

    def wants_poll(self, sched, now: float) -> bool:
        """Send an empty plan now to learn how the pulls are going?"""
        if sched.core.num_waiting_for_kv == 0 or now - self._last_poll < POLL_S:
            return False
        self._last_poll = now
        return True

    def wake_after(self, now: float) -> float | None:
        return POLL_S if self.remote else None

    def tick(self, sched, now: float) -> None:
        pass

    def _done_with(self, rid: int) -> None:
        a = self.remote.pop(rid, None)
        if a is not None:
            self._release(a)

    @staticmethod
    def _release(a: Adopt) -> None:
        try:
            a.source.send_channel.send_nowait(ReleaseKV(a.req.id, a.gen))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the engine is shutting down: the prefill side is gone with its blocks
