"""Presenting a simulation: a rich table for people, JSON for tools, a PNG of the curves."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table


def _gpus(n) -> str:
    return "1 GPU" if n == 1 else f"{n} GPUs"


def write_json(report: dict, path: str | Path) -> None:
    """To ``path``, or to standard output where it is "-"."""
    text = json.dumps(report, indent=2, sort_keys=True) + "\n"
    if str(path) == "-":
        sys.stdout.write(text)
    else:
        Path(path).write_text(text)


def _rate(x: float) -> str:
    """A rate with the digits that matter: 12,345 / 52.4 / 0.0312."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 1 else f"{x:.3g}"


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:,.1f}"


def print_table(report: dict, console: Console | None = None) -> None:
    console = console or Console()
    r = report["requests"]
    head = Table(title=f"lockstep sim: {report.get('deployment', '')} ({_gpus(report.get('num_gpus'))})")
    head.add_column("metric")
    head.add_column("value", justify="right")
    reasons = ", ".join(f"{k}: {v}" for k, v in r["rejected_reasons"].items()) or "none"
    head.add_row("requests", f"{r['total']:,} total, {r['completed']:,} completed, {r['rejected']:,} rejected ({reasons})")
    head.add_row("output tokens/s", f"{_rate(report['output_tokens_per_s'])} "
                 f"({_rate(report['output_tokens_per_s_per_gpu'])} per GPU)")
    g = report["goodput"]
    frac = "-" if g["fraction"] is None else f"{g['fraction']:.1%}"
    head.add_row("goodput", f"{frac} of requests within TTFT {g['slo_ttft_s']} s, TPOT {g['slo_tpot_s'] * 1e3:.0f} ms "
                 f"({_rate(g['requests_per_s'])} req/s)")
    pc = report["prefix_cache"]
    head.add_row("prefix cache", f"{pc['hit_rate']:.1%} of {pc['queries']:,} prompt tokens hit")
    head.add_row("preemptions", f"{report['preemptions']:,}")
    kv = report["kv_cache_use"]
    head.add_row("KV cache use", f"mean {kv['mean']:.1%}, max {kv['max']:.1%}")
    for name, kv in report.get("kv_cache_use_per_pool", {}).items():
        head.add_row(f"  pool {name}", f"mean {kv['mean']:.1%}, max {kv['max']:.1%}")
    head.add_row("simulated time", f"{report['duration_s']:,.1f} s in {report['steps']:,} steps")
    b = report.get("balancedness")
    if b is not None and b["mean"] is not None:
        head.add_row(f"expert balancedness ({b.get('pool', '')})",
                     f"mean {b['mean']:.3f}, min {b['min']:.3f} over {b['windows']:,} windows "
                     f"(balancer {'on' if b['balancer'] else 'off'})")
    if report.get("trace_rows_skipped"):
        head.add_row("trace rows skipped", f"{report['trace_rows_skipped']:,} (--skip-bad-rows)")
    cp = report.get("cost_profile")
    if cp is not None:  # step times from a measured profile, not the analytic model
        out, n = cp["lookups_outside_grid"], cp["lookups"]
        head.add_row("step costs", f"measured profile {cp['profile']} ({cp['device']}); {out:,} of {n:,} lookups "
                     "outside its grid (extrapolated)")
    console.print(head)
    if cp is not None and cp["lookups"] and cp["lookups_outside_grid"] > cp["lookups"] / 10:
        console.print(f"[yellow]warning:[/yellow] {cp['lookups_outside_grid']:,} of {cp['lookups']:,} step-cost "
                      "lookups fell outside the profile's measured grid and were extrapolated: measure the batch "
                      "sizes and contexts this workload reaches (lockstep profile --batches/--contexts/--chunks)")
    lat = Table(title="latency (ms)")
    for col in ("", "mean", "p50", "p90", "p99"):
        lat.add_column(col, justify="right")
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "end-to-end")):
        s = report[key]
        lat.add_row(name, *(_ms(s[q]) for q in ("mean", "p50", "p90", "p99")))
    console.print(lat)
    if "pools" in report:
        _print_pd(report, console)
    if "spec_decode" in report:
        _print_spec(report["spec_decode"], console)


