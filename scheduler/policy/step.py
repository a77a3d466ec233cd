"""The step contract: StepPlan (scheduler -> runtime) and StepResult (runtime -> scheduler).

Both are structures of arrays indexed by batch position, never lists of per-request objects,
so a 256-request plan encodes, crosses the shared-memory ring and decodes in microseconds.
Ragged per-request data (token ids, new block ids, speculative tokens) is a flat array plus
an offsets array of length n + 1.
"""

from __future__ import annotations

import functools

import attrs
import numpy as np

PLACEHOLDER = -1  # token id: "the token this request sampled in the previous step"
# The defaults of the optional array fields: one read-only empty per dtype, shared by every
# message (an array per message cost two allocations, and the step codec sends a shared
# empty without looking at it).
EMPTY_I32 = np.zeros(0, dtype=np.int32)
EMPTY_I32.setflags(write=False)
EMPTY_I64 = np.zeros(0, dtype=np.int64)
EMPTY_I64.setflags(write=False)


# No __weakref__ slot: the step codec builds decoded messages as a plain slotted twin and
# then sets __class__, which CPython allows only between identical layouts (a weakref slot
# breaks its layout check). Three times cheaper than a frozen class's __init__.
@attrs.frozen(weakref_slot=False)
class StepPlan:
    step_id: int
    req_ids: np.ndarray  # int64 (n,)
    slots: np.ndarray  # int32 (n,): the core's stable batch slot of each request
    num_new: np.ndarray  # int32 (n,): tokens fed this step (chunk, or 1 + spec)
    start_pos: np.ndarray  # int32 (n,): position of the first fed token
    samples: np.ndarray  # bool (n,): whether this step samples for the request
    token_ids: np.ndarray  # int32 flat; PLACEHOLDER for last step's sampled token
    token_offsets: np.ndarray  # int64 (n + 1,)
    block_start: np.ndarray  # int32 (n,): table index where the new block ids go
    block_ids: np.ndarray  # int32 flat: new block ids per request
    block_offsets: np.ndarray  # int64 (n + 1,)
    spec_tokens: np.ndarray = EMPTY_I32  # int32 flat, draft tokens to verify
    spec_offsets: np.ndarray = EMPTY_I64  # int64 (n + 1,) or empty
    # KV loads to start this step: blocks [first, first + num) of the request's table are
    # filled from elsewhere (the host tier, or a remote prefill pool for the whole table).
    kv_load_req_ids: np.ndarray = EMPTY_I64
    kv_load_first_block: np.ndarray = EMPTY_I32
    kv_load_num_blocks: np.ndarray = EMPTY_I32
    kv_send_req_ids: np.ndarray = EMPTY_I64  # finished prefills to hold/send
    # Requests the core dropped (finished, aborted, preempted): the runtime forgets their
    # state and cancels or completes their KV loads before running this plan, whose blocks
    # the core may already have handed to other requests.
    finished_req_ids: np.ndarray = EMPTY_I64
    num_tokens: int = 0
    num_padded_tokens: int = 0  # set by the DP sync; == num_tokens without DP
    is_dummy: bool = False
    placement_gen: int = 0
    # Set by the DP sync: every rank's plan feeds at most one token per request (or is a
    # dummy), so the ranks may all take the decode path (padded expert dispatch, graphs).
    uniform_decode: bool = False
    # Set by the DP sync: draft forwards every rank runs this step (speculation with a draft
    # whose experts are sharded over the ranks: each pass has all-to-alls every rank joins).
    draft_passes: int = 0
    draft_placement_gen: int = 0  # the draft's expert placement, as placement_gen is the target's

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def is_empty(self) -> bool:
        return self.num_reqs == 0 and len(self.kv_load_req_ids) == 0 and not self.is_dummy


