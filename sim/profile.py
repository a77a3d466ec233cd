"""A measured cost model: step times looked up in a profile written by `lockstep profile`.

A deployment names one with ``[cost] profile = "file.json"`` (or ``lockstep sim --profile``);
pools of the profile's model are then priced by ``ProfiledCost`` instead of ``AnalyticCost``.
Only the GPU part of a rank's step changes; the rest is the analytic model's, in its order:
host-tier loads, host work a step adds (P/D pulls), a draft model's passes (``draft_s``),
the host floor and the DP sync (see lockstep.sim.cost).

How a rank's plan is priced (assumptions, all of them):

- Entries feeding at most ``DECODE_MAX`` tokens are decode rows: a decode, a speculative
  verify of 1 + d tokens (d rows more, its request's context counted once, so the KV read
  stays the request's), or the short tail of a prompt. B rows with cached-context sum S
  cost ``decode(B, S / B)``: the profile's decode table, linear in log batch between its
  batch rows and linear in context inside a row.
- Longer entries are prefill chunks. T tokens in all, with token-weighted mean prefix
  P = sum(c_i * s_i) / T, cost ``prefill(T, P)``: linear in log T between the chunk rows,
  linear in prefix inside a row. Several chunks are priced as one chunk of their total (the
  GEMMs see T rows; their attention pairs c*s add up to T * P).
- A step with both costs decode + prefill. Both measurements read all the weights, so a
  mixed step is charged that read twice: an overestimate where the weights dominate (small
  chunks), small next to a large chunk's compute.
- Outside the grid: batch and chunk size are clamped to the measured range (beyond it the
  profile knows nothing, and the scheduler's max_num_seqs and max_num_batched_tokens bound
  them when the grid is the default one); context is clamped below the first point but
  extrapolated linearly above a row's last point (the slope of its last segment): decode at
  twice the largest measured context reads about twice the KV, and clamping would hide it.
  Lookups that leave the grid are counted (``statistics()``, in the sim report).
- The profile is one GPU's (DEP1): a pool of another DEP size is refused rather than priced
  with one GPU's expert reads and no all-to-all.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from pathlib import Path

import attrs
import numpy as np

from lockstep.policy.config import ConfigError
from lockstep.policy.deployment import HARDWARE_PRESETS, CostSpec, HardwareSpec, HostSpec, ModelSpec

from .cost import AnalyticCost, StepLoad

DECODE_MAX = 17  # entries this short are decode rows: one token plus up to MAX_SPEC_TOKENS drafts


@attrs.frozen
class Grid:
    """Seconds over (x, context): x is a batch size or a chunk size; ragged rows allowed."""

    xs: tuple[float, ...]  # sorted
    rows: tuple[tuple[tuple[float, ...], tuple[float, ...]], ...]  # per x: (contexts sorted, seconds)

    @classmethod
    def from_points(cls, points: list[list[float]]) -> Grid:
        by_x: dict[float, list[tuple[float, float]]] = {}
        for x, c, t in points:
            by_x.setdefault(float(x), []).append((float(c), float(t)))
        xs = tuple(sorted(by_x))
        return cls(xs, tuple(tuple(zip(*sorted(by_x[x]))) for x in xs))

    def at(self, x: float, c: float) -> tuple[float, bool]:
        """(seconds, whether the point lies outside the measured grid)."""
        xs = self.xs
        if x <= xs[0] or x >= xs[-1]:
            i = 0 if x <= xs[0] else len(xs) - 1
            t, out = self._row(i, c)
            return t, out or x != xs[i]
        i = bisect.bisect_right(xs, x) - 1
        w = (math.log(x) - math.log(xs[i])) / (math.log(xs[i + 1]) - math.log(xs[i]))
        (a, out_a), (b, out_b) = self._row(i, c), self._row(i + 1, c)
        return a + w * (b - a), out_a or out_b

    def _row(self, i: int, c: float) -> tuple[float, bool]:
        cs, ts = self.rows[i]
        if c <= cs[0] or len(cs) == 1:  # clamped below (and everywhere in a one-point row)
            return ts[0], c != cs[0]
        if c >= cs[-1]:  # extrapolated above: the last segment's slope
            slope = max((ts[-1] - ts[-2]) / (cs[-1] - cs[-2]), 0.0)
            return ts[-1] + slope * (c - cs[-1]), c > cs[-1]
        j = bisect.bisect_right(cs, c) - 1
        return ts[j] + (c - cs[j]) * (ts[j + 1] - ts[j]) / (cs[j + 1] - cs[j]), False


@attrs.frozen
class Profile:
    path: str
    model: str
    device: str
    dep: int
    decode: Grid
    prefill: Grid


def load_profile(path: str | Path, where: str) -> Profile:
    """Read and check a profile; ``where`` says who named it (for the error messages)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: profile file {path} does not exist (write one with `lockstep profile`)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{where}: profile file {path}: not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: profile file {path}: expected a JSON object, got {type(data).__name__}")

    def bad(field: str, what: str) -> ConfigError:
        return ConfigError(f"{where}: profile file {path}: field {field!r} {what}")

    if not isinstance(data.get("model"), str) or not data["model"]:
        raise bad("model", f"must be the model's name (a string), got {data.get('model')!r}")
    dep = data.get("dep", 1)
    if isinstance(dep, bool) or not isinstance(dep, int) or dep < 1:
        raise bad("dep", f"must be an integer >= 1, got {dep!r}")
    grids = {}
    for field, x in (("decode", "batch"), ("prefill", "chunk tokens")):
        points = data.get(field)
        if not isinstance(points, list) or not points:
            raise bad(field, f"must be a non-empty list of [{x}, context, seconds], got {points!r}")
        seen = set()
        for k, p in enumerate(points):
            ok = (isinstance(p, list) and len(p) == 3 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                             for v in p))
            if not ok or not (p[0] >= 1 and p[1] >= 0 and p[2] > 0 and math.isfinite(p[2])):
                raise bad(field, f"point {k}: expected [{x} >= 1, context >= 0, seconds > 0], got {p!r}")
            if (p[0], p[1]) in seen:
                raise bad(field, f"point {k}: {x} {p[0]} at context {p[1]} is measured twice")
            seen.add((p[0], p[1]))
        grids[field] = Grid.from_points(points)
    return Profile(str(path), data["model"], str(data.get("device", "")), dep, grids["decode"], grids["prefill"])


