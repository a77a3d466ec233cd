"""Workloads for the simulator: public trace readers and the synthetic agentic default.

Every source becomes a list of `TraceRequest`: when a request arrives, how long its prompt and
output are, and which content the prompt is made of. Content is a list of segments (id, length);
`segment_tokens` turns segments into tokens so that equal ids give equal tokens, which is how the
simulator's prefix cache sees the sharing that a trace recorded.
"""

from __future__ import annotations

import gzip
import itertools
import re
import zlib
from collections.abc import Iterable, Iterator
from datetime import date
from pathlib import Path
from typing import Annotated, NamedTuple

import attrs
import msgspec
import numpy as np

MOONCAKE_BLOCK = 512
# Disjoint segment-id namespaces, so content from different sources can never alias.
SEG_ID_SPACE = 1 << 40
AZURE_SEG_BASE = 1 * SEG_ID_SPACE
AGENTIC_SEG_BASE = 2 * SEG_ID_SPACE


class TraceFormatError(ValueError):
    """A trace file that does not match its format; the message names file, line and field."""


def _readonly(dtype: type) -> object:
    def convert(value: object) -> np.ndarray:
        if isinstance(value, np.ndarray) and value.dtype == dtype and not value.flags.writeable:
            return value  # readers build read-only arrays in bulk; do not pay per request
        view = np.asarray(value, dtype=dtype).view()  # a view: the caller's array stays writable
        view.flags.writeable = False
        return view

    return attrs.field(converter=convert, eq=attrs.cmp_using(eq=np.array_equal), hash=False)


@attrs.frozen
class TraceRequest:
    """One request of a workload; its prompt is the concatenation of its segments."""

    arrival_s: float
    input_len: int
    output_len: int
    seg_ids: np.ndarray = _readonly(np.int64)
    seg_lens: np.ndarray = _readonly(np.int32)
    output_seg: int = -1
    conversation: int = -1
    line: int = 0

    def check_integrity(self) -> None:
        if self.seg_ids.ndim != 1 or self.seg_ids.shape != self.seg_lens.shape:
            raise AssertionError(f"segment arrays differ: {self.seg_ids.shape} {self.seg_lens.shape}")
        if (self.seg_lens < 0).any() or int(self.seg_lens.sum()) != self.input_len:
            raise AssertionError(f"segment lengths {self.seg_lens} do not sum to {self.input_len}")
        if self.input_len < 1 or self.output_len < 1 or not self.arrival_s >= 0:
            raise AssertionError(f"bad request {self.input_len=} {self.output_len=} {self.arrival_s=}")


@attrs.frozen
class TraceLoad:
    """What a reader produced: requests sorted by arrival, and how many bad rows it skipped."""

    requests: list[TraceRequest]
    skipped: int
    path: str
    format: str
    out_of_order: int = 0  # rows stamped earlier than some row above them (replayed in time order)


# --- content ---------------------------------------------------------------------------------

