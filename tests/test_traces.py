"""Trace readers on real excerpts, their error messages, and the synthetic agentic workload."""

import json
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.sim.traces import (
    MOONCAKE_BLOCK,
    TraceFormatError,
    TraceRequest,
    agentic_workload,
    output_tokens,
    read_azure,
    read_mooncake,
    read_trace,
    segment_tokens,
)

DATA = pathlib.Path(__file__).parent / "data"
MOONCAKE = DATA / "mooncake_conversation_300.jsonl"
AZURE = DATA / "azure_code_300.csv"
VOCAB = 32_000


def tokens(req: TraceRequest, seed: int = 0) -> np.ndarray:
    return segment_tokens(req.seg_ids, req.seg_lens, vocab_size=VOCAB, seed=seed)


def check_load(requests: list[TraceRequest], n: int) -> None:
    assert len(requests) == n
    assert requests[0].arrival_s == 0.0
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)
    for r in requests:
        r.check_integrity()


# --- real rows -------------------------------------------------------------------------------


def test_mooncake_excerpt():
    load = read_mooncake(MOONCAKE)
    assert (load.format, load.skipped, load.path) == ("mooncake", 0, str(MOONCAKE))
    check_load(load.requests, 300)
    first = load.requests[0]
    assert (first.input_len, first.output_len, first.line, first.output_seg) == (6758, 500, 1, -1)
    assert first.seg_ids.tolist() == list(range(14))
    assert first.seg_lens.tolist() == [MOONCAKE_BLOCK] * 13 + [6758 - 13 * MOONCAKE_BLOCK]
    assert load.requests[-1].arrival_s == pytest.approx(102.0)  # timestamps are in ms
    assert all(r.seg_ids[0] == 0 for r in load.requests)  # every conversation shares block 0


def test_azure_excerpt():
    load = read_azure(AZURE)
    assert (load.format, load.skipped) == ("azure", 0)
    check_load(load.requests, 300)
    first, second = load.requests[:2]
    assert (first.input_len, first.output_len, first.line) == (4808, 10, 2)
    # 04.0319600 - 03.9799600: the 7th fractional digit must survive parsing.
    assert second.arrival_s == pytest.approx(0.052, abs=1e-9)
    ids = [int(r.seg_ids[0]) for r in load.requests]
    assert len(set(ids)) == 300 and all(len(r.seg_ids) == 1 for r in load.requests)


def test_read_trace_detects_format(tmp_path):
    assert read_trace(MOONCAKE).format == "mooncake"
    assert read_trace(AZURE).format == "azure"
    for src, fmt in [(MOONCAKE, "mooncake"), (AZURE, "azure")]:
        sniffed = tmp_path / f"{fmt}.trace"
        sniffed.write_bytes(src.read_bytes())
        assert read_trace(sniffed).format == fmt
        assert read_trace(sniffed, fmt).format == fmt


def test_the_first_line_outranks_the_extension_and_a_wrong_format_is_named(tmp_path):
    """An Azure CSV saved as .jsonl is read as Azure; forced to mooncake, the error says what
    the file looks like (it read as a bad JSON row, and skipping bad rows skipped them all)."""
    misnamed = tmp_path / "azure.jsonl"
    misnamed.write_bytes(AZURE.read_bytes())
    assert read_trace(misnamed).format == "azure"
    for skip in (False, True):
        with pytest.raises(TraceFormatError, match="looks like an Azure CSV trace: give --format azure"):
            read_trace(AZURE, "mooncake", skip_bad_rows=skip)


def test_read_trace_rejects_unknown(tmp_path):
    odd = tmp_path / "odd.txt"
    odd.write_text("hello world\n")
    with pytest.raises(TraceFormatError, match="odd.txt.*--format mooncake"):
        read_trace(odd)
    with pytest.raises(ValueError, match="unknown trace format 'sharegpt'"):
        read_trace(MOONCAKE, "sharegpt")


