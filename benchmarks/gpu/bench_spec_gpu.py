"""Speculative decoding on the GPU through the whole engine: the v2-lite target with and
without a draft, measured, not modeled (issue 9's H200 comparison).

Each setting runs in a process of its own (one engine per process): the v2-lite shape
(bf16, random weights drawn on the device) on the fast path, decode steps as CUDA graphs.
With a draft, the runtime's verify (the last token and its k drafts, per request) and the
draft's passes replay graphs sized by tokens. The draft is ``layers:N``: the target's own
first N layers with its embeddings and head (self-speculation, sharing the weights), the one
draft a random-weight target has whose proposals can agree with it. Even so a random target's
layers each rewrite its next-token choice, and the self-draft agrees almost never: a run
``DRAFT@SCALE`` multiplies every layer's output projections by SCALE (runtime option
``layer_output_scale``), so layers refine the residual stream rather than rewrite it and the
draft agrees more often. Acceptance is then measured, not injected, and step times do not
depend on the weights' values.

For each concurrency c in --concurrency: c requests at once (random prompts of --prompt
tokens, greedy, --output tokens each, EOS ignored); output tokens/s over the wall time of the
batch (median of --repeat), TPOT, TTFT (median and slowest), the steps the batch took (those
carrying a prefill apart, with their time and the runtime's own host and device seconds), each
request's tokens per decode step (fewest first: one request that never accepts a draft sets
the batch's wall time), and the speculation counters over those requests (acceptance per
position, mean accepted drafts).

With --regex, take a small scale (1e-6): the regex's letters are far down a random target's
choices, and at 1e-4 a request can settle on a letter where the draft's and the target's
second choices differ by a hair; its output then repeats that letter and no draft of it is
accepted again (seen on the H200: 1 request of 8, 3 of 32; session 26). Greedy tokens with a draft are compared with
the plain run's, request by request, up to each one's first difference (bf16 near-ties may
part them: a verify of 1 + k rows sums in another order than a one-row decode).

    python3 benchmarks/gpu/bench_spec_gpu.py --runs none@1,layers:2@1,none@0.1,layers:2@0.1 --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import attrs
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _common import emit  # noqa: E402


async def serve(args, draft: str, scale: float) -> dict:
    import trio

    from lockstep.api import open_engine
    from lockstep.engine.config import EngineConfig
    from lockstep.policy.config import SchedulerConfig
    from lockstep.policy.request import SamplingParams

    most = max(args.concurrency)
    sched = SchedulerConfig(num_blocks=args.blocks, max_num_seqs=most, max_num_batched_tokens=8192,
                            max_model_len=args.prompt + args.output + 64)
    opts = {"init_on_device": args.device == "cuda", "capture_len": args.prompt + args.output + 64,
            "layer_output_scale": scale}
    over = {"num_hidden_layers": args.layers} if args.layers else {}
    if args.init_range:
        over["initializer_range"] = args.init_range
    if over:
        opts["preset_overrides"] = over
    if args.no_compile:
        opts["compile"] = False
    if args.no_launch_ahead:
        opts["launch_ahead"] = False
    if args.device == "cpu":  # checks the script: the graph path's buffers, kernels interpreted
        opts.update(fast=True, cuda_graphs="padded", compile=False, preset_overrides={"num_hidden_layers": 2})
    extra = dict(draft_model=draft, num_spec_tokens=args.k) if draft else {}
    cfg = EngineConfig(model=args.model if args.device == "cuda" else "tiny", device=args.device,
                       dtype="bfloat16", tokenizer=None, scheduler=sched, runtime_options=opts, **extra)
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    if args.regex:  # every token of every request guided (a grammar that cannot end within --output)
        from lockstep.policy.request import StructuredOutputsParams

        params = attrs.evolve(params, structured_outputs=StructuredOutputsParams(regex=f"[a-z]{{{args.output + 50}}}"))
    rows, tokens = [], {}
    t_load = time.perf_counter()
    async with open_engine(cfg) as engine:
        load_s = time.perf_counter() - t_load
        # Each step: when its result came, whether some request prefilled, and the runtime's
        # own host and device seconds for it.
        steps = []
        most_new = 1 + (args.k if draft else 0)
        sampled: dict[int, list[int]] = {}  # request -> tokens each decode step gave it

        def on_result(plan, result):
            steps.append((time.perf_counter(), bool(len(plan.num_new) and plan.num_new.max() > most_new),
                          result.host_s, result.gpu_s))
            for rid, new, got in zip(plan.req_ids.tolist(), plan.num_new.tolist(), result.num_sampled.tolist()):
                if new <= most_new:
                    sampled.setdefault(rid, []).append(got)
        engine.scheduler.on_result = on_result
        await engine.complete(rng.integers(10, 500, 16).astype(np.int32), SamplingParams(max_tokens=4))  # warm
        for c in args.concurrency:
            runs, first = [], None
            for rep in range(args.repeat):
                prompts = [np.random.default_rng([args.seed, c, i]).integers(10, 500, args.prompt).astype(np.int32)
                           for i in range(c)]
                before = engine.spec_statistics() if draft else None
                if args.regex and args.fresh_grammar:  # a grammar no request has used yet: compiled while the batch arrives
                    from lockstep.policy.request import StructuredOutputsParams

                    params = attrs.evolve(params, structured_outputs=StructuredOutputsParams(
                        regex=f"[a-z]{{{args.output + 50}}}[0-9]{{{1 + rep + 10 * c}}}"))
                out = [None] * c
                steps.clear()
                sampled.clear()
                t0 = time.perf_counter()

                async def one(i):
                    out[i] = await engine.complete(prompts[i], params)
                async with trio.open_nursery() as n:
                    for i in range(c):
                        n.start_soon(one, i)
                wall = time.perf_counter() - t0
                n_out = sum(len(o.token_ids) for o in out)
                tpot = [(o.e2e_s - o.ttft_s) / max(len(o.token_ids) - 1, 1) for o in out]
                when = np.array([t0] + [s[0] for s in steps])
                took = np.diff(when)
                pre = np.array([s[1] for s in steps], bool)
                host, gpu = (np.array([s[i] for s in steps]) for i in (2, 3))
                ttft = [o.ttft_s for o in out]
                runs.append({"tokens_per_s": n_out / wall, "tpot_ms": 1e3 * float(np.median(tpot)),
                             "ttft_ms": 1e3 * float(np.median(ttft)), "ttft_max_ms": 1e3 * max(ttft),
                             "steps": len(steps), "prefill_steps": int(pre.sum()),
                             # each request's tokens per decode step, fewest first
                             "per_request": sorted(round(float(np.mean(v)), 2) for v in sampled.values()),
                             "prefill_step_ms": 1e3 * float(took[pre].sum()),
                             "decode_step_ms": 1e3 * float(np.median(took[~pre])) if (~pre).any() else float("nan"),
                             "prefill_host_ms": 1e3 * float(host[pre].sum()), "prefill_gpu_ms": 1e3 * float(gpu[pre].sum()),
                             "decode_host_ms": 1e3 * float(np.median(host[~pre])) if (~pre).any() else float("nan"),
                             "decode_gpu_ms": 1e3 * float(np.median(gpu[~pre])) if (~pre).any() else float("nan"),
                             "spec": _delta(before, engine.spec_statistics()) if draft else None})
                if first is None:
                    first = [o.token_ids.tolist() for o in out]
            mid = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
            tokens[c] = first
            if args.regex:  # (the byte tokenizer's ids: a letter's is its byte + 3)
                letters = set(range(ord("a") + 3, ord("z") + 4))
                row_out = sum(t not in letters for seq in first for t in seq)
            row = {"draft": draft or "none", "scale": scale, "k": args.k if draft else 0, "concurrency": c,
                   "tokens_per_s": mid["tokens_per_s"], "tpot_ms": mid["tpot_ms"],
                   **{k: mid[k] for k in ("ttft_ms", "ttft_max_ms", "steps", "prefill_steps", "prefill_step_ms",
                                          "decode_step_ms", "prefill_host_ms", "prefill_gpu_ms", "decode_host_ms",
                                          "decode_gpu_ms", "per_request")},
                   "all_tokens_per_s": [r["tokens_per_s"] for r in runs],
                   "distinct_tokens": len({t for seq in first for t in seq})}
            if args.regex:
                row["tokens_outside_regex"] = row_out
            if draft:
                sp = mid["spec"]
                row.update(mean_accepted=sp["accepted_tokens"] / max(sp["drafts"], 1),
                           acceptance=sp["accepted_tokens"] / max(sp["draft_tokens"], 1),
                           per_position=[a / max(sp["drafts"], 1) for a in sp["accepted_per_position"]])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"rows": rows, "tokens": {str(c): t for c, t in tokens.items()}, "load_s": load_s}


def _delta(a: dict, b: dict) -> dict:
    """The counters' growth between two spec_statistics snapshots."""
    out = {}
    for key in ("drafts", "draft_tokens", "accepted_tokens"):
        out[key] = b[key] - a[key]
    out["accepted_per_position"] = [y - x for x, y in zip(a["accepted_per_position"], b["accepted_per_position"])]
    return out