_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    z = x + _GAMMA  # uint64 arrays wrap silently, which is the arithmetic splitmix64 wants
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def segment_tokens(
    seg_ids: np.ndarray, seg_lens: np.ndarray, *, vocab_size: int, seed: int
) -> np.ndarray:
    """Tokens of the concatenated segments (int32); token j of segment s depends only on (seed, s, j)."""
    ids = np.asarray(seg_ids, dtype=np.int64)
    lens = np.asarray(seg_lens, dtype=np.int64)
    if ids.shape != lens.shape or ids.ndim != 1:
        raise ValueError(f"seg_ids and seg_lens must be 1-D of one length, got {ids.shape}, {lens.shape}")
    if (ids < 0).any() or (lens < 0).any():
        raise ValueError("segment ids and lengths must be non-negative (-1 means unknown content)")
    if not 1 <= vocab_size < 2**31:
        raise ValueError(f"vocab_size must be in [1, 2**31), got {vocab_size}")
    seed_key = _splitmix64(np.array([seed & (2**64 - 1)], dtype=np.uint64))
    keys = _splitmix64(ids.astype(np.uint64) ^ seed_key)  # a bijection: distinct ids, distinct keys
    # Token j of segment s is output j of a splitmix64 stream keyed by the segment (so a cut
    # segment is a prefix): splitmix64(key_s + j * G), whose input is key_s + (j + 1) * G. At
    # flat index i = start_s + j that is G * (i + 1) + (key_s - G * start_s), mod 2**64.
    starts = np.cumsum(lens) - lens
    z = np.repeat(keys - starts.astype(np.uint64) * _GAMMA, lens)
    out = np.empty(len(z), dtype=np.int32)
    step = np.arange(1, min(len(z), _CHUNK) + 1, dtype=np.uint64) * _GAMMA  # G * (i + 1)
    t = np.empty(len(step), dtype=np.uint64)
    vocab = np.uint64(vocab_size)
    for lo in range(0, len(z), _CHUNK):  # a cache-sized chunk at a time, in place
        zz = z[lo : lo + _CHUNK]
        tt = t[: len(zz)]
        zz += np.uint64(int(_GAMMA) * lo % 2**64)
        zz += step[: len(zz)]
        _mix_into(zz, tt)
        np.floor_divide(zz, vocab, out=tt)  # zz % vocab: 1.6x faster than np.remainder
        tt *= vocab
        zz -= tt
        out[lo : lo + len(zz)] = zz
    return out


_CHUNK = 1 << 14


def _mix_into(z: np.ndarray, t: np.ndarray) -> None:
    """splitmix64's finalizer on z in place (t: scratch of z's length); what _splitmix64
    does after adding the increment."""
    np.right_shift(z, np.uint64(30), out=t)
    z ^= t
    z *= np.uint64(0xBF58476D1CE4E5B9)
    np.right_shift(z, np.uint64(27), out=t)
    z ^= t
    z *= np.uint64(0x94D049BB133111EB)
    np.right_shift(z, np.uint64(31), out=t)
    z ^= t


def output_tokens(output_seg: int, n: int, vocab_size: int, seed: int) -> np.ndarray:
    """The first n tokens a request with this `output_seg` generates."""
    if output_seg < 0:
        raise ValueError("output_seg is -1: this request's output content is unknown (trace requests)")
    return segment_tokens(np.array([output_seg]), np.array([n]), vocab_size=vocab_size, seed=seed)


# --- shared reader plumbing ------------------------------------------------------------------


class _Row(NamedTuple):
    line: int
    t: float | int  # raw timestamp in the source's unit
    input_len: int
    output_len: int
    seg_ids: list[int]
    seg_lens: list[int]


