"""StepPlan and StepResult on the wire: a fixed binary header, then the arrays' raw bytes.

Both messages are structures of arrays and every field has one dtype in the step contract,
so only the scalars and the arrays' shapes travel: one precompiled ``struct`` header, then
the arrays' buffers, joined into one ``bytes`` (which the ring copies once: a copy per
array straight into the ring costs more than the join).

Two decoders. ``decode`` takes a private payload (``Ring.poll``'s copy) and makes each dtype's
arrays from one ``np.frombuffer``: they outlive the ring frame (the scheduler keeps result
arrays in what it hands to requests). ``decode_frame`` takes a frame the consumer holds
(``Ring.poll_frame``) and copies nothing: each array is a slice of the ring's own read-only
typed view, valid until the consumer takes its next message from that ring. The runtime
decodes plans this way, as it is done with a plan before it asks for the next one.
Either way the arrays are read-only.

A decode-only plan shares most of its arrays with every other plan of its size (the
contract's ``decode_constants``: one new token each, its placeholder, sampled, no new
block): the encoder knows them by identity and sends a first dim of -1 instead of their
bytes, and the decoder hands out the same constants.

A message off the contract's layout (another dtype, another number of dimensions, a
non-contiguous array, an int beyond int64, None in an array field) still round-trips
exactly, through a slower self-describing form (msgpack header with each array's dtype and
shape), flagged by the payload's first byte.

Each class's encoder and decoders are generated at import, as attrs generates ``__init__``:
a Python loop over 22 fields would cost more than everything else the codec does. The
decoders fill a plain slotted twin of the class and then set its ``__class__`` (the frozen
class's ``__init__`` calls ``object.__setattr__`` per field: three times the cost).
"""

from __future__ import annotations

import operator
import struct

import attrs
import msgspec
import numpy as np

from lockstep.policy.step import EMPTY_I32, EMPTY_I64, DecodeConstants, StepPlan, StepResult, decode_constants

from .shm_ring import Ring

KIND = {StepPlan: 1, StepResult: 2}
_FIXED, _DESCRIBED = 0, 1  # the payload's first byte

_I32, _I64, _BOOL = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.bool_)
_F32 = np.dtype(np.float32)
# Per class, every attrs field in order: a struct code for a scalar, or (dtype, ndim, may be
# None) for an array. Checked against the class at import, so a new field fails loudly here.
_LAYOUTS = {
    StepPlan: {
        "step_id": "q", "req_ids": (_I64, 1, False), "slots": (_I32, 1, False),
        "num_new": (_I32, 1, False), "start_pos": (_I32, 1, False), "samples": (_BOOL, 1, False),
        "token_ids": (_I32, 1, False), "token_offsets": (_I64, 1, False),
        "block_start": (_I32, 1, False), "block_ids": (_I32, 1, False),
        "block_offsets": (_I64, 1, False), "spec_tokens": (_I32, 1, False),
        "spec_offsets": (_I64, 1, False), "kv_load_req_ids": (_I64, 1, False),
        "kv_load_first_block": (_I32, 1, False), "kv_load_num_blocks": (_I32, 1, False),
        "kv_send_req_ids": (_I64, 1, False), "finished_req_ids": (_I64, 1, False),
        "num_tokens": "q", "num_padded_tokens": "q", "is_dummy": "?", "placement_gen": "q",
        "uniform_decode": "?", "draft_passes": "q", "draft_placement_gen": "q",
    },
    StepResult: {
        "step_id": "q", "num_sampled": (_I32, 1, False), "token_ids": (_I32, 1, False),
        "kv_loads_done": (_I64, 1, False), "kv_loads_failed": (_I64, 1, False),
        "expert_counts": (_I32, 2, True),
        "logprobs": (_F32, 1, True), "top_ids": (_I32, 2, True), "top_logprobs": (_F32, 2, True),
        "prompt_req_ids": (_I64, 1, False), "prompt_index": (_I64, 1, False),
        "prompt_token_logprobs": (_F32, 1, True), "prompt_top_ids": (_I32, 2, True),
        "prompt_top_logprobs": (_F32, 2, True), "prompt_token_ranks": (_I32, 1, True),
        "draft_expert_counts": (_I32, 2, True), "num_drafts": (_I32, 1, False),
        "grammars_ready": (_I64, 1, False),
        "host_s": "d", "gpu_s": "d", "sync_s": "d", "placement_ready": "q", "draft_placement_ready": "q",
    },
}


