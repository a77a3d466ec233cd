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


@pytest.mark.parametrize("script, args, says", [
    ("bench_sim.py", ["--trace", "/nonexistent.csv"], "--trace /nonexistent.csv: no such file"),
    ("bench_eplb.py", ["--settings", "16x300"], "16x300: need slots % ranks == 0"),
    ("bench_eplb.py", ["--seed", "-1"], "--seed: must be an integer >= 0"),
    ("bench_allreduce.py", ["--ranks", "1"], "--ranks: must be an integer >= 2"),
    ("bench_spec.py", ["--concurrency", "0"], "--concurrency must be integers >= 1"),
    ("bench_spec.py", ["--rates", "1.5,0.5,0.5"], "rates must be probabilities in [0, 1]"),
    ("bench_kv_transfer.py", ["--repeat", "0"], "--repeat: must be an integer >= 1"),
])
def test_bad_arguments_are_one_error_line_before_any_run(script, args, says):
    """(Each was a traceback from inside the run, or a NaN in the JSON line.)"""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and says in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