SKIP_HINT = " (bad rows can be skipped and counted: `lockstep sim --skip-bad-rows`, or skip_bad_rows=True in Python)"


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped where it is gzip; other compressions are named."""
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise TraceFormatError(f"{path}: a gzip file that does not decompress ({e})") from None
    for magic, what in _COMPRESSED.items():
        if data.startswith(magic):
            raise TraceFormatError(f"{path}: {what}-compressed; decompress it first (gzip is read as it is)")
    return data


_COMPRESSED = {b"\x28\xb5\x2f\xfd": "zstd", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"PK\x03\x04": "zip"}


def _collect(
    path: Path, fmt: str, rows: Iterable[tuple[int, _Row | str]], per_s: int, skip: bool
) -> TraceLoad:
    good: list[_Row] = []
    skipped = 0
    for line, row in rows:
        if isinstance(row, str):
            if not skip:
                raise TraceFormatError(f"{path} line {line}: {row}{SKIP_HINT}")
            skipped += 1
        else:
            good.append(row)
    if not good:
        raise TraceFormatError(f"{path}: no usable requests ({skipped} bad {'row' if skipped == 1 else 'rows'} skipped)")
    t0 = min(r.t for r in good)
    late, top = 0, good[0].t
    for r in good:  # (a trace is written in time order: say when it is not)
        if r.t < top:
            late += 1
        else:
            top = r.t
    good.sort(key=lambda r: r.t)  # stable: equal timestamps keep file order
    ids, lens, bounds = _flatten_segments(good)
    requests = [
        TraceRequest((r.t - t0) / per_s, r.input_len, r.output_len, ids[a:b], lens[a:b], line=r.line)
        for r, a, b in zip(good, bounds, bounds[1:])
    ]
    return TraceLoad(requests, skipped, str(path), fmt, late)


def _flatten_segments(rows: list[_Row]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    # Two arrays for the whole trace, sliced per request: per-row numpy calls dominated load time.
    ids = np.fromiter(itertools.chain.from_iterable(r.seg_ids for r in rows), dtype=np.int64)
    lens = np.fromiter(itertools.chain.from_iterable(r.seg_lens for r in rows), dtype=np.int32)
    ids.flags.writeable = lens.flags.writeable = False
    bounds = [0, *itertools.accumulate(len(r.seg_ids) for r in rows)]
    return ids, lens, bounds


MAX_TOKENS_FIELD = 2**31 - 1  # token counts are int32 downstream (a larger one overflowed there)


def _length_error(field: str, value: object, *, generated: bool = False) -> str | None:
    if isinstance(value, int) and 1 <= value <= MAX_TOKENS_FIELD:
        return None
    why = " (every request generates at least one token)" if generated else ""
    return f"field '{field}' must be an integer in [1, 2**31 - 1]{why}, got {_show(value)}"


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- Mooncake (JSONL) --------------------------------------------------------------------------


_Count = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS_FIELD)]
_BlockId = Annotated[int, msgspec.Meta(ge=0, lt=SEG_ID_SPACE)]


class _MooncakeRow(msgspec.Struct):
    # Types and ranges are checked inside msgspec's C decoder; Python only checks block counts.
    timestamp: Annotated[float, msgspec.Meta(ge=0)]
    input_length: _Count
    output_length: _Count
    hash_ids: list[_BlockId]


_MOONCAKE_RULES = {
    "timestamp": "a number >= 0 (milliseconds)",
    "input_length": "an integer in [1, 2**31 - 1]",
    "output_length": "an integer in [1, 2**31 - 1] (every request generates at least one token)",
    "hash_ids": f"a list of integer block ids in [0, 2**40), one per {MOONCAKE_BLOCK}-token block",
}
_MSGSPEC_PATH = re.compile(r"at `\$\.(\w+)(?:\[(\d+)\])?")
_MSGSPEC_MISSING = re.compile(r"missing required field `(\w+)`")


def read_mooncake(path: str | Path, *, skip_bad_rows: bool = False) -> TraceLoad:
    """Mooncake JSONL rows {timestamp (ms), input_length, output_length, hash_ids}."""
    path = Path(path)
    return _mooncake(path, _read_bytes(path), skip_bad_rows)


def _mooncake(path: Path, data: bytes, skip_bad_rows: bool) -> TraceLoad:
    decoder = msgspec.json.Decoder(_MooncakeRow)
    lines = data.removeprefix(b"\xef\xbb\xbf").splitlines()  # a UTF-8 BOM is not part of row 1
    # Blank lines are not rows (files often end with one), so they are not counted as skipped.
    rows = ((n, _mooncake_row(decoder, raw, n)) for n, raw in enumerate(lines, 1) if raw.strip())
    return _collect(path, "mooncake", rows, 1000, skip_bad_rows)


def _mooncake_row(decoder: msgspec.json.Decoder, raw: bytes, n: int) -> _Row | str:
    try:
        r = decoder.decode(raw)
    except msgspec.ValidationError as e:  # a subclass of DecodeError, so caught first
        return _mooncake_type_error(raw, str(e))
    except msgspec.DecodeError as e:
        return f"not valid JSON ({e})"
    ids = r.hash_ids
    last = r.input_length - MOONCAKE_BLOCK * (len(ids) - 1)
    if not 0 < last <= MOONCAKE_BLOCK:
        need = -(-r.input_length // MOONCAKE_BLOCK)
        return (
            f"field 'hash_ids' must hold {need} ids (one per {MOONCAKE_BLOCK}-token block of "
            f"input_length={r.input_length}), got {len(ids)}"
        )
    lens = [MOONCAKE_BLOCK] * (len(ids) - 1) + [last]
    return _Row(n, r.timestamp, r.input_length, r.output_length, ids, lens)


def _mooncake_type_error(raw: bytes, message: str) -> str:
    # msgspec names the field and the rule but not the value; re-decode untyped to show it.
    if m := _MSGSPEC_MISSING.search(message):
        return f"missing field '{m[1]}' (each row needs {', '.join(_MOONCAKE_RULES)})"
    m = _MSGSPEC_PATH.search(message)
    if m is None or m[1] not in _MOONCAKE_RULES:
        return f"row must be a JSON object with fields {', '.join(_MOONCAKE_RULES)} ({message})"
    try:
        value = msgspec.json.decode(raw)[m[1]]
    except (msgspec.DecodeError, KeyError, TypeError):  # e.g. a number past float range (1e400)
        return f"field '{m[1]}' must be {_MOONCAKE_RULES[m[1]]} ({message})"
    if m[2] is not None:
        return f"field '{m[1]}' must be {_MOONCAKE_RULES[m[1]]}, got {_show(value[int(m[2])])} at index {m[2]}"
    return f"field '{m[1]}' must be {_MOONCAKE_RULES[m[1]]}, got {_show(value)}"


# --- Azure LLM inference 2023 (CSV) -------------------------------------------------------------

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# Azure writes 7 fractional digits; Python 3.11's datetime.fromisoformat silently drops the 7th.
# The 2024 traces add a UTC offset ('2024-05-10 00:00:00.009930+00:00'): read as UTC.
_TIMESTAMP = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
                        r"(Z|[+-]\d{2}:?\d{2})?")
_INT = re.compile(r"[+-]?\d+")


def read_azure(path: str | Path, *, skip_bad_rows: bool = False) -> TraceLoad:
    """Azure LLM inference CSV `TIMESTAMP,ContextTokens,GeneratedTokens`; nothing is shared."""
    path = Path(path)
    return _azure(path, _read_bytes(path), skip_bad_rows)


def _azure(path: Path, data: bytes, skip_bad_rows: bool) -> TraceLoad:
    try:
        lines = data.decode("utf-8-sig").splitlines()
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise TraceFormatError(f"{path} line {line}: not UTF-8 text ({e.reason} at byte {e.start}); expected an "
                               "Azure CSV trace") from None
    if not lines:
        raise TraceFormatError(f"{path}: empty file; expected the header {','.join(_AZURE_COLUMNS)}")
    columns = _azure_header(path, lines[0])
    zones: list[bool] = []  # whether the first good row's TIMESTAMP has a UTC offset

    def row(line: str, n: int) -> _Row | str:
        got = _azure_row(line, columns, n)
        if isinstance(got, str):
            return got
        r, aware = got
        if not zones:
            zones.append(aware)
        elif aware != zones[0]:  # naive times are UTC here: mixed with offsets they shift by hours
            return (f"field 'TIMESTAMP' {'has' if aware else 'lacks'} a UTC offset, unlike the rows above it: "
                    "give every row one, or none")
        return r

    rows = ((n, row(line, n)) for n, line in enumerate(lines[1:], 2) if line.strip())
    return _collect(path, "azure", rows, 10**9, skip_bad_rows)


def _azure_header(path: Path, header: str) -> tuple[list[int], int]:
    names = [_unquote(name) for name in header.split(",")]
    missing = [c for c in _AZURE_COLUMNS if c not in names]
    if missing:
        raise TraceFormatError(
            f"{path} line 1: header is missing column {', '.join(map(repr, missing))}; "
            f"expected {','.join(_AZURE_COLUMNS)}, got {header!r}"
        )
    return [names.index(c) for c in _AZURE_COLUMNS], len(names)


def _unquote(field: str) -> str:
    """A CSV field without its spaces and its quotes, if any ("2023-11-16 18:17:04.1206440")."""
    field = field.strip()
    return field[1:-1].strip() if len(field) >= 2 and field[0] == field[-1] == '"' else field


def _azure_row(line: str, columns: tuple[list[int], int], n: int) -> tuple[_Row, bool] | str:
    """(the row, whether its TIMESTAMP has a UTC offset), or what is wrong with it."""
    where, width = columns
    fields = line.split(",")
    if len(fields) != width:
        return f"expected {width} comma-separated fields like the header, got {len(fields)}"
    stamp, context, generated = (_unquote(fields[i]) for i in where)
    got = _timestamp_ns(stamp)
    if got is None:
        return (f"field 'TIMESTAMP' must be a date-time like '2023-11-16 18:17:03.9799600' (a UTC offset such as "
                f"'+00:00' may follow), got {stamp!r}")
    input_len = int(context) if _INT.fullmatch(context) else context
    output_len = int(generated) if _INT.fullmatch(generated) else generated
    error = _length_error("ContextTokens", input_len)
    error = error or _length_error("GeneratedTokens", output_len, generated=True)
    if error:
        return error
    # One unique segment per request: the trace says nothing about shared content.
    t, aware = got
    return _Row(n, t, input_len, output_len, [AZURE_SEG_BASE + n], [input_len]), aware


def _timestamp_ns(text: str) -> tuple[int, bool] | None:
    """(nanoseconds, whether the text gave a UTC offset), or None if it is not a date-time."""
    m = _TIMESTAMP.fullmatch(text)
    if m is None:
        return None
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    try:
        days = date(year, month, day).toordinal()
    except ValueError:
        return None
    if hour > 23 or minute > 59 or second > 59:
        return None
    seconds = ((days * 24 + hour) * 60 + minute) * 60 + second
    if m[8] and m[8] != "Z":  # local time = UTC + offset
        sign, hh, mm = (-1 if m[8][0] == "-" else 1), int(m[8][1:3]), int(m[8][-2:])
        if hh > 23 or mm > 59:
            return None
        seconds -= sign * (hh * 60 + mm) * 60
    return seconds * 10**9 + int((m[7] or "").ljust(9, "0")), bool(m[8])  # exact integers: no float rounding


# --- dispatch ----------------------------------------------------------------------------------

_READERS = {"mooncake": _mooncake, "azure": _azure}
_EXTENSIONS = {".jsonl": "mooncake", ".json": "mooncake", ".csv": "azure"}


def _sniff(path: Path) -> str | None:
    """The format the first non-blank line shows plainly (a JSON object, Azure's header), if any."""
    with path.open("rb") as f:
        raw = f.read(1 << 16)
    if raw[:2] == b"\x1f\x8b" or any(raw.startswith(m) for m in _COMPRESSED):
        raw = _read_bytes(path)[: 1 << 16]  # (names any compression but gzip)
    return _sniff_data(raw)


def _sniff_data(raw: bytes) -> str | None:
    first = next((line for line in raw.splitlines() if line.strip()), b"").removeprefix(b"\xef\xbb\xbf").strip()
    if first.startswith(b"{"):
        return "mooncake"
    if all(c.encode() in first for c in _AZURE_COLUMNS):
        return "azure"
    return None


def detect_format(path: str | Path) -> str:
    """The trace format from the first non-blank line where it shows it plainly, or else from
    the file extension."""
    path = Path(path)
    return _detect(path, _sniff(path))


def _detect(path: Path, seen: str | None) -> str:
    if seen is not None:
        return seen
    suffix = Path(path.stem).suffix.lower() if path.suffix.lower() == ".gz" else path.suffix.lower()
    if suffix in _EXTENSIONS:
        return _EXTENSIONS[suffix]
    raise TraceFormatError(
        f"{path}: cannot tell the trace format from its first line or extension {path.suffix!r}; "
        "give the format: --format mooncake (JSONL: timestamp, input_length, output_length, hash_ids) "
        "or --format azure (CSV: TIMESTAMP,ContextTokens,GeneratedTokens); read_trace(..., fmt=...) in Python"
    )


def read_trace(path: str | Path, fmt: str = "auto", *, skip_bad_rows: bool = False) -> TraceLoad:
    """Read a trace; fmt is 'auto', 'mooncake' or 'azure'. The file is read once (a pipe
    such as /dev/stdin works too)."""
    if fmt != "auto" and fmt not in _READERS:
        raise ValueError(f"unknown trace format {fmt!r}; choose one of: auto, {', '.join(_READERS)}")
    path = Path(path)
    data = _read_bytes(path)
    seen = _sniff_data(data[: 1 << 16])
    name = _detect(path, seen) if fmt == "auto" else fmt
    try:
        return _READERS[name](path, data, skip_bad_rows)
    except TraceFormatError as e:
        if seen is not None and seen != name:  # a format given that the file plainly is not
            label = {"mooncake": "a Mooncake JSONL", "azure": "an Azure CSV"}[seen]
            said = str(e).replace(SKIP_HINT, "")  # (skipping rows is not the fix here)
            raise TraceFormatError(f"{path}: read as {name}, but the file looks like {label} trace: give --format "
                                   f"{seen} (or auto). The {name} reader said: {said}") from None
        raise


# --- synthetic agentic workload ------------------------------------------------------------------


@attrs.frozen
class AgenticShape:
    """One agentic conversation's distributions; token counts are log-normal (median, sigma)."""

    system_len: int = 2000
    user_median: float = 150.0
    user_sigma: float = 0.8
    tool_median: float = 400.0
    tool_sigma: float = 1.0
    output_median: float = 200.0
    output_sigma: float = 0.7
    max_output: int = 4096
    mean_turns: float = 5.0
    think_s: tuple[float, float] = (5.0, 30.0)


class _Draws(NamedTuple):
    user: int
    outputs: np.ndarray  # one per turn
    tools: np.ndarray  # one per turn after the first
    thinks: np.ndarray  # one per turn after the first


def agentic_workload(
    *,
    seed: int,
    num_conversations: int = 64,
    conversation_rate: float = 0.5,
    max_context: int = 32_768,
    shape: AgenticShape = AgenticShape(),
) -> list[TraceRequest]:
    """Tool-using conversations sharing one system prompt; each turn re-sends the whole history.

    Turn k's prompt is turn k-1's prompt, then turn k-1's output, then a new tool output. A
    conversation stops before the turn whose prompt plus output would exceed max_context.
    """
    if max_context <= shape.system_len:
        raise ValueError(f"max_context={max_context} does not fit the {shape.system_len}-token system prompt")
    rng = np.random.default_rng(seed)
    starts = np.cumsum(rng.exponential(1.0 / conversation_rate, num_conversations))
    ids = itertools.count(AGENTIC_SEG_BASE + 1)  # AGENTIC_SEG_BASE itself is the system prompt
    requests = []
    for conv, start in enumerate(starts - starts[0]):
        draws = _draw_conversation(rng, shape)
        requests += _conversation(conv, float(start), draws, ids, shape.system_len, max_context)
    return sorted(requests, key=lambda r: r.arrival_s)


def _lognormal_ints(
    rng: np.random.Generator, median: float, sigma: float, size: int, cap: int
) -> np.ndarray:
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, size)), 1, cap).astype(np.int64)


