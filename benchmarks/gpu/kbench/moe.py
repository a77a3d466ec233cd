"""The fused MoE (a layer, and a DEP rank's half over the exchange rows) and the router's GEMM."""

from __future__ import annotations

import traceback

import torch
import torch.nn.functional as F

from lockstep.kernels import fused_moe as moe_mod
from lockstep.kernels import router as router_mod

from .core import Bench

# -- 2. fused MoE ---------------------------------------------------------------------------------

def grouped_mm_moe(x, w13, w2, topk_weights, topk_ids):
    """The torch baseline: sort pairs by expert, two torch._grouped_mm calls, SiLU·mul,
    routing weights, index_add back (no host sync, so it can be graph-captured)."""
    t, k = topk_ids.shape
    e = w13.shape[0]
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.zeros(e, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    tok = order // k
    h = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    y = y.float() * topk_weights.flatten()[order, None]
    return torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tok, y).to(x.dtype)


def bmm_moe(x, w13, w2, topk_weights, topk_ids):
    """Fallback baseline where torch._grouped_mm is missing: pad every expert's rows to the
    busiest expert's count and bmm (one host sync for that count)."""
    t, k = topk_ids.shape
    e = w13.shape[0]
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.zeros(e, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    cap = int(counts.max())
    rank = torch.arange(flat.numel(), device=x.device) - (counts.cumsum(0) - counts)[flat[order]]
    xs = torch.zeros(e, cap, x.shape[1], dtype=x.dtype, device=x.device)
    xs[flat[order], rank] = x[order // k]
    gate, up = torch.bmm(xs, w13.transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2))[flat[order], rank]
    y = y.float() * topk_weights.flatten()[order, None]
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, order // k, y).to(x.dtype)


def moe_baseline(b: Bench, baseline, base_name: str, args, ref, name: str, us: float,
                 roof_us: float) -> dict:
    base = lambda: baseline(*args)  # noqa: E731
    b.check(f"baseline: {name}", base(), ref, tol=3e-2)
    try:
        base_us = b.graph_us(base)
    except Exception:  # noqa: BLE001 - the bmm fallback syncs: no graph
        base_us = b.flushed_us(base)
    return dict(baseline=base_name, baseline_us=base_us, baseline_us_eager=b.eager_us(base),
                speedup=base_us / us, baseline_frac=roof_us / base_us)


def moe_candidates(committed: dict, batch: int, per_expert: float, fp8: bool, smoke: bool) -> list[dict]:
    if smoke:
        return [{"BLOCK_M": 16, "up": {"BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2},
                 "down": {"BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}}]
    tiles = [(64, 128, 4, 4), (32, 128, 4, 5), (128, 128, 4, 3), (64, 256, 4, 3), (64, 64, 4, 5),
             (128, 64, 8, 4)]
    if fp8:
        tiles = [tl for tl in tiles if tl[1] <= 128]
    # (session 18: 16-row blocks at 24 rows an expert, 256 tokens, took 352-379 us against 302)
    bms = [16] if per_expert <= 8 else [16, 32] if per_expert <= 12 else [32, 64]
    out = [committed]  # first: what a run with --no-tune uses
    # the weight tiles as TMA bulk copies (session 17, untimed: offline for sm_90 the up GEMM's
    # weight loads became cp.async.bulk.tensor, pipelined 3 deep), on the committed tiles
    out.append({**committed, "TMA": not committed.get("TMA", False)})
    for bm in bms:
        for bn, bk, w, s in tiles:
            t = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": s}
            cfg = {"BLOCK_M": bm, "up": t, "down": dict(t)}
            if cfg != committed:
                out.append(cfg)
    return out


def moe_part_candidates(best: dict, part: str, fp8: bool, smoke: bool) -> list[dict]:
    """``best`` with one GEMM's tiles (``part``: "up" or "down") varied: the up GEMM reads
    N = 2I rows of K = H, the down GEMM N = H rows of K = I, so one tile rarely suits both
    (at 256 tokens v2-lite's layer went from 308 to 300 us so, 2026-11-30)."""
    if smoke:
        return [best]
    out = [best]
    for bn in (32, 64, 128, 256):
        for bk in (64, 128):
            for w, st in ((4, 3), (4, 4), (4, 5), (8, 4)):
                if fp8 and bn > 128:
                    continue
                tiles = 2 if part == "up" else 1  # the up GEMM stages a gate and an up tile
                if (best["BLOCK_M"] * bk + tiles * bn * bk) * 2 * st > 220_000:  # shared memory
                    continue
                cfg = {**best, part: {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st}}
                if cfg != best:
                    out.append(cfg)
    return out


def bench_moe(b: Bench, bw: float, cases: set[tuple[str, int]] | None = None) -> None:
    """``cases``: {(dtype, batch)} to run (--moe-cases), or None for all."""
    e, h, inter, k = (64, 2048, 1408, 6) if not b.smoke else (8, 256, 128, 2)
    batches = (1, 8, 64, 256) if not b.smoke else (1, 8)
    if cases:
        missing = sorted(c for c in cases if c[1] not in batches)
        if missing:
            print(f"--moe-cases: not cases of this section (batches {batches}): {missing}", flush=True)
        batches = tuple(t for t in batches if any(c[1] == t for c in cases))
    g = torch.Generator(device=b.dev).manual_seed(0)
    w13 = (torch.randn(e, 2 * inter, h, generator=g, device=b.dev) * h ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, inter, generator=g, device=b.dev) * inter ** -0.5).to(torch.bfloat16)
    q13, s13 = moe_mod.quantize_fp8_blockwise(w13)
    q2, s2 = moe_mod.quantize_fp8_blockwise(w2)
    try:
        baseline, base_name = grouped_mm_moe, "torch._grouped_mm"
        x = torch.randn(4, h, device=b.dev).to(torch.bfloat16)
        ids = torch.randint(0, e, (4, k), device=b.dev)
        baseline(x, w13, w2, torch.rand(4, k, device=b.dev), ids)
    except Exception as err:  # noqa: BLE001 - older torch: the bmm baseline instead
        baseline, base_name = bmm_moe, f"sort+bmm (torch._grouped_mm failed: {err!r:.80})"
    for t in batches:
        gt = torch.Generator(device=b.dev).manual_seed(100 + t)  # a case's inputs, whichever cases run
        x = torch.randn(t, h, generator=gt, device=b.dev).to(torch.bfloat16)
        scores = torch.randn(t, e, generator=gt, device=b.dev)
        top, ids = scores.topk(k, dim=-1)
        weights = top.softmax(-1).float().contiguous()
        distinct = int(ids.unique().numel())
        for fp8 in (False, True):
            if cases and ("fp8" if fp8 else "bf16", t) not in cases:
                continue
            key = (e, h, inter, "fp8" if fp8 else "bf16", t)
            name = f"moe {'fp8' if fp8 else 'bf16'} batch {t}"
            try:
                wa, wb = (q13, q2) if fp8 else (w13, w2)
                sc = {"w_gate_up_scale": s13, "w_down_scale": s2} if fp8 else {}
                ref = moe_mod.fused_moe_reference(x, wa, wb, weights, ids, **sc)
                tune = lambda c: moe_mod.fused_moe(x, wa, wb, weights, ids, config=c, **sc)  # noqa: E731
                cfg, _ = b.autotune(f"fused_moe.MOE_CONFIGS[{key}]",
                                    moe_candidates(moe_mod.moe_config(e, h, inter, fp8, t, k),
                                                   t, t * k / e, fp8, b.smoke), tune)
                if t >= 64:  # then each GEMM's tiles apart, BLOCK_M kept (where tiles matter)
                    for part in ("down", "up"):
                        cfg, _ = b.autotune(f"MoE {key}: {part} tiles apart",
                                            moe_part_candidates(cfg, part, fp8, b.smoke), tune)
                        del b.configs[f"MoE {key}: {part} tiles apart"]  # not an apply_tuned line
                    b.configs[f"fused_moe.MOE_CONFIGS[{key}]"] = cfg  # what apply_tuned writes
                run = lambda: moe_mod.fused_moe(x, wa, wb, weights, ids, config=cfg, **sc)  # noqa: E731
                check = b.check(name, run(), ref)
                elt = 1 if fp8 else 2
                nbytes = distinct * 3 * h * inter * elt + 2 * t * h * 2
                if fp8:
                    nbytes += distinct * (s13[0].numel() + s2[0].numel()) * 4
                us, us_eager = b.graph_us(run), b.eager_us(run)
                roof_us = 1e6 * nbytes / bw
                kw = {}
                if not fp8:
                    try:
                        kw = moe_baseline(b, baseline, base_name, (x, w13, w2, weights, ids), ref,
                                          name, us, roof_us)
                    except Exception:  # noqa: BLE001 - our row stands without the baseline
                        b.errors[f"{name} baseline"] = traceback.format_exc()[-1500:]
                b.row("fused_moe", name, us=us, us_eager=us_eager, bytes_mb=nbytes / 1e6,
                      frac_roofline=roof_us / us, check=check,
                      note=f"{distinct} experts touched; roofline {roof_us:.1f} us", **kw)
            except Exception:  # noqa: BLE001 - recorded; the next shape still runs
                b.errors[name] = traceback.format_exc()[-1500:]
                print(b.errors[name], flush=True)


def bench_moe_ep(b: Bench, bw: float) -> None:
    """The fused MoE as a DEP2 rank runs it over the rows the direct exchange delivered:
    half of v2-lite's experts, a block of pad x 6 receive rows per source rank, one term a
    row (k = 1, weight 1), half of all rows taken by pairs (each rank sends half its pairs
    here; the rest of the rows name no expert and are skipped), the terms
    written straight into the exchange's output rows (``out=``, ``reduce=False``). Tuned as
    ``MOE_CONFIGS[(32, ...)]`` keyed by its row count; timed against the same call summing
    through the last launch and copying, as it ran before."""
    e_all, h, inter = (64, 2048, 1408) if not b.smoke else (8, 256, 128)
    e = e_all // 2
    g = torch.Generator(device=b.dev).manual_seed(3)
    w13 = (torch.randn(e, 2 * inter, h, generator=g, device=b.dev) * h ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, inter, generator=g, device=b.dev) * inter ** -0.5).to(torch.bfloat16)
    for pad in ((256, 64) if not b.smoke else (8,)):
        n = 2 * pad * 6
        name = f"moe bf16 DEP2 rank, pad {pad} ({n} receive rows)"
        try:
            x = torch.randn(n, h, generator=g, device=b.dev).to(torch.bfloat16)
            real = n // 2  # (at the front: the kernels sort rows by expert, so where is moot)
            ids = torch.full((n, 1), e, dtype=torch.int64, device=b.dev)
            ids[:real, 0] = torch.randint(0, e, (real,), generator=g, device=b.dev)
            ones = torch.ones(n, 1, dtype=torch.float32, device=b.dev)
            area = torch.empty(n, h, dtype=torch.bfloat16, device=b.dev)
            key = (e, h, inter, "bf16", max(t for t in moe_mod.TOKEN_BUCKETS if t <= n))
            # what ran before (session 13): the nearest expert count's entry, or the default
            old_cfg = moe_mod.MOE_CONFIGS.get((e_all, *key[1:])) or moe_mod.default_moe_config(n, 1, e)
            tune = lambda c: moe_mod.fused_moe(x, w13, w2, ones, ids, config=c, reduce=False, out=area)  # noqa: E731
            cands = moe_candidates(moe_mod.moe_config(e, h, inter, False, n, 1), n, real / e, False, b.smoke)
            cfg, _ = b.autotune(f"fused_moe.MOE_CONFIGS[{key}]",
                                cands + ([old_cfg] if old_cfg not in cands and not b.smoke else []), tune)
            if not b.smoke:
                for part in ("down", "up"):
                    cfg, _ = b.autotune(f"MoE {key}: {part} tiles apart",
                                        moe_part_candidates(cfg, part, False, b.smoke), tune)
                    del b.configs[f"MoE {key}: {part} tiles apart"]
                b.configs[f"fused_moe.MOE_CONFIGS[{key}]"] = cfg
            run = lambda: moe_mod.fused_moe(x, w13, w2, ones, ids, config=cfg, reduce=False, out=area)  # noqa: E731
            run()
            live = ids[:, 0] < e
            check = b.check(name, area[live], moe_mod.fused_moe_reference(x, w13, w2, ones, ids)[live])
            before = lambda: area.copy_(moe_mod.fused_moe(x, w13, w2, ones, ids, config=old_cfg))  # noqa: E731
            us, us_before = b.graph_us(run), b.graph_us(before)
            distinct = int(ids[live].unique().numel())
            nbytes = distinct * 3 * h * inter * 2 + 2 * real * h * 2
            roof_us = 1e6 * nbytes / bw
            b.row("fused_moe", name, us=us, us_eager=b.eager_us(run), bytes_mb=nbytes / 1e6,
                  frac_roofline=roof_us / us, baseline="session 13: its config, summed by a last launch, then copied",
                  baseline_us=us_before, speedup=us_before / us, check=check,
                  note=f"{distinct} of {e} experts touched, {real} rows taken; roofline {roof_us:.1f} us")
        except Exception:  # noqa: BLE001 - recorded; the next shape still runs
            b.errors[name] = traceback.format_exc()[-1500:]
            print(b.errors[name], flush=True)


# -- 3b. the router's GEMM ----------------------------------------------------------------------

def router_candidates(smoke: bool) -> list[dict]:
    if smoke:
        return [{"BLOCK_T": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2}]
    out = [dict(router_mod.ROUTER_SPLIT_DEFAULT)]
    for bt in (16, 32, 64):
        for bk in (64, 128, 256):
            for w, st in ((4, 3), (4, 4), (8, 3)):
                out.append({"BLOCK_T": bt, "BLOCK_K": bk, "num_warps": w, "num_stages": st})
    return [c for i, c in enumerate(out) if c not in out[:i]]


def bench_router(b: Bench, bw: float) -> None:
    """v2-lite's gate (64 experts x 2048, float32) on bf16 activations: x.float() @ w.T through
    cuBLAS (a conversion copy and a float32 GEMM, what the fast path ran beyond 8 tokens)
    against the split-gate kernel (three bf16 pieces on tensor cores, one launch); both
    checked against the float64 product."""
    e, h = (64, 2048) if not b.smoke else (20, 48)
    g = torch.Generator(device=b.dev).manual_seed(5)
    w = torch.randn(e, h, generator=g, device=b.dev) * 0.05
    w3 = router_mod.split_gate(w)
    for t in ((16, 64, 256, 1024, 4096) if not b.smoke else (5, 19)):
        name = f"router gemm T={t} E={e} H={h}"
        try:
            x = torch.randn(t, h, generator=g, device=b.dev).to(torch.bfloat16)
            exact = x.double() @ w.double().T
            base = lambda: F.linear(x.float(), w)  # noqa: E731
            base_err = float((base().double() - exact).abs().max())
            cfg, _ = b.autotune(f"router.ROUTER_SPLIT_CONFIGS[{t}]", router_candidates(b.smoke),
                                lambda c: router_mod.router_logits_split(x, w3, config=c),
                                committed_first=False)  # the default first, not the committed
            run = lambda: router_mod.router_logits_split(x, w3, config=cfg)  # noqa: E731
            err = float((run().double() - exact).abs().max())
            ok = err <= 4 * base_err + 1e-5 * float(exact.abs().max())  # tensor cores add in their own way
            b.checks[name] = ok
            us, base_us = b.graph_us(run), b.graph_us(base)
            nbytes = t * h * 2 + 3 * e * h * 2 + t * e * 4
            b.row("router", name, us=us, us_eager=b.eager_us(run), baseline="x.float() @ w.T (cuBLAS float32)",
                  baseline_us=base_us, baseline_us_eager=b.eager_us(base), speedup=base_us / us,
                  bytes_mb=nbytes / 1e6, frac_roofline=1e6 * nbytes / bw / us,
                  check=f"{'ok' if ok else 'FAIL'} max_err={err:.3g} (cuBLAS float32 {base_err:.3g})",
                  note=f"config {cfg}")
        except Exception:  # noqa: BLE001
            b.errors[name] = traceback.format_exc()[-1500:]
            print(b.errors[name], flush=True)