def test_arrivals_sorted_stably(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [(5000, 1), (1000, 2), (1000, 3)]
    path.write_text("".join(mooncake_line(timestamp=t, input_length=n, hash_ids=[n]) + "\n" for t, n in rows))
    reqs = read_mooncake(path).requests
    assert [(r.arrival_s, r.input_len, r.line) for r in reqs] == [(0.0, 2, 2), (0.0, 3, 3), (4.0, 1, 1)]


# --- content -----------------------------------------------------------------------------------


def test_shared_hash_ids_give_equal_tokens():
    a, b = read_mooncake(MOONCAKE).requests[:2]
    assert a.seg_ids[0] == b.seg_ids[0] and a.seg_ids[1] != b.seg_ids[1]
    ta, tb = tokens(a), tokens(b)
    assert len(ta) == a.input_len and ta.dtype == np.int32
    assert np.array_equal(ta[:MOONCAKE_BLOCK], tb[:MOONCAKE_BLOCK])
    assert not np.array_equal(ta[MOONCAKE_BLOCK : 2 * MOONCAKE_BLOCK], tb[MOONCAKE_BLOCK : 2 * MOONCAKE_BLOCK])
    assert not np.array_equal(tokens(a, seed=1)[:MOONCAKE_BLOCK], ta[:MOONCAKE_BLOCK])


def test_output_tokens_are_one_segment():
    out = output_tokens(7, 100, VOCAB, 3)
    assert np.array_equal(out, segment_tokens(np.array([7]), np.array([100]), vocab_size=VOCAB, seed=3))
    with pytest.raises(ValueError, match="unknown"):
        output_tokens(-1, 10, VOCAB, 0)


@settings(deadline=None)
@given(
    segs=st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 600)), min_size=1, max_size=8),
    cut=st.floats(0, 1),
    seed=st.integers(0, 2**64 - 1),
    vocab=st.integers(1, 2**31 - 1),
)
def test_segment_tokens_prefix_property(segs, cut, seed, vocab):
    ids = np.array([s for s, _ in segs])
    lens = np.array([n for _, n in segs])
    full = segment_tokens(ids, lens, vocab_size=vocab, seed=seed)
    assert len(full) == lens.sum() and ((full >= 0) & (full < vocab)).all()
    short = lens.copy()
    short[-1] = int(lens[-1] * cut)
    assert np.array_equal(segment_tokens(ids, short, vocab_size=vocab, seed=seed), full[: short.sum()])


# --- malformed input -------------------------------------------------------------------------


def mooncake_line(**override) -> str:
    row = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
    row.update(override)
    return json.dumps(row)


def write_mooncake(tmp_path, bad_line: str, at: int = 17) -> pathlib.Path:
    lines = [mooncake_line(timestamp=i) for i in range(20)]
    lines[at - 1] = bad_line
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        (mooncake_line(output_length=-3), "field 'output_length' must be an integer in \\[1, 2\\*\\*31 - 1\\].*got -3"),
        (mooncake_line(output_length=0), "field 'output_length'.*at least one token.*got 0"),
        (mooncake_line(input_length="many"), "field 'input_length' must be an integer in \\[1, 2\\*\\*31 - 1\\], got 'many'"),
        (mooncake_line(timestamp=True), "field 'timestamp' must be a number.*got True"),
        (mooncake_line(hash_ids=[1, -4]), "field 'hash_ids' must be .*got -4 at index 1"),
        (mooncake_line(hash_ids=[1]), "field 'hash_ids' must hold 2 ids .*input_length=600.*got 1"),
        (mooncake_line(hash_ids=[1, 2, 3]), "field 'hash_ids' must hold 2 ids .*got 3"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 5}', "missing field 'hash_ids'"),
        ('{"timestamp": 0, "input_length": 6', "not valid JSON"),
        ("[1, 2]", "row must be a JSON object .*got `array`"),
        # past int32: rejected here, where it used to overflow in the simulator
        (mooncake_line(output_length=2**31), "field 'output_length' must be an integer in \\[1, 2\\*\\*31 - 1\\].*got 2147483648"),
        ('{"timestamp": 1e400, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}',
         "field 'timestamp' must be a number"),  # its value past float range: still a row error
    ],
)
def test_mooncake_errors_name_file_line_field(tmp_path, bad, expected):
    path = write_mooncake(tmp_path, bad)
    with pytest.raises(TraceFormatError, match=rf"trace\.jsonl line 17: {expected}"):
        read_mooncake(path)
    load = read_mooncake(path, skip_bad_rows=True)
    assert (load.skipped, len(load.requests)) == (1, 19)
    assert 17 not in [r.line for r in load.requests]


