"""Probe for the open start-up hang: engines started one after another in one process.

Twice on two H200s (session 5) the third or fourth engine one process started hung in its
runtimes' first ``torch.compile`` call, inside Python imports of torch._dynamo modules. This
starts --engines engines in turn in one process (DEP1 and DEP2 alternating, the fast path
with torch.compile on, the tiny preset in bf16), each serving a few greedy requests, and
prints each one's start and serve time. A watchdog thread: when one engine takes longer than
--stall seconds, it dumps every Python stack of this process and of its children (all
threads, with ``py-spy dump`` where it is installed, else the start-up tracebacks only) and
exits with status 3.

    python3 benchmarks/gpu/experiments/engine_restarts.py --engines 6
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import shutil
import subprocess
import sys
import threading
import time

for var, val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[var] = val

import numpy as np  # noqa: E402
import trio  # noqa: E402


def children(pid: int) -> list[int]:
    out = []
    try:
        kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    except OSError:
        return out
    for k in kids:
        out.append(int(k))
        out += children(int(k))
    return out


def dump_all() -> None:
    print("=== stall: stacks of this process and its children", flush=True)
    faulthandler.dump_traceback(all_threads=True)
    spy = shutil.which("py-spy") or next((p for p in ("/tmp/site/bin/py-spy",) if os.path.exists(p)), None)
    for pid in [os.getpid()] + children(os.getpid()):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")[:200].decode(errors="replace")
        except OSError:
            cmd = "?"
        print(f"--- pid {pid}: {cmd}", flush=True)
        if spy:
            r = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
            print(r.stdout[-6000:], r.stderr[-2000:], flush=True)


class Watchdog:
    def __init__(self, stall: float):
        self.stall, self.since, self.label = stall, time.monotonic(), ""
        threading.Thread(target=self._watch, daemon=True).start()

    def arm(self, label: str) -> None:
        self.since, self.label = time.monotonic(), label

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            if time.monotonic() - self.since > self.stall:
                print(f"=== {self.label}: no progress for {self.stall:.0f} s", flush=True)
                dump_all()
                os._exit(3)


async def one_engine(i: int, dep: int, dog: Watchdog, device: str) -> None:
    from lockstep.api import open_engine
    from lockstep.engine.config import EngineConfig
    from lockstep.policy.request import SamplingParams

    opts = {"compile": device == "cuda", "fast": True, "cuda_graphs": "on" if device == "cuda" else "padded",
            "preset_overrides": {"initializer_range": 0.15}}
    cfg = EngineConfig(model="tiny", device=device, dtype="bfloat16", dep=dep, tokenizer=None, runtime_options=opts)
    rng = np.random.default_rng(i)
    prompts = [rng.integers(3, 500, int(n)).astype(np.int32) for n in rng.integers(4, 200, 8)]
    dog.arm(f"engine {i} (DEP{dep}) start")
    t0 = time.perf_counter()
    async with open_engine(cfg) as engine:
        t1 = time.perf_counter()
        dog.arm(f"engine {i} (DEP{dep}) serve")
        async with trio.open_nursery() as n:
            for p in prompts:
                n.start_soon(engine.complete, p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        t2 = time.perf_counter()
        dog.arm(f"engine {i} (DEP{dep}) close")
    print(f"engine {i}: DEP{dep} started in {t1 - t0:.1f} s, served in {t2 - t1:.1f} s, closed in "
          f"{time.perf_counter() - t2:.1f} s", flush=True)


async def main_async(args) -> None:
    dog = Watchdog(args.stall)
    for i in range(args.engines):
        dep = 1 if i % 2 == 0 or args.gpus < 2 else 2
        await one_engine(i, dep, dog, args.device)
    dog.arm("done")
    print(f"all {args.engines} engines started, served and closed", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=6)
    ap.add_argument("--stall", type=float, default=120.0, help="seconds one engine may take before the dump")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (no compile, no graphs)")
    args = ap.parse_args()
    trio.run(main_async, args)
    sys.exit(0)


if __name__ == "__main__":
    main()
