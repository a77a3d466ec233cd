"""The torch runtime's CUDA fast path on an H200, in one run (issue 8, item 2 and the decode
targets of item 3): absorbed MLA over the paged latent cache, fused MoE, KV store (Triton),
CUDA graphs for decode steps, sampling on the device.

1. copy bandwidth: a 2 GiB device copy, (bytes read + bytes written) / time: the issue's
   4.19 TB/s figure; the roofline of a step is the bytes it must read over it.
2. correctness on the GPU, v2-lite's shape cut to 3 layers (and later the tiny preset, whose
   q LoRA and group routing v2-lite lacks): requests served through a real SchedulerCore
   (chunked prefill, staggered arrivals: mixed prefill/decode steps, padded decode graphs)
   by the reference runtime path (the model's own forward, host sampling) and by the fast
   path with and without graphs; the fast runtimes are fed the reference's tokens, so greedy
   tokens compare step by step. The reference path in float32 on the same weights is the
   oracle: the fast path, with graphs and eager, must stay as close to it as the bf16
   reference does (``close_to_fp32``: greedy agreement row by row and request by request,
   logprob distance at the median and the 90th percentile). (With an FP8 cache, see 5.)
3. decode, v2-lite in full (27 layers, bf16, random weights drawn on the GPU, 31 GB) at batch
   1, 8, 64, 256 and context 512 (the issue's setting, where its tokens/s targets are judged),
   1K and 4K: the runtime's step (plan in, sampled ids out: host
   prep, one graph replay, device sampling, one copy back) one at a time (step_ms), then
   launched one ahead as the runtime process runs them (ahead_ms: step N+1 launched before
   step N's tokens are back), and a bare graph replay, against the roofline: all non-expert
   weights, the routed experts the step's tokens select (counted from the step's own expert
   counts), and the KV read. tokens/s and the fraction of roofline take the faster way.
4. at batch 64, context 1K: a sampled step (temperature 1, top-p 0.95; and with top-k 50), the fast path without
   graphs, and the reference path.
5. while time is left, in this order: FP8 expert weights (W8A16) at batch 64 and 256; the
   FP8 KV cache (kv_cache_dtype fp8: e4m3 entries, a float32 scale per token) on the fast path,
   checked to stay as close to the bf16 reference as the reference path's own FP8 cache does
   (v2-lite cut to 3 layers; ``fp8_close_as_reference``) and timed
   at batch 64 and 256 at the longest context (the roofline reads 1 byte a value and a 4-byte
   scale per token and layer);
   transformers' DeepseekV3ForCausalLM forward loop at batch 64, prompts of 512 (the issue's
   baseline; its other figures are quoted from the issue); the tiny-preset correctness
   check; the engine end to end (LLM on CUDA, runtime processes), fast vs reference path.

Every section runs in try/except: a failure lands in headline.errors and the run goes on;
sections are skipped (and say so) when the time budget (--budget-s, default 420 s) runs low.
Prints a table and, with --json, the house JSON line (headline: output tokens/s at batch 64,
context 1K). ``--smoke`` runs the same code on the CPU at tiny shapes (kernels under
TRITON_INTERPRET=1; no graphs, no timing meaning): it checks the script, nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

from lockstep.policy.request import SamplingParams  # noqa: E402
from lockstep.runtime.models import preset  # noqa: E402
from lockstep.runtime.sampling import sample  # noqa: E402
from lockstep.runtime.torch_runtime import TorchRuntime  # noqa: E402

from decode_checks import BS, MAX_MISMATCH_SHARE, close_to_fp32, compare, fp8_close_as_reference, serve  # noqa: E402
from decode_pieces import (add_requests, copy_bandwidth, decode_plan, events_ms, fill_kv, free,  # noqa: E402
                           runtime, step_bytes)
from hf_baseline import bench_transformers  # noqa: E402

# Issue 8's H200 facts (transformers 5.17, prompts of 512 tokens): roofline step ms and tokens/s.
ISSUE_ROOFLINE = {1: (1.18, 851), 8: (4.30, 1859), 64: (7.64, 8381), 256: (8.39, 30498)}
TARGET_TOK_S = {64: 5900, 256: 21000}  # the issue's: about 70% of its roofline with 512-token prompts
ISSUE_CTX = 512
COLS = ("section", "case", "batch", "ctx", "step_ms", "ahead_ms", "gpu_ms", "host_ms", "tokens_per_s", "roofline_ms",
        "frac_roofline", "frac_roofline_gpu", "experts_touched", "target", "meets", "note")


class Run:
    """The deadline, the table, and what the run found."""

    def __init__(self, budget_s: float):
        self.deadline = time.monotonic() + budget_s
        self.rows: list[dict] = []
        self.errors: dict[str, str] = {}
        self.checks: dict[str, object] = {}
        self.info: dict[str, object] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @contextlib.contextmanager
    def section(self, name: str, need_s: float):
        if self.left() < need_s:
            self.errors[name] = f"skipped: {self.left():.0f} s left, needs ~{need_s:.0f} s"
            print(f"[{name}] {self.errors[name]}", flush=True)
            yield False
            return
        t = time.monotonic()
        print(f"[{name}] start ({self.left():.0f} s left)", flush=True)
        try:
            yield True
        except Exception as e:  # noqa: BLE001 - recorded; the next section still runs
            self.errors[name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            print(f"[{name}] done in {time.monotonic() - t:.1f} s", flush=True)

    def row(self, **kw) -> dict:
        r = {c: kw.get(c, "") for c in COLS}
        self.rows.append(r)
        print("  " + " | ".join(f"{c}={r[c]:.4g}" if isinstance(r[c], float) else f"{c}={r[c]}"
                                for c in COLS if r[c] != ""), flush=True)
        return r


# -- 2. correctness -------------------------------------------------------------------------------

def check_correctness(run: Run, name: str, model: str, overrides: dict, device: str, smoke: bool,
                      **options) -> None:
    """``options``: runtime options for the reference and the two fast runtimes
    (kv_cache_dtype="fp8": FP8 caches on all three).

    bf16: a fourth runtime, the reference path in float32 on the same weights, is the oracle:
    ok when both fast runtimes stay as close to it as the bf16 reference does (``close_to_fp32``;
    the clear-margin count of ``compare`` is reported, not judged: random weights' routing
    near-ties make it fail correct paths). FP8: a fourth runtime, the reference path over a bf16 cache, asks the question
    that matters there (``fp8_close_as_reference``): is the fast path's FP8 cache as close to
    the bf16 model as the reference's FP8 cache is? Two FP8 paths cannot agree as two bf16
    ones do: an e4m3 step is 16 bf16 ulps (3 mantissa bits against 7), so inputs one bf16 ulp
    apart (different kernels upstream) land on different codes in about 1 element of 16
    (session 18: matched logprobs differ by a median 0.23 between the FP8 paths, 0.09 between
    the bf16 ones; benchmarks/gpu/experiments/kv_mismatch.py)."""
    rng = np.random.default_rng(0)
    vocab = preset(model, **overrides).vocab_size
    lens = (1, 17, 40, 5) if smoke else (1, 17, 64, 130, 300, 700, 3, 33)
    prompts = [rng.integers(3, vocab, n).tolist() for n in lens]
    kw = dict(blocks=256 if smoke else 1024, max_seqs=4 if smoke else 8, max_len=256 if smoke else 1024,
              overrides=overrides, **options)
    graphs = "padded" if smoke else "on"
    fp8 = options.get("kv_cache_dtype") == "fp8"
    rts: list[TorchRuntime] = []  # built inside the try: whatever was built is freed if one fails
    try:
        rts.append(runtime(model, device, fast=False, **kw))
        rts.append(runtime(model, device, fast=True, cuda_graphs=graphs, compile=not smoke, **kw))
        rts.append(runtime(model, device, fast=True, cuda_graphs="off", compile=False, **kw))
        if fp8:  # fed the FP8 reference's tokens, as the others are
            rts.append(runtime(model, device, fast=False, **{a: v for a, v in kw.items() if a != "kv_cache_dtype"}))
        else:  # the oracle: the reference path in float32 on the bf16 weights, fed the same tokens
            rts.append(runtime(model, device, fast=False, dtype="float32", **kw))
            with torch.no_grad():
                rts[-1].model.load_state_dict(rts[0].model.state_dict())
        rows: list[int] = []  # each sampled row's request
        res = serve(rts, prompts, max_tokens=6 if smoke else 12, chunk=24 if smoke else 128,
                    max_seqs=kw["max_seqs"], max_len=kw["max_len"], blocks=kw["blocks"], rows=rows)
        got = {"fast_vs_reference": compare(res[0], res[1]), "fast_eager_vs_reference": compare(res[0], res[2]),
               "fast_graph_vs_fast_eager": compare(res[2], res[1]), "runner": rts[1].runner.statistics()}
        mixed = sum(1 for r in res[0] if len(r.token_ids) and r.num_sampled.sum() and len(r.num_sampled) > 1)
        got["steps"], got["steps_with_several_requests"] = len(res[0]), mixed
        if fp8:
            got["fp8_reference_vs_bf16"], got["fp8_fast_vs_bf16"] = compare(res[3], res[0]), compare(res[3], res[1])
            got["fp8_close_as_reference"] = fp8_close_as_reference(res[3], res[0], res[1])
            got["eager_fp8_close_as_reference"] = fp8_close_as_reference(res[3], res[0], res[2])
            ok = (got["fp8_close_as_reference"]["ok"] and got["eager_fp8_close_as_reference"]["ok"]
                  and got["fast_vs_reference"]["expert_count_totals_equal"]
                  and got["fast_eager_vs_reference"]["expert_count_totals_equal"] and got["runner"]["replays"] > 0)
        else:
            got["reference_vs_fp32"], got["fast_vs_fp32"] = compare(res[3], res[0]), compare(res[3], res[1])
            # both fast runtimes are judged: with graphs, and eager (the path prefill and
            # batches past the largest graph take)
            got["close_to_fp32"] = close_to_fp32(res[3], res[0], res[1], rows)
            got["eager_close_to_fp32"] = close_to_fp32(res[3], res[0], res[2], rows)
            fv, fe = got["fast_vs_reference"], got["fast_eager_vs_reference"]
            ok = (got["close_to_fp32"]["ok"] and got["eager_close_to_fp32"]["ok"]
                  and max(fv["mismatches"], fe["mismatches"]) <= MAX_MISMATCH_SHARE * fv["tokens"]
                  and fv["expert_count_totals_equal"] and fe["expert_count_totals_equal"]
                  and got["runner"]["replays"] > 0)
        got["ok"] = bool(ok and not got["runner"]["graph_errors"])
        run.checks[name] = got
        print(f"  {name}: {json.dumps(got, default=str)}", flush=True)
    finally:
        free(*rts)


# -- 3./4. decode ---------------------------------------------------------------------------------

def time_decode(run: Run, rt: TorchRuntime, batch: int, ctx: int, first_req: int, *, steps: int, warmup: int,
                temperature=0.0, top_p=1.0, case="greedy", graphs_off=False, expert_bytes=2, top_k=-1) -> dict:
    cfg, dev = rt.model.cfg, rt.device
    per = -(-(ctx + warmup + 2 * steps + 2) // BS)
    tables = np.arange(batch * per, dtype=np.int64).reshape(batch, per)
    req_ids = np.arange(first_req, first_req + batch)
    add_requests(rt, req_ids, temperature, top_p, top_k)
    mode = rt.runner.mode
    if graphs_off:
        rt.runner.mode = "off"
    try:
        walls, gpu, host, touched = [], [], [], []
        for i in range(warmup + steps):
            plan = decode_plan(i, req_ids, ctx + i, tables if i == 0 else None)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            res = rt.execute(plan)
            wall = time.perf_counter() - t
            if i >= warmup:
                walls.append(wall)
                gpu.append(res.gpu_s)
                host.append(res.host_s)
                moe = res.expert_counts[cfg.first_k_dense_replace:]
                touched.append(float((moe > 0).sum(-1).mean()))
        ahead_ms = "" if graphs_off else launched_ahead_ms(rt, req_ids, ctx, warmup + steps, steps)
        replay_ms = ""  # last: a step launched ahead is not timed right after a run of bare replays
        graph = None if graphs_off else rt.runner.graph_for(batch, ctx + warmup + steps)
        if graph is not None:
            replay_ms = events_ms(graph.replay, 20)
    finally:
        rt.runner.mode = mode
        rt.forget([int(r) for r in req_ids])
    step_ms = 1e3 * statistics.median(walls)
    t_experts = statistics.mean(touched)
    kv_token = rt.model.kv_block_bytes(BS, rt.kv_dtype) / BS  # every layer's entry (and FP8 scale)
    bandwidth = run.info.get("copy_Bps", 4.19e12)
    roof = 1e3 * step_bytes(cfg, batch, ctx + warmup, t_experts, expert_bytes, kv_token) / bandwidth
    # the tokens/s figures are the issue's 70% of its roofline at 512-token prompts: judged there
    # (ctx <= 512); the fraction of the roofline at every context
    target = TARGET_TOK_S.get(batch, "") if ctx <= ISSUE_CTX else ""
    frac_target = 0.7 if batch >= 64 else 0.5
    best_ms = min(step_ms, ahead_ms or step_ms)  # the runtime process launches steps ahead
    tok_s = batch / (best_ms / 1e3)
    meets = roof / best_ms >= frac_target and (not target or tok_s >= target)
    note = "" if not ISSUE_ROOFLINE.get(batch) else f"issue roofline (ctx 512): {ISSUE_ROOFLINE[batch][0]} ms"
    return run.row(section="decode", case=case, batch=batch, ctx=ctx, step_ms=step_ms, ahead_ms=ahead_ms,
                   gpu_ms=replay_ms, host_ms=1e3 * statistics.median(host), tokens_per_s=tok_s,
                   roofline_ms=roof, frac_roofline=roof / best_ms,
                   frac_roofline_gpu=roof / replay_ms if replay_ms else "", experts_touched=t_experts,
                   target=f">= {frac_target} of roofline" + (f", >= {target} tok/s" if target else ""),
                   meets=bool(meets), note=note)


def launched_ahead_ms(rt: TorchRuntime, req_ids: np.ndarray, ctx: int, first: int, steps: int) -> float:
    """Mean ms a step over ``steps`` decode steps launched one ahead, as the runtime process
    runs them (``launch`` of step N+1 before ``finish`` of step N: the GPU never waits for
    the host), from step ``first`` on."""
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
    t, pending = time.perf_counter(), None
    for i in range(first, first + steps):
        started = rt.launch(decode_plan(i, req_ids, ctx + i, None))
        if started is None:
            raise RuntimeError("the runtime did not launch a decode step ahead")
        if pending is not None:
            rt.finish(pending)
        pending = started
    rt.finish(pending)
    return 1e3 * (time.perf_counter() - t) / steps


def time_reference(run: Run, rt: TorchRuntime, batch: int, ctx: int, first_req: int, steps: int) -> dict:
    """The model's own forward (per-sequence attention, per-expert loop) plus host sampling,
    on the same weights, cache and tables."""
    per = -(-(ctx + steps + 3) // BS)
    tables = np.arange(batch * per, dtype=np.int64).reshape(batch, per)
    req_ids = np.arange(first_req, first_req + batch)
    add_requests(rt, req_ids)
    rt._update_tables(decode_plan(0, req_ids, ctx, tables))
    times = []
    for i in range(steps + 1):
        batch_, positions = rt._batch(decode_plan(i, req_ids, ctx + i, None))
        torch.cuda.synchronize() if rt.device.type == "cuda" else None
        t = time.perf_counter()
        logits, _ = rt.model(batch_, rt.kv)
        n = len(positions)
        sample(logits, np.zeros(n), np.ones(n), -np.ones(n, np.int64), -np.ones(n, np.int64), positions, rt.gen)
        if i:
            times.append(time.perf_counter() - t)
    rt.forget([int(r) for r in req_ids])
    ms = 1e3 * statistics.median(times)
    return run.row(section="reference", case="model forward + host sampling", batch=batch, ctx=ctx, step_ms=ms,
                   tokens_per_s=batch / (ms / 1e3), note="the torch runtime before this work (same weights)")


def bench_decode(run: Run, args, device: str) -> None:
    smoke = args.smoke
    batches = (1, 3) if smoke else tuple(args.batches)
    ctxs = (40,) if smoke else tuple(args.ctx)
    steps, warmup = (2, 1) if smoke else (args.steps, 3)
    model, overrides = ("tiny", {"num_hidden_layers": 2}) if smoke else ("v2-lite", {})
    max_ctx = max(ctxs) + warmup + 2 * steps + 8
    per = -(-(max_ctx + 2) // BS)
    rt = runtime(model, device, blocks=max(batches) * per + 8, max_seqs=max(batches), max_len=max_ctx + BS,
                 overrides=overrides, fast=True, cuda_graphs="padded" if smoke else "on", compile=not smoke,
                 fuse_shared=not args.no_fuse_shared, router_split=args.router_split,
                 capture_len=min(ctxs) + warmup + steps + 2)
    try:
        run.info["decode_runner_after_load"] = rt.runner.statistics()
        if device != "cpu":
            run.info["gpu_mem_gb_after_load"] = torch.cuda.memory_allocated() / 1e9
        fill_kv(rt)
        req = 0
        for ctx in ctxs:
            for b in batches:
                if run.left() < 25:
                    run.errors[f"decode b{b} ctx{ctx}"] = "skipped: time"
                    continue
                try:
                    time_decode(run, rt, b, ctx, req, steps=steps, warmup=warmup)
                except Exception as e:  # noqa: BLE001
                    run.errors[f"decode b{b} ctx{ctx}"] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
                req += b
        b64 = 3 if smoke else 64
        ctx = ctxs[0]
        if b64 > max(batches):  # the runtime holds only --batches' largest many sequences
            run.errors["decode sampled, without graphs, reference"] = \
                f"skipped: they run batch {b64}, above --batches' largest ({max(batches)})"
            b64 = 0
        for case, kw in (("sampled (temperature 1, top-p 0.95)", {"temperature": 1.0, "top_p": 0.95}),
                         ("sampled (temperature 1, top-k 50, top-p 0.95)",
                          {"temperature": 1.0, "top_p": 0.95, "top_k": 50}),
                         ("fast path without CUDA graphs", {"graphs_off": True})):
            try:
                if b64 and run.left() > 25:
                    time_decode(run, rt, b64, ctx, req, steps=max(2, steps // 4), warmup=2, case=case, **kw)
            except Exception as e:  # noqa: BLE001
                run.errors[f"decode {case}"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            req += b64
        try:
            if b64 and run.left() > 40:
                time_reference(run, rt, b64, ctx, req, steps=1 if smoke else 2)
        except Exception as e:  # noqa: BLE001
            run.errors["reference path"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        run.info["decode_runner"] = rt.runner.statistics()
    finally:
        free(rt)


def bench_fp8(run: Run, ctx: int, batches: tuple[int, ...], *, kv_cache: bool = False) -> None:
    """Routed experts in FP8 (block scales, W8A16): the roofline counts 1 byte per expert
    weight. ``kv_cache``: bf16 experts over an FP8 KV cache instead."""
    steps, warmup = 10, 3
    per = -(-(ctx + warmup + steps + 4) // BS)
    opts = {"kv_cache_dtype": "fp8"} if kv_cache else {"moe_fp8": True}
    rt = runtime("v2-lite", "cuda", blocks=max(batches) * per + 8, max_seqs=max(batches),
                 max_len=ctx + warmup + steps + 4 + BS, fast=True, cuda_graph_sizes=list(batches),
                 capture_len=ctx + warmup + steps + 2, **opts)
    try:
        fill_kv(rt)
        req = 0
        for b in batches:
            if kv_cache:
                time_decode(run, rt, b, ctx, req, steps=steps, warmup=warmup, case="FP8 KV cache")
            else:
                time_decode(run, rt, b, ctx, req, steps=steps, warmup=warmup, case="FP8 experts (W8A16)",
                            expert_bytes=1)
            req += b
        run.info["fp8_kv_runner" if kv_cache else "fp8_runner"] = rt.runner.statistics()
    finally:
        free(rt)


# -- 5. extras --------------------------------------------------------------------------------------

def check_engine(run: Run) -> None:
    from lockstep.llm import LLM

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["hello", "the quick brown fox", "x" * 200]
    overrides = {"initializer_range": 0.15}
    got = {}
    for name, opts in (("reference", {"fast": False}), ("fast", {"fast": True}),
                       ("fast, one step at a time", {"fast": True, "launch_ahead": False})):
        with LLM("tiny", device="cuda", dtype="bfloat16", runtime_options={**opts, "preset_overrides": overrides}) as llm:
            got[name] = [c.token_ids.tolist() for c in llm.generate(prompts, params)]
    same = sum(a == b for a, b in zip(got["reference"], got["fast"]))
    ahead = sum(a == b for a, b in zip(got["fast, one step at a time"], got["fast"]))
    # The fast path launches steps ahead in the runtime process: the same tokens as one at a
    # time, exactly; against the reference path, bf16 sums in another order may flip a near-tie.
    run.checks["engine_fast_vs_reference"] = {"prompts": len(prompts), "identical_outputs": same,
                                              "launched_ahead_vs_one_at_a_time": ahead, **got}
    print(f"  engine: {same}/{len(prompts)} identical greedy outputs (fast vs reference), "
          f"{ahead}/{len(prompts)} (steps launched ahead vs one at a time)", flush=True)


# -- main -------------------------------------------------------------------------------------------

def headline(run: Run) -> dict:
    dec = {(r["batch"], r["ctx"]): r for r in run.rows if r["section"] == "decode" and r["case"] == "greedy"}
    ctx0 = min((c for _, c in dec), default=0)
    main = dec.get((64, ctx0)) or dec.get((3, ctx0))
    value = main["tokens_per_s"] if main else 0.0
    hf = next((r for r in run.rows if r["section"] == "transformers"), None)
    ref = next((r for r in run.rows if r["section"] == "reference"), None)
    if hf:
        base = {"name": "transformers DeepseekV3ForCausalLM forward loop, batch 64 (this run)",
                "value": hf["tokens_per_s"]}
    elif ref:
        base = {"name": "reference torch runtime path, batch 64 (this run)", "value": ref["tokens_per_s"]}
    else:
        base = {"name": "transformers forward loop, batch 64 (issue 8's figure: 123 ms)", "value": 64 / 0.123}
    targets = {f"b{b}_ctx{c}": r["meets"] for (b, c), r in dec.items()}
    correct = [v.get("ok") for k, v in run.checks.items() if isinstance(v, dict) and "ok" in v]
    # every greedy row's target, and every correctness check that ran; a correctness section that
    # raised fails it; without a row at the issue's 512-token setting the tokens/s targets are
    # not judged, so there is no verdict (None)
    crashed = any(k.startswith("correctness") or "correctness" in k for k in run.errors)
    judged = any(c <= ISSUE_CTX and b in TARGET_TOK_S for b, c in dec)
    verdict = (bool(targets) and all(targets.values()) and (not correct or all(correct)) and not crashed) \
        if judged or crashed else None
    return {"metric": f"v2-lite decode output tokens/s at batch 64, ctx {ctx0} (27 layers, bf16, runtime step)",
            "unit": "tokens/s", "value": value, "baseline": base,
            "ratio": value / base["value"] if base["value"] else 0.0,
            "target": (">= 70% of roofline at batch 64-256 and >= 50% at 1-8, every context; >= 5,900 / 21,000 "
                       "tokens/s at batch 64 / 256 with 512-token contexts (the issue's setting); the correctness "
                       "checks that ran pass"),
            "meets_target": verdict, "targets": targets,
            "correct": (all(correct) if correct else None), "checks": run.checks, "errors": run.errors, "info": run.info}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, interpreter: checks the script only")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 1024, 4096],
                    help="contexts; the tokens/s targets are judged at 512 (the issue's setting) only")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--router-split", action="store_true",
                    help="runtime option router_split on (the split-gate router GEMM in prefill steps; an A/B)")
    ap.add_argument("--no-fuse-shared", action="store_true",
                    help="run the shared experts as their own MLP, not inside the fused MoE launch")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine (runtime processes) check")
    ap.add_argument("--only-decode", action="store_true",
                    help="the bf16 decode section alone (no correctness checks, no FP8 or baseline sections)")
    args = ap.parse_args()
    run = Run(args.budget_s)
    device = "cpu" if args.smoke else "cuda"
    run.info.update(torch=torch.__version__, device=device)
    try:
        import triton
        run.info["triton"] = triton.__version__
    except ImportError:
        pass
    if device == "cuda":
        run.info["gpu"] = torch.cuda.get_device_name()
        with run.section("copy bandwidth", 5) as go:
            if go:
                run.info["copy_Bps"] = copy_bandwidth()
                print(f"  copy bandwidth (read + write): {run.info['copy_Bps'] / 1e12:.2f} TB/s", flush=True)
    v2_small = {"num_hidden_layers": 3, "initializer_range": 0.1}
    with run.section("correctness v2-lite (3 layers)", 60) as go:
        if go and not args.only_decode:
            if args.smoke:
                check_correctness(run, "correct_tiny_smoke", "tiny",
                                  {"num_hidden_layers": 2, "initializer_range": 0.15}, device, True)
            else:
                check_correctness(run, "correct_v2lite_3_layers", "v2-lite", v2_small, device, False)
    with run.section("decode v2-lite", 90) as go:
        if go:
            bench_decode(run, args, device)
    if not args.smoke and not args.only_decode:
        with run.section("decode v2-lite, FP8 experts", 60) as go:
            if go:
                bench_fp8(run, args.ctx[0], (64, 256))
        with run.section("FP8 KV cache: correctness v2-lite (3 layers), decode v2-lite", 100) as go:
            if go:
                check_correctness(run, "correct_v2lite_3_layers_fp8_kv", "v2-lite", v2_small, device, False,
                                  kv_cache_dtype="fp8")
                bench_fp8(run, max(args.ctx), (64, 256), kv_cache=True)
        if not args.no_hf:
            with run.section("transformers baseline", 90) as go:
                if go:
                    bench_transformers(run, 64, 512, 4)
        with run.section("correctness tiny (q LoRA, group routing)", 60) as go:
            if go:
                check_correctness(run, "correct_tiny", "tiny", {"initializer_range": 0.15}, device, False)
        if not args.no_engine:
            with run.section("engine on CUDA", 100) as go:
                if go:
                    check_engine(run)
    emit("bench_decode_h200", run.rows, headline(run), args.json)


if __name__ == "__main__":
    main()
