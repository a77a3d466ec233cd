"""What a Scheduler does when its runtime dies: every request the runtime held fails with a
clear error (none is lost silently), then a fresh runtime and a fresh core take over; in a DEP
group every rank does this together (the group fails, meets at a barrier, rejoins, and starts
its runtimes again). A runtime that keeps dying while it starts ends the engine."""

from __future__ import annotations

import structlog
import trio

from .runtime_client import RuntimeDied

MAX_FAILED_STARTS = 3  # a group restart whose runtime fails to start this often in a row stops

log = structlog.get_logger("lockstep.scheduler")


class Recovery:
    """The restart half of ``Scheduler`` (a mixin: the methods read and set its state)."""

    async def _restart(self, error: RuntimeDied) -> None:
        """A fresh runtime for a dead one; one that dies again while it starts is replaced
        too, up to MAX_FAILED_STARTS starts in a row (then it cannot start: the error ends
        the engine)."""
        log.error("runtime died; failing its requests and restarting it", error=str(error).splitlines()[0])
        self._fail_all(error)
        self._new_core()
        self.down = True
        for attempt in range(1, MAX_FAILED_STARTS + 1):
            await self.client.aclose()
            self.client = self.make_client()
            try:
                await self.client.start()
                break
            except (RuntimeDied, trio.TooSlowError) as e:
                if attempt == MAX_FAILED_STARTS:
                    raise
                log.error("restarted runtime died while starting; starting another", attempt=attempt,
                          error=str(e).splitlines()[0])
        self._started()
        self.down = False
        self.restarts += 1
        log.info("runtime restarted", rank=self.rank, pid=self.client.ready.pid, restarts=self.restarts)

    def _started(self) -> None:
        if self.role is not None:
            self.role.on_started(self)

    async def _restart_with_group(self) -> None:
        error = self.group.failure
        log.error("a rank of the DEP group died; failing the group's requests and restarting it",
                  rank=self.rank, error=str(error).splitlines()[0].rstrip(":"))
        self.down = True  # until the group is up again (a lost node may take a while to rejoin)
        self._fail_all(error)
        self._new_core()
        if self.client.proc is not None and self.client.proc.is_alive():
            self.client.proc.kill()  # it may be blocked in a collective with the dead rank
        await self.client.aclose()
        await self.group.barrier("down", on_last=self.group.restarted)
        await self.group.rejoined()  # nodes: a fresh link with every node (raises if one never comes)
        self.client = self.make_client()
        # A rank or node lost again while the runtimes start (their process group would wait
        # for it) fails the group once more: the caller's loop then restarts it again.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.group.cancel_on_failure, nursery.cancel_scope)
            try:
                await self.client.start()
            except (RuntimeDied, trio.TooSlowError) as e:
                self._failed_starts += 1
                if self._failed_starts >= MAX_FAILED_STARTS:  # not a lost peer: it cannot start
                    raise
                self.group.fail(RuntimeDied(f"runtime of rank {self.rank} did not restart: {e!r}"))
                await trio.sleep_forever()
            self._failed_starts = 0
            self._started()
            self.restarts += 1
            log.info("runtime restarted", rank=self.rank, pid=self.client.ready.pid, restarts=self.restarts)
            await self.group.barrier("up")
            self.down = False
            nursery.cancel_scope.cancel()

    def _fail_inbox(self, error: BaseException) -> None:
        """Fail the requests still in this rank's mailbox (submitted or handed over, never
        taken)."""
        while True:
            try:
                msg = self._inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            stream = getattr(msg, "stream", None)  # a Submit, or with P/D an Adopt
            if stream is not None:
                stream.fail(error, self.pacer.now())

    def _fail_all(self, error: BaseException) -> None:
        now = self.pacer.now()
        for rid in list(self.core.requests):
            self.core.abort(rid)
        for req in self.holds.clear():
            self.inbound -= req.prompt_len
        if self.role is not None:
            self.role.on_fail(self)
        streams, self.streams = self.streams, {}
        self._unscheduled.clear()
        self._want_logprobs.clear()
        for s in streams.values():
            s.fail(error, now)
