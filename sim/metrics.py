"""Metrics the simulator collects and the report it writes (DESIGN.md's `lockstep sim --json`).

Per-request times live in numpy arrays indexed by request id, so recording a step is a few
vector operations. Inter-token latencies are kept as (value, weight) pairs: ``advance(k)``
adds k-1 step durations with the batch size as weight instead of one sample per token.
Nothing here reads a wall clock: same inputs, same bytes.
"""

from __future__ import annotations

import math

import numpy as np


def _stats(values: np.ndarray, weights: np.ndarray | None = None) -> dict:
    if len(values) == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    if weights is None:
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return {"mean": float(values.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order]
    cum = np.cumsum(w)
    total = cum[-1]
    pick = lambda q: float(v[min(np.searchsorted(cum, q * total), len(v) - 1)])  # noqa: E731
    return {"mean": float((v * w).sum() / total), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


class Metrics:
    def __init__(self, n_requests: int, total_blocks: int):
        self.arrival = np.full(n_requests, np.nan)
        self.first = np.full(n_requests, np.nan)
        self.second = np.full(n_requests, np.nan)  # P/D: the first token from the decode side
        self.last = np.full(n_requests, np.nan)
        self.finish = np.full(n_requests, np.nan)
        self.ntok = np.zeros(n_requests, dtype=np.int64)
        self.rejected: dict[str, int] = {}
        # Flat Python lists, turned into arrays at report time: a step adds a few values,
        # which numpy would charge a few microseconds of call overhead each.
        self._itl_v: list[float] = []
        self._itl_w: list[float] = []
        self._tok_t: list[float] = []
        self._tok_n: list[int] = []
        # KV use per instance, as (times, blocks used): instances advance their clocks
        # independently, so the deployment-wide series is merged at report time.
        self._kv: dict[int, tuple[list, list]] = {}
        self.total_blocks = total_blocks
        self.steps = 0

    def reject(self, rid: int, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def tokens(self, rids: np.ndarray, t: float) -> None:
        """One token for each request in ``rids`` at time t."""
        if len(rids) == 0:
            return
        ntok, last, first, second = self.ntok, self.last, self.first, self.second
        if len(rids) > 8:  # the same values, in the same order, from vector operations
            n = ntok[rids]
            seen = rids[n > 0]
            self._itl_v += (t - last[seen]).tolist()
            self._itl_w += [1.0] * len(seen)
            second[rids[n == 1]] = t
            first[rids[n == 0]] = t
            last[rids] = t
            ntok[rids] = n + 1
            self._tok_t.append(t)
            self._tok_n.append(len(rids))
            return
        itl_v, itl_w = self._itl_v, self._itl_w
        for r in rids.tolist():  # item() and Python floats: a step is one or a few requests
            n = ntok.item(r)
            if n:
                itl_v.append(t - last.item(r))
                itl_w.append(1.0)
                if n == 1:
                    second[r] = t
            else:
                first[r] = t
            last[r] = t
            ntok[r] = n + 1
        self._tok_t.append(t)
        self._tok_n.append(len(rids))

    def token_counts(self, rids: np.ndarray, counts: np.ndarray, t: float) -> None:
        """counts[i] tokens for request rids[i], delivered together at time t (speculative
        decoding): one inter-token latency per delivery, so ITL is the time between a
        request's deliveries while TPOT still divides by every token."""
        if len(rids) == 0:
            return
        ntok, last, first, second = self.ntok, self.last, self.first, self.second
        for r, n in zip(rids.tolist(), counts.tolist()):
            if ntok[r] > 0:
                self._itl_v.append(t - last[r])
                self._itl_w.append(1.0)
                if ntok[r] == 1:
                    second[r] = t
            else:
                first[r] = t
            last[r] = t
            ntok[r] += n
        self._tok_t.append(t)
        self._tok_n.append(int(counts.sum()))

    def token_run(self, rids: np.ndarray, ends: list[float]) -> None:
        """k tokens for each request, at step ends ``ends`` (k,)."""
        self.tokens(rids, ends[0])
        if len(ends) > 1:
            more = len(ends) - 1
            if len(rids) <= 8:  # item() and Python floats, as ``tokens``
                ntok, second, last, end = self.ntok, self.second, self.last, ends[-1]
                for r in rids.tolist():
                    n = ntok.item(r)
                    if n == 1:
                        second[r] = ends[1]
                    last[r] = end
                    ntok[r] = n + more
            else:
                got_one = rids[self.ntok[rids] == 1]
                self.second[got_one] = ends[1]
                self.last[rids] = ends[-1]
                self.ntok[rids] += more
            self._itl_v += [b - a for a, b in zip(ends, ends[1:])]
            self._itl_w += [float(len(rids))] * more
            self._tok_t += ends[1:]
            self._tok_n += [len(rids)] * more

    def kv_sample(self, instance: int, t, used_blocks) -> None:
        """Blocks in use on one instance from time t on (scalars, or lists of both)."""
        ts, us = self._kv.setdefault(instance, ([], []))
        if isinstance(t, list):
            ts += t
            us += used_blocks
        else:
            ts.append(t)
            us.append(used_blocks)

    def _kv_series(self, instances=None, blocks: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Share of KV blocks in use, as a step function (times, use): deployment-wide, or
        over ``instances`` (indices) holding ``blocks`` blocks between them."""
        kv = self._kv if instances is None else {i: v for i, v in self._kv.items() if i in instances}
        if not kv:
            return np.zeros(0), np.zeros(0)
        times, deltas = [], []
        for ts, us in kv.values():
            t, u = np.array(ts, dtype=np.float64), np.array(us, dtype=np.float64)
            times.append(t)
            deltas.append(np.diff(u, prepend=0.0))  # each sample replaces the instance's last
        t, d = np.concatenate(times), np.concatenate(deltas)
        order = np.argsort(t, kind="stable")
        return t[order], np.cumsum(d[order]) / (self.total_blocks if blocks is None else blocks)

    # -- the report --------------------------------------------------------------------------
    def report(self, *, num_gpus: int, slo_ttft: float, slo_tpot: float, prefix: tuple[int, int],
               preemptions: int, extra: dict) -> dict:
        done = ~np.isnan(self.finish)
        ttft = (self.first - self.arrival)[done]
        e2e = (self.finish - self.arrival)[done]
        n = self.ntok[done]
        multi = n > 1
        tpot = ((self.last - self.first)[done][multi]) / (n[multi] - 1)
        itl_v = np.array(self._itl_v, dtype=np.float64)
        itl_w = np.array(self._itl_w, dtype=np.float64)
        start = float(np.nanmin(self.arrival)) if done.any() else 0.0
        end = float(np.nanmax(self.finish)) if done.any() else 0.0
        span = max(end - start, 1e-9)
        out_tokens = int(n.sum())
        tpot_all = np.zeros(done.sum())
        tpot_all[multi] = tpot
        good = (ttft <= slo_ttft) & (tpot_all <= slo_tpot)
        total = len(self.arrival)  # rejected and unfinished requests miss the SLO too
        queries, hits, host_hits = prefix
        kv_mean, kv_max = self._kv_stats()
        rejected = sum(self.rejected.values())
        return {
            **extra,
            "requests": {
                "total": int(len(self.arrival)), "completed": int(done.sum()),
                "rejected": int(rejected), "rejected_reasons": dict(sorted(self.rejected.items())),
            },
            "ttft_s": _stats(ttft), "tpot_s": _stats(tpot), "itl_s": _stats(itl_v, itl_w),
            "e2e_s": _stats(e2e),
            "output_tokens": out_tokens,
            "duration_s": span,
            "output_tokens_per_s": out_tokens / span,
            "output_tokens_per_s_per_gpu": out_tokens / span / num_gpus,
            "goodput": {
                "slo_ttft_s": slo_ttft, "slo_tpot_s": slo_tpot,
                "requests": int(good.sum()), "fraction": float(good.sum() / total) if total else None,
                "requests_per_s": float(good.sum() / span),
            },
            "prefix_cache": {"queries": int(queries), "hits": int(hits),
                             "hit_rate": hits / queries if queries else 0.0,
                             "host_hits": int(host_hits)},
            "preemptions": int(preemptions),
            "kv_cache_use": {"mean": kv_mean, "max": kv_max},
            "steps": int(self.steps),
        }

    def kv_stats(self, instances=None, blocks: int | None = None) -> dict:
        """{mean, max} of ``_kv_series(instances, blocks)``, the mean weighted by time."""
        mean, peak = self._kv_stats(instances, blocks)
        return {"mean": mean, "max": peak}

    def _kv_stats(self, instances=None, blocks: int | None = None) -> tuple[float, float]:
        t, u = self._kv_series(instances, blocks)
        if len(t) < 2:
            return (float(u[0]), float(u[0])) if len(u) else (0.0, 0.0)
        dt = np.diff(t)
        mean = float((u[:-1] * dt).sum() / dt.sum()) if dt.sum() > 0 else float(u.mean())
        return mean, float(u.max())

    def series(self) -> dict:
        """Time series for plots: token throughput and KV use."""
        tok_t = np.array(self._tok_t, dtype=np.float64)
        tok_n = np.array(self._tok_n, dtype=np.int64) if self._tok_n else np.zeros(0)
        kv_t, kv_use = self._kv_series()
        return {"tok_t": tok_t, "tok_n": tok_n, "kv_t": kv_t,
                "kv_use": kv_use, "ttft": self.first - self.arrival,
                "e2e": self.finish - self.arrival}


def clean(obj):
    """JSON-safe: NaN and inf become null."""
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
