"""The step codec round-trips every field exactly: on the contract's layout (the fast, fixed
header) and off it (other dtypes, shapes, strides, None, big ints: the self-describing form)."""

import math

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.policy.step import EMPTY_I64, StepPlan, StepResult, decode_constants
from lockstep.transports.shm_ring import Ring
from lockstep.transports.step_codec import KIND, builder, decode, decode_frame, encode

I32, I64 = np.int32, np.int64
PLAN_ARRAYS = {f.name: f for f in attrs.fields(StepPlan) if f.type == "np.ndarray"}


def wire(msg):
    """What the other process gets: the parts joined, as ``Ring.poll`` returns them."""
    kind, parts = encode(msg)
    return kind, b"".join(bytes(p) for p in parts)


def round_trip(msg):
    return decode(*wire(msg))


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    for f in attrs.fields(type(a)):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray), f.name
            assert (y.dtype, y.shape) == (x.dtype, x.shape), f.name
            assert np.array_equal(x, y), f.name
        elif isinstance(x, float) and math.isnan(x):
            assert isinstance(y, float) and math.isnan(y), f.name
        else:
            assert type(y) is type(x) and y == x, f.name


def arrays(dtype, max_len=40):
    info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else None
    elems = st.booleans() if info is None else st.integers(int(info.min), int(info.max))
    return st.lists(elems, max_size=max_len).map(lambda v: np.array(v, dtype=dtype))


step_ids = st.integers(0, 2**63 - 1) | st.sampled_from([0, 2**32, 2**32 + 1, 2**63 - 1])
ints = st.integers(-(2**63), 2**63 - 1)


@st.composite
def plans(draw):
    fields = {"step_id": draw(step_ids), "num_tokens": draw(ints), "num_padded_tokens": draw(ints),
              "is_dummy": draw(st.booleans()), "placement_gen": draw(ints)}
    for name in PLAN_ARRAYS:
        dtype = np.bool_ if name == "samples" else I64 if "req_ids" in name or "offsets" in name else I32
        fields[name] = draw(arrays(dtype))
    return StepPlan(**fields)


floats = st.floats(allow_nan=True, allow_infinity=True)


@st.composite
def results(draw):
    counts = draw(st.none() | st.tuples(st.integers(0, 4), st.integers(0, 5)).flatmap(
        lambda shape: st.lists(st.integers(-(2**31), 2**31 - 1), min_size=shape[0] * shape[1],
                               max_size=shape[0] * shape[1]).map(lambda v: np.array(v, I32).reshape(shape))))
    return StepResult(step_id=draw(step_ids), num_sampled=draw(arrays(I32)), token_ids=draw(arrays(I32)),
                      kv_loads_done=draw(arrays(I64)), kv_loads_failed=draw(arrays(I64)),
                      expert_counts=counts, host_s=draw(floats), gpu_s=draw(floats), sync_s=draw(floats),
                      placement_ready=draw(ints))


@settings(deadline=None, max_examples=200)
@given(plans())
def test_plans_round_trip_exactly(plan):
    assert_same(plan, round_trip(plan))
    assert wire(plan)[1][0] == 0  # the contract's layout takes the fixed form


@settings(deadline=None, max_examples=200)
@given(results())
def test_results_round_trip_exactly(result):
    assert_same(result, round_trip(result))
    assert wire(result)[1][0] == 0


@settings(deadline=None, max_examples=100)
@given(st.lists(plans() | results(), min_size=1, max_size=8))
def test_frames_decode_in_place_to_the_same_messages(msgs):
    """decode_frame reads a held frame where it lies: the same message, arrays that view the
    ring (read-only), valid until the next take."""
    ring = Ring.create(1 << 16)
    try:
        for msg in msgs:
            ring.send(*_flat(encode(msg)))
            got = decode_frame(ring, ring.poll_frame())
            assert_same(msg, got)
            for f in attrs.fields(type(got)):
                x = getattr(got, f.name)
                if isinstance(x, np.ndarray) and x.size:
                    assert not x.flags.writeable and np.shares_memory(x, ring.view(x.dtype))
    finally:
        ring.close()


