"""StepPlan and StepResult on the wire: a msgpack header, then the arrays' raw bytes.

Both messages are structures of arrays, so encoding is one small msgspec header (the
scalar fields, and each array's dtype and length) plus the arrays' buffers, with no
per-request work and nothing pickled.
"""

from __future__ import annotations

import attrs
import msgspec
import numpy as np

from lockstep.policy.step import StepPlan, StepResult

KIND = {StepPlan: 1, StepResult: 2}
_BY_KIND = {v: k for k, v in KIND.items()}
_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder()
_FIELDS = {cls: [f.name for f in attrs.fields(cls)] for cls in KIND}
_DTYPES: dict[str, np.dtype] = {}


def encode(msg: StepPlan | StepResult) -> tuple[int, list]:
    """(kind, parts) for ``Ring.send(kind, *parts)``."""
    cls = type(msg)
    scalars, arrays, bufs = {}, [], []
    for name in _FIELDS[cls]:
        value = getattr(msg, name)
        if isinstance(value, np.ndarray):
            value = np.ascontiguousarray(value).ravel()  # the contract's arrays are 1-D
            arrays.append((name, value.dtype.str, len(value)))
            bufs.append(value.data.cast("B"))
        else:
            scalars[name] = value
    header = _ENC.encode((scalars, arrays))
    return KIND[cls], [len(header).to_bytes(4, "little"), header, *bufs]


def decode(kind: int, payload: bytes) -> StepPlan | StepResult:
    cls = _BY_KIND.get(kind)
    if cls is None:
        raise ValueError(f"unknown message kind {kind}; known: {sorted(_BY_KIND)}")
    n = int.from_bytes(payload[:4], "little")
    scalars, arrays = _DEC.decode(payload[4 : 4 + n])
    pos, fields = 4 + n, scalars
    for name, dtype, count in arrays:
        dt = _DTYPES.get(dtype) or _DTYPES.setdefault(dtype, np.dtype(dtype))
        fields[name] = np.frombuffer(payload, dt, count, pos)
        pos += count * dt.itemsize
    return cls(**fields)
