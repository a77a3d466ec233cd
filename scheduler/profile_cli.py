"""`lockstep profile`: measure a model's step times on this device, for the simulator.

Drives a torch runtime directly (no scheduler, no engine processes) with hand-built plans, as
benchmarks/gpu/bench_decode.py does, and writes a JSON profile that ``lockstep.sim.profile``
loads as its cost model in place of the analytic one ([cost] profile in a deployment):

- decode: B requests, each with C tokens already cached, feed one token each (the runtime's
  CUDA-graph path on a GPU): [B, C, seconds] for B in --batches, C in --contexts;
- prefill: one request feeds a chunk of T new tokens after a cached prefix of C:
  [T, C, seconds] for T in --chunks, C in a few of --contexts.

A point's seconds is the median over repetitions of the runtime's ``execute`` (plan in, sampled
ids out): timed with CUDA events on a GPU (the stream's time from before the plan's host
preparation to after the sampled ids reach the host), with the wall clock on the CPU. Cache
contents and weights are random: they do not change the time. Cells whose KV does not fit in
--kv-gb are left out and listed in ``notes``, as are cells the --budget-s deadline skipped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

BS = 16  # the scheduler's default block size


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure step times on this device, as a profile for `lockstep sim`")
    p.add_argument("--model", default="v2-lite", help="preset name (tiny, v2-lite) or checkpoint directory")
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                   help="auto: the model's dtype; fp8: e4m3 entries with a float32 scale per token")
    p.add_argument("--out", required=True, help="profile file to write (JSON)")
    p.add_argument("--batches", type=_ints, default=[1, 8, 32, 64, 128, 256],
                   help="decode batch sizes, comma-separated")
    p.add_argument("--contexts", type=_ints, default=[512, 1024, 2048, 4096, 8192],
                   help="cached tokens per request, comma-separated")
    p.add_argument("--chunks", type=_ints, default=[256, 1024, 2048, 4096, 8192], help="prefill chunk sizes")
    p.add_argument("--prefill-contexts", type=_ints,
                   help="cached prefixes for prefill points (default: the smallest, a middle and the largest of --contexts)")
    p.add_argument("--steps", type=int, default=8, help="timed repetitions per point")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions per point (graph capture, compiles)")
    p.add_argument("--kv-gb", type=float, default=80.0, help="KV cache size; cells that need more are left out")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="stop measuring after this long (left-out cells are noted)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")


def _ints(text: str) -> list[int]:
    # argparse names what a type function's ArgumentTypeError says (a ValueError it reports as
    # "invalid _ints value")
    try:
        vals = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or vals[0] < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return vals


def run_profile(args) -> int:
    import torch

    from lockstep.runtime.base import RuntimeSpec
    from lockstep.runtime.torch_runtime import TorchRuntime

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here (use --device cpu)")
    if args.steps < 1 or args.warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    if not args.budget_s > 0:  # none would measure nothing and write an empty profile
        raise ValueError(f"--budget-s must be > 0 seconds, got {args.budget_s}")
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    started = time.monotonic()
    deadline = started + args.budget_s
    pre_ctx = args.prefill_contexts or sorted({args.contexts[0], args.contexts[len(args.contexts) // 2],
                                               args.contexts[-1]})
    extra = args.warmup + args.steps + 2
    max_len = max(max(args.contexts) + extra, max(pre_ctx) + max(args.chunks)) + BS
    cfg = _config(args.model)
    if args.kv_cache_dtype == "fp8":
        per_token = cfg.num_hidden_layers * (cfg.kv_cache_dim + 4)  # one byte a value, a float32 scale
    else:
        per_token = cfg.num_hidden_layers * cfg.kv_cache_dim * {"float32": 4, "float64": 8}.get(dtype, 2)
    max_blocks = int(args.kv_gb * 1e9 // (per_token * BS))
    need = max(_blocks(b, c + extra) for b in args.batches for c in args.contexts)
    need = max(need, _blocks(1, max_len))
    blocks = min(need, max_blocks)
    if blocks < _blocks(1, max_len):
        raise ValueError(f"--kv-gb {args.kv_gb}: room for {max_blocks} blocks, not even one request of "
                         f"{max_len} tokens ({_blocks(1, max_len)} blocks)")
    print(f"loading {args.model} ({dtype}) on {args.device}: {blocks} KV blocks", flush=True)
    rt = TorchRuntime()
    opts = {"init_on_device": args.device != "cpu", "capture_len": 0, "kv_cache_dtype": args.kv_cache_dtype}
    rt.load(RuntimeSpec(model=args.model, device=args.device, dtype=dtype, num_blocks=blocks, block_size=BS,
                        max_num_seqs=max(args.batches), max_model_len=max_len, seed=args.seed, options=opts))
    with torch.no_grad():  # finite, non-trivial cache contents (a zero cache is not slower, but be safe)
        if rt.kv_dtype is None:
            rt.kv_pool.normal_(0.0, 1.0)
        else:  # e4m3 codes below 0x70 (finite, under 128), every scale 1/448
            rt.kv_pool.random_(0, 0x70)
            for layer in rt.kv:
                layer.scales.fill_(1 / 448)
    vocab = cfg.vocab_size
    timer = _timer(rt.device.type == "cuda")
    notes: list[str] = []
    print(f"loaded in {time.monotonic() - started:.1f} s", flush=True)
    decode = _measure_decode(rt, args, timer, blocks, deadline, notes)
    prefill = _measure_prefill(rt, args, timer, vocab, pre_ctx, blocks, deadline, notes)
    if rt.device.type == "cuda":  # eager prefill allocates: a full allocator retries (and syncs)
        mem = torch.cuda.memory_stats(rt.device)
        notes.append(f"allocator: {mem.get('num_alloc_retries', 0)} alloc retries, "
                     f"{mem.get('reserved_bytes.all.peak', 0) / 1e9:.1f} GB peak reserved of "
                     f"{torch.cuda.get_device_properties(rt.device).total_memory / 1e9:.1f} GB")
    rt.shutdown()
    profile = {
        "model": Path(args.model).name if Path(args.model).is_dir() else args.model,
        "device": torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "cpu",
        "dtype": dtype, "kv_cache_dtype": args.kv_cache_dtype, "dep": 1,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(), "torch": torch.__version__, "block_size": BS,
        "decode": decode, "prefill": prefill,
        "notes": [
            "decode: [batch, cached tokens per request, seconds]; prefill: [chunk tokens, cached prefix, seconds]",
            f"seconds: median of {args.steps} runs of the runtime's execute (plan in, sampled ids out) after "
            f"{args.warmup} warm-up runs; " + ("CUDA events" if rt.device.type == "cuda" else "wall clock"),
            "random weights and cache; one GPU (DEP1); greedy sampling",
        ] + notes,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_dumps(profile))
    print(f"wrote {out}: {len(decode)} decode and {len(prefill)} prefill points in "
          f"{time.monotonic() - started:.0f} s", flush=True)
    return 0


def _dumps(profile: dict) -> str:
    """JSON with one point a line, so the file reads (and diffs) as a table."""
    body = {k: v for k, v in profile.items() if k not in ("decode", "prefill")}
    text = json.dumps(body, indent=1)[:-2]
    for key in ("decode", "prefill"):
        rows = ",\n  ".join(json.dumps([a, b, float(f"{t:.6g}")]) for a, b, t in profile[key])
        text += f',\n "{key}": [\n  {rows}\n ]'
    return text + "\n}\n"


def _config(model: str):
    """The model's shape, before loading it: a preset's or a checkpoint's config.json."""
    from lockstep.runtime.models import ModelConfig, preset

    return ModelConfig.from_pretrained(model) if Path(model).is_dir() else preset(model)


