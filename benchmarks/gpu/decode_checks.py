"""bench_decode's correctness checks (issue 8): requests served through a SchedulerCore by
several runtimes, teacher-forced on the first one's tokens, and the rules that compare their
greedy tokens and logprobs. No timing here; bench_decode.py times, this module judges.
"""

from __future__ import annotations

import numpy as np

from lockstep.policy.config import SchedulerConfig
from lockstep.policy.core import SchedulerCore
from lockstep.policy.hashing import BlockHasher
from lockstep.policy.request import Request, SamplingParams
from lockstep.runtime.base import NewRequests

BS = 16  # the scheduler's default block size (bench_decode's too)


def serve(runtimes, prompts, *, max_tokens: int, chunk: int, max_seqs: int, max_len: int, blocks: int,
          rows: list | None = None):
    """Prompts through a SchedulerCore, each plan executed by every runtime; the others are fed
    the first one's tokens. Returns each runtime's StepResults; ``rows``, if given, gets the
    prompt index of every sampled row, in the results' order."""
    cfg = SchedulerConfig(num_blocks=blocks, block_size=BS, max_num_seqs=max_seqs, max_num_batched_tokens=chunk,
                          max_model_len=max_len, async_scheduling=False)
    core = SchedulerCore(cfg, BlockHasher(b"bench", BS))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    out = [[] for _ in runtimes]
    step = 0
    while step < len(prompts) or core.has_work():
        if step < len(prompts):
            core.add_request(Request(id=step, prompt=np.asarray(prompts[step], np.int32), params=params))
            for rt in runtimes:
                rt.add_requests(NewRequests([step], [0.0], [1.0], [-1], [-1], [2]))
        plan = core.schedule(float(step))
        if plan.num_reqs:
            got = [rt.execute(plan) for rt in runtimes]
            for rt in runtimes[1:]:
                rt.feed(plan.slots[plan.samples], got[0].token_ids)
            if rows is not None:
                rows.extend(plan.req_ids[plan.samples].tolist())
            for o, r in zip(out, got):
                o.append(r)
            core.update(plan, got[0], float(step))
        step += 1
        if step > 10_000:
            raise RuntimeError("serve: the scheduler did not finish")
    return out


MAX_MISMATCH_SHARE = 0.5  # a path that misses more of the reference's greedy tokens fails outright


def compare(ref_results, results) -> dict:
    """Greedy tokens and logprobs of ``results`` against ``ref_results`` (one token stream).

    The noise between the two paths is measured where they pick the same token (that token's
    logprob on each): a mismatch is at a "clear" margin when the reference's top-2 margin is
    over twice the largest such difference. (Measured over every row, the mismatched ones
    included, the bar would rise with the very errors it should catch.)"""
    ref_tok = np.concatenate([r.token_ids for r in ref_results])
    tok = np.concatenate([r.token_ids for r in results])
    top = np.concatenate([r.top_logprobs for r in ref_results if r.top_logprobs is not None])
    lp_ref = np.concatenate([r.logprobs for r in ref_results if r.logprobs is not None])
    lp = np.concatenate([r.logprobs for r in results if r.logprobs is not None])
    margin = top[:, 0] - top[:, 1]
    bad = ref_tok != tok
    # the same token's logprob on both: the noise between the two paths (none: NaN)
    aligned = len(lp) == len(lp_ref) == len(bad)
    err = float(np.abs(lp - lp_ref).max()) if aligned and len(lp) else float("nan")
    matched = np.abs(lp - lp_ref)[~bad] if aligned else np.zeros(0)
    noise = float(matched.max()) if len(matched) else 0.0  # no matched row: every mismatch is clear
    clear = margin > max(2 * noise, 0.05)
    counts_ok = all(np.array_equal(a.expert_counts.sum(-1), b.expert_counts.sum(-1))
                    for a, b in zip(ref_results, results) if a.expert_counts is not None)
    return {"tokens": int(len(tok)), "greedy_equal": bool(not bad.any()), "mismatches": int(bad.sum()),
            "mismatches_at_clear_margin": int((bad & clear).sum()), "max_logprob_diff": err,
            "matched_max_logprob_diff": noise,
            "min_ref_margin": float(margin.min()) if len(margin) else 0.0, "expert_count_totals_equal": counts_ok,
            "matched_median_logprob_diff": float(np.median(matched)) if len(matched) else float("nan")}


def _rows(results) -> tuple[np.ndarray, np.ndarray]:
    """(sampled tokens, their logprobs) of a runtime's step results, in order."""
    return (np.concatenate([r.token_ids for r in results]),
            np.concatenate([r.logprobs for r in results if r.logprobs is not None]))


def _agreement(base, ref, fast):
    """Rows of three runtimes teacher-forced on one token stream, against ``base``: (rows where
    ``ref`` picks base's token, the same for ``fast``, and each one's logprob distance from
    base's on the rows where both do); None when the rows do not line up."""
    tb, lb = _rows(base)
    tr, lr = _rows(ref)
    tf, lf = _rows(fast)
    if not len(tb) == len(tr) == len(tf) == len(lb) == len(lr) == len(lf):
        return None
    ar, af = tr == tb, tf == tb
    common = ar & af
    return ar, af, np.abs(lr - lb)[common], np.abs(lf - lb)[common]


