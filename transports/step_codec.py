"""StepPlan and StepResult on the wire: a fixed binary header, then the arrays' raw bytes.

Both messages are structures of arrays and every field has one dtype in the step contract,
so only the scalars and the arrays' shapes travel: one precompiled ``struct`` header, then
the arrays' buffers, joined into one ``bytes`` (which the ring copies once). The decoder
makes each array with one ``np.frombuffer`` on the received payload. That payload is already
a private copy of the ring's bytes (``Ring.poll``), so the arrays stay valid after the next
message — the scheduler and the runtime both keep plan arrays that long — and are read-only.

A message off the contract's layout (another dtype, another number of dimensions, a
non-contiguous array, an int beyond int64, None in an array field) still round-trips
exactly, through a slower self-describing form (msgpack header with each array's dtype and
shape), flagged by the payload's first byte.

Each class's encoder and decoder are generated at import, as attrs generates ``__init__``:
a Python loop over 22 fields would cost more than everything else the codec does.
"""

from __future__ import annotations

import operator
import struct

import attrs
import msgspec
import numpy as np

from lockstep.policy.step import StepPlan, StepResult

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
    },
    StepResult: {
        "step_id": "q", "num_sampled": (_I32, 1, False), "token_ids": (_I32, 1, False),
        "kv_loads_done": (_I64, 1, False), "kv_loads_failed": (_I64, 1, False),
        "expert_counts": (_I32, 2, True),
        "logprobs": (_F32, 1, True), "top_ids": (_I32, 2, True), "top_logprobs": (_F32, 2, True),
        "host_s": "d", "gpu_s": "d", "sync_s": "d", "placement_ready": "q",
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
    dec = _DECODERS.get(kind)
    if dec is None:
        raise ValueError(f"unknown message kind {kind}; known: {sorted(_DECODERS)}")
    return dec(payload)


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


def _check_length(cls, payload, pos: int) -> None:
    if pos != len(payload):
        raise ValueError(f"a {cls.__name__} payload of {len(payload)} bytes whose header describes "
                         f"{pos}: the two processes disagree on the wire layout")


# -- the fixed form: generated per class --------------------------------------------------------
class _Described(Exception):
    """Raised inside a generated encoder: this message needs the self-describing form."""


def _compile(cls: type, kind: int, layout: dict) -> tuple:
    """Generate (encode, decode) for ``cls``. Payload: u8 form, the scalars, each array's
    dims as int64 (-1 for None), padding to 8 bytes, then the arrays' bytes, widest dtype
    first so that each one stays aligned."""
    names = [f.name for f in attrs.fields(cls)]
    if names != list(layout):
        raise TypeError(f"step_codec's layout for {cls.__name__} lists {list(layout)}, but the "
                        f"class has fields {names}; update _LAYOUTS in transports/step_codec.py")
    scalars = [n for n, t in layout.items() if isinstance(t, str)]
    arrays = [n for n, t in layout.items() if not isinstance(t, str)]
    # Stable sort, grouped by dtype: ties keep field order.
    wire = sorted(arrays, key=lambda n: (-layout[n][0].itemsize, layout[n][0].str))
    dims = {n: [f"{n}_{i}" for i in range(layout[n][1])] for n in arrays}
    header_vars = scalars + [d for n in arrays for d in dims[n]]
    header = struct.Struct("<B" + "".join(layout[n] for n in scalars) + "q" * (len(header_vars) - len(scalars)))
    pad = -header.size % 8
    env = {"cls": cls, "kind": kind, "get": operator.attrgetter(*names), "HEADER": header,
           "PAD": bytes(pad), "START": header.size + pad, "join": b"".join, "frombuffer": np.frombuffer,
           "Described": _Described, "struct_error": struct.error,
           "encode_described": _encode_described, "decode_described": _decode_described,
           "check_length": _check_length}
    for n in arrays:
        dtype, ndim, _ = layout[n]
        env[f"{n}_DT"] = env[f"{dtype}_DT"] = dtype
        env[f"{n}_EMPTY"] = empty = np.empty((0,) * ndim, dtype)
        empty.setflags(write=False)  # shared by every message with this field empty
    src = "\n".join(_encoder(layout, names, arrays, wire, dims, header_vars)
                    + _decoder(layout, names, wire, dims, header_vars)) + "\n"
    exec(compile(src, f"<step_codec: {cls.__name__}>", "exec"), env)
    env["encode"].__doc__ = env["decode"].__doc__ = src  # for whoever wonders what runs
    return env["encode"], env["decode"]


def _encoder(layout, names, arrays, wire, dims, header_vars) -> list[str]:
    lines = ["def encode(m):", f"    {', '.join(names)}, = get(m)", "    try:"]
    for n in arrays:
        ndim, optional = layout[n][1:]
        check = [f"if {n}.dtype is not {n}_DT:", "    raise Described",
                 f"{', '.join(dims[n])}, = {n}.shape"]  # ValueError when ndim differs
        if optional:  # None travels as a first dim of -1 and no bytes
            check = [f"if {n} is None:", f"    {', '.join(dims[n])}, = -1, {'0, ' * (ndim - 1)}",
                     f"    {n}_buf = b''", "else:", *("    " + line for line in check), f"    {n}_buf = {n}"]
        lines += ["        " + line for line in check]
    bufs = ", ".join(f"{n}_buf" if layout[n][2] else n for n in wire)
    return lines + [
        f"        payload = join((HEADER.pack({_FIXED}, {', '.join(header_vars)}), PAD, {bufs}))",
        # Off-layout values: None or a non-array (AttributeError), other ndim (ValueError),
        # non-contiguous (TypeError from join), an int beyond int64 (struct.error).
        "    except (Described, AttributeError, ValueError, TypeError, struct_error):",
        "        return kind, [encode_described(m)]",
        "    return kind, [payload]"]


def _decoder(layout, names, wire, dims, header_vars) -> list[str]:
    lines = ["def decode(p):", "    if p[0]:", "        return decode_described(cls, p)",
             f"    _, {', '.join(header_vars)} = HEADER.unpack_from(p)", "    pos = START"]
    # One frombuffer per dtype and a slice per array: slicing costs half a frombuffer.
    for dtype in dict.fromkeys(layout[n][0] for n in wire):
        group = [n for n in wire if layout[n][0] is dtype]
        # An optional array's first dim is -1 for None: count it through n_n, which is 0 then.
        count = {n: dims[n][0] if len(dims[n]) == 1 and not layout[n][2] else f"{n}_n" for n in group}
        for n in group:
            if layout[n][2]:  # None arrives as a first dim of -1, and no bytes
                lines.append(f"    {n}_n = {' * '.join(dims[n])} if {dims[n][0]} > 0 else 0")
            elif len(dims[n]) > 1:
                lines.append(f"    {n}_n = {' * '.join(dims[n])}")
        lines += [f"    n = {' + '.join(count.values())}",
                  f"    g = frombuffer(p, {dtype}_DT, n, pos) if n else None  # sliced only where not empty"]
        for i, n in enumerate(group):
            c, optional = count[n], layout[n][2]
            part = "g" if len(group) == 1 else f"g[:{c}]" if i == 0 else f"g[o:o + {c}]"
            make = f"{part} if {c} else {n}_EMPTY"
            if len(dims[n]) > 1:
                make = f"({make}).reshape({', '.join(dims[n])})"
            if optional:
                make = f"None if {dims[n][0]} < 0 else {make}"
            lines.append(f"    {n} = {make}")
            if i < len(group) - 1:
                lines.append(f"    o {'+=' if i else '='} {c}")
        lines.append(f"    pos += n * {dtype.itemsize}")
    return lines + ["    if pos != len(p):", "        check_length(cls, p, pos)",
                    f"    return cls({', '.join(names)})"]


_COMPILED = {cls: _compile(cls, KIND[cls], layout) for cls, layout in _LAYOUTS.items()}
_ENCODERS = {cls: ed[0] for cls, ed in _COMPILED.items()}
_DECODERS = {KIND[cls]: ed[1] for cls, ed in _COMPILED.items()}
