"""Top-k selection and sampling."""

from __future__ import annotations

import traceback

import torch

from lockstep.kernels import sampling as sampling_mod
from lockstep.kernels import topk as topk_mod
from lockstep.kernels import topk_threshold as topk_threshold_mod

from .core import Bench, same_sorted_rows

# -- 3. top-k --------------------------------------------------------------------------------------

def topk_candidates(rows: int, n: int, smoke: bool) -> list[dict]:
    """Configs of the two-launch select path (the committed one first)."""
    if smoke:
        return [{"CHUNK": 256, "TILE": 128, "SAMPLE": 64, "PIECES": 8, "BINS": 256, "CAND": 512,
                 "select_warps": 4, "FINISH_TILE": 256}]
    base = dict(topk_mod.DEFAULT_CONFIG)
    committed = topk_mod.topk_config(rows, n)
    out = [committed]
    if n <= 65536:  # ~3,600 candidates of 32K with Z = 6: a register tile of 4,096 may hold them
        for extra in ({"ASM_STORES": True, "PDL": True}, {"ASM_STORES": True, "PDL": True, "CAND": 4096},
                      {"ASM_STORES": True, "PDL": True, "CAND": 4096, "Z": 5.0, "SAMPLE": 2048},
                      {"ASM_STORES": True, "PDL": True, "CAND": 4096, "select_warps": 8},
                      {"ASM_STORES": True, "PDL": True, "CAND": 4096, "Z": 5.0, "SAMPLE": 2048, "select_warps": 8},
                      {"ASM_STORES": True, "PDL": True, "CAND": 4096, "PROGRAMS_PER_SM": 8},
                      {"ASM_STORES": True, "PDL": True, "CAND": 4096, "TILE": 2048, "num_warps": 8},
                      {"ASM_STORES": True, "PDL": True, "CAND": 4096, "PROGRAMS_PER_SM": 2}):
            out.append({**committed, **extra})
    # programmatic dependent launch off (the A/B for it: first, tuning stops at the deadline),
    # and on with the other launch shapes that were close
    for extra in ({"ASM_STORES": True}, {"ASM_STORES": True, "PDL": not committed.get("PDL", True)},
                  {"ASM_STORES": True, "TILE": 2048}, {"ASM_STORES": True, "PROGRAMS_PER_SM": 8},
                  {"PDL": not committed.get("PDL", True)}, {"PROGRAMS_PER_SM": 8, "TILE": 1024}, {"PROGRAMS_PER_SM": 2},
                  {"TILE": 2048}, {"select_warps": 8}, {"SCAN_STAGES": 3}, {"BINS": 8192}):
        out.append({**committed, **extra})
    for tile, warps, per_sm in ((2048, 4, 8), (4096, 8, 4), (4096, 8, 2), (1024, 4, 8),
                                (2048, 8, 4), (512, 4, 8), (1024, 4, 4), (2048, 4, 4),
                                (1024, 8, 4), (2048, 8, 2), (512, 4, 16)):
        out.append({**base, "TILE": tile, "num_warps": warps, "PROGRAMS_PER_SM": per_sm})
    out.append({**base, "SAMPLE": 2048, "Z": 5.0})
    out.append({**base, "select_warps": 8})
    # the select program's ways of finding the k-th key in its bin, on the committed scan
    for extra in ({"WALK": 0, "WAYS": 16}, {"WALK": 0, "WAYS": 64}, {"WALK": 4, "WAYS": 16},
                  {"select_warps": 32}, {"select_warps": 8, "WALK": 0, "WAYS": 16},
                  {"SAMPLE": 2048, "Z": 4.0}, {"BINS": 8192, "WALK": 0, "WAYS": 16}):
        out.append({**committed, **extra})
    return [c for i, c in enumerate(out) if c not in out[:i]]


def topk_row(b: Bench, name: str, x: torch.Tensor, k: int, cfg: dict, torch_us: tuple,
             bw: float, note: str) -> None:
    """Check and time topk(x, k, config=cfg) and record it against torch.topk's times."""
    rows, n = x.shape
    run = lambda: topk_mod.topk(x, k, config=cfg)  # noqa: E731
    vals, idx = run()
    ref_vals, ref_idx = topk_mod.topk_reference(x, k)
    same = torch.equal(idx, ref_idx) and torch.equal(vals, ref_vals)
    as_torch = torch.equal(idx.long(), torch.topk(x, k, dim=1).indices.sort(dim=1).values)
    b.checks[name] = same and as_torch
    us, us_eager = b.graph_us(run), b.eager_us(run)
    split = ""
    full = {**topk_mod.topk_config(rows, n), **cfg}
    if full["ALGO"] == "select" and 2 * k <= full["CAND"]:  # where the time goes: the scan alone
        scan_us = b.graph_us(lambda: topk_mod._scan(x, k, full, topk_mod._pdl(x, full)))
        split = f"; floor + scan kernels {scan_us:.1f} us, select {us - scan_us:.1f} us"
    t_sorted, t_unsorted, base_eager = torch_us
    base_us = min(t_sorted, t_unsorted)
    nbytes = rows * n * 4 + rows * k * 8
    roof_us = 1e6 * nbytes / bw
    b.row("topk", name, us=us, us_eager=us_eager, baseline="torch.topk (faster of sorted/unsorted)",
          baseline_us=base_us, baseline_us_eager=base_eager, speedup=base_us / us,
          bytes_mb=nbytes / 1e6, frac_roofline=roof_us / us, baseline_frac=roof_us / base_us,
          check=f"{'ok' if same and as_torch else 'FAIL'} exact={same} "
                f"same_set_as_torch={as_torch}",
          note=f"{note}; eager speedup {base_eager / us_eager:.2f}x; "
               f"torch sorted {t_sorted:.1f} us, unsorted {t_unsorted:.1f} us{split}")