def compare(plain: dict, other: dict) -> dict:
    same = total = whole = seqs = 0
    for c, seq in plain["tokens"].items():
        for x, y in zip(seq, other["tokens"].get(c, [])):
            k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            same, total, whole, seqs = same + k, total + len(x), whole + (k == len(x)), seqs + 1
    return {"tokens_before_first_difference": same, "tokens": total, "sequences_equal": whole, "sequences": seqs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default="v2-lite")
    ap.add_argument("--layers", type=int, default=0, help="cut the target to this many layers (0: all)")
    ap.add_argument("--runs", default="none@1,layers:2@1",
                    help="comma-separated DRAFT@SCALE settings (DRAFT 'none': no speculation)")
    ap.add_argument("--init-range", type=float, default=0.0, help="the preset's initializer_range (0: its own)")
    ap.add_argument("--no-compile", action="store_true", help="no torch.compile of the fast path's small ops")
    ap.add_argument("--no-launch-ahead", action="store_true",
                    help="runtime option launch_ahead off: each step's tokens are back before the next starts")
    ap.add_argument("--k", type=int, default=3, help="drafts per decode")
    ap.add_argument("--regex", action="store_true",
                    help="structured outputs: every request held to a regex of letters on every step")
    ap.add_argument("--fresh-grammar", action="store_true",
                    help="with --regex: each batch's regex is one no request used before (compiled as it arrives)")
    ap.add_argument("--concurrency", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cpu: checks the script on the tiny model")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per setting's process")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: run this DRAFT@SCALE, print JSON
    args = ap.parse_args()
    runs = [_setting(r) for r in args.runs.split(",") if r]
    if args.one is not None:
        import trio

        print("RESULT " + json.dumps(trio.run(serve, args, *_setting(args.one))), flush=True)
        return
    results = {}
    for draft, scale in runs:
        cmd = [sys.executable, "-u", __file__, "--one", f"{draft or 'none'}@{scale}"] + [
            a for a in sys.argv[1:] if a != "--json"]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=os.environ)
        except subprocess.TimeoutExpired as e:
            print(f"{draft or 'none'}@{scale}: timed out after {args.timeout:.0f} s\n{(e.stdout or b'')[-2000:]!r}",
                  flush=True)
            continue
        got = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
        if p.returncode or not got:
            print(f"{draft or 'none'}@{scale}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}",
                  flush=True)
            continue
        results[draft, scale] = res = json.loads(got[-1][len("RESULT "):])
        print(f"{draft or 'none'}@{scale}: {time.perf_counter() - t0:.0f} s (engine start {res['load_s']:.0f} s)",
              flush=True)
    rows, info = [], {}
    for (draft, scale), res in results.items():
        # The baseline: no draft at the same scale, else at any (weights' values do not change
        # step times, only which tokens come out).
        plain = results.get(("", scale)) or next((v for (d, _), v in results.items() if not d), None)
        base = {r["concurrency"]: r["tokens_per_s"] for r in plain["rows"]} if plain else {}
        for r in res["rows"]:
            b = base.get(r["concurrency"])
            rows.append({**{k: v for k, v in r.items() if k != "all_tokens_per_s"},
                         "speedup": r["tokens_per_s"] / b if b and draft else float("nan")})
        if draft and ("", scale) in results:
            info[f"greedy_vs_plain_{draft}@{scale}"] = compare(results["", scale], res)
            print(f"{draft}@{scale} greedy vs plain:", info[f"greedy_vs_plain_{draft}@{scale}"], flush=True)
    best = max((r for r in rows if r["draft"] != "none"), key=lambda r: r["speedup"], default=None)
    if best is not None:  # its own baseline: no draft at its scale (else at any)
        plain = results.get(("", best["scale"])) or next((v for (d, _), v in results.items() if not d), None)
        base = {r["concurrency"]: r["tokens_per_s"] for r in plain["rows"]} if plain else {}
    emit("bench_spec_gpu", rows, {
        "metric": f"output tokens/s with speculation ({best['draft']}@{best['scale']}, k={best['k']}, concurrency "
                  f"{best['concurrency']})" if best else "output tokens/s with speculation",
        "unit": "tokens/s", "value": best["tokens_per_s"] if best else float("nan"),
        "baseline": {"name": "the same engine without a draft, same run",
                     "value": base.get(best["concurrency"], float("nan")) if best else float("nan")},
        "ratio": best["speedup"] if best else float("nan"),
        "target": "the comparison (issue 9 gives no figure)", "meets_target": None, **info,
    }, args.json)


def _setting(text: str) -> tuple[str, float]:
    """'DRAFT@SCALE' (or 'DRAFT', scale 1) as (draft, or '' for none; scale)."""
    draft, _, scale = text.partition("@")
    return ("" if draft == "none" else draft), float(scale or 1.0)


if __name__ == "__main__":
    main()
