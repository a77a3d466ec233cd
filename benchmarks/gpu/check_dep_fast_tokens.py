"""Greedy tokens of the fast path (bf16, Triton kernels) with DEP2 against DEP1, one engine
per process (run it once per setting; each writes a JSON file), then a comparison.

DEP2's decode steps replay CUDA graphs whose all-to-alls are captured NCCL collectives
(padded expert dispatch); a capture that replayed wrong buffers would still run at full
speed, so the throughput runs cannot tell. Tokens can: DEP2 must pick the tokens DEP1 picks,
except at near-ties (bf16: the pairs' sums run in another order).

    python3 check_dep_fast_tokens.py run --dep 1 --out a.json
    python3 check_dep_fast_tokens.py run --dep 2 --dispatch padded --out b.json
    python3 check_dep_fast_tokens.py run --dep 2 --dispatch padded --exchange nccl --out c.json
    python3 check_dep_fast_tokens.py compare a.json b.json c.json

Padded dispatch through the peers' memory (``--exchange peer``, the GPU default) must give
exactly the tokens of the same dispatch through NCCL: the same rows reach the same experts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import trio

for var, val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[var] = val


async def run(dep: int, dispatch: str | None, graphs: bool, device: str = "cuda", exchange: str | None = None) -> dict:
    from lockstep.api import open_engine
    from lockstep.engine.config import EngineConfig
    from lockstep.policy.request import SamplingParams

    cuda_graphs = ("on" if device == "cuda" else "padded") if graphs else "off"  # CPU: the graph path, no graphs
    if dispatch == "exact" and dep > 1 and cuda_graphs == "on":
        cuda_graphs = "off"  # exact dispatch syncs the host in every MoE layer: no capture (refused)
    opts = {"compile": False, "fast": True, "preset_overrides": {"initializer_range": 0.15}, "cuda_graphs": cuda_graphs}
    if dispatch:
        opts["ep_dispatch"] = dispatch
    if exchange:
        opts["ep_exchange"] = exchange
    cfg = EngineConfig(model="tiny", device=device, dtype="bfloat16", dep=dep, tokenizer=None, runtime_options=opts)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, int(n)).astype(np.int32) for n in rng.integers(4, 200, 16)]
    out = [None] * len(prompts)
    async with open_engine(cfg) as engine:
        async def one(i):
            c = await engine.complete(prompts[i], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
            out[i] = c.token_ids.tolist()
        async with trio.open_nursery() as n:
            for i in range(len(prompts)):
                n.start_soon(one, i)
    return {"dep": dep, "dispatch": dispatch, "graphs": graphs, "exchange": exchange, "tokens": out}


def compare(a: dict, b: dict) -> dict:
    """Tokens equal position by position up to each sequence's first difference (after it
    the two continue from different text), and how many sequences match whole."""
    same = total = whole = 0
    for x, y in zip(a["tokens"], b["tokens"]):
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
        same += k
        total += len(x)
        whole += k == len(x)
    keys = ("dep", "dispatch", "graphs", "exchange")
    return {"a": {k: a.get(k) for k in keys}, "b": {k: b.get(k) for k in keys},
            "tokens_before_first_difference": same, "tokens": total, "sequences_equal": whole,
            "sequences": len(a["tokens"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--dep", type=int, default=1)
    r.add_argument("--dispatch", default=None)
    r.add_argument("--no-graphs", action="store_true")
    r.add_argument("--exchange", default=None, choices=("nccl", "peer", "direct"), help="runtime option ep_exchange")
    r.add_argument("--out", required=True)
    r.add_argument("--device", default="cuda", help="cpu: checks the script (kernels under TRITON_INTERPRET=1)")
    c = sub.add_parser("compare")
    c.add_argument("files", nargs="+")
    args = ap.parse_args()
    if args.cmd == "run":
        got = trio.run(run, args.dep, args.dispatch, not args.no_graphs, args.device, args.exchange)
        with open(args.out, "w") as f:
            json.dump(got, f)
        print("wrote", args.out, flush=True)
        return
    runs = [json.load(open(p)) for p in args.files]
    for other in runs[1:]:
        print(json.dumps(compare(runs[0], other)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
