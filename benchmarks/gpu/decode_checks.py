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


def serve(runtimes, prompts, *, max_tokens: int, chunk: int, max_seqs: int, max_len: int, blocks: int):
    """Prompts through a SchedulerCore, each plan executed by every runtime; the others are fed
    the first one's tokens. Returns each runtime's StepResults."""
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
    tb, lb = _rows(base)
    tr, lr = _rows(ref)
    tf, lf = _rows(fast)
    if not len(tb) == len(tr) == len(tf) == len(lb) == len(lr) == len(lf):
        return {"ok": False, "why": "the three runs' rows do not line up"}
    ar, af = tr == tb, tf == tb
    common = ar & af
    nr = float(np.median(np.abs(lr - lb)[common])) if common.any() else float("nan")
    nf = float(np.median(np.abs(lf - lb)[common])) if common.any() else float("nan")
    ok = int(af.sum()) >= 0.75 * int(ar.sum()) - 2 and int(common.sum()) >= 3 and nf <= 1.25 * nr + 0.02
    return {"tokens": int(len(tb)), "reference_agrees": int(ar.sum()), "fast_agrees": int(af.sum()),
            "both_agree": int(common.sum()), "reference_noise": nr, "fast_noise": nf, "ok": bool(ok)}
