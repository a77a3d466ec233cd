"""DEP on several GPUs of one host: experts sharded over the ranks, NCCL all-to-all.

1. Greedy tokens of the tiny model (fp32) with DEP2 equal one GPU's (DEP1).
2. The v2-lite shape (bf16, random weights, `--layers` of its 27 layers) through the whole
   engine: output tokens/s per GPU with DEP1 on one GPU and DEP2 on two, at `--per-rank`
   concurrent requests per rank, and the time each step spends in the ranks' per-step sync.
3. ``sweep`` (what bench_multi_gpu.py runs): one engine per process and DEP size, decoding
   at each of several loads per rank in turn (64, 128, 256): the decode step (the runtime's,
   rank 0, steps at the load's full batch), tokens/s per GPU, the per-step sync, and the
   step's memory roofline for one rank (its non-expert weights, the routed experts its
   tokens' pairs touch on it, its KV). The all-to-all runs inside the step's CUDA graph, so
   ``alltoall`` times the collective alone on the padded dispatch's own buffers (two
   exchanges per MoE layer: rows out with their slots, as bytes; rows back), as NCCL runs it
   between the ranks' processes.

Runs on a machine with >= 2 GPUs (`nvidia-h200-x2`); NVLink multicast stays off.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import trio

for var, val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[var] = val

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import emit  # noqa: E402

from lockstep.api import open_engine  # noqa: E402
from lockstep.engine.config import EngineConfig  # noqa: E402
from lockstep.policy.config import SchedulerConfig  # noqa: E402
from lockstep.policy.request import SamplingParams  # noqa: E402


async def greedy(dep: int) -> list[list[int]]:
    cfg = EngineConfig(model="tiny", device="cuda", dtype="float32", dep=dep, tokenizer=None)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, n).astype(np.int32) for n in (5, 40, 130, 17, 64, 90)]
    out = [None] * len(prompts)
    async with open_engine(cfg) as engine:
        async def one(i):
            out[i] = (await engine.complete(prompts[i], SamplingParams(max_tokens=12, temperature=0,
                                                                         ignore_eos=True))).token_ids.tolist()
        async with trio.open_nursery() as n:
            for i in range(len(prompts)):
                n.start_soon(one, i)
    return out


async def complete_all(engine, prompts, params) -> int:
    """Serve every prompt at once; the output tokens, in all."""
    counts = []

    async def one(p):
        counts.append(len((await engine.complete(p, params)).token_ids))
    async with trio.open_nursery() as nursery:
        for p in prompts:
            nursery.start_soon(one, p)
    return sum(counts)


def time_sync(engine, sync: list[float]) -> None:
    """Append to ``sync`` the seconds rank 0 spends in each per-step DP all-reduce."""
    group = engine.schedulers[0].group
    if group is None:
        return
    inner = group.allreduce

    async def timed(rank, values):
        t = time.perf_counter()
        try:
            return await inner(rank, values)
        finally:
            if rank == 0:
                sync.append(time.perf_counter() - t)
    group.allreduce = timed


async def throughput(dep: int, layers: int, per_rank: int, prompt: int, output: int, dispatch: str | None = None) -> dict:
    sched = SchedulerConfig(num_blocks=16384, max_num_seqs=per_rank, max_num_batched_tokens=16384, max_model_len=4096)
    cfg = EngineConfig(model="v2-lite", device="cuda", dtype="bfloat16", dep=dep, tokenizer=None, scheduler=sched,
                       runtime_options={"preset_overrides": {"num_hidden_layers": layers},
                                        **({"ep_dispatch": dispatch} if dispatch else {})})
    rng = np.random.default_rng(1)
    n = per_rank * dep
    prompts = [rng.integers(10, 500, prompt).astype(np.int32) for _ in range(n)]
    params = SamplingParams(max_tokens=output, ignore_eos=True)
    async with open_engine(cfg) as engine:
        steps, sync = [], []
        engine.schedulers[0].on_result = lambda p, r: steps.append((p.num_reqs, r.gpu_s))
        time_sync(engine, sync)
        await engine.complete(prompts[0][:8], SamplingParams(max_tokens=2))  # warm up
        steps.clear()
        sync.clear()
        t = time.perf_counter()
        tokens = await complete_all(engine, prompts, params)
        wall = time.perf_counter() - t
    full = max((k for k, _ in steps), default=0)  # the router may give a rank a few more or fewer
    decode = [g for k, g in steps if k == full]
    return {"dep": dep, "gpus": dep, "ep_dispatch": dispatch or ("padded" if dep > 1 else "-"), "layers": layers, "requests": n, "output_tokens_per_s": tokens / wall,
            "tokens_per_s_per_gpu": tokens / wall / dep, "decode_step_ms": 1e3 * float(np.median(decode)) if decode else float("nan"),
            "sync_ms_per_step": 1e3 * float(np.median(sync)) if sync else 0.0}


async def sweep(dep: int, layers: int, levels: list[int], prompt: int, output: int,
                dispatch: str | None = None, exchange: str | None = None) -> list[dict]:
    """One engine of ``dep`` ranks; per load c in ``levels``: c requests a rank decoding.
    ``exchange``: the runtime option ep_exchange (None: its default)."""
    sched = SchedulerConfig(num_blocks=32768, max_num_seqs=max(levels), max_num_batched_tokens=16384,
                            max_model_len=prompt + output + 64)
    opts = {"init_on_device": True, "capture_len": prompt + output + 64}
    if layers:
        opts["preset_overrides"] = {"num_hidden_layers": layers}
    if dispatch:
        opts["ep_dispatch"] = dispatch
    if exchange:
        opts["ep_exchange"] = exchange
    cfg = EngineConfig(model="v2-lite", device="cuda", dtype="bfloat16", dep=dep, tokenizer=None, scheduler=sched,
                       runtime_options=opts)
    params = SamplingParams(max_tokens=output, ignore_eos=True)
    rows = []
    async with open_engine(cfg) as engine:
        steps, sync = [], []
        # decode-only steps: each request feeds one token
        engine.schedulers[0].on_result = lambda p, r: p.num_tokens == p.num_reqs and steps.append(
            (p.num_reqs, r.gpu_s, time.perf_counter()))
        time_sync(engine, sync)
        rng = np.random.default_rng(1)
        await engine.complete(rng.integers(10, 500, 8).astype(np.int32), SamplingParams(max_tokens=2))  # warm up
        for c in levels:
            prompts = [rng.integers(10, 500, prompt).astype(np.int32) for _ in range(c * dep)]
            steps.clear()
            sync.clear()
            t = time.perf_counter()
            tokens = await complete_all(engine, prompts, params)
            wall = time.perf_counter() - t
            full = max((k for k, _, _ in steps), default=0)
            decode = [g for k, g, _ in steps if k >= 0.95 * full]  # the router may give a rank a few more or fewer
            step = float(np.median(decode)) if decode else float("nan")
            # Wall time between consecutive full decode steps' results on rank 0: above the
            # step itself where the host (engine or runtime) holds the GPU up.
            gaps = [b[2] - a[2] for a, b in zip(steps, steps[1:]) if min(a[0], b[0]) >= 0.95 * full]
            rows.append({"dep": dep, "exchange": (exchange or "default") if dep > 1 else "-", "per_rank": c,
                         "requests": c * dep, "layers": layers or 27,
                         "decode_step_ms": 1e3 * step, "decode_tokens_per_s_per_gpu": full / step,
                         "step_gap_ms": 1e3 * float(np.median(gaps)) if gaps else float("nan"),
                         "output_tokens_per_s_per_gpu": tokens / wall / dep,
                         "sync_ms_per_step": 1e3 * float(np.median(sync)) if sync else 0.0,
                         "step_bytes_per_gpu": rank_bytes(layers, dep, full, prompt + output // 2)})
            print(rows[-1], flush=True)
    return rows


def rank_bytes(layers: int, dep: int, batch: int, ctx: int) -> float:
    """Bytes one rank's decode step must read: bench_decode's step_bytes with the routed
    experts its ``batch`` tokens touch on this rank (of the pairs of every rank's tokens,
    the expected distinct experts among its 1/dep share of the experts)."""
    from decode_pieces import step_bytes

    from lockstep.runtime.models import preset

    cfg = preset("v2-lite", **({"num_hidden_layers": layers} if layers else {}))
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    local = e / dep
    pairs = batch * dep * k / dep  # every rank's tokens' pairs for this rank's experts, even routing
    touched = local * (1 - (1 - 1 / local) ** pairs)
    return step_bytes(cfg, batch, ctx, touched)


def _timed_s(run, iters: int, per: int = 1) -> float:
    """Median seconds of ``run()`` over ``iters`` runs (divided by ``per``), every rank of the
    process group starting each run together (CUDA events)."""
    import torch
    import torch.distributed as dist

    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / per)
    return float(np.median(times))


def _graph_s(fn, *, layers: int = 26, warmup: int = 1) -> float:
    """Seconds per call of ``fn``, ``layers`` calls captured as one CUDA graph (as a decode
    step holds a MoE layer's each), after ``warmup`` calls on a side stream."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            fn()
    return _timed_s(graph.replay, 10, layers)


def _a2a_worker(rank: int, world: int, sizes: list[int], hidden: int, top_k: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    res = {}
    for pad in sizes:
        rows = world * pad * top_k
        send = torch.zeros(rows, 2 * hidden + 2, dtype=torch.uint8, device="cuda")  # rows and slots, as bytes
        x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
        recv, y = torch.empty_like(send), torch.empty_like(x)

        def nccl():
            dist.all_to_all_single(recv, send)
            dist.all_to_all_single(y, x)
        variants = {"nccl": nccl}
        try:  # the same two exchanges as copies into the peers' memory and a barrier each
            from lockstep.runtime.models.peer_exchange import PeerExchange

            ex = PeerExchange(rows // world, [send.shape[1], x.shape[1] * 2], world, rank, None,
                              torch.device("cuda", rank))

            def p2p():
                ex.exchange(0, send)
                ex.exchange(1, x.view(torch.uint8))
            variants["p2p"] = p2p
            send.copy_(torch.randint(0, 256, send.shape, dtype=torch.uint8, device="cuda"))
            nccl()
            want = recv.clone()
            p2p()
            res[f"p2p_same_{pad}"] = bool(torch.equal(ex.received(0, rows).view(recv.shape), want))
        except Exception as e:  # noqa: BLE001 - reported, the NCCL figures still stand
            res[f"p2p_error_{pad}"] = f"{type(e).__name__}: {e}"[:500]
        for name, layer in variants.items():
            for _ in range(5):
                layer()
            res[pad if name == "nccl" else f"{name}_{pad}"] = _timed_s(layer, 30)
            try:  # 26 layers' exchanges in one CUDA graph, as the decode step holds them
                res[f"{name}_graph_{pad}"] = _graph_s(layer, warmup=1)
            except Exception as e:  # noqa: BLE001
                res[f"{name}_graph_error_{pad}"] = f"{type(e).__name__}: {e}"[:500]
    if rank == 0:
        results.put(res)
    dist.destroy_process_group()


def alltoall(world: int, sizes: list[int], *, hidden: int = 2048, top_k: int = 6) -> dict:
    """Seconds of one MoE layer's padded exchanges (rows out with their slots, rows back) per
    ``pad_tokens`` in ``sizes``, NCCL between ``world`` processes, one GPU each (keys: the
    pad); keys ``p2p_<pad>``: the same exchanges as copies into the peers' memory
    (``PeerExchange``), ``p2p_same_<pad>`` whether they delivered what NCCL delivered;
    ``<variant>_graph_<pad>``: per layer, 26 layers replayed as one CUDA graph."""
    return _on_ranks(world, _a2a_worker, (sizes, hidden, top_k), "the all-to-all workers")


def _on_ranks(world: int, worker, args: tuple, what: str) -> dict:
    """Run ``worker(rank, world, *args, port, queue)`` in ``world`` spawned processes (one GPU
    each, NCCL over a free loopback port); rank 0's report."""
    import queue
    import socket

    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(r, world, *args, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 300
    while True:  # until rank 0 reports, or every worker is gone (a failure) or time is up
        try:
            got = q.get(timeout=2)
            break
        except queue.Empty:
            if not any(p.is_alive() for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{what} ended without a result") from None
    for p in procs:
        p.join(timeout=60)
    return got


def _kernel_table(fn, calls: int = 20) -> str:
    """torch.profiler's CUDA kernel table over ``calls`` eager calls of fn (after one more)."""
    import torch

    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)


def _layer_worker(rank: int, world: int, pads: list[int], profile: bool, port: int, results) -> None:
    """One v2-lite MoE layer (64 experts, hidden 2048, intermediate 1408, top-6, bf16, random
    weights and routing) through ShardedExperts with padded dispatch, 26 layers captured as
    one CUDA graph, per exchange; and one GPU's fused MoE over all 64 experts (DEP1)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from lockstep.kernels.fused_moe import fused_moe
    from lockstep.runtime.models.expert_parallel import ShardedExperts, attach_peer_exchange

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=dev)
    e, h, inter, k = 64, 2048, 1408, 6
    g = torch.Generator(device=dev).manual_seed(0)  # the same weights on every rank
    experts = nn.Module()
    experts.gate_up_proj = nn.Parameter(torch.randn(e, 2 * inter, h, generator=g, device=dev).mul_(0.02)
                                        .to(torch.bfloat16), requires_grad=False)
    experts.down_proj = nn.Parameter(torch.randn(e, h, inter, generator=g, device=dev).mul_(0.02)
                                     .to(torch.bfloat16), requires_grad=False)

    def local(x, w13, w2, tw, ti, **kw):
        return fused_moe(x, w13, w2, tw, ti, **kw)

    def graph_us(fn) -> float:
        return 1e6 * _graph_s(fn, warmup=3)

    res = {}
    gx = torch.Generator(device=dev).manual_seed(1 + rank)
    for pad in pads:
        x = torch.randn(pad, h, generator=gx, device=dev).to(torch.bfloat16)
        ids = torch.rand(pad, e, generator=gx, device=dev).topk(k, dim=1).indices
        w = torch.rand(pad, k, generator=gx, device=dev).softmax(dim=1)
        res[f"dep1_fused_moe_{pad}"] = graph_us(lambda: fused_moe(x, experts.gate_up_proj, experts.down_proj, w, ids))
        if profile:
            res[f"profile_dep1_{pad}"] = _kernel_table(
                lambda: fused_moe(x, experts.gate_up_proj, experts.down_proj, w, ids))
        outs = {}
        from lockstep.kernels import ep_dispatch

        for how in ("nccl", "peer", "direct", "direct_unaligned"):
            ep_dispatch.ALIGNED = how != "direct_unaligned"
            layer = ShardedExperts(experts, np.arange(e), rank, world, dispatch="padded")
            layer.pad_tokens = pad
            ex = None if how == "nccl" else attach_peer_exchange([layer], pad, k, None, dev,
                                                                 direct=how.startswith("direct"))
            outs[how] = layer(x, w, ids, local=local)
            res[f"{how}_{pad}"] = graph_us(lambda: layer(x, w, ids, local=local))
            if profile and how == "direct":  # where a layer's time goes, kernel by kernel (eager)
                res[f"profile_{how}_{pad}"] = _kernel_table(lambda: layer(x, w, ids, local=local))
            if ex is not None:
                ex.close()
        want = fused_moe(x, experts.gate_up_proj, experts.down_proj, w, ids).float()
        for how, got in outs.items():
            res[f"{how}_max_err_{pad}"] = float((got.float() - want).abs().max())
        res[f"scale_{pad}"] = float(want.abs().max())
    if rank == 0:
        results.put(res)
    dist.destroy_process_group()


def layer_probe(world: int, pads: list[int], profile: bool = False) -> dict:
    """Microseconds per MoE layer (see ``_layer_worker``), keyed by exchange and pad;
    ``profile``: also the kernel tables of the direct exchange's layer and of DEP1's."""
    return _on_ranks(world, _layer_worker, (pads, profile), "the layer probe's workers")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--per-rank", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--sweep-one", type=int, help="run `sweep` for this DEP size, print its rows as JSON")
    ap.add_argument("--levels", default="64,128,256", help="requests per rank, for --sweep-one")
    ap.add_argument("--exchange", default=None, choices=("nccl", "peer", "direct"), help="runtime option ep_exchange")
    ap.add_argument("--layer-probe", action="store_true",
                    help="time one MoE layer's padded dispatch per exchange on 2 GPUs (pads: --levels)")
    ap.add_argument("--profile", action="store_true",
                    help="with --layer-probe: print the kernel tables of the direct exchange and DEP1")
    args = ap.parse_args()
    if args.layer_probe:
        import json

        got = layer_probe(2, [int(x) for x in args.levels.split(",")], args.profile)
        for key in [k for k in got if k.startswith("profile_")]:
            print(f"== {key}\n{got.pop(key)}", flush=True)
        print("LAYER " + json.dumps(got), flush=True)
        return
    if args.sweep_one:
        import json

        rows = trio.run(sweep, args.sweep_one, args.layers, [int(x) for x in args.levels.split(",")], args.prompt,
                        args.output, None, args.exchange)
        print("RESULT " + json.dumps(rows), flush=True)
        return
    g1, g2 = trio.run(greedy, 1), trio.run(greedy, 2)
    print("greedy DEP2 == DEP1:", g1 == g2, flush=True)
    rows = [trio.run(throughput, dep, args.layers, args.per_rank, args.prompt, args.output) for dep in (1, 2)]
    for r in rows:
        print(r, flush=True)
    one, two = rows
    emit("bench_dep_h200", rows, {
        "metric": f"output tokens/s per GPU, v2-lite shape ({args.layers} layers), DEP2 on 2 H200s, "
                  f"{args.per_rank} requests per rank (torch reference runtime)",
        "unit": "tokens/s/GPU", "value": two["tokens_per_s_per_gpu"],
        "baseline": {"name": "DEP1 on one H200, same run", "value": one["tokens_per_s_per_gpu"]},
        "ratio": two["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"],
        "target": "greedy tokens equal to one GPU's", "meets_target": g1 == g2,
    }, args.json)


if __name__ == "__main__":
    main()
