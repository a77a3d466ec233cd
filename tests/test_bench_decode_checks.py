"""bench_decode.py's correctness rules (benchmarks/gpu/decode_checks.py) on made-up step results (the GPU run is the real one):
compare()'s matched-row noise and the FP8 cache's rule, which must fail a path that agrees
with the bf16 reference nowhere, or has no rows to measure."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("decode_checks_under_test", ROOT / "benchmarks/gpu/decode_checks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bd = _bench()


def steps(tokens, logprobs, top=None):
    """One step result per row, as the runtimes return them."""
    top = np.zeros((len(tokens), 2)) if top is None else top
    return [SimpleNamespace(token_ids=np.array([t]), logprobs=np.array([lp]), top_logprobs=np.array([tp]),
                            expert_counts=None) for t, lp, tp in zip(tokens, logprobs, top)]


def test_compare_measures_noise_on_matched_rows_only():
    ref = steps([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4], top=[[-0.1, -3.0]] * 4)
    got = steps([1, 2, 9, 4], [-0.15, -0.2, -5.0, -0.4])
    c = bd.compare(ref, got)
    # the wrong token's own logprob (-5.0) does not raise the bar: noise 0.05 on rows 0, 1, 3,
    # and the reference's margin 2.9 is clear of it
    assert c["mismatches"] == 1 and c["mismatches_at_clear_margin"] == 1
    assert np.isclose(c["matched_max_logprob_diff"], 0.05) and np.isclose(c["matched_median_logprob_diff"], 0.0)


def test_compare_keeps_near_ties_as_noise():
    ref = steps([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4], top=[[-0.1, -0.2]] * 4)  # margin 0.1
    got = steps([1, 2, 9, 4], [-0.05, -0.2, -0.35, -0.4])
    c = bd.compare(ref, got)
    assert c["mismatches"] == 1 and c["mismatches_at_clear_margin"] == 0  # 0.1 is not above 2 x 0.05


def test_compare_fails_a_path_wrong_everywhere():
    ref = steps(list(range(10)), [-0.1] * 10, top=[[-0.1, -4.0]] * 10)
    got = steps(list(range(100, 110)), [-11.5] * 10)
    c = bd.compare(ref, got)
    assert c["mismatches"] == 10 and c["mismatches_at_clear_margin"] == 10


def test_compare_reports_no_noise_when_nothing_matches():
    c = bd.compare(steps([1, 2], [-0.1, -0.2]), steps([3, 4], [-0.1, -0.2]))
    assert np.isnan(c["matched_median_logprob_diff"])


def _fp8_case(rng, agree_fast: float, noise_fast: float):
    n = 96
    base = rng.integers(0, 1000, n)
    lb = -rng.random(n)
    ref_tok = np.where(rng.random(n) < 0.2, base, base + 1)  # the reference FP8 path: ~20% agree
    fast_tok = np.where(rng.random(n) < agree_fast, base, base + 2)
    lr = lb + 0.3 * rng.standard_normal(n)
    lf = lb + noise_fast * rng.standard_normal(n)
    return steps(base, lb), steps(ref_tok, lr), steps(fast_tok, lf)


def test_fp8_rule_passes_a_path_as_close_as_the_reference():
    rng = np.random.default_rng(0)
    got = bd.fp8_close_as_reference(*_fp8_case(rng, agree_fast=0.5, noise_fast=0.3))
    assert got["ok"], got


def test_fp8_rule_fails_a_path_that_never_agrees_or_is_noisier():
    rng = np.random.default_rng(1)
    never = bd.fp8_close_as_reference(*_fp8_case(rng, agree_fast=0.0, noise_fast=0.3))
    assert not never["ok"] and never["fast_agrees"] == 0 and np.isnan(never["fast_noise"])
    noisy = bd.fp8_close_as_reference(*_fp8_case(rng, agree_fast=0.5, noise_fast=3.0))
    assert not noisy["ok"], noisy


def test_fp8_rule_fails_rows_that_do_not_line_up():
    base, ref, fast = _fp8_case(np.random.default_rng(2), 0.5, 0.3)
    assert not bd.fp8_close_as_reference(base, ref, fast[:-1])["ok"]


def _fp32_case(rng, n: int = 96):
    """An oracle's rows, and a bf16 reference agreeing with it on ~90% of them (logprob noise
    0.02): returns (oracle tokens, oracle logprobs, reference tokens, reference logprobs)."""
    base = rng.integers(0, 1000, n)
    lb = -rng.random(n)
    ref_tok = np.where(rng.random(n) < 0.9, base, base + 1)
    return base, lb, ref_tok, lb + 0.02 * rng.standard_normal(n)


def _judge(base, lb, tok, lp, fast_tok, fast_lp, requests=None):
    return bd.close_to_fp32(steps(base, lb), steps(tok, lp), steps(fast_tok, fast_lp), requests)


def test_fp32_rule_passes_a_path_as_close_as_the_reference():
    rng = np.random.default_rng(0)
    base, lb, tok, lp = _fp32_case(rng)
    fast = np.where(rng.random(96) < 0.9, base, base + 2)  # as often right, on other rows
    got = _judge(base, lb, tok, lp, fast, lb + 0.02 * rng.standard_normal(96), np.repeat(np.arange(8), 12))
    assert got["ok"], got


def test_fp32_rule_fails_fewer_agreements_a_noisier_path_or_misaligned_rows():
    rng = np.random.default_rng(1)
    base, lb, tok, lp = _fp32_case(rng)
    noise = lb + 0.02 * rng.standard_normal(96)
    fewer = _judge(base, lb, tok, lp, np.where(rng.permutation(96) < 55, base, base + 2), noise)
    assert not fewer["ok"] and fewer["only_reference_agrees"] - fewer["only_fast_agrees"] > 20
    never = _judge(base, lb, tok, lp, base + 2, noise)
    assert not never["ok"] and never["both_agree"] == 0
    noisy = _judge(base, lb, tok, lp, tok, lb + 0.2 * rng.standard_normal(96))
    assert not noisy["ok"] and noisy["fast_noise"] > 1.5 * noisy["reference_noise"] + 0.01
    assert not _judge(base, lb, tok, lp, tok[:-1], noise[:-1])["ok"]


def test_fp32_rule_fails_one_request_gone_wrong_and_a_bad_tail():
    """What a median and a total over 96 rows miss (session 19's review): one request's 12
    rows all wrong, and logprobs off by 1.0 on 20 of the rows both paths get right."""
    rng = np.random.default_rng(2)
    base, lb, tok, lp = _fp32_case(rng)
    requests = np.repeat(np.arange(8), 12)
    one_wrong = np.where(requests == 3, base + 2, tok)
    assert _judge(base, lb, tok, lp, one_wrong, lp)["ok"]  # the totals alone let it through
    got = _judge(base, lb, tok, lp, one_wrong, lp, requests)
    assert not got["ok"] and [w["request"] for w in got["requests_failing"]] == [3]
    off = lp.copy()
    off[np.flatnonzero(tok == base)[::4][:20]] += 1.0
    tail = _judge(base, lb, tok, lp, tok, off)
    assert not tail["ok"] and tail["fast_noise"] <= 1.5 * tail["reference_noise"] + 0.01  # the median misses it