def encode(msg: StepPlan | StepResult) -> tuple[int, list]:
    """(kind, parts) for ``Ring.send(kind, *parts)``."""
    try:
        enc = _ENCODERS[type(msg)]
    except KeyError:
        raise TypeError(f"step_codec encodes {[c.__name__ for c in KIND]}, not {type(msg).__name__}") from None
    return enc(msg)


def decode(kind: int, payload: bytes) -> StepPlan | StepResult:
    """The message in a private payload; its arrays stay valid as long as they are kept."""
    dec = _DECODERS.get(kind)
    if dec is None:
        raise ValueError(f"unknown message kind {kind}; known: {sorted(_DECODERS)}")
    return dec(payload)


def decode_frame(ring: Ring, frame: tuple[int, int, int, int]) -> StepPlan | StepResult:
    """The message in ``frame`` (``ring.poll_frame()``/``recv_frame()``), without a copy: its
    arrays view the ring and are valid only until the consumer takes its next message from
    ``ring`` (or calls ``ring.release()``). Copy what must live longer."""
    dec = _FRAME_DECODERS.get(frame[0])
    if dec is None:
        raise ValueError(f"unknown message kind {frame[0]}; known: {sorted(_FRAME_DECODERS)}")
    return dec(ring, frame[2], frame[3])


def builder(cls: type[StepPlan] | type[StepResult]):
    """A function with the signature of ``cls``'s ``__init__`` that makes the same frozen
    instance the way the decoders do, at a third of the cost (for a producer that makes one
    every step, such as a runtime's result)."""
    return _BUILDERS[cls]


# -- the self-describing form: rare, so plain code ---------------------------------------------
_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder()


def _encode_described(msg) -> bytes:
    scalars, arrays, bufs = {}, [], []
    for f in attrs.fields(type(msg)):
        value = getattr(msg, f.name)
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                raise TypeError(f"{type(msg).__name__}.{f.name} has dtype object; the step "
                                f"contract's arrays are numeric")
            if not value.flags.c_contiguous:  # (ascontiguousarray would make 0-d arrays 1-d)
                value = value.copy(order="C")
            arrays.append((f.name, value.dtype.str, value.shape))
            bufs.append(value.reshape(-1).view(np.uint8))
        else:
            scalars[f.name] = value
    header = _ENC.encode((scalars, arrays))
    return b"".join((bytes((_DESCRIBED,)), len(header).to_bytes(4, "little"), header, *bufs))


def _decode_described(cls, payload) -> StepPlan | StepResult:
    payload = bytes(payload)  # private: a ring frame's bytes go back to the producer
    n = int.from_bytes(payload[1:5], "little")
    fields, arrays = _DEC.decode(payload[5 : 5 + n])
    pos = 5 + n
    for name, dtype, shape in arrays:
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        fields[name] = np.frombuffer(payload, dt, count, pos).reshape(shape)
        pos += count * dt.itemsize
    _check_length(cls, payload, pos)
    return cls(**fields)


def _check_length(cls, payload, pos: int, start: int = 0, end: int | None = None) -> None:
    size = (len(payload) if end is None else end) - start
    if pos - start != size:
        raise ValueError(f"a {cls.__name__} payload of {size} bytes whose header describes "
                         f"{pos - start}: the two processes disagree on the wire layout")


# -- the fixed form: generated per class --------------------------------------------------------
class _Described(Exception):
    """Raised inside a generated encoder: this message needs the self-describing form."""


_NO_CONSTANTS = DecodeConstants(None, None, None, None, None)  # no array is any of these


