"""Expert placements in a runtime: the active one, and the next one staging in the background.

The engine's load balancer sends new placements (a generation number and each MoE layer's
phy2log). The runtime copies the experts it lacks into spare storage entries on a background
thread (on a side stream on a GPU) while steps keep running on the active placement, and
each StepResult says the newest generation ready here (``placement_ready``). Every rank's
ready generation goes into the DEP all-reduce, the plans carry the minimum, and the runtime
switches when a plan's ``placement_gen`` names the staged one: at a step boundary, on every
rank at the same step, with nothing left to copy. A plan naming a generation that is not
ready here is a scheduler bug, and fails loudly instead of waiting.

Placements that arrive while one is staging queue behind it (after a group restart a stale
one may still be on its way); a runtime stages one at a time, so copies never race.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
import torch

from .models.expert_parallel import ShardedExperts, Staged


class _Staging:
    def __init__(self, gen: int, staged: list[Staged], stream):
        self.gen, self.staged, self.stream = gen, staged, stream
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.steps = 0  # steps run since it started
        self.thread: threading.Thread | None = None


class ExpertPlacements:
    def __init__(self, layers: list[ShardedExperts], device: torch.device, min_stage_steps: int = 0):
        self.layers, self.device = layers, device
        # The results of at least this many steps after a placement arrived report it not
        # ready: tests and demos use it to make the overlap of copies and steps certain.
        self.min_stage_steps = min_stage_steps
        self.active = 0
        self._newest = 0
        self._queue: deque[tuple[int, np.ndarray]] = deque()
        self._staging: _Staging | None = None

    def receive(self, gen: int, phy2log: np.ndarray) -> None:
        if gen <= self._newest:
            raise ValueError(f"expert placement {gen} arrived after placement {self._newest}; generations only grow")
        if phy2log.shape[0] != len(self.layers):
            raise ValueError(f"expert placement {gen} has {phy2log.shape[0]} layers, this model "
                             f"{len(self.layers)} MoE layers")
        self._newest = gen
        self._queue.append((gen, phy2log))
        self._start_next()

    def ready_gen(self) -> int:
        st = self._staging
        return st.gen if st is not None and self._ready(st) else self.active

    def use(self, gen: int) -> None:
        """At the start of a step: switch to placement ``gen`` if the plan says so."""
        if gen == self.active:
            return
        st = self._staging
        if st is None or st.gen != gen or not self._ready(st):
            raise RuntimeError(f"a step asks for expert placement {gen}, but this rank runs {self.active} and has "
                               f"{'nothing' if st is None else f'{st.gen} (ready: {self._ready(st)})'} staged: "
                               "the ranks switch only to the minimum ready generation")
        st.thread.join()  # it has finished: setting done is its last act
        for layer, staged in zip(self.layers, st.staged):
            layer.switch(staged)
        self.active, self._staging = gen, None
        self._start_next()

    def step_done(self) -> None:
        if self._staging is not None:
            self._staging.steps += 1

    def _ready(self, st: _Staging) -> bool:
        if st.error is not None:
            raise RuntimeError(f"copying the experts of placement {st.gen} failed") from st.error
        return st.done.is_set() and st.steps > self.min_stage_steps

    def _start_next(self) -> None:
        if self._staging is not None or not self._queue:
            return
        gen, phy2log = self._queue.popleft()
        staged = [layer.prepare(row) for layer, row in zip(self.layers, phy2log)]
        stream = None
        if self.device.type == "cuda":
            # Entries freed by the last switch may still be read by queued kernels.
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
        st = self._staging = _Staging(gen, staged, stream)
        st.thread = threading.Thread(target=self._copy, args=(st,), name=f"lockstep-expert-copy-{gen}", daemon=True)
        st.thread.start()

    def _copy(self, st: _Staging) -> None:
        try:
            if st.stream is None:
                self._copy_all(st)
            else:
                with torch.cuda.stream(st.stream):
                    self._copy_all(st)
                st.stream.synchronize()
        except BaseException as e:  # re-raised on the runtime's thread by the next query
            st.error = e
        finally:
            st.done.set()

    def _copy_all(self, st: _Staging) -> None:
        for layer, staged in zip(self.layers, st.staged):
            layer.copy_in(staged)