def _draw_conversation(rng: np.random.Generator, s: AgenticShape) -> _Draws:
    turns = 1 + int(rng.poisson(s.mean_turns - 1))
    user = int(_lognormal_ints(rng, s.user_median, s.user_sigma, 1, 8192)[0])
    outputs = _lognormal_ints(rng, s.output_median, s.output_sigma, turns, s.max_output)
    tools = _lognormal_ints(rng, s.tool_median, s.tool_sigma, turns - 1, 16_384)
    return _Draws(user, outputs, tools, rng.uniform(*s.think_s, turns - 1))


def _conversation(
    conv: int, t: float, d: _Draws, ids: Iterator[int], system_len: int, max_context: int
) -> list[TraceRequest]:
    seg_ids, seg_lens = [AGENTIC_SEG_BASE, next(ids)], [system_len, d.user]
    out: list[TraceRequest] = []
    for k, output_len in enumerate(d.outputs.tolist()):
        if k:
            seg_ids += [out[-1].output_seg, next(ids)]
            seg_lens += [out[-1].output_len, int(d.tools[k - 1])]
            t += float(d.thinks[k - 1])
        if sum(seg_lens) + output_len > max_context:
            break
        out.append(TraceRequest(t, sum(seg_lens), output_len, seg_ids, seg_lens, next(ids), conv, 0))
    return out
