"""Expert-parallel load balancing: balancedness, moved experts and planner time.

Synthetic power-law expert loads: 256 experts, 61 layers (every layer treated as MoE); per
layer a Zipf profile rank^-alpha over a random permutation of the experts, times a log-normal
per-expert factor (sigma 0.3) so layers differ. alpha is calibrated per setting (bisection) so
the naive contiguous layout (slot s holds expert s mod 256, slots contiguous per GPU) scores
0.35, or 0.21 for the heavier skew. Settings: EP 16/32/64/72 with the valid slot counts, and
nodes = EP/8 (home-node rule) or 1 (one NVLink domain).

Columns (balancedness = mean/max tokens per GPU, averaged over layers; "prop" = the tokens of
a replicated expert split to level its replicas' GPUs, "even" = split evenly):
- same window: naive, ds (baseline), ours, bound, ours/bound;
- next window (every expert's load times a log-normal factor, sigma 0.1 and 0.3), the same
  plans: ours and ds, prop split; and the bound on that window;
- moves at sigma 0.1: a fresh plan of the new window as planned (a stateless planner, search
  stopped within 1%), the same renumbered to keep what stays, and the incremental plan (eps
  0.01: every layer within 1% of the fresh plan's heaviest GPU, the fresh plan's own search
  stopped within 0.5%; where the repair cannot get there, fresh nodes are mixed in), with the
  balancedness the fresh and incremental plans reach on the new window; x_fewer = fresh /
  incremental moves, x_vs_renum = renumbered fresh / incremental. The ">= 4x fewer moves"
  target is judged on x_fewer: its baseline is a stateless fresh plan, as DeepSeek's EPLB
  makes one (the issue: "a fresh plan moves nearly every slot"). Against our own fresh plan
  renumbered to keep what stays, a stronger baseline, the factor is lower (x_vs_renum, quoted
  with the verdict);
- the verdicts: every target of the issue is printed, and the JSON headline's meets_target is
  all of them (the list under "targets"); a run of some settings (--settings) gives no verdict;
- ms: CPU time (process time, single-threaded numpy) of our fresh plan (median of 5), of the
  incremental plan (which includes a fresh plan as its reference), and of the baseline.

Bound: an upper bound on any placement's balancedness under the same rules with an even
split: mean GPU load over the least heaviest-GPU load any replica counts allow given the mean,
the largest load per replica, each node's own experts' share of its GPUs (home nodes) and
at most one replica per GPU; with no redundant slots also the k-per-GPU partition bound per
node; with several nodes also what the nodes can take in: a node's GPUs carry at most its
own experts' tokens plus one replica of another node's expert per spare slot, each no
heavier than the heaviest GPU nor than half its expert, and, k slots to a GPU, at most
the heaviest GPU on each GPU holding another node's replica or one of the node's x hottest
experts (at most spare + x GPUs), while its other GPUs hold only its remaining experts less
the coldest that share those GPUs (``lockstep.policy.eplb.bound``, ``absorb_bound``,
``eplb_count.hold_terms``; tests/test_eplb_bound.py checks it against an exhaustive search on
tiny machines). It does not count how evenly a node's replicas can be packed k to a GPU,
so where slots per GPU are few (EP72/288: 4) it can stay above what any placement reaches.

``--settings 72x288`` (or ``72x288x9`` for one node count) runs only those and prints
their rows without the targets.

Baseline, same run: our numpy implementation, written from its published description, of
DeepSeek's EPLB as vLLM and SGLang call it (8 expert groups): hierarchical (pack groups to
nodes, replicate within nodes by max load per replica, pack replicas to each node's GPUs by
LPT with equal counts) where the groups divide by the nodes, otherwise global.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import at_least, emit  # noqa: E402

from lockstep.policy.eplb import Placement, Topology, bound, evaluate, naive, plan

EXPERTS, LAYERS, GROUPS = 256, 61, 8
SETTINGS = [(16, 256), (16, 288), (16, 320), (32, 256), (32, 288), (32, 320), (64, 256), (64, 320), (72, 288), (72, 360)]


def profile(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(ranks, noise) that with an exponent alpha give loads noise * rank ** -alpha."""
    rng = np.random.default_rng(seed)
    ranks = np.stack([rng.permutation(EXPERTS) + 1 for _ in range(LAYERS)]).astype(np.float64)
    return ranks, np.exp(0.3 * rng.standard_normal((LAYERS, EXPERTS)))


