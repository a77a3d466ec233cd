"""The DP sync rule: what the ranks of one DEP instance agree on before every step.

Each rank contributes its local state; one all-reduce (max, element-wise) gives every rank
the same view, and ``decide`` turns it into the same decision everywhere: whether the step
runs at all, the token count every rank pads to (the MoE all-to-alls need equal shapes), and
the expert-placement generation every rank has ready (the load balancer switches to a new
placement only once all have it), whether every rank only decodes (one token per request),
which lets all of them take the decode path together, and how many draft forwards a
speculating rank runs (a draft with sharded experts: every rank runs as many). A rank with nothing to run in a step that runs sends a
dummy plan, so the collectives line up. Min is carried as max of the negation.
"""

from __future__ import annotations

import attrs
import numpy as np

from .step import EMPTY_I64, PLACEHOLDER, StepPlan

# tokens, has a plan, wants pause, -(ready placement generation), longest feed, draft passes,
# -(the draft's ready placement generation)
NUM_FIELDS = 7


@attrs.frozen
class SyncDecision:
    run: bool  # some rank has a real plan: every rank sends one (real or dummy)
    padded_tokens: int
    pause: bool
    placement_gen: int
    uniform_decode: bool = False  # no rank feeds any request more than one token
    draft_passes: int = 0
    draft_placement_gen: int = 0


def local_state(plan: StepPlan | None, *, wants_pause: bool = False, ready_gen: int = 0,
                draft_ready_gen: int = 0) -> np.ndarray:
    tokens = 0 if plan is None else plan.num_tokens
    longest = int(plan.num_new.max()) if plan is not None and plan.num_reqs else 0
    return np.array([tokens, plan is not None, wants_pause, -ready_gen, longest, draft_passes(plan),
                     -draft_ready_gen], dtype=np.int64)


def draft_passes(plan: StepPlan | None) -> int:
    """Draft forwards a speculating runtime runs for ``plan``: one per draft of its longest
    speculative decode (an entry of PLACEHOLDERs: the last token and its drafts), at least
    one while anything is fed (the draft's cache follows the prompts), none otherwise."""
    if plan is None or not plan.num_reqs:
        return 0
    fed = plan.num_new > 0
    if not fed.any():
        return 0
    decode = plan.token_ids[plan.token_offsets[:-1][fed]] == PLACEHOLDER
    drafts = plan.num_new[fed][decode]
    return max(1, int(drafts.max()) - 1 if len(drafts) else 0)


def decide(reduced_max: np.ndarray) -> SyncDecision:
    return SyncDecision(run=bool(reduced_max[1]), padded_tokens=int(reduced_max[0]),
                        pause=bool(reduced_max[2]), placement_gen=int(-reduced_max[3]),
                        uniform_decode=bool(reduced_max[4] <= 1), draft_passes=int(reduced_max[5]),
                        draft_placement_gen=int(-reduced_max[6]))


def padded(plan: StepPlan, d: SyncDecision) -> StepPlan:
    return attrs.evolve(plan, num_padded_tokens=d.padded_tokens, placement_gen=d.placement_gen,
                        uniform_decode=d.uniform_decode, draft_passes=d.draft_passes,
                        draft_placement_gen=d.draft_placement_gen)


def dummy(d: SyncDecision) -> StepPlan:
    """The plan of a rank with nothing to run in a step that runs."""
    i32, i64 = np.zeros(0, np.int32), EMPTY_I64
    return StepPlan(step_id=-1, req_ids=i64, slots=i32, num_new=i32, start_pos=i32,
                    samples=np.zeros(0, bool), token_ids=i32, token_offsets=np.zeros(1, np.int64),
                    block_start=i32, block_ids=i32, block_offsets=np.zeros(1, np.int64),
                    num_tokens=0, num_padded_tokens=d.padded_tokens, is_dummy=True,
                    placement_gen=d.placement_gen, uniform_decode=d.uniform_decode, draft_passes=d.draft_passes,
                    draft_placement_gen=d.draft_placement_gen)
