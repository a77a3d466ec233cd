"""`lockstep bench serve`: load any OpenAI-compatible endpoint with a trace or a random
dataset and report latency percentiles, throughput and goodput.

Flags follow `vllm bench serve` where they overlap. Prompts are sent as token ids, so input
lengths are exact; outputs use ``ignore_eos`` so output lengths are too (a server that
ignores it shortens them, and the report counts what came back). Arrivals: the trace's own
times, or Poisson (``--burstiness 1``) / gamma arrivals at ``--request-rate``.
"""

from __future__ import annotations

import collections
import json
import os
import math
import time
from pathlib import Path

import numpy as np
import trio


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks against a running server").add_subparsers(
        dest="bench", required=True, metavar="{serve}", title="benchmarks")
    s = b.add_parser("serve", help="load an OpenAI-compatible endpoint and report latencies")
    s.add_argument("--base-url", help="e.g. http://127.0.0.1:8000 (default: from --host/--port)")
    s.add_argument("--host", default="127.0.0.1", help="server address (without --base-url)")
    s.add_argument("--port", type=int, default=8000, help="server port (without --base-url)")
    s.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions"],
                   help="the completions endpoint (prompts are sent as token ids)")
    s.add_argument("--model", help="model id (default: the server's first model)")
    s.add_argument("--dataset-name", default="random", choices=["random", "mooncake", "azure", "agentic"])
    s.add_argument("--dataset-path", help="trace file for mooncake/azure")
    s.add_argument("--num-prompts", type=int, default=200, help="requests to send")
    s.add_argument("--random-input-len", type=int, default=256, help="prompt tokens (dataset random)")
    s.add_argument("--random-output-len", type=int, default=32, help="max_tokens (dataset random)")
    s.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf sends all at once "
                   "(default for random), traces keep their own times unless this is given")
    s.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times (1 = Poisson)")
    s.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    s.add_argument("--vocab-size", type=int, help="token ids are drawn below this (default: the server's, or 32000)")
    s.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    s.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help="metrics to report percentiles of")
    s.add_argument("--metric-percentiles", default="50,90,99", help="percentiles to report")
    s.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    s.add_argument("--save-result", action="store_true", help="write the results as JSON")
    s.add_argument("--result-dir", default=".", help="where --save-result writes (made if missing)")
    s.add_argument("--result-filename", help="file name for --save-result (default: from the run's settings)")
    s.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def workload(args, vocab: int) -> tuple[list[np.ndarray], list[int], list[float] | None]:
    """(prompts as token-id arrays, output lengths, trace arrival times or None)."""
    rng = np.random.default_rng(args.seed)
    if args.dataset_name == "random":
        prompts = [rng.integers(10, vocab, args.random_input_len).astype(np.int32) for _ in range(args.num_prompts)]
        return prompts, [args.random_output_len] * args.num_prompts, None
    from lockstep.sim.traces import agentic_workload, read_trace, segment_tokens

    if args.dataset_name == "agentic":
        reqs = agentic_workload(seed=args.seed)
    else:
        if not args.dataset_path:
            raise ValueError(f"--dataset-path is required for --dataset-name {args.dataset_name}")
        reqs = read_trace(args.dataset_path, fmt=args.dataset_name).requests
    reqs = reqs[: args.num_prompts]
    prompts = [segment_tokens(r.seg_ids, r.seg_lens, vocab_size=vocab, seed=args.seed) for r in reqs]
    return prompts, [max(1, r.output_len) for r in reqs], [r.arrival_s - reqs[0].arrival_s for r in reqs]


