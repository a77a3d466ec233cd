"""GrammarHolds, the sans-I/O policy behind vLLM's WAITING_FOR_FSM in the engine: which
structured-output requests wait for their grammar's compile, and which start on a report."""

import numpy as np

from lockstep import StructuredOutputsParams as S
from lockstep.policy.grammar_holds import GrammarHolds
from lockstep.policy.request import Request, SamplingParams

A, B = S(regex="[0-9]+"), S(regex="[a-z]+")


def req(rid: int, so=None) -> Request:
    return Request(id=rid, prompt=np.arange(1, 9, dtype=np.int32), params=SamplingParams(structured_outputs=so))


def test_only_guided_requests_arriving_while_others_run_are_held():
    h = GrammarHolds()
    assert not h.arrive(req(1), busy=True)  # no grammar
    assert not h.arrive(req(2, A), busy=False)  # an idle engine: it compiles while it prefills
    assert h.arrive(req(3, A), busy=True)
    assert list(h.held) == [3] and len(h) == 1 and set(h.awaiting) == {2, 3}


def test_a_report_starts_its_request_and_those_held_for_an_equal_grammar():
    h = GrammarHolds()
    for rid, so in ((1, A), (2, A), (3, B)):
        assert h.arrive(req(rid, so), busy=True)
    assert [r.id for r in h.compiled([1])] == [1, 2]  # 2's own report has not come
    assert list(h.held) == [3] and set(h.awaiting) == {2, 3}
    assert not h.arrive(req(4, A), busy=True)  # compiled already: not held again
    assert h.compiled([2, 4]) == [] and [r.id for r in h.compiled([3])] == [3]
    assert (h.held, h.awaiting) == ({}, {})


def test_drop_release_and_clear():
    h = GrammarHolds(kept=1)
    for rid, so in ((1, A), (2, B), (3, B)):
        h.arrive(req(rid, so), busy=True)
    assert h.drop(1).id == 1 and h.drop(1) is None
    assert [r.id for r in h.release_all()] == [2, 3] and len(h) == 0
    h.compiled([1, 2])  # (kept=1: the older grammar, A, is forgotten)
    assert h.arrive(req(5, A), busy=True) and not h.arrive(req(6, B), busy=True)
    assert [r.id for r in h.clear()] == [5] and (h.held, h.awaiting) == ({}, {})
    assert h.arrive(req(7, B), busy=True)  # a new runtime has compiled nothing


def test_a_request_gone_before_its_report_leaves_nothing_awaiting():
    """Aborted (drop) or finished (forget) while its compile is queued: the runtime cancels
    the compile and never reports it, so it must not wait for a report."""
    h = GrammarHolds()
    h.arrive(req(1, A), busy=True)
    h.arrive(req(2, A), busy=False)
    assert h.drop(1).id == 1 and set(h.awaiting) == {2}
    h.forget([2, 3])
    assert (h.held, h.awaiting) == ({}, {})
    assert h.arrive(req(4, A), busy=True)  # (nothing reported A compiled)


def test_a_report_after_its_request_finished_still_marks_the_grammar_compiled():
    """A compile running when its request finished is not cancelled: its report may come a
    step later, and the next request with that grammar must not be held for it."""
    h = GrammarHolds()
    h.arrive(req(1, A), busy=False)
    h.forget([1])
    assert h.awaiting == {} and h.arrive(req(2, A), busy=True)  # not known compiled yet
    assert [r.id for r in h.compiled([1])] == [2]  # the late report releases it
    assert not h.arrive(req(3, A), busy=True)
    assert h.compiled([1]) == []  # reported twice: nothing more


def test_finished_requests_unreported_are_forgotten_in_the_end():
    """Cancelled compiles are never reported: what is kept for late reports stays bounded."""
    from lockstep.policy.grammar_holds import GONE_KEPT

    h = GrammarHolds()
    for rid in range(GONE_KEPT + 10):
        h.arrive(req(rid, A), busy=False)
        h.forget([rid])
    assert len(h._gone) == GONE_KEPT and 0 not in h._gone
    h.compiled([0])  # evicted: no longer counts
    assert h.arrive(req(10_000, A), busy=True)
