"""The CPU benchmark scripts stay runnable between the sessions that measure with them: each
one starts and prints its help (a change elsewhere once broke one at import, and `make bench`
with it), and the cost-model one, which takes no time, runs whole to its JSON line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py"))


def test_make_bench_names_every_script():
    make = (ROOT / "Makefile").read_text()
    assert SCRIPTS and all(f"benchmarks/{s}" in make for s in SCRIPTS), SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_starts(script):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0 and "usage:" in run.stdout, run.stderr[-2000:]


def test_the_cost_model_benchmark_runs_to_its_json_line():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_dep_host.py"), "--json"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    line = json.loads(run.stdout.strip().splitlines()[-1])
    assert line["bench"] == "bench_dep_host" and line["headline"]["meets_target"] is True
