"""Experiment (session 19): bench_sim's floor. The Azure code trace's first 3,000 requests,
each arriving 100 s after the last so that every one runs alone, on the one-GPU example:
CPU time per request (simulator built, then run), and per call of the core and of the
simulator's own steps (wall time of each, wrapped; nested calls count in their callers too).

Session 19 (this VM): 32 µs a request to build, 227 to run (3,860 requests per CPU-second
together), against the 133 µs a request that bench_sim's 7,500 target allows. The core's
calls for one lone request (two schedules, an update, a decode_run and an advance, 6 µs to
add it) take about 150 µs of that.

Run from the repository root: python3 benchmarks/experiments/sim_alone.py
"""
from __future__ import annotations

import collections
import time
from pathlib import Path

import attrs

from lockstep.policy.core import SchedulerCore
from lockstep.policy.deployment_file import load_deployment
from lockstep.sim.simulator import Simulator
from lockstep.sim.traces import read_trace

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT.parent / "shared/traces/azure2023/AzureLLMInferenceTrace_code.csv"
CORE = ("add_request", "schedule", "update", "decode_run", "advance")
SIM = ("_admit", "_step_end", "_try_advance", "_dispatch", "_apply", "_step_time", "_decode_ends")


def main() -> None:
    workload = [attrs.evolve(r, arrival_s=i * 100.0) for i, r in enumerate(read_trace(TRACE).requests[:3000])]
    dep = load_deployment(ROOT / "examples/h200-v2lite.toml")
    n = len(workload)
    t0 = time.process_time()
    sim = Simulator(dep, workload)
    t1 = time.process_time()
    sim.run()
    t2 = time.process_time()
    print(f"{n} requests, each alone: build {(t1 - t0) / n * 1e6:.0f} us, run {(t2 - t1) / n * 1e6:.0f} us a request "
          f"({n / (t2 - t0):,.0f} requests per CPU-second)")
    spent, calls = collections.Counter(), collections.Counter()

    def wrap(cls, name):
        f = getattr(cls, name)
        label = f"{cls.__name__}.{name}"

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t
                calls[label] += 1
        setattr(cls, name, timed)

    for name in CORE:
        wrap(SchedulerCore, name)
    for name in SIM:
        wrap(Simulator, name)
    Simulator(dep, workload).run()
    print("call | us a request | calls a request | us a call")
    for label, s in spent.most_common():
        print(f"{label} | {s / n * 1e6:.1f} | {calls[label] / n:.2f} | {s / calls[label] * 1e6:.1f}")


if __name__ == "__main__":
    main()