def _print_spec(sd: dict, console: Console) -> None:
    t = Table(title=f"speculative decoding: {sd['num_spec_tokens']} drafts of {sd['draft_model']} per decode"
                    f"{' (adaptive)' if sd['adaptive'] else ''}, acceptance {sd['acceptance']}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("drafts", f"{sd['num_drafts']:,} ({sd['num_draft_tokens']:,} draft tokens)")
    rate = sd["draft_acceptance_rate"]
    of = "" if rate is None else f" ({rate:.1%} of drafts)"
    t.add_row("accepted tokens", f"{sd['num_accepted_tokens']:,}{of}")
    mal = sd["mean_acceptance_length"]
    t.add_row("mean acceptance length", "-" if mal is None else f"{mal:.2f} tokens per decode")
    per = sd["acceptance_rate_per_pos"]
    # vLLM's per-position figure: drafts accepted at position j over all drafts (so it
    # compounds the positions before, unlike [speculative] rates, each given the ones before)
    t.add_row("accepted at position j / drafts", "-" if per is None else ", ".join(f"{p:.1%}" for p in per))
    frac = sd["draft_time_fraction"]
    t.add_row("draft model's share of step time", "-" if frac is None else f"{frac:.1%}")
    console.print(t)


def _print_pd(report: dict, console: Console) -> None:
    steps = Table(title="P/D steps per pool (ms)")
    for col in ("pool", "steps", "step p50", "step p99", "step max", "jump p99", "jump max"):
        steps.add_column(col, justify="right", no_wrap=col == "pool")
    for name, p in report["pools"].items():
        s, j = p["step_s"], p["step_jump_s"]
        steps.add_row(f"{name} ({p['role']}, {_gpus(p['gpus'])})", f"{p['steps']:,}", _ms(s["p50"]), _ms(s["p99"]),
                      _ms(s["max"]), _ms(j["p99"]), _ms(j["max"]))
    console.print(steps)
    kv = report["kv_transfer"]
    t = Table(title="KV transfer (prefill -> decode)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rate = kv["tokens_per_s_per_gpu"]
    t.add_row("pulls", f"{kv['pulls']:,} ({kv['tokens']:,} tokens, {rate:,.0f} tokens/s per decode GPU)")
    for key, name in (("transfer_s", "pull time"), ("queue_wait_s", "wait before the pull starts"),
                      ("second_token_gap_s", "first -> second token")):
        v = kv[key]
        t.add_row(f"{name} (ms)", f"p50 {_ms(v['p50'])}, p99 {_ms(v['p99'])}, max {_ms(v['max'])}")
    desc = kv["descriptors_per_pull"]
    t.add_row("descriptors per pull", "-" if desc is None else f"{desc:.2f}")
    for key, name in (("queued_for_kv", "requests queued for a pull"), ("waiting_for_kv", "requests waiting for KV"),
                      ("prefill_held_blocks", "prefill blocks held for pulls")):
        v = kv[key]
        t.add_row(name, f"mean {v['mean']:,.2f}, max {v['max']:,}")
    console.print(t)


def _bin_width(span: float) -> float:
    """About 60 bins over the run, of a round width (1, 2 or 5 times a power of ten seconds)."""
    if span <= 0:
        return 1.0
    raw = span / 60
    base = 10 ** np.floor(np.log10(raw))
    return float(next(m * base for m in (1, 2, 5, 10) if m * base >= raw))


def plot(series: dict, path: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for key, name in (("ttft", "TTFT"), ("e2e", "end-to-end")):
        v = np.sort(series[key][~np.isnan(series[key])])
        if len(v):
            axes[0].plot(v, np.arange(1, len(v) + 1) / len(v), label=name)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("seconds")
    axes[0].set_ylabel("CDF")
    if axes[0].lines:  # (nothing completed: no curve to name)
        axes[0].legend()
    axes[0].set_title("latency CDFs")
    t, n = series["tok_t"], series["tok_n"]
    width = _bin_width(float(t.max()) if len(t) else 0.0)
    if len(t):
        edges = np.arange(0, t.max() + width, width)
        if len(edges) < 2 or edges[-1] < t.max():
            edges = np.append(edges, edges[-1] + width)
        hist, edges = np.histogram(t, bins=edges, weights=n)
        spans = np.diff(edges)
        spans[-1] = max(t.max() - edges[-2], width / 100)  # the last bin ends with the run, not with the bin
        axes[1].plot(edges[:-1], hist / spans)
    axes[1].set_xlabel("time (s)")
    axes[1].set_ylabel(f"output tokens/s ({width:g} s bins)")
    axes[1].set_title("throughput")
    axes[2].step(series["kv_t"], series["kv_use"] * 100, where="post")
    axes[2].set_xlabel("time (s)")
    axes[2].set_ylabel("KV cache use (%)")
    axes[2].set_title("KV cache")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