def _summary(ar, af, dr, df) -> dict:
    """``_agreement``'s rows as counts, and the median distance of each one's logprob."""
    nr, nf = (float(np.median(dr)), float(np.median(df))) if len(dr) else (float("nan"), float("nan"))
    return {"tokens": int(len(ar)), "reference_agrees": int(ar.sum()), "fast_agrees": int(af.sum()),
            "both_agree": int(len(dr)), "reference_noise": nr, "fast_noise": nf}


def _closeness(base, ref, fast) -> dict | None:
    """How close ``ref`` and ``fast`` each stay to ``base`` (``_summary``); None when the rows
    do not line up."""
    got = _agreement(base, ref, fast)
    return None if got is None else _summary(*got)


def fp8_close_as_reference(base, ref, fast) -> dict:
    """Whether the fast path's FP8 cache (``fast``) stays as close to the bf16 reference
    (``base``) as the reference path's FP8 cache (``ref``) does, all three teacher-forced on
    one token stream (step results of each).

    Agreement: the rows where each FP8 path picks the bf16 reference's token. Noise: on the
    rows where both do (the same rows for both), the median distance of each one's logprob of
    that token from the bf16 one. Passes with agreement at least 0.75 of the reference's less
    2 rows, at least 3 common rows, and noise within 1.25x (+0.02) of the reference's. A path
    that agrees nowhere, or has no rows to measure, fails.

    What it cannot see: an error below the FP8 cache's own quantization noise, which with
    random weights is large (v2-lite cut to 3 layers: the reference's FP8 cache picks the bf16
    token in only 17 of 96 rows). The kernel tests (``mla_decode`` against its reference over
    an FP8 cache, ``tests/test_kernels.py``) are the check for those."""
    c = _closeness(base, ref, fast)
    if c is None:
        return {"ok": False, "why": "the three runs' rows do not line up"}
    ok = (c["fast_agrees"] >= 0.75 * c["reference_agrees"] - 2 and c["both_agree"] >= 3
          and c["fast_noise"] <= 1.25 * c["reference_noise"] + 0.02)
    return {**c, "ok": bool(ok)}


def close_to_fp32(oracle, ref, fast, requests=None) -> dict:
    """Whether the bf16 fast path (``fast``) stays as close to the model computed in float32
    (``oracle``: the reference path with the same weights, upcast) as the bf16 reference path
    (``ref``) does, all three teacher-forced on one token stream; ``requests``: each row's
    request (``serve``'s ``rows``).

    Why not count the fast path's mismatches against the bf16 reference at a clear margin
    (``compare``): with random weights a model's routing has near-ties, and one rounding
    difference flips an expert and moves a token's logits by up to ~1. On the H200 (session
    19, ``benchmarks/gpu/experiments/tiny_mismatch.py``) the tiny preset's routing differed in
    half the steps between any two paths, even the fast path with and without graphs (same
    kernels), and every mismatch at a "clear" margin fell in such a step; the bf16 reference
    has one against float32 too. The float32 model is what both bf16 paths approximate: a bug
    makes the fast path a worse approximation.

    Passes when, with "agree" meaning picks the oracle's token:
    - paired: the rows where only the reference agrees exceed those where only the fast path
      does by at most 3 standard deviations of their difference (sqrt of their sum) + 2;
    - per request: the fast path agrees in at least half the reference's rows less 2 (a
      request gone wrong whole, a few rows out of 96, must not hide in the total);
    - on the rows both agree on (at least 3), the distance of each one's logprob from the
      oracle's: the fast path's median within 1.5x (+0.01) of the reference's, its 90th
      percentile within 1.5x (+0.05) (a minority of bad rows moves no median).
    A path that agrees nowhere, or has no rows to measure, fails. Errors below bf16 noise are
    the kernel tests' to find."""
    got = _agreement(oracle, ref, fast)
    if got is None or (requests is not None and len(requests) != len(got[0])):
        return {"ok": False, "why": "the three runs' rows do not line up"}
    ar, af, dr, df = got
    c = _summary(*got)
    only_ref, only_fast = int((ar & ~af).sum()), int((af & ~ar).sum())
    paired = only_ref - only_fast <= 3 * float(np.sqrt(only_ref + only_fast)) + 2
    nr, nf = c["reference_noise"], c["fast_noise"]
    nan = float("nan")
    tr90, tf90 = (float(np.quantile(dr, 0.9)), float(np.quantile(df, 0.9))) if len(dr) else (nan, nan)
    worst = []  # requests where the fast path agrees in too few rows
    if requests is not None:
        req = np.asarray(requests)
        for r in np.unique(req).tolist():
            a_r, a_f = int(ar[req == r].sum()), int(af[req == r].sum())
            if a_f < a_r / 2 - 2:
                worst.append({"request": r, "reference_agrees": a_r, "fast_agrees": a_f})
    ok = (paired and not worst and c["both_agree"] >= 3
          and nf <= 1.5 * nr + 0.01 and tf90 <= 1.5 * tr90 + 0.05)
    return {**c, "only_reference_agrees": only_ref, "only_fast_agrees": only_fast,
            "reference_noise_p90": tr90, "fast_noise_p90": tf90,
            "requests_checked": requests is not None, "requests_failing": worst, "ok": bool(ok)}
