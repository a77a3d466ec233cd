"""Recursive-doubling all-reduce of a few int64s: the schedule, the combine step, the errors.

The ranks of one DEP instance agree on every step (padded tokens, has-work, wants-pause,
ready placement generation) through this all-reduce (DESIGN.md, DEP). The algorithm lives
here, free of I/O, and two links drive it: shared memory within a host
(``lockstep.transports.collective_shm``) and TCP between hosts
(``lockstep.transports.collective_tcp``). The simulator reads ``num_rounds`` to charge it.

Schedule for ``size`` ranks, with ``p`` the largest power of two <= size:
  round 0          fold: each extra rank ``e >= p`` sends its values to ``e - p``
  rounds 1..log2 p each rank ``r < p`` exchanges with ``r ^ 2**(k-1)`` and combines
  round log2 p + 1 unfold: ``e - p`` sends the result back to ``e``
The fold and unfold rounds exist only when size is not a power of two. Both partners of an
exchange combine the same two operands, and integer sum and max are exact and commutative,
so every rank ends with bit-identical values. Sums wrap around at 64 bits on every rank
alike. Min is carried as max of the negation (callers negate; INT64_MIN has no negation).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Literal, Protocol

import attrs
import numpy as np

Op = Literal["sum", "max"]
OPS: tuple[Op, ...] = ("sum", "max")


class CollectiveError(RuntimeError):
    """The group can no longer all-reduce; the DEP instance must be failed and restarted."""


class RankFailed(CollectiveError):
    """A peer died, closed its link, or a peer saw another one fail."""

    def __init__(self, rank: int, why: str = "died"):
        super().__init__(f"rank {rank} {why}; fail the DEP group and restart it")
        self.rank, self.why = rank, why


class CollectiveTimeout(CollectiveError):
    """No word from ``rank`` within a deadline the caller asked for (off by default: a slow
    peer is not a failure, a dead one is noticed through its process)."""

    def __init__(self, rank: int, timeout_s: float):
        super().__init__(f"no values from rank {rank} within {timeout_s} s; "
                         "is it alive but stuck outside the all-reduce?")
        self.rank, self.timeout_s = rank, timeout_s


@attrs.frozen
class Step:
    """One round of one rank: send my current values to ``peer``, and/or take theirs."""

    round: int
    peer: int
    send: bool
    recv: bool
    adopt: bool = False  # what arrives is the final result (unfold), not an operand


def _lower_pow2(size: int) -> int:
    return 1 << (size.bit_length() - 1)


def num_rounds(size: int) -> int:
    """Rounds on the critical path, fold and unfold included (what the sim charges)."""
    p = _lower_pow2(size)
    return p.bit_length() - 1 + (2 if p != size else 0)


@lru_cache(maxsize=256)
def schedule(rank: int, size: int) -> tuple[Step, ...]:
    """The rounds rank ``rank`` of ``size`` takes part in, in order."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a group of {size} ranks")
    p = _lower_pow2(size)
    last = p.bit_length()  # the unfold round's number
    if rank >= p:  # an extra rank: hand over, then wait for the answer
        return (Step(0, rank - p, send=True, recv=False),
                Step(last, rank - p, send=False, recv=True, adopt=True))
    steps = []
    if rank + p < size:
        steps.append(Step(0, rank + p, send=False, recv=True))
    steps += [Step(k + 1, rank ^ (1 << k), send=True, recv=True) for k in range(last - 1)]
    if rank + p < size:
        steps.append(Step(last, rank + p, send=True, recv=False))
    return tuple(steps)


def peers(rank: int, size: int) -> frozenset[int]:
    """Every rank this one exchanges with (the links connect only these)."""
    return frozenset(s.peer for s in schedule(rank, size))


def combine(mine: np.ndarray, theirs: np.ndarray, op: Op, step: Step) -> np.ndarray:
    """My values after ``step`` received ``theirs``: always a new array, never a view of a
    link's buffer (links reuse their buffers)."""
    if step.adopt:
        return theirs.copy()
    if op == "sum":
        return np.add(mine, theirs)
    return np.maximum(mine, theirs)


def check_values(values: np.ndarray, op: str, max_values: int | None = None) -> np.ndarray:
    """The boundary check every link runs on its caller's input."""
    if op not in OPS:
        raise ValueError(f"all-reduce op must be one of {OPS}, got {op!r} (min: max of the negation)")
    arr = np.asarray(values)
    if arr.dtype != np.int64 or arr.ndim != 1:
        raise ValueError(f"all-reduce takes a 1-D int64 array, got {arr.dtype} with shape {arr.shape}")
    if max_values is not None and len(arr) > max_values:
        raise ValueError(f"{len(arr)} values do not fit this link's {max_values}; "
                         "make the link with a larger max_values")
    return arr


def simulate(inputs: Sequence[np.ndarray], op: Op) -> list[np.ndarray]:
    """Run every rank's schedule in-process (the reference the links are tested against)."""
    size = len(inputs)
    acc = [np.asarray(v) for v in inputs]
    plans = [schedule(r, size) for r in range(size)]
    for rnd in range(num_rounds(size) + 1):
        sent = {(r, s.peer): acc[r] for r in range(size) for s in plans[r] if s.round == rnd and s.send}
        for r in range(size):
            for s in plans[r]:
                if s.round == rnd and s.recv:
                    acc[r] = combine(acc[r], sent.pop((s.peer, r)), op, s)
        if sent:
            raise AssertionError(f"round {rnd}: messages nobody receives: {sorted(sent)}")
    return acc


class Collective(Protocol):
    """A group of ``size`` ranks that all-reduce together; every rank calls the same
    all-reduces in the same order with the same length and op."""

    rank: int
    size: int

    async def allreduce_async(self, values: np.ndarray, op: Op) -> np.ndarray: ...

    def close(self) -> None: ...


class BlockingCollective(Collective, Protocol):
    """One that a synchronous caller (the Scheduler between steps) may block on."""

    def allreduce(self, values: np.ndarray, op: Op) -> np.ndarray: ...


class LocalCollective:
    """The group of one: what a rank without DEP peers uses."""

    rank, size = 0, 1

    def allreduce(self, values: np.ndarray, op: Op) -> np.ndarray:
        return check_values(values, op).copy()

    async def allreduce_async(self, values: np.ndarray, op: Op) -> np.ndarray:
        return self.allreduce(values, op)

    def close(self) -> None:
        pass