def loads(ranks: np.ndarray, noise: np.ndarray, alpha: float) -> np.ndarray:
    w = noise * ranks**-alpha
    return w / w.sum(1, keepdims=True) * 1e6  # tokens per layer in the window


def calibrate(topo: Topology, ranks, noise, score: float) -> float:
    """alpha at which the naive layout scores ``score`` (it falls as alpha grows)."""
    lay = naive(topo, LAYERS)
    lo, hi = 0.0, 4.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if evaluate(lay, loads(ranks, noise, mid), topo).mean > score:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def drift(w: np.ndarray, sigma: float, seed: int) -> np.ndarray:
    return w * np.exp(sigma * np.random.default_rng(seed).standard_normal(w.shape))


# --- baseline: DeepSeek's EPLB policy, from its description --------------------------------


def ds_pack(weight: np.ndarray, packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Items heaviest first, each to the lightest pack not yet full (equal counts)."""
    layers, n = weight.shape
    per = n // packs
    if per == 1:
        return np.tile(np.arange(n), (layers, 1)), np.zeros((layers, n), dtype=np.int64)
    rows = np.arange(layers)
    load, count = np.zeros((layers, packs)), np.zeros((layers, packs), dtype=np.int64)
    pack, rank = np.empty((layers, n), dtype=np.int64), np.empty((layers, n), dtype=np.int64)
    for item in np.argsort(-weight, axis=1, kind="stable").T:
        p = np.where(count < per, load, np.inf).argmin(1)
        pack[rows, item], rank[rows, item] = p, count[rows, p]
        load[rows, p] += weight[rows, item]
        count[rows, p] += 1
    return pack, rank


def ds_replicate(weight: np.ndarray, physical: int) -> tuple[np.ndarray, np.ndarray]:
    """Extra replicas one at a time to the largest load per replica: (phy2log, counts)."""
    layers, n = weight.shape
    rows = np.arange(layers)
    phy2log = np.concatenate([np.tile(np.arange(n), (layers, 1)), np.zeros((layers, physical - n), np.int64)], 1)
    count = np.ones((layers, n), dtype=np.int64)
    for i in range(n, physical):
        e = (weight / count).argmax(1)
        phy2log[:, i] = e
        count[rows, e] += 1
    return phy2log, count


def ds_hierarchical(weight: np.ndarray, physical: int, groups: int, nodes: int, gpus: int) -> np.ndarray:
    layers, n = weight.shape
    size, per_node_log, per_node_phy = n // groups, n // nodes, physical // nodes
    gpack, grank = ds_pack(weight.reshape(layers, groups, size).sum(2), nodes)
    log2mlog = (((gpack * (groups // nodes) + grank) * size)[:, :, None] + np.arange(size)).reshape(layers, n)
    mlog2log = np.argsort(log2mlog, axis=1)
    w_mlog = np.take_along_axis(weight, mlog2log, 1).reshape(layers * nodes, per_node_log)
    phy2mlog, count = ds_replicate(w_mlog, per_node_phy)
    per_phy = np.take_along_axis(w_mlog / count, phy2mlog, 1)
    pack, rank = ds_pack(per_phy, gpus // nodes)
    pphy2phy = np.argsort(pack * (physical // gpus) + rank, axis=1)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, 1).reshape(layers, nodes, -1)
    pphy2mlog = (pphy2mlog + (np.arange(nodes) * per_node_log)[None, :, None]).reshape(layers, -1)
    return np.take_along_axis(mlog2log, pphy2mlog, 1)


def deepseek(weight: np.ndarray, topo: Topology) -> Placement:
    hier = GROUPS % topo.nodes == 0
    p2l = ds_hierarchical(weight, topo.slots, GROUPS if hier else 1, topo.nodes if hier else 1, topo.ranks)
    return Placement.from_phy2log(p2l, EXPERTS)


# --- one setting ------------------------------------------------------------------------------


def timed(fn, repeat: int = 1):
    """(result, median CPU ms): process time, so other work sharing the cores counts less."""
    ts, out = [], None
    for _ in range(repeat):
        t = time.process_time()
        out = fn()
        ts.append(time.process_time() - t)
    return out, float(np.median(ts)) * 1e3


def run_setting(ep: int, slots: int, nodes: int, score: float, seed: int, repeat: int) -> dict:
    topo = Topology(EXPERTS, slots, ep, nodes)
    ranks, noise = profile(seed)
    alpha = calibrate(topo, ranks, noise, score)
    w = loads(ranks, noise, alpha)
    ours, ms = timed(lambda: plan(w, topo), repeat)
    ds, ds_ms = timed(lambda: deepseek(w, topo))
    b = bound(w, topo).mean
    row = {"ep": ep, "slots": slots, "nodes": nodes, "skew": score, "alpha": round(alpha, 3),
           "naive": evaluate(naive(topo, LAYERS), w, topo).mean, "ds": evaluate(ds, w, topo).mean,
           "ours": ours.balancedness.mean, "bound": b, "ours/bound": ours.balancedness.mean / b}
    for sigma in (0.1, 0.3):
        w2 = drift(w, sigma, seed + 1)
        tag = f"s{sigma:g}"
        row[f"{tag}_ours"] = evaluate(ours.placement, w2, topo, "proportional").mean
        row[f"{tag}_ours_even"] = evaluate(ours.placement, w2, topo).mean
        row[f"{tag}_ds"] = evaluate(ds, w2, topo, "proportional").mean
        row[f"{tag}_bound"] = bound(w2, topo).mean
    row.update(moves(w, ours.placement, topo, seed))
    row.update({"ms": ms, "ds_ms": ds_ms})
    return row


def moves(w: np.ndarray, current: Placement, topo: Topology, seed: int) -> dict:
    w2 = drift(w, 0.1, seed + 1)
    fresh = plan(w2, topo, tol=0.01)
    renum = plan(w2, topo, current, tol=0.01)
    incr, ms = timed(lambda: plan(w2, topo, current, incremental=True, eps=0.01))
    n_fresh = int((fresh.placement.phy2log != current.phy2log).sum())
    return {"mv_fresh": n_fresh, "mv_renum": len(renum.moves), "mv_incr": len(incr.moves),
            "fresh_bal": fresh.balancedness.mean, "incr_bal": incr.balancedness.mean,
            "x_fewer": n_fresh / max(len(incr.moves), 1), "x_vs_renum": len(renum.moves) / max(len(incr.moves), 1),
            "incr_ms": ms}


# --- report -------------------------------------------------------------------------------------


def check_targets(rows: list[dict]) -> list[tuple[str, bool, str]]:
    out = []
    worst = min(rows, key=lambda r: r["ours/bound"])
    out.append(("same window >= 0.99 of the bound, every setting", worst["ours/bound"] >= 0.99,
                f"worst {worst['ours/bound']:.4f} at EP{worst['ep']}/{worst['slots']} nodes {worst['nodes']} skew {worst['skew']}"))
    for skew, need in ((0.35, 0.94), (0.21, 0.89)):
        sel = [r for r in rows if r["skew"] == skew and (r["ep"], r["slots"]) in ((32, 288), (64, 320))]
        low = min(sel, key=lambda r: r["s0.1_ours"])
        out.append((f"per batch sigma 0.1 (prop) >= {need} at skew {skew}, EP32/288 and EP64/320", low["s0.1_ours"] >= need,
                    f"lowest {low['s0.1_ours']:.4f} at EP{low['ep']}/{low['slots']} nodes {low['nodes']}"))
    slow = max(rows, key=lambda r: r["ms"])
    flat = max((r for r in rows if r["nodes"] == 1), key=lambda r: r["ms"])
    out.append(("fresh plan <= 100 ms for 61 layers", slow["ms"] <= 100,
                f"slowest {slow['ms']:.0f} ms at EP{slow['ep']}/{slow['slots']} nodes {slow['nodes']}; "
                f"one node: slowest {flat['ms']:.0f} ms at EP{flat['ep']}/{flat['slots']}; median {np.median([r['ms'] for r in rows]):.0f} ms"))
    few = min(rows, key=lambda r: r["x_fewer"])
    par = min(rows, key=lambda r: r["incr_bal"] / r["fresh_bal"])  # equal balancedness: within eps = 1%
    out.append((">= 4x fewer moves than a fresh plan at sigma 0.1, within 1% of its balancedness",
                few["x_fewer"] >= 4 and par["incr_bal"] >= 0.99 * par["fresh_bal"],
                f"least {few['x_fewer']:.1f}x at EP{few['ep']}/{few['slots']} nodes {few['nodes']} skew {few['skew']} "
                f"(vs the renumbered fresh plan: least {min(r['x_vs_renum'] for r in rows):.1f}x); "
                f"balancedness incremental / fresh: lowest {par['incr_bal'] / par['fresh_bal']:.4f} "
                f"at EP{par['ep']}/{par['slots']} nodes {par['nodes']} skew {par['skew']}"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="only EP32/288 and EP64/320")
    ap.add_argument("--settings", type=_settings, help="only these, e.g. 72x288 or 72x288x9 (EPxSLOTS[xNODES]), comma-separated")
    ap.add_argument("--seed", type=at_least(0), default=0)
    ap.add_argument("--repeat", type=at_least(1), default=5, help="timed runs of each fresh plan (median)")
    args = ap.parse_args()
    settings = args.settings or [(ep, slots, None) for ep, slots in ([(32, 288), (64, 320)] if args.quick else SETTINGS)]
    rows = [run_setting(ep, slots, nodes, skew, args.seed, args.repeat)
            for skew in (0.35, 0.21) for ep, slots, pin in settings for nodes in ((ep // 8, 1) if pin is None else (pin,))]
    if args.settings:  # a subset: the table, and no verdict (some targets need settings left out)
        for r in rows:
            print(f"EP{r['ep']}/{r['slots']} nodes {r['nodes']} skew {r['skew']}: ours/bound {r['ours/bound']:.4f} "
                  f"(ours {r['ours']:.4f}, bound {r['bound']:.4f}), {r['ms']:.0f} ms, incremental x{r['x_fewer']:.2f} fewer moves")
        r = rows[0]
        emit("bench_eplb", rows, {
            "metric": f"same window, ours / bound, EP{r['ep']}/{r['slots']} nodes {r['nodes']} skew {r['skew']} (a subset of settings)",
            "unit": "fraction", "value": r["ours/bound"], "baseline": {"name": "DeepSeek EPLB, numpy, same run, ds / bound",
                                                                       "value": r["ds"] / r["bound"]},
            "ratio": r["ours"] / r["ds"], "target": "judged on the full run only", "meets_target": None,
        }, args.json)
        return
    targets = [{"name": name, "met": bool(ok), "detail": detail} for name, ok, detail in check_targets(rows)]
    for t in targets:
        print(f"target: {t['name']}: {'met' if t['met'] else 'NOT met'} ({t['detail']})")
    if args.quick:  # two settings: the targets say "every valid setting", which only the full run holds
        print("--quick: these verdicts cover EP32/288 and EP64/320 only; the full run judges the targets")
    head = next(r for r in rows if (r["ep"], r["slots"], r["nodes"], r["skew"]) == (32, 288, 4, 0.35))
    emit("bench_eplb", rows, {
        "metric": "balancedness per batch, sigma 0.1 drift, proportional split, EP32/288, 4 nodes, skew 0.35",
        "unit": "mean/max", "value": head["s0.1_ours"],
        "baseline": {"name": "DeepSeek EPLB (hierarchical, as vLLM selects it), numpy, same run", "value": head["s0.1_ds"]},
        "ratio": head["s0.1_ours"] / head["s0.1_ds"],
        "target": ("judged on the full run only (--quick: two settings)" if args.quick else
                   "all of the issue's targets (listed under targets); the value is one of them (>= 0.94)"),
        "meets_target": None if args.quick else all(t["met"] for t in targets), "targets": targets,
    }, args.json)


def _settings(text: str) -> list[tuple[int, int, int | None]]:
    out = []
    for part in text.split(","):
        try:
            nums = [int(x) for x in part.lower().split("x")]
        except ValueError:
            nums = []
        if len(nums) not in (2, 3):
            raise argparse.ArgumentTypeError(f"a setting is EPxSLOTS or EPxSLOTSxNODES, e.g. 72x288; got {part!r}")
        ep, slots = nums[:2]
        for nodes in (nums[2],) if len(nums) == 3 else (ep // 8, 1):  # as the run will make it
            try:
                Topology(experts=EXPERTS, slots=slots, ranks=ep, nodes=nodes)
            except ValueError as e:  # (the planner's own rules: slots a multiple of EP, ...)
                raise argparse.ArgumentTypeError(f"{part}: {e}") from None
        out.append((ep, slots, nums[2] if len(nums) == 3 else None))
    return out


if __name__ == "__main__":
    main()