def step_mix(num_new: list[int], start_pos: list[int]) -> tuple[float, float, float, float]:
    """One rank's plan as the profile prices it: (decode rows, their requests' cached-context
    sum, prefill tokens, sum of chunk tokens x prefix). Integer sums, exact as floats."""
    rows = ctx = tokens = weighted = 0
    for c, s in zip(num_new, start_pos):
        if c == 0:  # a table-only entry: its KV arrives from elsewhere
            continue
        if c <= DECODE_MAX:
            rows, ctx = rows + c, ctx + s
        else:
            tokens, weighted = tokens + c, weighted + c * s
    return float(rows), float(ctx), float(tokens), float(weighted)


def mix_from_load(tokens: float, ctx: float, pairs: float) -> tuple[float, float, float, float]:
    """The mix when only the analytic model's per-rank sums are known: every entry one token
    (pairs == ctx) is a decode batch; anything else is taken as one chunk, whose prefix the
    pairs give exactly (c*s + c*(c+1)/2)."""
    if not tokens:
        return 0.0, 0.0, 0.0, 0.0
    if pairs == ctx:
        return tokens, ctx - tokens, 0.0, 0.0
    return 0.0, 0.0, tokens, pairs - tokens * (tokens + 1) / 2


def _same_gpu(preset: str, device: str) -> bool:
    """Whether a device name (torch's, as `lockstep profile` records it) is the preset's GPU:
    the preset's name as a whole word ('NVIDIA H200', 'NVIDIA H200 NVL', 'NVIDIA GB300'; not
    'NVIDIA GH200', not a MIG slice of it)."""
    name = device.lower()
    return bool(re.search(rf"(?<![a-z0-9]){re.escape(preset)}(?![0-9])", name)) and "mig" not in name.split()