def decode_plan(n: int, grew: int = 0, **overrides) -> StepPlan:
    """A decode-only plan as the scheduler builds it: the shared constants for n requests."""
    k = decode_constants(n)
    block_offsets = k.zeros
    if grew:
        block_offsets = np.zeros(n + 1, I64)
        block_offsets[1 : grew + 1] = np.arange(1, grew + 1)
        block_offsets[grew + 1 :] = grew
    fields = dict(step_id=9, req_ids=np.arange(n, dtype=I64), slots=np.arange(n, dtype=I32), num_new=k.ones,
                  start_pos=np.arange(n, dtype=I32), samples=k.trues, token_ids=k.placeholders,
                  token_offsets=k.arange, block_start=np.zeros(n, I32), block_ids=np.arange(grew, dtype=I32),
                  block_offsets=block_offsets, num_tokens=n, num_padded_tokens=n)
    return StepPlan(**(fields | overrides))


@pytest.mark.parametrize("n, grew", [(0, 0), (1, 0), (5, 2), (256, 16), (9000, 3)])
def test_decode_plans_send_their_shared_constants_as_a_flag(n, grew):
    p = decode_plan(n, grew)
    kind, payload = wire(p)
    own = attrs.evolve(p, **{f: np.array(getattr(p, f)) for f in ("num_new", "samples", "token_ids",
                                                                  "token_offsets", "block_offsets")})
    assert len(wire(own)[1]) - len(payload) == (4 + 1 + 4 + 8 + (8 if not grew else 0)) * n + (16 if not grew else 8)
    for q in (decode(kind, payload), round_trip(own)):
        assert_same(p, q)
    q, k = decode(kind, payload), decode_constants(n)
    assert (q.num_new, q.samples, q.token_ids, q.token_offsets) == (k.ones, k.trues, k.placeholders, k.arange)
    assert all(a is b for a, b in zip((q.num_new, q.samples, q.token_ids, q.token_offsets),
                                      (k.ones, k.trues, k.placeholders, k.arange)))


def test_constants_of_another_size_travel_as_bytes():
    k = decode_constants(4)
    p = decode_plan(5, num_new=np.concatenate([k.ones, k.ones[:1]]), samples=decode_constants(6).trues[:5])
    assert_same(p, round_trip(p))


def test_the_builder_makes_what_init_makes():
    ns, toks = np.ones(3, I32), np.arange(3, dtype=I32)
    for args, kw in [((1, ns, toks), {}), ((2, ns, toks, EMPTY_I64), {"gpu_s": 0.5, "placement_ready": 3})]:
        a, b = StepResult(*args, **kw), builder(StepResult)(*args, **kw)
        assert_same(a, b)
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            b.step_id = 5
    p = plan()
    assert_same(p, builder(StepPlan)(**{f.name: getattr(p, f.name) for f in attrs.fields(StepPlan)}))


def plan(n: int = 5, **overrides) -> StepPlan:
    fields = dict(step_id=7, req_ids=np.arange(n, dtype=I64), slots=np.arange(n, dtype=I32),
                  num_new=np.ones(n, I32), start_pos=np.arange(n, dtype=I32), samples=np.ones(n, bool),
                  token_ids=np.arange(n, dtype=I32), token_offsets=np.arange(n + 1, dtype=I64),
                  block_start=np.zeros(n, I32), block_ids=np.arange(2 * n, dtype=I32),
                  block_offsets=np.arange(0, 2 * n + 1, 2, dtype=I64), num_tokens=n, num_padded_tokens=n)
    return StepPlan(**(fields | overrides))


