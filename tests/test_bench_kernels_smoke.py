"""benchmarks/gpu/bench_kernels.py end to end at its smoke shapes (CPU, Triton's interpreter):
every section runs, checks against its reference and reports, and the JSON line parses. The GPU
run is the real one; this keeps the script and its sections (benchmarks/gpu/kbench) runnable
between GPU sessions."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_kernels_smoke_runs_every_section():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu/bench_kernels.py"), "--smoke", "--json"],
                         capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    sections = {r["section"] for r in report["rows"]}
    assert {"copy", "fused_moe", "topk", "router", "mla_decode", "dense", "kv_store", "sampling"} <= sections, sections
    assert not report["headline"].get("errors"), report["headline"]["errors"]
    assert all("FAIL" not in str(r.get("check", "")) for r in report["rows"])