class ProfiledCost(AnalyticCost):
    """AnalyticCost with the GPU part of a rank's step looked up in a measured profile."""

    needs_mix = True

    def __init__(self, model: ModelSpec, hw: HardwareSpec, cost: CostSpec, dep: int, host: HostSpec,
                 profile: Profile, pool: str = ""):
        if profile.model != model.name:
            raise ConfigError(f"pool {pool!r} runs model {model.name!r}, but profile {profile.path} measured "
                              f"{profile.model!r}: profile that model, or drop [cost] profile")
        if dep != profile.dep:
            raise ConfigError(f"pool {pool!r} runs DEP{dep}, but profile {profile.path} was measured at "
                              f"DEP{profile.dep}: one GPU's times do not price a DEP group's expert reads "
                              "or all-to-all; use the analytic model for it")
        if hw.name in HARDWARE_PRESETS and not _same_gpu(hw.name, profile.device):
            raise ConfigError(f"pool {pool!r} runs on [hardware] {hw.name!r}, but profile {profile.path} was "
                              f"measured on {profile.device!r}: its step times are that device's; profile the "
                              "hardware the pool runs on, drop [cost] profile, or give [hardware] a name of "
                              "its own (custom hardware is not checked)")
        super().__init__(model, hw, cost, dep, host)
        self.profile = profile
        self.lookups = self.outside = 0

    def gpu_time(self, mix: tuple[float, float, float, float]) -> float:
        rows, ctx, tokens, weighted = mix
        t = 0.0
        if rows:
            got, out = self.profile.decode.at(rows, ctx / rows)
            t, self.lookups, self.outside = t + got, self.lookups + 1, self.outside + out
        if tokens:
            got, out = self.profile.prefill.at(tokens, weighted / tokens)
            t, self.lookups, self.outside = t + got, self.lookups + 1, self.outside + out
        return t

    def rank_step_time(self, tokens: list[float], ctx: list[float], pairs: list[float],
                       loaded: list[float], host_extra: list[float] | None = None, draft_s: float = 0.0,
                       mix: list[tuple[float, float, float, float]] | None = None) -> float:
        """The parent's step with ``gpu_time`` per rank; ``mix``: each rank's ``step_mix``
        (without it, ``mix_from_load`` guesses from the sums)."""
        if max(tokens) == 0 and not any(loaded):
            return self._host_only(host_extra)
        if mix is None:
            mix = [mix_from_load(t, c, p) for t, c, p in zip(tokens, ctx, pairs)]
        m, hw = self.m, self.hw
        serial = host_extra if host_extra is not None and not self.host_overlap else None
        worst = -np.inf
        for r, (mx, ld) in enumerate(zip(mix, loaded)):
            t = self.gpu_time(mx) + m.kv_bytes_per_token * ld / hw.host_bandwidth
            if serial is not None:
                t = t + serial[r]
            worst = t if t > worst else worst
        return self._with_host(worst, host_extra, draft_s)

    def decode_run_ends(self, t: float, ns: list[float], bases: list[float], k: int,
                        until: float, last_free: bool = False, through: bool = False) -> list[float]:
        """As the parent's, by calling ``rank_step_time`` on each step's loads: the same bits
        as stepping. Step j feeds position ncomp - 1 + j of each request, so its cached
        contexts sum to bases[r] - ns[r] + ns[r] * j."""
        zeros = [0.0] * len(ns)
        ends = []
        for j in range(k):
            mix = [(n, b - n + n * float(j), 0.0, 0.0) for n, b in zip(ns, bases)]
            t = t + self.rank_step_time(ns, zeros, zeros, zeros, mix=mix)
            if t >= until and not (last_free and j == k - 1):
                if through:
                    ends.append(t)
                break
            ends.append(t)
        return ends

    def step_time(self, load: StepLoad) -> np.ndarray:
        """The parent's contract (arrays over ranks, or ranks x steps), from the sums alone."""
        tokens = np.asarray(load.tokens, np.float64)
        cols = [np.broadcast_to(np.asarray(v, np.float64), tokens.shape).reshape(len(tokens), -1)
                for v in (load.tokens, load.ctx, load.pairs, load.loaded)]
        out = [self.rank_step_time(*(a[:, j].tolist() for a in cols)) for j in range(cols[0].shape[1])]
        return np.asarray(out if tokens.ndim > 1 else out[0])

    def statistics(self) -> dict:
        return {"profile": self.profile.path, "device": self.profile.device, "lookups": self.lookups,
                "lookups_outside_grid": self.outside}