OFF_LAYOUT = {
    "another dtype": dict(slots=np.arange(5, dtype=I64)),
    "a float dtype": dict(token_ids=np.linspace(0, 1, 5, dtype=np.float32)),
    "big-endian": dict(req_ids=np.arange(5, dtype=">i8")),
    "non-contiguous": dict(block_ids=np.arange(20, dtype=I32)[::2]),
    "two dimensions": dict(start_pos=np.arange(6, dtype=I32).reshape(2, 3)),
    "zero dimensions": dict(num_new=np.array(3, dtype=I32)),
    "None for an array": dict(spec_tokens=None),
    "ints beyond int64": dict(step_id=2**64 - 1, placement_gen=2**63),
}


@pytest.mark.parametrize("overrides", OFF_LAYOUT.values(), ids=OFF_LAYOUT.keys())
def test_off_layout_plans_still_round_trip_exactly(overrides):
    p = plan(**overrides)
    kind, payload = wire(p)
    assert payload[0] == 1  # the self-describing form
    assert_same(p, decode(kind, payload))


def test_off_layout_results_round_trip_exactly():
    fortran = np.asfortranarray(np.arange(12, dtype=I32).reshape(3, 4))
    for r in (StepResult(step_id=1, num_sampled=np.ones(2, I32), token_ids=np.ones(2, I32), expert_counts=fortran),
              StepResult(step_id=1, num_sampled=np.ones(2, I32), token_ids=np.ones(2, I32),
                         expert_counts=np.ones((2, 3), np.int64))):
        assert_same(r, round_trip(r))


def test_scalars_arrive_as_the_contracts_types():
    """The fixed header has one struct code per scalar: an int in a float field arrives as
    the equal float, a numpy int as the equal int."""
    r = round_trip(StepResult(step_id=np.int64(3), num_sampled=np.ones(2, I32), token_ids=np.ones(2, I32),
                              host_s=1, gpu_s=np.float32(0.5)))
    assert (r.step_id, r.host_s, r.gpu_s) == (3, 1.0, 0.5)
    assert (type(r.step_id), type(r.host_s), type(r.gpu_s)) == (int, float, float)


def test_empty_fields_decode_to_read_only_empties_of_the_right_dtype():
    q = round_trip(plan(0))
    assert q.req_ids.dtype == I64 and q.slots.dtype == I32 and q.samples.dtype == np.bool_
    assert len(q.spec_tokens) == 0 and not q.spec_tokens.flags.writeable
    empty = round_trip(StepResult(step_id=0, num_sampled=np.zeros(0, I32), token_ids=np.zeros(0, I32),
                                  expert_counts=np.zeros((0, 8), I32)))
    assert empty.expert_counts.shape == (0, 8)


def test_arrays_are_aligned_and_outlive_the_ring_frame():
    """The runtime and the scheduler keep plan arrays after the next message arrives."""
    ring = Ring.create(4096)
    try:
        first, second = plan(5), plan(5, req_ids=np.arange(100, 105, dtype=I64))
        ring.send(*_flat(encode(first)))
        got = decode(*_kind_payload(ring.poll()))
        for _ in range(50):  # overwrite every byte of the ring several times
            ring.send(*_flat(encode(second)))
            decode(*_kind_payload(ring.poll()))
        assert_same(first, got)
        assert all(getattr(got, n).flags.aligned for n in PLAN_ARRAYS)
    finally:
        ring.close()


def _flat(kind_parts):
    kind, parts = kind_parts
    return (kind, *parts)


def _kind_payload(msg):
    kind, _, payload = msg
    return kind, payload


def test_bad_input_fails_clearly():
    with pytest.raises(TypeError, match="encodes"):
        encode(object())
    with pytest.raises(ValueError, match="unknown message kind"):
        decode(99, b"\0" * 8)
    kind, payload = wire(plan(5))
    with pytest.raises(ValueError, match="disagree on the wire layout"):
        decode(kind, payload + b"\0" * 8)
    with pytest.raises(ValueError):
        decode(kind, payload[:-8])
    assert KIND[StepPlan] == 1  # runtime/main.py matches on this number