def write_azure(tmp_path, text: str) -> pathlib.Path:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZURE_ROW = "2023-11-16 18:17:03.9799600,4808,10\n"


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ("2023-11-16 18:17:03.9799600,4808,0", "field 'GeneratedTokens' must be an integer in \\[1, 2\\*\\*31 - 1\\] .*got 0"),
        ("2023-11-16 18:17:03.9799600,-3,10", "field 'ContextTokens' must be an integer in \\[1, 2\\*\\*31 - 1\\], got -3"),
        ("2023-11-16 18:17:03.9799600,12.5,10", "field 'ContextTokens' .*got '12.5'"),
        ("2023-13-16 18:17:03.9799600,4808,10", "field 'TIMESTAMP' must be a date-time .*got '2023-13-16"),
        ("yesterday,4808,10", "field 'TIMESTAMP' .*got 'yesterday'"),
        ("2023-11-16 18:17:03.9799600,4808", "expected 3 comma-separated fields.*got 2"),
    ],
)
def test_azure_errors_name_file_line_field(tmp_path, bad, expected):
    path = write_azure(tmp_path, AZURE_HEADER + AZURE_ROW * 3 + bad + "\n" + AZURE_ROW)
    with pytest.raises(TraceFormatError, match=rf"trace\.csv line 5: {expected}"):
        read_azure(path)
    load = read_azure(path, skip_bad_rows=True)
    assert (load.skipped, len(load.requests)) == (1, 4)


def test_azure_header_problems(tmp_path):
    path = write_azure(tmp_path, "TIMESTAMP,ContextTokens,Output\n" + AZURE_ROW)
    with pytest.raises(TraceFormatError, match="trace.csv line 1: header is missing column 'GeneratedTokens'"):
        read_azure(path)
    with pytest.raises(TraceFormatError, match="empty file"):
        read_azure(write_azure(tmp_path, ""))
    with pytest.raises(TraceFormatError, match="no usable requests"):
        read_azure(write_azure(tmp_path, AZURE_HEADER))


def test_azure_accepts_reordered_columns_and_crlf(tmp_path):
    path = write_azure(tmp_path, "GeneratedTokens,TIMESTAMP,ContextTokens\r\n7,2023-11-16 18:17:04,30\r\n")
    (req,) = read_azure(path).requests
    assert (req.input_len, req.output_len) == (30, 7)


def test_all_rows_bad_is_an_error_even_when_skipping(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(mooncake_line(output_length=0) + "\n")
    with pytest.raises(TraceFormatError, match=r"no usable requests \(1 bad row skipped\)"):
        read_mooncake(path, skip_bad_rows=True)


# --- agentic workload ----------------------------------------------------------------------------


def test_agentic_is_deterministic():
    a = agentic_workload(seed=7)
    assert a == agentic_workload(seed=7)
    assert a != agentic_workload(seed=8)
    assert 100 <= len(a) <= 1000  # the `make run` default must stay small
    check_load(a, len(a))
    assert all(r.line == 0 and r.output_seg >= 0 for r in a)


def test_agentic_shares_the_system_prompt():
    reqs = agentic_workload(seed=1, num_conversations=8)
    assert len({r.conversation for r in reqs}) == 8
    assert len({int(r.seg_ids[0]) for r in reqs}) == 1
    system = {int(r.seg_lens[0]) for r in reqs}
    assert system == {2000}


def test_agentic_turn_extends_previous_prompt_and_output():
    reqs = agentic_workload(seed=3, num_conversations=6)
    by_conv: dict[int, list[TraceRequest]] = {}
    for r in reqs:
        by_conv.setdefault(r.conversation, []).append(r)
    turns = 0
    for conv in by_conv.values():
        for prev, cur in zip(conv, conv[1:]):
            expected = np.concatenate([tokens(prev), output_tokens(prev.output_seg, prev.output_len, VOCAB, 0)])
            assert np.array_equal(tokens(cur)[: len(expected)], expected)
            assert cur.input_len > len(expected) and cur.arrival_s > prev.arrival_s
            turns += 1
    assert turns > 0


def test_agentic_respects_max_context():
    reqs = agentic_workload(seed=5, max_context=6000)
    assert reqs and all(r.input_len + r.output_len <= 6000 for r in reqs)
    with pytest.raises(ValueError, match="max_context"):
        agentic_workload(seed=5, max_context=1000)


def test_mooncake_with_a_utf8_bom_reads(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (mooncake_line(timestamp=0) + "\n").encode())
    assert len(read_mooncake(path).requests) == 1


def test_azure_timestamps_with_a_utc_offset_read_as_utc(tmp_path):
    """The 2024 traces write '2024-05-10 00:00:00.009930+00:00'."""
    path = write_azure(tmp_path, AZURE_HEADER + "2024-05-10 00:00:00.009930+00:00,4808,10\n"
                       "2024-05-10 02:00:01.509930+02:00,100,10\n2024-05-10 00:00:02.009930Z,50,5\n")
    assert [r.arrival_s for r in read_azure(path).requests] == [0.0, 1.5, 2.0]
    with pytest.raises(TraceFormatError, match="a UTC offset such as '\\+00:00' may follow"):
        read_azure(write_azure(tmp_path, AZURE_HEADER + "2024-05-10 00:00:00+25:00,1,1\n"))


def test_gzip_traces_read_and_other_compressions_are_named(tmp_path):
    import gzip

    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(MOONCAKE.read_bytes()))
    assert read_trace(gz).requests == read_trace(MOONCAKE).requests
    odd = tmp_path / "t.gz"  # (no extension under it: the first line tells)
    odd.write_bytes(gzip.compress(AZURE.read_bytes()))
    assert read_trace(odd).format == "azure"
    zst = tmp_path / "t.jsonl.zst"
    zst.write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 16)
    with pytest.raises(TraceFormatError, match="t.jsonl.zst: zstd-compressed; decompress it first"):
        read_trace(zst)