def _compile(cls: type, kind: int, layout: dict, consts: tuple) -> tuple:
    """Generate (encode, decode, decode_frame, build) for ``cls``. Payload: u8 form, the
    scalars, each array's dims as int64 (-1 for None, or for the shared constant), padding to
    8 bytes, then the arrays' bytes, widest dtype first so that each one stays aligned."""
    names = [f.name for f in attrs.fields(cls)]
    if names != list(layout):
        raise TypeError(f"step_codec's layout for {cls.__name__} lists {list(layout)}, but the "
                        f"class has fields {names}; update _LAYOUTS in transports/step_codec.py")
    if consts[1] and not all(names.index(consts[0]) < names.index(n) for n in consts[1]):
        raise TypeError(f"step_codec reads n for {cls.__name__}'s constants from {consts[0]}: it must come first")
    plain_init = all(f.validator is None and f.converter is None for f in attrs.fields(cls)) and not (
        hasattr(cls, "__attrs_post_init__") or hasattr(cls, "__attrs_pre_init__"))
    twin = type(f"_{cls.__name__}Slots", (), {"__slots__": cls.__slots__})
    try:
        object.__new__(twin).__class__ = cls
    except TypeError:
        plain_init = False
    if not plain_init:
        raise TypeError(f"step_codec builds {cls.__name__} as a slotted twin: it must stay a slotted attrs "
                        f"class without a weakref slot, validators, converters or init hooks")
    scalars = [n for n, t in layout.items() if isinstance(t, str)]
    arrays = [n for n, t in layout.items() if not isinstance(t, str)]
    # Stable sort, grouped by dtype: ties keep field order.
    wire = sorted(arrays, key=lambda n: (-layout[n][0].itemsize, layout[n][0].str))
    for dt in {layout[n][0] for n in arrays}:  # the decoders read a group's rare fields last
        kinds = [f.default is not attrs.NOTHING and f.name in arrays and isinstance(f.default, np.ndarray)
                 and f.default.size == 0 for f in attrs.fields(cls) if f.name in arrays and layout[f.name][0] == dt]
        if kinds != sorted(kinds):
            raise TypeError(f"{cls.__name__}: among its {dt} arrays, those defaulting to the shared empty must "
                            "come after the others (the decoders read them last)")
    dims = {n: [f"{n}_{i}" for i in range(layout[n][1])] for n in arrays}
    header_vars = scalars + [d for n in arrays for d in dims[n]]
    fmt = "<B" + "".join(layout[n] for n in scalars) + "q" * (len(header_vars) - len(scalars))
    header = struct.Struct(fmt + "x" * (-struct.calcsize(fmt) % 8))  # padded to 8 bytes
    env = {"cls": cls, "kind": kind, "HEADER": header, "START": header.size,
           "get": operator.attrgetter(*names),
           "join": b"".join, "frombuffer": np.frombuffer, "new": object.__new__, "Twin": twin,
           "constants": decode_constants, "NO_CONSTANTS": _NO_CONSTANTS,
           "Described": _Described, "struct_error": struct.error,
           "encode_described": _encode_described, "decode_described": _decode_described,
           "check_length": _check_length}
    shared = {(_I32, 1): EMPTY_I32, (_I64, 1): EMPTY_I64}  # the contract's own defaults
    for n in arrays:
        dtype, ndim, _ = layout[n]
        env[f"{n}_DT"] = env[f"{dtype}_DT"] = dtype
        empty = shared.get((dtype, ndim))
        if empty is None:
            empty = np.empty((0,) * ndim, dtype)
            empty.setflags(write=False)
        env[f"{n}_EMPTY"] = empty  # shared by every message with this field empty
    # Fields whose default is that shared empty: usually it, so the encoder looks for it first.
    defaults = {f.name for f in attrs.fields(cls) if f.name in arrays and f.default is env[f"{f.name}_EMPTY"]}
    gen = _Gen(layout, names, arrays, wire, dims, header_vars, defaults, *consts)
    params = []
    for f in attrs.fields(cls):
        if isinstance(f.default, attrs.Factory):
            raise TypeError(f"step_codec's builder for {cls.__name__} takes plain defaults; {f.name} has a factory")
        env[f"D_{f.name}"] = f.default
        params.append(f.name if f.default is attrs.NOTHING else f"{f.name}=D_{f.name}")
    src = "\n".join(gen.encoder() + gen.decoder(frame=False) + gen.decoder(frame=True)
                    + [f"def build({', '.join(params)}):", *gen.construct()]) + "\n"
    exec(compile(src, f"<step_codec: {cls.__name__}>", "exec"), env)
    for fn in ("encode", "decode", "decode_frame", "build"):
        env[fn].__doc__ = src  # for whoever wonders what runs
    return env["encode"], env["decode"], env["decode_frame"], env["build"]