@attrs.frozen(weakref_slot=False)
class StepResult:
    step_id: int
    num_sampled: np.ndarray  # int32 (n,): tokens sampled per plan entry (1 + accepted, or 0)
    token_ids: np.ndarray  # int32 flat, in plan order
    kv_loads_done: np.ndarray = EMPTY_I64
    kv_loads_failed: np.ndarray = EMPTY_I64
    expert_counts: np.ndarray | None = None  # (layers, experts) int32, for EPLB
    # Only when a sampled request asked for logprobs; one row per sampled token, in order:
    logprobs: np.ndarray | None = None  # float32 (rows,): log-probability of the sampled token
    top_ids: np.ndarray | None = None  # int32 (rows, k): the k most likely tokens
    top_logprobs: np.ndarray | None = None  # float32 (rows, k)
    # Prompt logprobs (requests that asked, SamplingParams.prompt_logprobs): one row per
    # prompt token scored this step, which is prompt token ``prompt_index`` (1 on: the
    # first has none) of request ``prompt_req_ids``; top k as above.
    prompt_req_ids: np.ndarray = EMPTY_I64
    prompt_index: np.ndarray = EMPTY_I64
    prompt_token_logprobs: np.ndarray | None = None  # float32 (rows,)
    prompt_top_ids: np.ndarray | None = None  # int32 (rows, k)
    prompt_top_logprobs: np.ndarray | None = None  # float32 (rows, k)
    prompt_token_ranks: np.ndarray | None = None  # int32 (rows,): 1 + ids more likely than the token
    # A speculating runtime's draft, when its experts are sharded: tokens per (MoE layer,
    # expert) over the step's passes (the balancer's draft planner reads them).
    draft_expert_counts: np.ndarray | None = None
    # Drafts the runtime proposed per plan entry where it may propose fewer than planned
    # (adaptive k); empty: as planned. The counters count these, not the reserved positions.
    num_drafts: np.ndarray = EMPTY_I32
    # Requests whose structured-output grammar this runtime finished compiling (or failed
    # to) since its last result: the engine holds such a request back until then.
    grammars_ready: np.ndarray = EMPTY_I64
    host_s: float = 0.0
    gpu_s: float = 0.0
    sync_s: float = 0.0
    # The newest expert-placement generation this runtime could switch to at its next step
    # (the active one while a new one is still copying): its share of the DP sync's minimum.
    placement_ready: int = 0
    draft_placement_ready: int = 0  # the same for the draft's own placement (sharded experts)


@attrs.frozen
class StepOutputs:
    """What one update tells the caller: tokens per request and who finished."""

    req_ids: np.ndarray  # int64 (m,): requests that got tokens, in plan order
    num_tokens: np.ndarray  # int32 (m,)
    token_ids: np.ndarray  # int32 flat
    finished: tuple  # ((req_id, FinishReason), ...)
    first_token_ids: np.ndarray  # int64: requests whose first output token is in this step


@attrs.frozen(weakref_slot=False)
class DecodeConstants:
    """What every decode-only plan of n requests has in common: one new token each (its
    placeholder), sampled, no new blocks. Read-only, and one object per n
    (``decode_constants``): the scheduler's decode plans share these arrays, and the step
    codec knows them by identity and sends a flag instead of their bytes."""

    ones: np.ndarray  # int32 (n,): num_new
    trues: np.ndarray  # bool (n,): samples
    placeholders: np.ndarray  # int32 (n,): token_ids
    arange: np.ndarray  # int64 (n + 1,): token_offsets
    zeros: np.ndarray  # int64 (n + 1,): block_offsets when no request starts a block


def _read_only(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def _bases(n: int) -> tuple[np.ndarray, ...]:
    return (_read_only(np.ones(n, np.int32)), _read_only(np.ones(n, bool)),
            _read_only(np.full(n, PLACEHOLDER, np.int32)), _read_only(np.arange(n, dtype=np.int64)),
            _read_only(np.zeros(n, np.int64)))


_SHARED = 1 << 13
_BASES = _bases(_SHARED + 1)  # below _SHARED requests, every plan size takes views of these


@functools.lru_cache(maxsize=4096)
def decode_constants(n: int) -> DecodeConstants:
    """The shared constants of an n-request decode plan: the same object for the same n, its
    arrays views of read-only arrays (so that they can never be made writable)."""
    ones, trues, placeholders, arange, zeros = _BASES if n < _SHARED else _bases(n + 1)
    return DecodeConstants(ones[:n], trues[:n], placeholders[:n], arange[: n + 1], zeros[: n + 1])