def _blocks(batch: int, tokens: int) -> int:
    return batch * -(-tokens // BS)


def _timer(cuda: bool):
    """fn -> seconds one call took: the stream's time on a GPU, the wall clock on the CPU."""
    import torch

    def timed(fn) -> float:
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return timed


def _measure_decode(rt, args, timer, blocks: int, deadline: float, notes: list[str]) -> list[list[float]]:
    from lockstep.runtime.base import NewRequests

    points, req = [], 0
    n = args.warmup + args.steps
    for ctx in args.contexts:
        for b in args.batches:
            per = -(-(ctx + n + 2) // BS)
            if b * per > blocks:
                notes.append(f"decode batch {b} x context {ctx}: needs {b * per} KV blocks, have {blocks} (--kv-gb)")
                continue
            if time.monotonic() > deadline:
                notes.append(f"decode batch {b} x context {ctx}: skipped, --budget-s spent")
                continue
            ids = list(range(req, req + b))
            req += b
            rt.add_requests(NewRequests(ids, [0.0] * b, [1.0] * b, [-1] * b, [-1] * b))
            tables = np.arange(b * per, dtype=np.int32).reshape(b, per)
            times = []
            for i in range(n):
                plan = _decode_plan(i, np.array(ids), ctx + i, tables if i == 0 else None)
                t = timer(lambda: rt.execute(plan))
                if i >= args.warmup:
                    times.append(t)
            rt.forget(ids)
            points.append([b, ctx, statistics.median(times)])
            print(f"decode batch {b:4d} context {ctx:6d}: {points[-1][2] * 1e3:8.3f} ms", flush=True)
    return points


def _measure_prefill(rt, args, timer, vocab: int, contexts: list[int], blocks: int, deadline: float,
                     notes: list[str]) -> list[list[float]]:
    import torch

    from lockstep.runtime.base import NewRequests

    rng = np.random.default_rng(args.seed)
    points, req = [], 1 << 40  # ids apart from the decode requests'
    for ctx in contexts:
        for t_new in args.chunks:
            if time.monotonic() > deadline:
                notes.append(f"prefill chunk {t_new} on prefix {ctx}: skipped, --budget-s spent")
                continue
            table = np.arange(-(-(ctx + t_new) // BS), dtype=np.int32)
            tokens = rng.integers(3, vocab, t_new).astype(np.int32)
            rt.add_requests(NewRequests([req], [0.0], [1.0], [-1], [-1]))
            times = []
            try:
                for i in range(args.warmup + args.steps):  # the same chunk again: it rewrites the same KV slots
                    plan = _chunk_plan(i, req, ctx, tokens, table)
                    t = timer(lambda: rt.execute(plan))
                    if i >= args.warmup:
                        times.append(t)
            except (MemoryError, torch.cuda.OutOfMemoryError) as e:  # noted; the other cells go on
                notes.append(f"prefill chunk {t_new} on prefix {ctx}: out of memory ({str(e)[:120]})")
                _release_memory()
                continue
            finally:
                rt.forget([req])
                req += 1
            points.append([t_new, ctx, statistics.median(times)])
            print(f"prefill chunk {t_new:5d} prefix {ctx:6d}: {points[-1][2] * 1e3:8.3f} ms", flush=True)
    return points


def _release_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _decode_plan(step_id: int, req_ids: np.ndarray, pos: int, tables: np.ndarray | None):
    """Slot i decodes one token at ``pos``; ``tables``: whole block tables, first plan only."""
    from lockstep.policy.step import PLACEHOLDER, StepPlan

    n = len(req_ids)
    blk = np.zeros(0, np.int32) if tables is None else tables.reshape(-1)
    boff = np.zeros(n + 1, np.int64) if tables is None else np.arange(n + 1, dtype=np.int64) * tables.shape[1]
    return StepPlan(step_id=step_id, req_ids=req_ids.astype(np.int64), slots=np.arange(n, dtype=np.int32),
                    num_new=np.ones(n, np.int32), start_pos=np.full(n, pos, np.int32), samples=np.ones(n, bool),
                    token_ids=np.full(n, PLACEHOLDER, np.int32), token_offsets=np.arange(n + 1, dtype=np.int64),
                    block_start=np.zeros(n, np.int32), block_ids=blk, block_offsets=boff,
                    num_tokens=n, num_padded_tokens=n)


def _chunk_plan(step_id: int, req_id: int, start: int, tokens: np.ndarray, table: np.ndarray):
    """One request in slot 0 feeds ``tokens`` from position ``start`` and samples once."""
    from lockstep.policy.step import StepPlan

    t = len(tokens)
    return StepPlan(step_id=step_id, req_ids=np.array([req_id], np.int64), slots=np.zeros(1, np.int32),
                    num_new=np.array([t], np.int32), start_pos=np.array([start], np.int32),
                    samples=np.ones(1, bool), token_ids=tokens, token_offsets=np.array([0, t], np.int64),
                    block_start=np.zeros(1, np.int32), block_ids=table,
                    block_offsets=np.array([0, len(table)], np.int64), num_tokens=t, num_padded_tokens=t)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
