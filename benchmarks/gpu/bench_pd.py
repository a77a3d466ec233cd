"""P/D between two GPUs of one host: KV pulled over NIXL (UCX, VRAM to VRAM), then the whole
engine with a prefill GPU and a decode GPU against a colocated engine on the same two GPUs.

1. Transfer. A spawned prefill process holds a KV pool on GPU 0 (v2-lite's MLA cache in bf16:
   27 layers x (512 + 64) x 2 B = 31,104 B a token, 16-token blocks, one block one span),
   registered with NIXL as VRAM; this process pulls whole requests (1K-8K tokens, each one
   run of blocks, as P/D allocates them) into its pool on GPU 1, all in flight at once.
   Same run, same runs of blocks: torch's peer copy GPU 0 -> GPU 1 (copy_ per run), and one
   copy of the same number of bytes in a single call (the link's ceiling). The pulled bytes
   are checked against the prefill side's pattern.
2. Greedy tokens of the tiny model (fp32) through a P/D engine (prefill on GPU 0, decode on
   GPU 1, KV over NIXL) equal those of a colocated engine on one GPU.
3. A Mooncake conversation-trace slice (tests/data, first requests of at most --max-input
   tokens, outputs capped at --max-output, replayed at --speed times their arrival times)
   through the v2-lite shape (bf16, random weights, all 27 layers): P/D (1 prefill + 1
   decode GPU) against colocated serving (2 instances, one a GPU); TTFT and TPOT.

Runs on `nvidia-h200-x2`; NVLink multicast stays off. --json prints the JSON object last.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np

for var, val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"),
                 ("NIXL_LOG_LEVEL", "WARN")):
    os.environ.setdefault(var, val)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import emit  # noqa: E402

PUBLISHED = (141_000, 440_000)  # tokens/s per GPU, rack-scale P/D (before, after)
BS = 16
BPT = 27 * 576 * 2  # v2-lite's MLA cache, bf16, B/token


# -- 1. transfer --------------------------------------------------------------------------------

def gpu_pattern(torch, blocks, block_bytes: int, device):
    """Bytes that differ between blocks and within one: ((b * 2654435761 + i * 40503) >> 7) & 255."""
    b = torch.as_tensor(blocks, dtype=torch.int64, device=device)[:, None]
    i = torch.arange(block_bytes, dtype=torch.int64, device=device)[None, :]
    return (((b * 2654435761 + i * 40503) >> 7) & 255).to(torch.uint8)


def _prefill(sock: socket.socket, num_blocks: int, block_bytes: int) -> None:
    import select

    import torch

    from lockstep.transports.kv.base import send_peer_info
    from lockstep.transports.kv.nixl_transport import NixlKVTransport

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    pool = torch.empty((num_blocks, block_bytes), dtype=torch.uint8, device=dev)
    for b0 in range(0, num_blocks, 64):
        b = list(range(b0, min(num_blocks, b0 + 64)))
        pool[b0 : b0 + len(b)] = gpu_pattern(torch, b, block_bytes, dev)
    torch.cuda.synchronize()
    t = NixlKVTransport("prefill-gpu0")
    t.register_pool(pool)
    send_peer_info(sock, t.export())
    try:
        while not select.select([sock], [], [], 0)[0]:
            t.poll()
        sock.recv(1)
    finally:
        t.close()
        sock.close()


def transfer(args) -> dict:
    import torch

    from lockstep.transports.kv.base import recv_peer_info
    from lockstep.transports.kv.nixl_transport import NixlKVTransport

    block_bytes = BS * BPT
    num_blocks = (args.pool_gib << 30) // block_bytes
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = mp.get_context("spawn").Process(target=_prefill, args=(theirs, num_blocks, block_bytes), daemon=True)
    proc.start()
    theirs.close()
    dev = torch.device("cuda", 1)
    torch.cuda.set_device(dev)
    pool = torch.zeros((num_blocks, block_bytes), dtype=torch.uint8, device=dev)
    src = torch.empty((num_blocks, block_bytes), dtype=torch.uint8, device="cuda:0")  # the peer-copy baseline's
    t = NixlKVTransport("decode-gpu1")
    t.register_pool(pool)
    try:
        peer = t.connect(recv_peer_info(ours))
        rng = np.random.default_rng(args.seed)
        # A wave: requests of 1K-8K tokens, one run each, filling about wave_gib on both sides.
        lens, total = [], 0
        while total < (args.wave_gib << 30) // BPT:
            lens.append(int(rng.integers(1024, 8193)))
            total += lens[-1]
        nblk = [-(-n // BS) for n in lens]
        starts = np.concatenate([[0], np.cumsum(nblk)[:-1]]).astype(np.int64)
        assert starts[-1] + nblk[-1] <= num_blocks, "wave larger than the pool"
        remote = [np.arange(s, s + n) for s, n in zip(num_blocks - 1 - starts - np.array(nblk) + 1, nblk)]
        local = [np.arange(s, s + n) for s, n in zip(starts, nblk)]
        wave_bytes = sum(nblk) * block_bytes
        rid = iter(range(1 << 30))

        def nixl_wave() -> float:
            ids = []
            t0 = time.perf_counter()
            for r, l in zip(remote, local):
                ids.append(next(rid))
                t.pull(ids[-1], peer, r, l)
            left = len(ids)
            while left:
                done, failed = t.poll()
                if failed:
                    raise RuntimeError(f"NIXL pulls {failed} failed")
                left -= len(done)
            torch.cuda.synchronize(dev)
            return time.perf_counter() - t0

        def peer_copy_wave() -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for r, l in zip(remote, local):
                pool[int(l[0]) : int(l[-1]) + 1].copy_(src[int(r[0]) : int(r[-1]) + 1], non_blocking=True)
            torch.cuda.synchronize(dev)
            torch.cuda.synchronize(torch.device("cuda", 0))
            return time.perf_counter() - t0

        flat_src, flat_dst = src.view(-1)[:wave_bytes], pool.view(-1)[:wave_bytes]

        def one_copy() -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            flat_dst.copy_(flat_src, non_blocking=True)
            torch.cuda.synchronize(dev)
            torch.cuda.synchronize(torch.device("cuda", 0))
            return time.perf_counter() - t0

        modes = {"nixl": nixl_wave, "peer copy per run": peer_copy_wave, "one peer copy": one_copy}
        for f in modes.values():  # warm up: connections, UCX's IPC handle cache, the copy engines
            f()
            f()
        times = {m: [] for m in modes}
        for _ in range(args.repeat):  # interleaved, so drifting load hits all alike
            for m, f in modes.items():
                times[m].append(f())
        # The bytes landed where they should (the waves overwrote the pool; one more pull).
        sample = rng.choice(len(remote), size=min(8, len(remote)), replace=False)
        for k in sample:
            t.pull(next(rid), peer, remote[k], local[k])
        left = len(sample)
        while left:
            done, failed = t.poll()
            assert not failed, failed
            left -= len(done)
        torch.cuda.synchronize(dev)
        ok = all(torch.equal(pool[torch.as_tensor(local[k], device=dev)],
                             gpu_pattern(torch, remote[k], block_bytes, dev)) for k in sample)
        # Host time of one pull of a one-block request (pull + polls until done).
        one = []
        for i in range(200):
            r = next(rid)
            t0 = time.perf_counter()
            t.pull(r, peer, [i], [i])
            while not t.poll()[0]:
                pass
            one.append(time.perf_counter() - t0)
    finally:
        t.close()
        ours.send(b"x")
        ours.close()
        proc.join(30)
    med = {m: float(np.median(v)) for m, v in times.items()}
    tokens = sum(lens)
    row = {"requests": len(lens), "tokens": tokens, "bytes": wave_bytes, "block_tokens": BS,
           "bytes_per_token": BPT, "verified": ok, "one_block_pull_us": 1e6 * float(np.median(one[20:]))}
    for m, s in med.items():
        row[f"{m} tokens_per_s"] = tokens / s
        row[f"{m} GB_per_s"] = wave_bytes / s / 1e9
    row["nixl vs one peer copy"] = med["one peer copy"] / med["nixl"]
    row["nixl vs peer copy per run"] = med["peer copy per run"] / med["nixl"]
    return row


# -- 2. greedy tokens ---------------------------------------------------------------------------

async def greedy(prefill_instances: int) -> list[list[int]]:
    import trio

    from lockstep.api import open_engine
    from lockstep.engine.config import EngineConfig
    from lockstep.policy.request import SamplingParams

    cfg = EngineConfig(model="tiny", device="cuda", dtype="float32", tokenizer=None,
                       prefill_instances=prefill_instances, kv_transport="nixl")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, n).astype(np.int32) for n in (5, 40, 130, 17, 64, 90)]
    out = [None] * len(prompts)
    async with open_engine(cfg) as engine:
        async def one(i):
            c = await engine.complete(prompts[i], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
            out[i] = c.token_ids.tolist()
        async with trio.open_nursery() as n:
            for i in range(len(prompts)):
                n.start_soon(one, i)
    return out


# -- 3. the engine on a trace slice --------------------------------------------------------------

def trace_slice(args):
    from lockstep.sim.traces import read_mooncake, segment_tokens

    load = read_mooncake(ROOT / "tests" / "data" / "mooncake_conversation_300.jsonl")
    reqs = [r for r in load.requests if r.input_len <= args.max_input][: args.requests]
    out = []
    for r in reqs:
        toks = segment_tokens(r.seg_ids, r.seg_lens, vocab_size=args.vocab, seed=0)
        out.append((r.arrival_s / args.speed, toks, min(r.output_len, args.max_output)))
    return out


async def serve_slice(mode: str, reqs, args) -> dict:
    import trio

    from lockstep.api import open_engine
    from lockstep.engine.config import EngineConfig
    from lockstep.policy.config import SchedulerConfig
    from lockstep.policy.request import SamplingParams

    sched = SchedulerConfig(num_blocks=args.kv_blocks, block_size=BS, max_num_seqs=args.max_seqs,
                            max_num_batched_tokens=args.chunk, max_model_len=args.max_input + args.max_output + BS)
    cpu = args.device == "cpu"  # a smoke test of the script on a machine without GPUs
    opts = {"init_on_device": not cpu, "capture_len": args.capture_len}
    pd = dict(prefill_instances=1, instances=1, kv_transport="nixl") if mode == "pd" else dict(instances=2)
    cfg = EngineConfig(model=args.model, device=args.device, dtype="float32" if cpu else "bfloat16", tokenizer=None,
                       scheduler=sched, runtime_options=opts, **pd)
    ttft, tpot, e2e, out_tokens = [], [], [], 0
    t_start = time.perf_counter()
    async with open_engine(cfg) as engine:
        started = time.perf_counter() - t_start
        if args.router_slack is not None:  # the prefix-affinity router's slack, in tokens
            engine.frontend.router.slack_tokens = args.router_slack
        steps = []  # (rank, tokens, requests, GPU seconds) of every step after the warm-up
        for rank, sch in enumerate(engine.schedulers):
            sch.on_result = lambda p, r, rank=rank: steps.append((rank, p.num_tokens, p.num_reqs, r.gpu_s))
        # warm up both GPUs' kernels and graphs at the sizes the run uses
        async with trio.open_nursery() as n:
            for k in range(4):
                n.start_soon(engine.complete, np.arange(3, 3 + min(700 * (k + 1), args.max_input),
                                                        dtype=np.int32) % args.vocab,
                             SamplingParams(max_tokens=8, ignore_eos=True))
        t0 = time.perf_counter()
        steps.clear()

        async def one(at: float, toks: np.ndarray, max_tokens: int):
            nonlocal out_tokens
            await trio.sleep_until(t_trio0 + at)
            last = None
            async for o in engine.generate(toks, SamplingParams(max_tokens=max_tokens, ignore_eos=True)):
                last = o
            ttft.append(last.ttft_s)
            e2e.append(last.e2e_s)
            out_tokens += last.num_output_tokens
            if last.num_output_tokens > 1:
                tpot.append((last.e2e_s - last.ttft_s) / (last.num_output_tokens - 1))
        t_trio0 = trio.current_time()
        async with trio.open_nursery() as n:
            for at, toks, m in reqs:
                n.start_soon(one, at, toks, m)
        wall = time.perf_counter() - t0
        stats = engine.statistics()
    q = lambda v, p: 1e3 * float(np.percentile(v, p))  # noqa: E731
    st = np.array(steps, dtype=np.float64).reshape(-1, 4)
    big = st[st[:, 1] > 1024]
    return {"mode": "P/D: 1 prefill + 1 decode GPU, NIXL" if mode == "pd" else "colocated: 2 instances, 1 GPU each",
            "router_slack_tokens": args.router_slack if mode != "pd" else None,
            "requests": len(reqs), "prompt_tokens": int(sum(len(t) for _, t, _ in reqs)), "output_tokens": out_tokens,
            "ttft_ms_p50": q(ttft, 50), "ttft_ms_p90": q(ttft, 90), "tpot_ms_p50": q(tpot, 50),
            "tpot_ms_p90": q(tpot, 90), "e2e_s_p50": float(np.median(e2e)), "wall_s": wall,
            "output_tokens_per_s": out_tokens / wall, "startup_s": started,
            "steps": len(st), "gpu_busy_s_per_rank": [float(st[st[:, 0] == r, 3].sum()) for r in range(int(st[:, 0].max()) + 1)] if len(st) else [],
            "step_gpu_ms_max": 1e3 * float(st[:, 3].max()) if len(st) else float("nan"),
            "step_gpu_ms_p50_over_1k_tokens": 1e3 * float(np.median(big[:, 3])) if len(big) else float("nan"),
            "kv_pulls": getattr(stats, "kv_pulls", None), "kv_pull_failures": getattr(stats, "kv_pull_failures", None)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--pool-gib", type=int, default=8, help="each side's KV pool (transfer part)")
    ap.add_argument("--wave-gib", type=int, default=4, help="bytes pulled per wave, roughly")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", default="transfer,greedy,trace")
    ap.add_argument("--requests", type=int, default=48, help="trace requests replayed")
    ap.add_argument("--max-input", type=int, default=16384)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--speed", type=float, default=1.0, help="arrival times divided by this")
    ap.add_argument("--kv-blocks", type=int, default=40_000, help="per runtime (16 tokens, 497,664 B each)")
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--capture-len", type=int, default=0,
                    help="decode graphs captured at load for contexts up to this (0: each when first used)")
    ap.add_argument("--router-slack", type=int, default=None,
                    help="colocated: the router's slack in tokens (default 32768; 0 balances by load first)")
    ap.add_argument("--modes", default="colocated,pd", help="trace runs, in this order (the first pays JIT warm-up)")
    ap.add_argument("--model", default="v2-lite", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=102_400, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    return ap


def main() -> None:
    args = build_parser().parse_args()
    parts = set(args.parts.split(","))
    rows, info = [], {}
    xfer = None
    if "transfer" in parts:
        xfer = transfer(args)
        print("transfer:", xfer, flush=True)
        rows.append({"part": "transfer", **xfer})
    if "greedy" in parts:
        import trio

        one, pd = trio.run(greedy, 0), trio.run(greedy, 1)
        info["greedy_pd_equals_colocated"] = one == pd
        print("greedy P/D == colocated:", one == pd, flush=True)
    if "trace" in parts:
        import trio

        reqs = trace_slice(args)
        for mode in args.modes.split(","):
            r = trio.run(serve_slice, mode, reqs, args)
            print(r, flush=True)
            rows.append({"part": "trace", **r})
    value = xfer["nixl tokens_per_s"] if xfer else float("nan")
    ceiling = xfer["one peer copy tokens_per_s"] if xfer else float("nan")
    emit("bench_pd_h200", rows, {
        "metric": "KV tokens/s pulled GPU 0 -> GPU 1 over NIXL (UCX cuda_ipc, VRAM to VRAM), v2-lite bf16 "
                  "31,104 B/token, 16-token blocks, 1K-8K-token requests all in flight",
        "unit": "tokens/s", "value": value,
        "baseline": {"name": "one torch peer copy of the same bytes, GPU 0 -> GPU 1, same run", "value": ceiling},
        "ratio": value / ceiling if xfer else float("nan"),
        "published_per_gpu": PUBLISHED,
        "target": "the transfer against the copy bandwidth between the GPUs; TTFT and TPOT against colocated "
                  "(a comparison: the issue gives no figure; the verdict is the checks: bytes verified, greedy equal)",
        # no threshold to judge: the checks that ran (None where neither did)
        "meets_target": (None if not xfer and "greedy_pd_equals_colocated" not in info else
                         bool((not xfer or xfer["verified"]) and info.get("greedy_pd_equals_colocated", True))),
        **info,
    }, args.json)


if __name__ == "__main__":
    main()