@attrs.frozen
class _Gen:
    """The source of one class's encoder, decoders and builder."""

    layout: dict
    names: list
    arrays: list
    wire: list
    dims: dict
    header_vars: list
    defaults: set  # arrays whose default is the shared empty
    count: str | None  # the array whose length is n for the DecodeConstants
    consts: dict  # array -> its DecodeConstants attribute

    def negative(self, n: str) -> bool:
        """Whether a first dim of -1 may stand for this array (None, or its constant)."""
        return self.layout[n][2] or n in self.consts

    def encoder(self) -> list[str]:
        # Inline checks: a ``map`` of attrgetters over the arrays costs more than these lines.
        lines = ["def encode(m):", f"    {', '.join(self.names)}, = get(m)", "    try:"]
        for n in self.arrays:
            if n not in self.defaults:
                lines += ["        " + line for line in self._check(n)]
            if n == self.count and self.consts:
                # A plan built from the constants has its arrays' base set; others rarely do.
                first = next(iter(self.consts))
                lines.append(f"        K = constants({n}_0) if {first}.base is not None else NO_CONSTANTS")
        if self.defaults:  # usually all the shared empty: one test for all of them
            rare = [n for n in self.arrays if n in self.defaults]
            lines += [f"        if {' and '.join(f'{n} is {n}_EMPTY' for n in rare)}:",
                      f"            {' = '.join(self.dims[n][0] for n in rare)} = 0",
                      f"            {' = '.join(f'{n}_buf' for n in rare)} = b''",
                      "        else:", *("            " + line for n in rare for line in self._check(n))]
        bufs = ", ".join(f"{n}_buf" if self.negative(n) or n in self.defaults else n for n in self.wire)
        return lines + [
            f"        payload = join((HEADER.pack({_FIXED}, {', '.join(self.header_vars)}), {bufs}))",
            # Off-layout values: None or a non-array (AttributeError), other ndim (ValueError),
            # non-contiguous (ValueError or TypeError from join), an int beyond int64 (struct.error).
            "    except (Described, AttributeError, ValueError, TypeError, struct_error):",
            "        return kind, [encode_described(m)]",
            "    return kind, [payload]"]

    def _check(self, n: str) -> list[str]:
        ndim, optional = self.layout[n][1:]
        dims = ", ".join(self.dims[n])
        check = [f"if {n}.dtype is not {n}_DT:", "    raise Described",
                 f"{dims}, = {n}.shape"]  # ValueError when ndim differs
        if n in self.defaults:  # the shared empty: nothing to look at (and b'' is joined faster)
            return [f"if {n} is {n}_EMPTY:", f"    {self.dims[n][0]} = 0", f"    {n}_buf = b''",
                    "el" + check[0], check[1], "else:", "    " + check[2], f"    {n}_buf = {n}"]
        if optional:  # None travels as a first dim of -1 and no bytes
            return [f"if {n} is None:", f"    {dims}, = -1, {'0, ' * (ndim - 1)}", f"    {n}_buf = b''",
                    "else:", *("    " + line for line in check), f"    {n}_buf = {n}"]
        if n in self.consts:  # so does the shared constant
            return [f"if {n} is K.{self.consts[n]}:", f"    {dims}, = -1, {'0, ' * (ndim - 1)}",
                    f"    {n}_buf = b''", "else:", *("    " + line for line in check), f"    {n}_buf = {n}"]
        return check

    def decoder(self, *, frame: bool) -> list[str]:
        """``decode(p)`` on a private payload (one frombuffer per dtype, then slices), or
        ``decode_frame(ring, start, end)`` on a frame the ring's consumer holds (slices of
        ``ring.view(dtype)``, its whole mapping as a typed array)."""
        dims, header_vars = self.dims, self.header_vars
        if frame:
            lines = ["def decode_frame(ring, start, end):", "    mem = ring.buffer", "    if mem[start]:",
                     "        return decode_described(cls, mem[start:end])",
                     f"    _, {', '.join(header_vars)} = HEADER.unpack_from(mem, start)", "    pos = start + START"]
        else:
            lines = ["def decode(p):", "    if p[0]:", "        return decode_described(cls, p)",
                     f"    _, {', '.join(header_vars)} = HEADER.unpack_from(p)", "    pos = START"]
        if self.consts:
            any_const = " | ".join(dims[n][0] for n in self.consts)
            lines.append(f"    K = constants({dims[self.count][0]}) if ({any_const}) < 0 else None")
        if self.defaults:
            lines.append(f"    rare = {' | '.join(dims[n][0] for n in self.arrays if n in self.defaults)}")
        for dtype in dict.fromkeys(self.layout[n][0] for n in self.wire):
            lines += self._group(dtype, frame)
        if frame:
            lines += ["    if pos != end:", "        check_length(cls, mem, pos, start, end)"]
        else:
            lines += ["    if pos != len(p):", "        check_length(cls, p, pos)"]
        return lines + self.construct()

    def _group(self, dtype: np.dtype, frame: bool) -> list[str]:
        """One dtype's arrays, from ``pos``. Those whose default is the shared empty come last
        (attrs puts fields with defaults last) and are usually all empty (``rare`` is 0):
        then a store each does."""
        layout, dims = self.layout, self.dims
        group = [n for n in self.wire if layout[n][0] is dtype]
        rare = [n for n in group if n in self.defaults]
        main = group[: len(group) - len(rare)]
        # A first dim of -1 (None, or the constant) means no bytes: count through n_n, 0 then.
        count = {n: dims[n][0] if len(dims[n]) == 1 and not self.negative(n) else f"{n}_n" for n in group}
        lines = []
        for n in group:
            if self.negative(n):
                lines.append(f"    {n}_n = {' * '.join(dims[n])} if {dims[n][0]} > 0 else 0")
            elif len(dims[n]) > 1:
                lines.append(f"    {n}_n = {' * '.join(dims[n])}")
        lines.append(f"    n = {' + '.join(count[n] for n in main) or 0}")
        if rare:
            lines.append(f"    if rare:\n        n += {' + '.join(count[n] for n in rare)}")
        # Sliced only where not empty (an empty field gets the shared read-only empty).
        if frame:
            lines += ["    if n:", f"        g = ring.views.get({dtype}_DT)", "        if g is None:",
                      f"            g = ring.view({dtype}_DT)", f"    o = pos >> {dtype.itemsize.bit_length() - 1}"]
        else:
            lines += [f"    g = frombuffer(p, {dtype}_DT, n, pos) if n else None", "    o = 0"]

        def fields(names: list[str], indent: str) -> list[str]:
            out = []
            for i, n in enumerate(names):
                c = count[n]
                whole = not frame and group == [n]  # the group's one array: the frombuffer itself
                make = f"{'g' if whole else f'g[o:o + {c}]'} if {c} else {n}_EMPTY"
                if len(dims[n]) > 1:
                    make = f"({make}).reshape({', '.join(dims[n])})"
                if layout[n][2]:
                    make = f"None if {dims[n][0]} < 0 else {make}"
                elif n in self.consts:
                    make = f"K.{self.consts[n]} if {dims[n][0]} < 0 else {make}"
                out.append(f"{indent}{n} = {make}")
                if n != group[-1]:
                    out.append(f"{indent}o += {c}")
            return out

        lines += fields(main, "    ")
        if rare:
            lines += ["    if rare:", *fields(rare, "        "), "    else:", f"        {' = '.join(rare)} = {rare[0]}_EMPTY"]
        return lines + [f"    pos += n * {dtype.itemsize}"]

    def construct(self) -> list[str]:
        # Filled as its slotted twin (plain stores, no frozen __setattr__ to get around), then
        # made the frozen class: what attrs' __init__ makes, at a third of its cost.
        return ["    m = new(Twin)", *(f"    m.{n} = {n}" for n in self.names), "    m.__class__ = cls", "    return m"]


# Arrays that a decode-only plan shares with every other of its size (``decode_constants``,
# n = the length of the first): sent as a first dim of -1 and no bytes.
_CONSTANTS = {
    StepPlan: ("req_ids", {"num_new": "ones", "samples": "trues", "token_ids": "placeholders",
                           "token_offsets": "arange", "block_offsets": "zeros"}),
    StepResult: (None, {}),
}
_COMPILED = {cls: _compile(cls, KIND[cls], layout, _CONSTANTS[cls]) for cls, layout in _LAYOUTS.items()}
_ENCODERS = {cls: c[0] for cls, c in _COMPILED.items()}
_DECODERS = {KIND[cls]: c[1] for cls, c in _COMPILED.items()}
_FRAME_DECODERS = {KIND[cls]: c[2] for cls, c in _COMPILED.items()}
_BUILDERS = {cls: c[3] for cls, c in _COMPILED.items()}
