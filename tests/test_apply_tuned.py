"""benchmarks/gpu/apply_tuned.py: a tuning run's printed winners go into the kernel tables."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
from apply_tuned import rewrite, tuned  # noqa: E402

MODULE = '''"""A kernel module."""

DECODE_CONFIGS: dict[tuple, dict] = {
    ('bf16', 1): {'BLOCK_N': 32},
    ('bf16', 8): {'BLOCK_N': 64},
}


def decode_config():
    return DECODE_CONFIGS
'''

RUN = """  tuned mla_decode.DECODE_CONFIGS[('bf16', 8)]: best {'BLOCK_N': 16} at 9.0 us (of 3: 9, 10, 11)
  tuned mla_decode.DECODE_CONFIGS[('fp8', 8)]: best {'BLOCK_N': 64} at 9.0 us (of 1: 9)
  tuned topk.TOPK_CONFIGS[64] (n=65536): best {'TILE': 512} at 9.0 us (of 1: 9)
# tuned configs (paste into the kernel modules):
#   mla_decode.DECODE_CONFIGS[('bf16', 8)] = {'BLOCK_N': 16}
#   mla_decode.DECODE_CONFIGS[('bf16', 256, 1024)] = {'BLOCK_N': 32, 'WAVES': 2}
#   mla_decode.DECODE_CONFIGS[('fp8', 1)] = {'BLOCK_N': 64, 'error': "OutOfResources('shared memory')"}
#   topk.TOPK_CONFIGS[64] (n=32768) = {'TILE': 4096}
#   topk.TOPK_CONFIGS[64] (n=131072) = {'TILE': 1024}
#   topk.TOPK_CONFIGS[(1, 131072)] = {'TILE': 2048}
#   mla_decode.DECODE_CONFIGS[('fp8', 8)] = {'BLOCK_N': 64}
#   topk.TOPK_CONFIGS[64] (n=65536) = {'TILE': 512}
"""


def test_tuned_reads_the_winners_skips_failures_and_lone_timings_and_keys_topk_by_row_length():
    found = tuned(RUN.splitlines())
    assert found == {("mla_decode", "DECODE_CONFIGS"): {("bf16", 8): {"BLOCK_N": 16},
                                                        ("bf16", 256, 1024): {"BLOCK_N": 32, "WAVES": 2}},
                     ("topk", "TOPK_CONFIGS"): {(64, 32768): {"TILE": 4096}, (64, 131072): {"TILE": 1024},
                                                (1, 131072): {"TILE": 2048}}}


def test_a_config_timed_alone_in_one_run_and_tuned_in_the_next_is_applied():
    first = """  tuned topk.TOPK_CONFIGS[(64, 32768)]: best {'TILE': 1} at 9.0 us (of 1: 9)
#   topk.TOPK_CONFIGS[(64, 32768)] = {'TILE': 1}
"""
    second = """  tuned topk.TOPK_CONFIGS[(64, 32768)]: best {'TILE': 2} at 8.0 us (of 2: 9, 8)
#   topk.TOPK_CONFIGS[(64, 32768)] = {'TILE': 2}
"""
    assert tuned((first + second).splitlines()) == {("topk", "TOPK_CONFIGS"): {(64, 32768): {"TILE": 2}}}
    assert tuned((second + first).splitlines()) == {("topk", "TOPK_CONFIGS"): {(64, 32768): {"TILE": 2}}}


def test_rewrite_sets_keys_keeps_the_others_and_the_rest_of_the_module(tmp_path):
    path = tmp_path / "mla_decode.py"
    path.write_text(MODULE)
    updates = tuned(RUN.splitlines())[("mla_decode", "DECODE_CONFIGS")]
    assert rewrite(path, "DECODE_CONFIGS", updates, dry_run=True) and path.read_text() == MODULE
    changes = rewrite(path, "DECODE_CONFIGS", updates, dry_run=False)
    assert len(changes) == 2
    namespace: dict = {}
    exec(path.read_text(), namespace)
    assert namespace["DECODE_CONFIGS"] == {("bf16", 1): {"BLOCK_N": 32}, ("bf16", 8): {"BLOCK_N": 16},
                                           ("bf16", 256, 1024): {"BLOCK_N": 32, "WAVES": 2}}
    assert namespace["decode_config"]() is namespace["DECODE_CONFIGS"]
    assert rewrite(path, "DECODE_CONFIGS", updates, dry_run=False) == []  # nothing left to change


def test_rewrite_names_a_table_it_cannot_find(tmp_path):
    path = tmp_path / "other.py"
    path.write_text("X = 1\n")
    with pytest.raises(SystemExit, match="no dict literal `DECODE_CONFIGS = {`"):
        rewrite(path, "DECODE_CONFIGS", {}, dry_run=False)
