"""Structured-output requests held out of the core until their runtime has compiled their
grammar (vLLM's WAITING_FOR_FSM): scheduled at once, a request's first sampling step would
wait for the compile, and every request in that step with it.

A request is held when it arrives while others run and its grammar is not one the runtime
has reported compiled (its compiler keeps those: a cache hit is ready at once). Each result
names the requests whose compile finished; those start, and so do the requests held for an
equal grammar. Sans-I/O: the engine's Scheduler feeds it arrivals and reports and starts the
requests it hands back.
"""

from __future__ import annotations

from collections import OrderedDict

from .request import Request

# Grammars remembered as compiled: fewer than the runtime keeps at hand (runtime.grammar's
# RECENT_KEPT, 16), so that a request not held finds its matcher there at once rather than
# on the compile pool, where it could wait behind another grammar's compile.
COMPILED_KEPT = 8
# Finished requests whose compile may still be reported (it was running when they finished,
# or its report lagged their last step): their grammars, kept this long for that report.
GONE_KEPT = 64


class GrammarHolds:
    def __init__(self, kept: int = COMPILED_KEPT):
        self.kept = kept
        self.held: dict[int, Request] = {}  # request id -> the request, out of the core
        # Requests whose compile the runtime has not reported yet, and their grammar
        # (structured_outputs.spec()); the grammars it has compiled, most recent last.
        self.awaiting: dict[int, tuple] = {}
        self._compiled: OrderedDict[tuple, None] = OrderedDict()
        self._gone: OrderedDict[int, tuple] = OrderedDict()  # finished: request id -> grammar

    def __len__(self) -> int:
        return len(self.held)

    def arrive(self, req: Request, busy: bool) -> bool:
        """Whether ``req`` is held (rather than going to the core now); ``busy``: others run."""
        so = req.params.structured_outputs
        if so is None:
            return False
        grammar = tuple(so.spec())
        self.awaiting[req.id] = grammar
        if busy and grammar not in self._compiled:
            self.held[req.id] = req
            return True
        return False

    def compiled(self, rids: list[int]) -> list[Request]:
        """The runtime has compiled the grammars of ``rids`` (or failed to): the held requests
        to start now, those among them and those held for an equal grammar."""
        for rid in rids:
            grammar = self.awaiting.pop(rid, None)
            if grammar is None:  # a request that finished before its report came
                grammar = self._gone.pop(rid, None)
            if grammar is not None:
                self._compiled[grammar] = None
                self._compiled.move_to_end(grammar)
                if len(self._compiled) > self.kept:
                    self._compiled.popitem(last=False)
        if not self.held:
            return []
        done = self._compiled
        return self.release(rids + [rid for rid in self.held if self.awaiting.get(rid) in done])

    def release(self, rids: list[int]) -> list[Request]:
        """The held requests among ``rids``, no longer held (others: never held, or gone)."""
        out = []
        for rid in rids:
            req = self.held.pop(rid, None)
            if req is not None:
                out.append(req)
        return out

    def release_all(self) -> list[Request]:
        """Nothing runs that a compile could hold up: every held request, to start."""
        return self.release(list(self.held))

    def drop(self, rid: int) -> Request | None:
        """``rid`` was aborted (the runtime cancels its compile, never reported): the request,
        if it was held."""
        self.awaiting.pop(rid, None)
        return self.held.pop(rid, None)

    def forget(self, rids: list[int]) -> None:
        """``rids`` finished: a compile of theirs still queued is cancelled, never reported;
        one already running may still be, after the finish: its grammar is kept a while
        (``GONE_KEPT`` finished requests) so that such a report still counts."""
        for rid in rids:
            grammar = self.awaiting.pop(rid, None)
            if grammar is not None:
                self._gone[rid] = grammar
                if len(self._gone) > GONE_KEPT:
                    self._gone.popitem(last=False)

    def clear(self) -> list[Request]:
        """The runtime is gone (a new one's compiler starts empty): the held requests, dropped."""
        held = list(self.held.values())
        self.held.clear()
        self.awaiting.clear()
        self._compiled.clear()
        self._gone.clear()
        return held