def test_a_wrong_format_does_not_suggest_skipping_rows():
    with pytest.raises(TraceFormatError) as e:
        read_trace(AZURE, "mooncake")
    assert "--skip-bad-rows" not in str(e.value)


# --- walkthrough findings (session 27) -----------------------------------------------------------


def test_a_negative_timestamp_is_a_bad_row_and_rows_out_of_order_are_counted(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(mooncake_line(timestamp=t) + "\n" for t in (0, -1000)))
    with pytest.raises(TraceFormatError, match=r"line 2: field 'timestamp' must be a number >= 0 .*got -1000"):
        read_mooncake(path)
    path.write_text("".join(mooncake_line(timestamp=t) + "\n" for t in (0, 99_999, 10, 20, 100_000)))
    load = read_mooncake(path)
    assert load.out_of_order == 2 and [r.arrival_s for r in load.requests] == [0.0, 0.01, 0.02, 99.999, 100.0]
    assert read_mooncake(MOONCAKE).out_of_order == 0 and read_azure(AZURE).out_of_order == 0


def test_azure_quoted_fields_read_and_mixed_utc_offsets_are_refused(tmp_path):
    path = write_azure(tmp_path, '"TIMESTAMP","ContextTokens","GeneratedTokens"\n'
                       '"2023-11-16 18:17:04.1206440",7433,14\n"2023-11-16 18:17:05.1206440", "10" ,"3"\n')
    assert [(r.arrival_s, r.input_len, r.output_len) for r in read_azure(path).requests] == [(0.0, 7433, 14),
                                                                                             (1.0, 10, 3)]
    mixed = AZURE_HEADER + "2023-11-16 18:17:04,10,1\n2023-11-16 18:17:05+05:00,10,1\n"
    with pytest.raises(TraceFormatError, match="line 3: field 'TIMESTAMP' has a UTC offset, unlike the rows above"):
        read_azure(write_azure(tmp_path, mixed))
    assert len(read_azure(write_azure(tmp_path, mixed), skip_bad_rows=True).requests) == 1


def test_a_csv_that_is_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_bytes(AZURE_HEADER.encode() + b"2023-11-16 18:17:04,10,1\n2023-11-16 18:17:05,1\xff0,1\n")
    with pytest.raises(TraceFormatError, match="bad.csv line 3: not UTF-8 text"):
        read_azure(path)


def test_a_trace_from_a_pipe_is_read_once_with_its_format_detected(tmp_path):
    """`--trace /dev/stdin`: detecting the format must not use up the stream."""
    import os
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    text = MOONCAKE.read_bytes()
    writer = threading.Thread(target=lambda: fifo.write_bytes(text))
    writer.start()
    try:
        load = read_trace(fifo)
    finally:
        writer.join()
    assert load.format == "mooncake" and len(load.requests) == len(read_mooncake(MOONCAKE).requests)