def arrivals(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


async def one_request(client, url: str, model: str, prompt: np.ndarray, out_len: int) -> dict:
    body = {"model": model, "prompt": prompt.tolist(), "max_tokens": out_len, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0}
    rec = {"input_len": len(prompt), "ok": False, "chunks": [], "output_len": 0, "error": ""}
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode("utf-8", "replace")
                try:
                    body = str(json.loads(body)["error"]["message"])
                except (ValueError, KeyError, TypeError):
                    pass
                rec["error"] = f"HTTP {r.status_code}: {body[:200]}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:  # the server failed it mid-stream: a failure, whatever came before
                    err = data["error"] if isinstance(data["error"], dict) else {"message": data["error"]}
                    rec["error"] = f"{err.get('type', 'error')}: {err.get('message', '')}"[:300]
                    return rec
                if data.get("choices"):
                    rec["chunks"].append(time.perf_counter() - start)
                if data.get("usage"):
                    rec["output_len"] = data["usage"]["completion_tokens"]
        rec["ok"] = bool(rec["chunks"])
        rec["output_len"] = rec["output_len"] or len(rec["chunks"])
    except Exception as e:  # noqa: BLE001 - reported per request, counted as a failure
        rec["error"] = repr(e)
    rec["e2e"] = time.perf_counter() - start
    return rec


def _metrics(args) -> tuple[list[str], list[float]]:
    """--percentile-metrics and --metric-percentiles, parsed (spaces allowed), or a ValueError
    naming the flag: checked before any request is sent."""
    names = [n.strip() for n in args.percentile_metrics.split(",") if n.strip()]
    bad = [n for n in names if n not in ("ttft", "tpot", "itl", "e2el")]
    if bad or not names:
        raise ValueError(f"--percentile-metrics takes a comma-separated list of ttft, tpot, itl, e2el; "
                         f"got {args.percentile_metrics!r}")
    try:
        pcts = [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError:
        pcts = [float("nan")]
    if not all(0 <= p <= 100 for p in pcts):
        raise ValueError(f"--metric-percentiles takes comma-separated numbers in [0, 100], got {args.metric_percentiles!r}")
    return names, pcts


def summarize(recs: list[dict], duration: float, args) -> dict:
    ok = [r for r in recs if r["ok"]]
    names, pcts = _metrics(args)
    ttft = np.array([r["chunks"][0] for r in ok]) * 1e3
    e2el = np.array([r["e2e"] for r in ok]) * 1e3
    tpot = np.array([(r["e2e"] - r["chunks"][0]) / (r["output_len"] - 1) for r in ok if r["output_len"] > 1]) * 1e3
    itl = np.concatenate([np.diff(r["chunks"]) for r in ok] or [np.zeros(0)]) * 1e3
    out = {"completed": len(ok), "failed": len(recs) - len(ok), "duration_s": duration,
           "total_input_tokens": int(sum(r["input_len"] for r in ok)),
           "total_output_tokens": int(sum(r["output_len"] for r in ok)),
           "errors": [f"{n} x {e}" for e, n in collections.Counter(r["error"] for r in recs if r["error"])
                      .most_common(5)]}
    # vLLM's per-request arrays (seconds), in request order; failed requests keep their slot
    # with zero output (as `vllm bench serve` saves them)
    out["duration"] = duration
    out["input_lens"] = [r["input_len"] for r in recs]
    out["output_lens"] = [r["output_len"] if r["ok"] else 0 for r in recs]
    out["ttfts"] = [r["chunks"][0] if r["ok"] else 0.0 for r in recs]
    out["itls"] = [np.diff(r["chunks"]).tolist() if r["ok"] else [] for r in recs]
    out["request_throughput"] = len(ok) / duration
    out["output_throughput"] = out["total_output_tokens"] / duration
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / duration
    series = {"ttft": ttft, "tpot": tpot, "itl": itl, "e2el": e2el}
    for name in names:
        v = series[name]
        out[f"mean_{name}_ms"] = float(v.mean()) if len(v) else float("nan")
        out[f"median_{name}_ms"] = float(np.median(v)) if len(v) else float("nan")
        out[f"std_{name}_ms"] = float(v.std()) if len(v) else float("nan")
        for p in pcts:
            out[f"p{p:g}_{name}_ms"] = float(np.percentile(v, p)) if len(v) else float("nan")
    if args.goodput:
        slo = _goodput(args.goodput)
        good = 0
        for r in ok:
            t = {"ttft": r["chunks"][0] * 1e3, "e2el": r["e2e"] * 1e3,
                 "tpot": (r["e2e"] - r["chunks"][0]) / max(r["output_len"] - 1, 1) * 1e3}
            good += all(t[k] <= v for k, v in slo.items())
        out["request_goodput"] = good / duration
    return out


async def run(args) -> dict:
    import httpx

    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    limits = httpx.Limits(max_connections=args.max_concurrency or 4096, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        try:
            models = (await client.get(f"{base}/v1/models")).json()["data"]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            raise ValueError(f"cannot list models at {base}/v1/models ({e!r}); is the server up?") from None
        model = args.model or models[0]["id"]
        vocab = args.vocab_size or next((m.get("vocab_size") for m in models if m["id"] == model), None) or 32000
        prompts, outs, trace_times = workload(args, vocab)
        n = len(prompts)
        when = (np.array(trace_times) if trace_times is not None and math.isinf(args.request_rate)
                else arrivals(n, args.request_rate, args.burstiness, args.seed))
        gate = trio.CapacityLimiter(args.max_concurrency or n)
        recs: list = [None] * n
        progress = _progress(n, args.disable_tqdm)
        t0 = trio.current_time()

        async def fire(i):
            async with gate:
                recs[i] = await one_request(client, base + args.endpoint, model, prompts[i], outs[i])
            progress(1)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(n):
                await trio.sleep_until(t0 + float(when[i]))
                nursery.start_soon(fire, i)
        progress(0, close=True)
        duration = time.perf_counter() - start
    result = summarize(recs, duration, args)
    from datetime import datetime

    replayed = trace_times is not None and math.isinf(args.request_rate)  # arrivals at the trace's times
    result.update({"model": model, "model_id": model, "tokenizer_id": model, "backend": "lockstep",
                   "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "base_url": base,
                   "dataset": args.dataset_name, "num_prompts": n,
                   "request_rate": "trace" if replayed else args.request_rate, "burstiness": args.burstiness,
                   "max_concurrency": args.max_concurrency})
    return result


def _progress(total: int, disabled: bool):
    if disabled:
        return lambda k, close=False: None
    from rich.progress import Progress

    bar = Progress(transient=True)
    bar.start()
    task = bar.add_task("requests", total=total)

    def step(k, close=False):
        bar.advance(task, k)
        if close:
            bar.stop()
    return step


def print_table(res: dict, args) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"lockstep bench serve: {res['model']} at {res['base_url']}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for key in ("completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "request_goodput"):
        if key in res:
            v = res[key]
            t.add_row(key, f"{v:.3f}" if isinstance(v, float) else str(v))
    for name in _metrics(args)[0]:
        for k in [k for k in res if k.endswith(f"_{name}_ms")]:
            t.add_row(k, f"{res[k]:.2f}")
    Console().print(t)
    for e in res["errors"]:
        print("error:", e)


_SLO_KEYS = ("ttft", "tpot", "e2el")


def _goodput(items: list[str]) -> dict[str, float]:
    """--goodput KEY:MS ... as {key: ms}, or a ValueError naming the item that is not."""
    slo = {}
    for item in items:
        key, _, ms = item.partition(":")
        try:
            value = float(ms)
        except ValueError:
            value = float("nan")
        if key not in _SLO_KEYS or not value > 0:
            raise ValueError(f"--goodput takes KEY:MS with KEY one of {', '.join(_SLO_KEYS)} and MS > 0, "
                             f"e.g. ttft:500; got {item!r}")
        slo[key] = value
    return slo


def _strict_json(v):
    """JSON that every parser takes: an infinite rate as "inf" (as vLLM writes it), a
    statistic of nothing (NaN) as null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {k: _strict_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_strict_json(x) for x in v]
    return v


def run_bench(args) -> int:
    _goodput(args.goodput)  # checked before any request is sent
    _metrics(args)
    if args.save_result:  # made now, as vLLM's (a missing one used to fail after the whole run)
        out = Path(args.result_dir)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--result-dir {args.result_dir}: cannot make it: {e.strerror or e}") from None
        if not out.is_dir() or not os.access(out, os.W_OK):
            raise ValueError(f"--result-dir {args.result_dir}: not a writable directory")
    res = trio.run(run, args)
    print_table(res, args)
    if args.save_result:
        name = args.result_filename or f"lockstep-bench-{res['dataset']}-{int(time.time())}.json"
        path = Path(args.result_dir) / name
        path.write_text(json.dumps(_strict_json(res), indent=2, sort_keys=True, allow_nan=False))
        print(f"saved {path}")
    return 0 if res["failed"] == 0 else 1