def bench_topk(b: Bench, bw: float, only_rows: set[int] | None = None) -> None:
    """Each case: the default (select) path tuned, then the four-launch threshold path with its
    committed config, both against torch.topk. only_rows: the cases of these row counts."""
    cases = ((1, 131072), (64, 131072), (64, 32768)) if not b.smoke else ((1, 3000), (4, 3000))
    if only_rows:
        cases = tuple(c for c in cases if c[0] in only_rows)
    k = 2048 if not b.smoke else 100
    for rows, n in cases:
        name = f"topk k={k} rows={rows} n={n}"
        try:
            x = torch.randn(rows, n, generator=torch.Generator(device=b.dev).manual_seed(rows),
                            device=b.dev)
            base_sorted = lambda: torch.topk(x, k, dim=1)  # noqa: E731
            base_unsorted = lambda: torch.topk(x, k, dim=1, sorted=False)  # noqa: E731
            torch_us = (b.graph_us(base_sorted), b.graph_us(base_unsorted),
                        min(b.eager_us(base_sorted), b.eager_us(base_unsorted)))
            cfg, _ = b.autotune(f"topk.TOPK_CONFIGS[({rows}, {n})]",
                                topk_candidates(rows, n, b.smoke),
                                lambda c: topk_mod.topk(x, k, config=c), same=same_sorted_rows)
            paths = topk_mod.select_paths(x, k, cfg)
            b.facts[f"topk rows={rows} n={n} select paths"] = str(paths)
            topk_row(b, name, x, k, cfg, torch_us, bw, f"select (2 launches), rows' paths {paths}")
            old = {"ALGO": "threshold", **({} if not b.smoke else topk_candidates(rows, n, True)[0])}
            topk_row(b, f"{name} threshold", x, k, old, torch_us, bw,
                     f"threshold (4 launches), {topk_threshold_mod.threshold_config(rows)}")
        except Exception:  # noqa: BLE001
            b.errors[name] = traceback.format_exc()[-1500:]
            print(b.errors[name], flush=True)


# -- 6. sampling ---------------------------------------------------------------------------------

def bench_sampling(b: Bench, bw: float) -> None:
    """sample_rows on float32 logits with their noise, against the torch ops the runtime ran
    before (sort, softmax, cumsum, scatter, softmax, race); the floor reads the logits and the
    noise once. The check is against ``sample_reference``: the torch ops keep a sorted part
    of a tied nucleus boundary, the kernel all of it, so their picks may differ there."""

    def sorted_nucleus(logits, temp, top_p, noise, k=0):
        """The runtime's torch ops before the kernel (``sampling._probs`` and the race), with
        device-side parameters so that a CUDA graph can hold them; ``k`` > 0: top-k first."""
        x = logits.float()
        x = (x - x.max(dim=-1, keepdim=True).values) / temp[:, None]
        srt, idx = x.sort(dim=-1, descending=True)
        if k:
            srt[:, k:] = float("-inf")
        p = srt.softmax(dim=-1)
        srt = srt.masked_fill((p.cumsum(dim=-1) - p) >= top_p[:, None], float("-inf"))
        probs = torch.full_like(x, float("-inf")).scatter(1, idx, srt).softmax(dim=-1)
        return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)

    vocab = 102400 if not b.smoke else 300
    cases = [(rows, k) for k in (0, 50) for rows in ((1, 64, 256) if not b.smoke else (1, 4))]
    for rows, k in cases:
        name = f"sample {f'top-k {k} ' if k else ''}top-p 0.95 rows={rows}"
        try:
            g = torch.Generator(device=b.dev).manual_seed(rows)
            logits = torch.randn(rows, vocab, generator=g, device=b.dev) * 3
            noise = torch.empty(rows, vocab, device=b.dev).exponential_(generator=g)
            ones = torch.ones(rows, device=b.dev)
            temp, top_p, nrows = ones, ones * 0.95, torch.arange(rows, device=b.dev)
            top_k = torch.full((rows,), k, dtype=torch.int32, device=b.dev)
            run = lambda: sampling_mod.sample_rows(logits, temp, top_p, top_k, noise, nrows)  # noqa: E731
            base = lambda: sorted_nucleus(logits, temp, top_p, noise, k)  # noqa: E731
            picks = run()
            same = torch.equal(picks, sampling_mod.sample_reference(logits, temp, top_p, top_k, noise, nrows))
            agree = int((picks == base()).sum())
            b.checks[name] = same
            us, base_us = b.graph_us(run), b.graph_us(base)
            nbytes = rows * vocab * (4 + 4)
            roof_us = 1e6 * nbytes / bw
            b.row("sampling", name, us=us, us_eager=b.eager_us(run), baseline="sort-based torch ops",
                  baseline_us=base_us, baseline_us_eager=b.eager_us(base), speedup=base_us / us,
                  bytes_mb=nbytes / 1e6, frac_roofline=roof_us / us, baseline_frac=roof_us / base_us,
                  check=f"{'ok' if same else 'FAIL'} as sample_reference",
                  note=f"one program a row: max, {'4 radix passes, ' if k else ''}normalizer, race, mass above its winner; "
                       f"the torch ops' picks agree on {agree}/{rows} rows")
        except Exception:  # noqa: BLE001
            b.errors[name] = traceback.format_exc()[-1500:]
            print(b.errors[name], flush=True)
