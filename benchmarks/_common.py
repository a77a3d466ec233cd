"""Shared helpers for benchmarks: timing medians, the table, the JSON contract line."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time

import numpy as np


def median_s(fn, repeat: int = 30, warmup: int = 3) -> tuple[float, float]:
    """(median, best) wall seconds of fn()."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)), float(min(ts))


def machine() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return f"{platform.processor() or platform.machine()}, {platform.python_version()}, commit {commit}"


def emit(bench: str, rows: list[dict], headline: dict, as_json: bool) -> None:
    cols = list(dict.fromkeys(c for r in rows for c in r))  # every row's columns, first seen first
    print(f"# {bench} ({machine()})")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols))
    h = headline
    if h.get("measured") is False:  # a partial run (e.g. other sections only): no figure to judge
        print(f"headline: {h['metric']}: not measured in this run (target {h['target']})")
    else:
        verdict = "no verdict" if h["meets_target"] is None else "met" if h["meets_target"] else "NOT met"
        print(f"headline: {h['metric']} = {h['value']:.4g} {h['unit']} (baseline {h['baseline']['name']}: "
              f"{h['baseline']['value']:.4g}; {h['ratio']:.1f}x better; target {h['target']}: {verdict})")
    if as_json:
        print(json.dumps({"bench": bench, "rows": rows, "headline": h}))


def at_least(low: int):
    """An argparse type: an integer >= ``low`` (a bad one is a usage error naming the flag,
    not a traceback from deep inside the run)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse
