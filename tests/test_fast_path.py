"""The CUDA fast path (absorbed MLA, Triton kernels, device tables, graph-style padded
batches, device sampling) checked on the CPU: the kernels run under TRITON_INTERPRET=1 at
tiny shapes, the model is the tiny preset in bfloat16, and the reference is the model's own
forward on the same weights (and a float32 copy of them as ground truth, since bf16 paths
that add in different orders differ by more than their agreement with each other says).
CUDA graphs themselves need a GPU: benchmarks/gpu/bench_decode.py checks them on an H200.
"""

from __future__ import annotations

import dataclasses
import os
import re

import attrs

import numpy as np
import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Must precede the kernels' import: triton.jit decides compiled vs interpreted there.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is installed on x86_64 only (see pyproject's test extra)")

from lockstep.kernels.fused_moe import fused_moe_reference  # noqa: E402
from lockstep.kernels.mla_decode import mla_decode_reference  # noqa: E402
from lockstep.policy.config import SchedulerConfig  # noqa: E402
from lockstep.policy.core import SchedulerCore  # noqa: E402
from lockstep.policy.hashing import BlockHasher  # noqa: E402
from lockstep.policy.request import Request, SamplingParams  # noqa: E402
from lockstep.policy.step import StepPlan, StepResult, decode_constants  # noqa: E402
from lockstep.engine.runtime_client import new_requests  # noqa: E402
from lockstep.runtime.base import NewRequests, RuntimeSpec  # noqa: E402
from lockstep.runtime.models import load_model  # noqa: E402
from lockstep.runtime.models.batch import ForwardBatch  # noqa: E402
from lockstep.runtime.models.deepseek_v3 import FP8Cache  # noqa: E402
from lockstep.runtime.models.fast import FastDeepseek, layer_weights  # noqa: E402
from lockstep.runtime.models.fast_inputs import DECODE_MAX_NEW  # noqa: E402
from lockstep.runtime.sampling import sample_on_device  # noqa: E402
from lockstep.runtime.torch_runtime import TorchRuntime  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
# Two layers (one dense, one MoE) keep the interpreter quick; a wide init gives clear argmax
# margins, so greedy tokens are comparable across bf16 paths.
SMALL = {"num_hidden_layers": 2, "initializer_range": 0.15}
BS = 16


def tiny(dtype):
    return load_model("tiny", dtype=dtype, device=DEV, seed=0, overrides=SMALL)


def test_absorbed_attention_equals_expanded():
    """q_nope through kv_b_proj's K part, attention over latents, out through its V part:
    the expanded form's output, in float64 (plain torch, no kernels)."""
    model = load_model("tiny", dtype=torch.float64, device="cpu", seed=1, overrides=SMALL)
    cfg, attn = model.cfg, model.layers[0].self_attn
    lw = layer_weights(model.layers[0], cfg)
    h, dn, dl, n = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank, 37
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(4, BS, cfg.kv_cache_dim, generator=g, dtype=torch.float64)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    q = torch.randn(1, h, cfg.qk_head_dim, generator=g, dtype=torch.float64)
    cached = cache[table[0].long()].flatten(0, 1)[:n]
    k, v = attn._expand(cached)
    p = (torch.einsum("hd,lhd->hl", q[0], k) * cfg.softmax_scale).softmax(-1)
    want = torch.einsum("hl,lhd->hd", p, v)
    q_latent = torch.bmm(q[..., :dn].transpose(0, 1), lw.w_uk).transpose(0, 1)  # (1, H, dl)
    latent, k_pe = cached[:, :dl], cached[:, dl:]
    s = (q_latent[0] @ latent.T + q[0, :, dn:] @ k_pe.T) * cfg.softmax_scale
    o = (s.softmax(-1) @ latent)[None]  # every head's output, still in latent space
    got = torch.bmm(o.transpose(0, 1), lw.w_uv).transpose(0, 1)[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # The decode kernel's own reference computes the same latent output (in float32).
    ref = mla_decode_reference(q_latent, q[..., dn:], cache, table, torch.tensor([n]), cfg.softmax_scale,
                               compute_dtype=torch.float64)
    torch.testing.assert_close(ref, o, rtol=1e-5, atol=1e-7)


def _ground_truth(model16):
    """A float32 copy of the same (bf16-valued) weights."""
    ref = tiny(torch.float32)
    with torch.no_grad():
        for p16, p32 in zip(model16.parameters(), ref.parameters()):
            p32.copy_(p16.float())
    return ref


@pytest.mark.parametrize("kv_dtype", [None, FP8], ids=["bf16_cache", "fp8_cache"])
def test_fast_forward_matches_reference_for_prefill_mixed_and_decode(kv_dtype):
    """With an FP8 cache every path (float32 truth included) stores e4m3 with per-token
    scales, so the fast path's kernels are judged against the same quantization."""
    model = tiny(torch.bfloat16)
    truth = _ground_truth(model)
    fast = FastDeepseek(model)
    rng = np.random.default_rng(0)
    tables = [row.tolist() for row in rng.permutation(32).reshape(4, 8)]
    long = DECODE_MAX_NEW + 9  # prefills through mla_prefill; the others attend per token
    steps = [([rng.integers(3, 500, n).tolist() for n in (1, long, 5, 3)], [0, 0, 0, 0])]
    done = [1, long, 5, 3]
    steps.append(([[7], rng.integers(3, 500, long).tolist(), [9], [4, 5]], list(done)))  # mixed
    done = [d + len(s) for d, s in zip(done, steps[-1][0])]
    steps.append(([[5], [6], [8], [2]], done))  # decode only
    outs = {}
    for name, m in (("truth", truth), ("ref", model), ("fast", fast)):
        kv = (truth if m is truth else model).make_kv_cache(32, BS, kv_dtype)
        outs[name] = []
        for new, cached in steps:  # logits at every position: many rows to judge by
            b = ForwardBatch.build(new, cached, tables, BS, device=DEV)
            outs[name].append(m(dataclasses.replace(b, sample_index=torch.arange(len(b.input_ids), device=DEV)), kv))
    for i, ((lt, ct), (lr, cr), (lf, cf)) in enumerate(zip(outs["truth"], outs["ref"], outs["fast"])):
        # Per-row error against float32. A bf16 path now and then routes a token to another
        # expert than float32 does (random weights, near-ties), and that row is far off: so
        # judge typical rows and the number of far-off ones, each against the bf16 reference.
        row_ref, row_fast = (((x - lt).abs().amax(-1) / lt.abs().amax(-1)) for x in (lr, lf))
        assert row_fast.median() <= 2 * row_ref.median() + 0.01, f"step {i}: {row_fast.median()} vs {row_ref.median()}"
        assert int((row_fast > 0.2).sum()) <= int((row_ref > 0.2).sum()) + 1, f"step {i}"
        # Argmax against float32: as often right as the bf16 reference, give or take a tenth of
        # the rows and at least one (a near-tie flips either way: the decode step has 4 rows).
        wrong_fast, wrong_ref = (int((x.argmax(-1) != lt.argmax(-1)).sum()) for x in (lf, lr))
        assert wrong_fast <= wrong_ref + max(1, len(lt) // 10), f"step {i}: argmax {wrong_fast} vs {wrong_ref} off"
        assert torch.equal(cf.sum(-1), ct.sum(-1))  # every real token counted k times per MoE layer


def test_shared_experts_fused_as_expert_slots_are_the_shared_mlp():
    """fuse_shared: a shared MLP of 2 experts' width becomes expert slots e and e + 1 after
    the routed ones, whose sum is the shared MLP; the routed experts' parameters now view the
    fused tensor; and the forward with it equals the forward without it, up to bf16 sums."""
    model = load_model("tiny", dtype=torch.bfloat16, device=DEV, seed=0,
                       overrides={**SMALL, "n_shared_experts": 2})
    cfg, e = model.cfg, model.cfg.n_routed_experts
    unfused = FastDeepseek(model, fuse_shared=False)
    b = ForwardBatch.build([[5, 9, 11], [7, 8]], [0, 0], [[0, 1], [2, 3]], BS, device=DEV)
    b = dataclasses.replace(b, sample_index=torch.arange(len(b.input_ids), device=DEV))
    before, counts_before = unfused(b, model.make_kv_cache(4, BS))
    fast = FastDeepseek(model)
    lw = next(lw for lw in fast.layers if lw.moe is not None)
    w13, w2, routed = lw.with_shared
    assert w13.shape[0] == w2.shape[0] == e + 2 and routed == e
    assert lw.moe.experts.gate_up_proj.data_ptr() == w13.data_ptr()
    assert lw.moe.experts.down_proj.data_ptr() == w2.data_ptr()
    x = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(DEV)
    width = lw.gate_up.shape[0] // 2
    g, u = lw.gate_up[:width].float(), lw.gate_up[width:].float()
    want = (F.silu(x.float() @ g.T) * (x.float() @ u.T)) @ lw.down.float().T
    ids = torch.tensor([[e, e + 1]] * 6, device=DEV)
    got = fused_moe_reference(x, w13, w2, torch.ones(6, 2, device=DEV), ids)
    torch.testing.assert_close(got.float(), want, rtol=0.03, atol=0.03 * want.abs().max().item())
    after, counts_after = fast(b, model.make_kv_cache(4, BS))
    rows = (after - before).abs().amax(-1) / before.abs().amax(-1)
    assert rows.median() < 0.02 and torch.equal(after.argmax(-1), before.argmax(-1))
    assert torch.equal(counts_after, counts_before)  # the shared slots are not routed experts


def test_one_token_decode_through_per_head_matrix_vector_products(monkeypatch):
    """At one decoding token the absorbed heads' products run as ``gemv`` where the table has
    their shapes, the attention splits merged by their own launch or inside W_UV's product
    (``MERGE_IN_W_UV_MAX_SPLITS``): the step's logits match torch.bmm's, up to bf16 sums."""
    from lockstep.kernels import dense
    from lockstep.runtime.models import fast as F

    model = tiny(torch.bfloat16)
    cfg = model.cfg
    fast = FastDeepseek(model)
    kv = model.make_kv_cache(8, BS)
    fast(ForwardBatch.build([[5, 9, 11, 4]], [0], [[0, 1]], BS, device=DEV), kv)
    step = ForwardBatch.build([[7]], [4], [[0, 1]], BS, device=DEV)
    before, _ = fast(step, kv)
    tile = {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
    h, dn, dl, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    monkeypatch.setitem(dense.BMM_ROW_CONFIGS, (h, dn, dl), tile)
    monkeypatch.setitem(dense.BMM_ROW_CONFIGS, (h, dl, dv), tile)
    calls, gemv, merges = [], dense.gemv, []
    monkeypatch.setattr(dense, "gemv", lambda x, w, c: calls.append(tuple(w.shape)) or gemv(x, w, c))
    merge = fast._merge_bmm_row
    fast._merge_bmm_row = lambda p, lse, w: merges.append(p.shape[1]) or merge(p, lse, w)
    monkeypatch.setattr(F, "MERGE_IN_W_UV_MAX_SPLITS", 0)  # the splits merged by mla_decode's launch
    after, _ = fast(step, kv)
    assert sorted(set(calls)) == sorted({(h, dn, dl), (h, dl, dv)}) and not merges
    rows = (after - before).abs().amax(-1) / before.abs().amax(-1)
    assert rows.max() < 0.02 and torch.equal(after.argmax(-1), before.argmax(-1))
    # merged inside W_UV's product instead (the CPU's 4 "SMs" give several splits)
    calls.clear()
    monkeypatch.setattr(F, "MERGE_IN_W_UV_MAX_SPLITS", 128)
    merged, _ = fast(step, kv)
    assert set(calls) == {(h, dn, dl)} and merges and min(merges) > 1
    rows = (merged - after).abs().amax(-1) / after.abs().amax(-1)
    assert rows.max() < 0.02 and torch.equal(merged.argmax(-1), after.argmax(-1))
    # more splits than the cap: merged by mla_decode's launch after all, W_UV by gemv
    calls.clear()
    merges.clear()
    monkeypatch.setattr(F, "MERGE_IN_W_UV_MAX_SPLITS", 1)
    capped, _ = fast(step, kv)
    assert sorted(set(calls)) == sorted({(h, dn, dl), (h, dl, dv)}) and not merges
    assert torch.equal(capped, after)


def test_ab_switches_keep_the_logits_and_long_steps_sum_in_the_kernel(monkeypatch):
    """The forms the GPU A/B switches bring back (the MoE's sum by its own launch, the MLA
    prologue as norm and rope then kv_store, the shared experts' columns by concatenation)
    give the same logits, bit for bit in the interpreter; and a step of more than
    MOE_SUM_IN_NORM_MAX_TOKENS tokens (summed by the kernel) equals one summed in the norm."""
    from lockstep.runtime.models import fast as F

    model = tiny(torch.bfloat16)
    fast = FastDeepseek(model)

    def logits(new, done, tables):
        b = ForwardBatch.build(new, done, tables, BS, device=DEV)
        b = dataclasses.replace(b, sample_index=torch.arange(len(b.input_ids), device=DEV))
        kv = model.make_kv_cache(8, BS)
        if done[0]:  # a cached prefix first
            fast(ForwardBatch.build([list(range(3, 3 + done[0]))], [0], tables, BS, device=DEV), kv)
        return fast(b, kv)[0]

    short = ([[7, 8, 9]], [16], [[0, 1]])
    base = logits(*short)
    for name, value in (("MOE_SUM_IN_NORM_MAX_TOKENS", 0), ("MLA_PREP_KERNEL", False),
                        ("ROUTER_WRITES_SHARED", False)):
        with monkeypatch.context() as m:
            m.setattr(F, name, value)
            assert torch.equal(logits(*short), base), name
    long = ([list(range(5, 5 + F.MOE_SUM_IN_NORM_MAX_TOKENS + 2))], [0], [[0, 1, 2, 3, 4]])
    summed_by_kernel = logits(*long)
    monkeypatch.setattr(F, "MOE_SUM_IN_NORM_MAX_TOKENS", 1 << 20)
    assert torch.equal(logits(*long), summed_by_kernel)


def test_fp8_experts_stay_close_to_bf16():
    """moe_fp8: the routed experts read as e4m3 with 128x128 block scales (W8A16)."""
    model = tiny(torch.bfloat16)
    rng = np.random.default_rng(1)
    new = [rng.integers(3, 500, n).tolist() for n in (3, DECODE_MAX_NEW + 4)]
    tables = [[0, 1], [2, 3]]
    got = {}
    for fp8 in (False, True):
        b = ForwardBatch.build(new, [0, 0], tables, BS, device=DEV)
        b = dataclasses.replace(b, sample_index=torch.arange(len(b.input_ids), device=DEV))
        got[fp8], _ = FastDeepseek(model, moe_fp8=fp8)(b, model.make_kv_cache(4, BS))
    rows = (got[True] - got[False]).abs().amax(-1) / got[False].abs().amax(-1)
    assert rows.median() < 0.1 and (got[True].argmax(-1) == got[False].argmax(-1)).float().mean() >= 0.8


def _drive(runtimes, prompts, *, max_tokens=4, logprobs=2, placement_gen=0, dp_sync=False, **processing):
    """Serve prompts through a real SchedulerCore (chunked prefill, staggered arrivals, so
    steps mix prefill chunks and decodes), executing each plan on every runtime; later
    runtimes are fed the first one's tokens, so their samples compare position by position."""
    cfg = SchedulerConfig(num_blocks=64, block_size=BS, max_num_seqs=4, max_num_batched_tokens=24,
                          max_model_len=256, async_scheduling=False)
    core = SchedulerCore(cfg, BlockHasher(b"k", BS))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs, **processing)
    results = [[] for _ in runtimes]
    step = 0
    while step < len(prompts) or core.has_work():
        if step < len(prompts):
            req = Request(id=step, prompt=np.asarray(prompts[step], np.int32), params=params)
            core.add_request(req)
            for rt in runtimes:
                rt.add_requests(new_requests(req))
        plan = core.schedule(float(step))
        if placement_gen:
            plan = attrs.evolve(plan, placement_gen=placement_gen)
        if dp_sync:  # what the DP sync of a one-rank instance would set
            plan = attrs.evolve(plan, num_padded_tokens=plan.num_tokens,
                                uniform_decode=bool(plan.num_reqs) and int(plan.num_new.max()) <= 1)
        if plan.num_reqs:
            got = [rt.execute(plan) for rt in runtimes]
            for rt in runtimes[1:]:
                rt.feed(plan.slots[plan.samples], got[0].token_ids)
            for out, r in zip(results, got):
                out.append(r)
            core.update(plan, got[0], float(step))
        step += 1
    return results


def _runtime(**options) -> TorchRuntime:
    # Weights drawn on the CPU, as load_model draws the references here (the runtime's default
    # on CUDA draws them on the GPU: other weights, other near-ties in bf16)
    rt = TorchRuntime()
    rt.load(RuntimeSpec(model="tiny", device=DEV, dtype="bfloat16", num_blocks=64, block_size=BS, max_num_seqs=4,
                        max_model_len=256, options={"preset_overrides": SMALL, "init_on_device": False, **options}))
    return rt


def test_fast_path_penalties_follow_the_reference_path():
    """Penalties on the fast path: counted on the device as tokens are drawn, the same
    choices as the reference path's host-side ones; logprobs stay the model's."""
    ref = _runtime(fast=False)
    fast = _runtime(fast=True, cuda_graphs="padded", compile=False)
    prompts = [[5] * 30, list(range(3, 23)), [9, 8, 7]]
    processing = dict(repetition_penalty=1.8, frequency_penalty=1.0, presence_penalty=0.5, max_tokens=6)
    want, got = _drive([ref, fast], prompts, **processing)
    (plain,) = _drive([_runtime(fast=False)], prompts, max_tokens=6)
    toks = [r.token_ids.tolist() for r in want]
    assert toks == [r.token_ids.tolist() for r in got]
    assert toks != [r.token_ids.tolist() for r in plain]  # the penalties changed the tokens
    for a, b in zip(want, plain):  # the model's own log-probabilities, where both drew the same
        same = a.token_ids == b.token_ids
        if same.all() and len(same):
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5)


def test_fast_path_logit_bias_and_allowed_ids_follow_the_reference_path():
    """logit_bias and allowed_token_ids on the fast path: the reference path's choices,
    which they change; logprobs stay the model's (as vLLM's: before processing)."""
    ref = _runtime(fast=False)
    fast = _runtime(fast=True, cuda_graphs="padded", compile=False)
    prompts = [[5] * 30, list(range(3, 23)), [9, 8, 7]]
    (plain,) = _drive([_runtime(fast=False)], prompts, max_tokens=6)
    first = sorted({int(t) for r in plain for t in r.token_ids[:1]})
    processing = dict(logit_bias={t: -100 for t in first} | {40: 4.0}, allowed_token_ids=(40, 41, 42, 43, *first))
    want, got = _drive([ref, fast], prompts, max_tokens=6, **processing)
    toks = [r.token_ids.tolist() for r in want]
    assert toks == [r.token_ids.tolist() for r in got]
    assert all(set(t) <= {40, 41, 42, 43} for t in toks) and toks != [r.token_ids.tolist() for r in plain]


def _async_run(rt, prompts, params, launch: bool) -> dict:
    """Serve through a core that plans step N+1 before step N's result (as the engine does),
    the runtime launching each step before the last one is finished (``launch``, as its
    process does) or running each one whole; each request's tokens."""
    cfg = SchedulerConfig(num_blocks=64, block_size=BS, max_num_seqs=4, max_num_batched_tokens=24,
                          max_model_len=256)
    core = SchedulerCore(cfg, BlockHasher(b"k", BS))
    for i, p in enumerate(prompts):
        req = Request(id=i, prompt=np.asarray(p, np.int32), params=params[i] if isinstance(params, list) else params)
        core.add_request(req)
        rt.add_requests(new_requests(req))
    flight, got, step, launched = [], {}, 0, 0
    while core.has_work() or flight:
        plan = core.schedule(float(step)) if core.has_work() else None
        step += 1
        if plan is not None and plan.num_reqs:
            h = rt.launch(plan) if launch else None
            if h is None:  # run whole, after finishing what was launched (the runtime process's order)
                flight = [(p, rt.finish(x) if not isinstance(x, StepResult) else x) for p, x in flight]
                h = rt.execute(plan)
            else:
                launched += 1
            flight.append((plan, h))
        if flight and (len(flight) == 2 or plan is None or not plan.num_reqs):
            p, h = flight.pop(0)
            out = core.update(p, h if isinstance(h, StepResult) else rt.finish(h), float(step))
            offs = np.concatenate([[0], np.cumsum(out.num_tokens)])
            for j, rid in enumerate(out.req_ids.tolist()):
                got.setdefault(rid, []).extend(out.token_ids[offs[j]:offs[j + 1]].tolist())
    assert launched > 0 or not launch
    return got


def test_penalties_count_alike_with_steps_launched_ahead():
    """A step launched before the last one's tokens reach the host reads penalty counts that
    the device already holds: the tokens are those of steps run one at a time."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.8,
                            frequency_penalty=1.0, presence_penalty=0.5, min_tokens=3)
    prompts = [[5] * 30, list(range(3, 23)), [9, 8, 7]]
    ahead = _async_run(_runtime(fast=True, cuda_graphs="padded", compile=False), prompts, params, True)
    whole = _async_run(_runtime(fast=True, cuda_graphs="padded", compile=False), prompts, params, False)
    plain = _async_run(_runtime(fast=True, cuda_graphs="padded", compile=False), prompts,
                       SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), True)
    assert ahead == whole and ahead != plain and all(len(t) == 10 for t in ahead.values())


def test_guided_steps_launch_ahead_and_wait_for_the_last_tokens_before_their_masks():
    """A structured output's mask needs the last step's token on the host: a step with a
    guided request is launched behind the one in flight (its forward first), then waits for
    that step's tokens; the tokens are those of steps run one at a time, and the guided
    output follows its grammar."""
    from lockstep import StructuredOutputsParams

    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    guided = SamplingParams(max_tokens=8, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(regex="[a-z]{3}[0-9]"))
    params = [plain, guided, plain]
    prompts = [[5] * 12, list(range(3, 13)), [9, 8, 7]]
    ahead = _async_run(_runtime(fast=True, cuda_graphs="padded", compile=False), prompts, params, True)
    whole = _async_run(_runtime(fast=True, cuda_graphs="padded", compile=False), prompts, params, False)
    assert ahead == whole and len(ahead[0]) == len(ahead[2]) == 8
    # (this core knows no end of sequence: the tokens drawn after it, unconstrained, come too)
    assert ahead[1][4] == 1 and re.fullmatch("[a-z]{3}[0-9]", bytes(t - 3 for t in ahead[1][:4]).decode())


def test_fast_path_runtime_scores_prompts_with_the_kernels_that_serve_the_step():
    """A step with prompt logprobs runs as the fast path runs it without them (prefill graphs
    where they apply, else eagerly), the scored rows' logits from a product of their own:
    the scores agree with the reference path's, and the tokens drawn are those the fast path
    draws without scoring (its own kernels, not another path's numbers)."""
    ref = _runtime(fast=False)
    fast = _runtime(fast=True, cuda_graphs="padded", compile=False)
    prompts = [[5] * 30, list(range(3, 23)), [9, 8, 7]]
    want, got = _drive([ref, fast], prompts, prompt_logprobs=2, max_tokens=6)
    rows = [(a, b) for a, b in zip(want, got) if len(a.prompt_req_ids)]
    assert len(rows) >= 3 and sum(len(a.prompt_req_ids) for a, _ in rows) == 29 + 19 + 2
    for a, b in rows:
        assert (a.prompt_req_ids == b.prompt_req_ids).all() and (a.prompt_index == b.prompt_index).all()
        np.testing.assert_allclose(a.prompt_token_logprobs, b.prompt_token_logprobs, atol=0.1)  # bf16 paths
    assert fast.runner.replays  # the decode steps after them went the graph way
    (plain,) = _drive([_runtime(fast=True, cuda_graphs="padded", compile=False)], prompts, max_tokens=6)
    assert [r.token_ids.tolist() for r in got] == [r.token_ids.tolist() for r in plain]
    for a, b in zip(got, plain):  # the same kernels: the same numbers
        if b.logprobs is not None:
            np.testing.assert_array_equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("kv", ["auto", "fp8"], ids=["bf16_cache", "fp8_cache"])
def test_runtime_fast_path_follows_the_reference_path(kv):
    """Prefill chunks, mixed steps and padded decode steps (the graph path's buffers). With
    kv_cache_dtype fp8 the fast path stores through kv_store with per-token scales and reads
    them in mla_decode and mla_prefill, in the reference path's pool layout (what P/D moves):
    the two runtimes' pools then hold the same entries."""
    ref = _runtime(fast=False, kv_cache_dtype=kv)
    fast = _runtime(fast=True, cuda_graphs="padded", compile=False, kv_cache_dtype=kv)
    prompts = [[5] * 30, list(range(3, 23)), [9, 8, 7]]
    want, got = _drive([ref, fast], prompts)
    assert fast.runner.eager_steps and fast.runner.replays and fast.runner.mode == "padded"
    sampled = [(a, b) for a, b in zip(want, got) if len(a.token_ids)]
    err = max(float(np.abs(b.logprobs - a.logprobs).max()) for a, b in sampled)
    assert err < 0.1
    # FP8: each path quantizes its own bf16 latents, and where they straddle a rounding
    # boundary the codes differ by a step (1/16 to 1/8 of the value): logprobs differ about twice as
    # much as with bf16 (0.06 here), more than some of this random model's top-2 margins. So
    # greedy tokens must be equal where the reference's margin is clear (over twice that).
    clear_above = 2 * err if kv == "fp8" else -1.0
    compared = 0
    for a, b in zip(want, got):
        assert np.array_equal(a.num_sampled, b.num_sampled)
        if len(a.token_ids):
            clear = a.top_logprobs[:, 0] - a.top_logprobs[:, 1] > clear_above
            assert np.array_equal(a.token_ids[clear], b.token_ids[clear])
            assert np.array_equal(b.expert_counts.sum(-1), a.expert_counts.sum(-1))
            compared += int(clear.sum())
    assert compared >= sum(len(a.token_ids) for a, _ in sampled) // 3
    assert np.array_equal(fast.runner.tables.cpu().numpy(), fast.tables)  # device table by deltas
    for a, b in zip(ref.kv, fast.kv):  # per layer, every token's entry (unwritten ones are zero)
        ea, eb = _entries(a), _entries(b)
        top = ea.abs().amax(-1, keepdim=True).clamp_min(1e-6)
        assert float(((eb - ea).abs() / top).max()) < 0.1  # an e4m3 step at the top (448) is 32: 1/14


@pytest.mark.parametrize("kv", ["auto", "fp8"], ids=["bf16_cache", "fp8_cache"])
def test_prefill_steps_through_pieces_compute_what_the_eager_forward_does(kv):
    """Prefill and mixed steps padded to a prefill graph size and run piece by piece between
    their attention cores (``PrefillGraphs``; on the CPU mode "padded": its buffers and
    padding without capturing; on CUDA captured and replayed) give the eager fast path's
    logits, expert counts and cache entries."""
    eager = _runtime(fast=True, cuda_graphs="padded", compile=False, kv_cache_dtype=kv, prefill_graph_sizes=[])
    pieces = _runtime(fast=True, cuda_graphs="on" if DEV == "cuda" else "padded", compile=False,
                      kv_cache_dtype=kv, prefill_graph_sizes=[20, 32])
    assert eager.runner.prefill is None and pieces.runner.prefill is not None
    prompts = [[5] * 30, list(range(3, 23)), [9, 8, 7], list(range(40, 75))]
    want, got = _drive([eager, pieces], prompts)
    pf = pieces.runner.prefill
    assert pf.replays >= 3 and not pf.errors  # 24-token chunks pad to 32, a 20-token one runs at 20
    if DEV == "cuda":
        assert sorted(pf.graphs) == [20, 32]
    sampled = [(a, b) for a, b in zip(want, got) if len(a.token_ids)]
    err = max(float(np.abs(b.logprobs - a.logprobs).max()) for a, b in sampled)
    assert err < 2e-2
    for a, b in zip(want, got):
        assert np.array_equal(a.expert_counts, b.expert_counts)
        if len(a.token_ids):  # equal wherever the margin is clear of the logits' difference
            clear = a.top_logprobs[:, 0] - a.top_logprobs[:, 1] > 2 * err
            assert np.array_equal(a.token_ids[clear], b.token_ids[clear])
    for a, b in zip(eager.kv, pieces.kv):
        ea, eb = _entries(a), _entries(b)
        assert torch.equal(ea == 0, eb == 0)  # padding stored nothing
        assert float((eb - ea).abs().max()) <= 0.02 * float(ea.abs().max())


def test_prefill_graph_sizes_stop_at_the_token_budget():
    """No prefill graph beyond the first size that holds the scheduler's token budget."""
    rt = TorchRuntime()
    rt.load(RuntimeSpec(model="tiny", device=DEV, dtype="bfloat16", num_blocks=64, block_size=BS, max_num_seqs=4,
                        max_model_len=256, max_num_batched_tokens=24,
                        options={"preset_overrides": SMALL, "fast": True, "cuda_graphs": "padded", "compile": False,
                                 "prefill_graph_sizes": [20, 32, 64, 128]}))
    assert rt.runner.prefill.sizes == [20, 32]
    rt.shutdown()


def test_split_router_routes_prefill_steps_as_the_float32_gemm(monkeypatch):
    """With the gate split into bf16 pieces (``router_split``, off by default, Hopper only;
    forced here), steps with a prefill chunk run the router's GEMM through ``router_logits_split``
    and decode steps through the float32 GEMM (the small-step kernel off here, so decode
    steps reach that choice); tokens, expert counts and logprobs follow the path without it."""
    import lockstep.runtime.models.fast as fast_mod
    from lockstep.kernels.router import split_gate

    monkeypatch.setattr(fast_mod, "ROUTER_GEMM_MAX_TOKENS", 0)
    plain = _runtime(fast=True, cuda_graphs="padded", compile=False, router_split=False)
    split = _runtime(fast=True, cuda_graphs="padded", compile=False)
    fast = split.runner.fast
    fast.router_split = True
    for lw in fast.layers:
        if lw.moe is not None:
            lw.gate_split = split_gate(lw.moe.gate.weight.detach())
    calls, kinds = [], []
    inner_op, inner_routed = fast.ops.router_logits_split, fast._routed
    fast.ops.router_logits_split = lambda h, w3: calls.append(h.shape[0]) or inner_op(h, w3)
    fast._routed = lambda h, lw, step, *a, **kw: kinds.append(step.has_prefill) or inner_routed(h, lw, step, *a, **kw)
    want, got = _drive([plain, split], [[5] * 30, list(range(3, 23)), [9, 8, 7]])
    assert calls and len(calls) == sum(kinds) and not all(kinds)  # prefill steps only, and some decode steps
    for a, b in zip(want, got):
        assert np.array_equal(a.expert_counts, b.expert_counts)
        assert np.array_equal(a.token_ids, b.token_ids)
        if len(a.token_ids):
            assert float(np.abs(b.logprobs - a.logprobs).max()) < 1e-2
    plain.shutdown()
    split.shutdown()


@pytest.mark.parametrize("bad", [[0], [16, -4], ["64"], [True], 2048, "2048"])
def test_prefill_graph_sizes_must_be_token_counts(bad):
    with pytest.raises(ValueError, match="prefill_graph_sizes must (list token counts >= 1|be a list)"):
        _runtime(fast=True, cuda_graphs="padded", compile=False, prefill_graph_sizes=bad)


def _entries(layer_cache) -> torch.Tensor:
    """A layer's cache entries in float32 (dequantized when FP8)."""
    return layer_cache[:] if isinstance(layer_cache, FP8Cache) else layer_cache.float()


def test_fast_path_with_expert_slots_computes_through_them():
    """With expert slots (expert parallelism, or a balancer on one rank) the fast path must
    run the routed experts through the model's slot module, whose all-to-all the other ranks
    wait on, never the fused kernel over this rank's own weights. (A name clash once made the
    fast path always take the kernel: DEP ranks then disagreed about a step and hung.) A
    placement that moves experts to other slots keeps the tokens."""
    ref = _runtime(fast=False, redundant_experts=0)
    fast = _runtime(fast=True, cuda_graphs="off", compile=False, redundant_experts=0)
    assert fast.runner.fast.use_fused_moe is False
    calls = []
    layer = next(lw.moe.experts for lw in fast.runner.fast.layers if lw.moe is not None)
    inner = layer.forward
    layer.forward = lambda *a, **kw: calls.append(1) or inner(*a, **kw)
    e = fast.model.cfg.n_routed_experts
    moved = np.stack([np.roll(np.arange(e), 3)] * len(fast.moe_layers))  # every expert in another slot
    for rt in (ref, fast):
        rt.placements.receive(1, moved)
        rt.placements._staging.done.wait()  # the background copy
        rt.placements.step_done()
        rt.placements.use(1)
    prompts = [[5] * 30, list(range(3, 23)), [9, 8, 7]]
    want, got = _drive([ref, fast], prompts, placement_gen=1)
    assert calls
    for a, b in zip(want, got):
        assert np.array_equal(a.token_ids, b.token_ids)


def test_padded_expert_dispatch_on_the_fast_path_follows_exact_dispatch():
    """Decode steps through padded expert dispatch (fixed-size buffers, the local experts as
    one fused MoE: what a DEP decode graph holds), padded to a graph size; prefill steps
    through exact dispatch. The tokens follow exact dispatch's."""
    exact = _runtime(fast=True, cuda_graphs="padded", compile=False, redundant_experts=0)
    padded = _runtime(fast=True, cuda_graphs="padded", compile=False, redundant_experts=0, ep_dispatch="padded")
    assert padded.ep_padded and not exact.ep_padded
    layer = padded.placements.layers[0]
    seen = []
    inner = layer.forward
    layer.forward = lambda *a, **k: seen.append((layer.dispatch, layer.pad_tokens, a[0].shape[0])) or inner(*a, **k)
    prompts = [[5] * 30, list(range(3, 23)), [9, 8, 7]]
    want, got = _drive([exact, padded], prompts, dp_sync=True)
    assert ("padded", 4, 4) in seen and ("padded", 2, 2) in seen  # 3 decodes pad to a graph size of 4
    assert any(d == "exact" for d, _, _ in seen)
    sampled = [(a, b) for a, b in zip(want, got) if len(a.token_ids)]
    err = max(float(np.abs(b.logprobs - a.logprobs).max()) for a, b in sampled)
    assert err < 0.1
    for a, b in zip(want, got):
        if len(a.token_ids):
            clear = a.top_logprobs[:, 0] - a.top_logprobs[:, 1] > 2 * err
            assert np.array_equal(a.token_ids[clear], b.token_ids[clear])
            assert np.array_equal(b.expert_counts.sum(-1), a.expert_counts.sum(-1))


@pytest.mark.parametrize("bad", [0, -0.5, float("nan"), "x"])
def test_layer_output_scale_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match="runtime option layer_output_scale must be a finite number > 0"):
        _runtime(fast=False, layer_output_scale=bad)


def test_layer_output_scale_scales_every_layer_output_projection():
    """Benchmarks' knob: attention's o_proj and every down projection (dense MLP, routed and
    shared experts) times the scale, nothing else."""
    ref, scaled = _runtime(fast=False), _runtime(fast=False, layer_output_scale=0.5)
    for a, b in zip(ref.model.named_parameters(), scaled.model.named_parameters()):
        want = 0.5 if a[0].endswith(("o_proj.weight", "down_proj.weight", "down_proj")) else 1.0
        assert torch.equal(b[1], a[1] * want), a[0]


def _serve(rt, prompts, *, spec_tokens=0, max_tokens=10, temperature=0.0) -> dict[int, list[int]]:
    """Tokens of each prompt (greedy, or sampled at ``temperature`` with seed = its index),
    served through a SchedulerCore of its own (speculative decodes of 1 + ``spec_tokens``
    tokens when > 0)."""
    cfg = SchedulerConfig(num_blocks=64, block_size=BS, max_num_seqs=4, max_num_batched_tokens=24,
                          max_model_len=256, async_scheduling=False, num_spec_tokens=spec_tokens)
    core = SchedulerCore(cfg, BlockHasher(b"k", BS))
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(Request(id=i, prompt=np.asarray(p, np.int32), params=params))
        rt.add_requests(NewRequests([i], [temperature], [1.0], [-1], [i if temperature else -1], [-1]))
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    step = 0
    while core.has_work():
        plan = core.schedule(float(step))
        if plan.num_reqs:
            res = rt.execute(plan)
            offs = np.concatenate([[0], np.cumsum(res.num_sampled)])
            for j, rid in enumerate(plan.req_ids.tolist()):
                out[rid] += res.token_ids[offs[j]:offs[j + 1]].tolist()
            core.update(plan, res, float(step))
        step += 1
    return {i: t[:max_tokens] for i, t in out.items()}


def test_speculation_on_the_fast_path_replays_verify_and_draft_passes_as_graphs():
    """With a draft on the fast path, a verify (the last token and its drafts, per request)
    and the draft's passes run as decode rows through the graph path's padded buffers, sized
    by tokens; prefill chunks run eagerly. Greedy tokens equal the fast path's without
    speculation. (On a GPU the graphs are real ones, captured at load.)"""
    graphs = "on" if DEV == "cuda" else "padded"
    plain = _runtime(fast=True, cuda_graphs=graphs, compile=False)
    spec = _runtime(fast=True, cuda_graphs=graphs, compile=False, draft_model="layers:1", num_spec_tokens=2)
    assert spec.runner.sizes[-1] == 16 and spec.spec.runner.sizes[-1] == 8  # 4 requests x (1 + 2) = 12, x 2
    assert spec.spec.runner.tables is spec.runner.tables
    prompts = [[5] * 30, list(range(3, 23)), [9, 8, 7]]
    want = _serve(plain, prompts, max_tokens=6)  # (two verifies at least: the interpreter is slow)
    replays, draft_replays = spec.runner.replays, spec.spec.runner.replays
    got = _serve(spec, prompts, spec_tokens=2, max_tokens=6)
    assert got == want
    assert spec.runner.replays > replays and spec.spec.runner.replays > draft_replays
    assert spec.spec.draft_passes > 0


def test_sample_on_device_greedy_seeded_and_distribution(monkeypatch):
    """Greedy, seeded and top-k rows and the draws' frequencies, through the sorting torch
    ops: the kernel would take minutes over 40,000 rows in the interpreter."""
    from lockstep.runtime import sampling

    monkeypatch.setattr(sampling, "SAMPLE_KERNEL", False)
    g = torch.Generator(device=DEV).manual_seed(0)
    logits = torch.randn(6, 50, generator=g, device=DEV)
    temp = np.array([0.0, 1.0, 1.0, 0.7, 1.0, 0.0])
    top_p, top_k = np.array([1.0, 1.0, 1.0, 0.9, 1.0, 1.0]), np.array([-1, -1, 5, -1, -1, -1])
    seeds, pos = np.array([-1, 3, 4, -1, 3, -1]), np.arange(6) * 10
    out = sample_on_device(logits, temp, top_p, top_k, seeds, pos, g)
    assert out[[0, 5]].tolist() == logits[[0, 5]].argmax(-1).tolist()
    assert out[2].item() in logits[2].topk(5).indices.tolist()
    # A seeded row draws the same at the same position, whoever shares the batch.
    alone = sample_on_device(logits[1:2], temp[1:2], top_p[1:2], top_k[1:2], seeds[1:2], pos[1:2], g)
    assert alone.item() == out[1].item()
    # The draws follow the softmax (exponential race).
    row = torch.tensor([[0.0, 1.0, 2.0, -1.0]], device=DEV).expand(40000, 4).contiguous()
    n = len(row)
    picks = sample_on_device(row, np.ones(n), np.ones(n), -np.ones(n, np.int64), -np.ones(n, np.int64),
                             np.zeros(n, np.int64), g)
    freq = torch.bincount(picks.cpu(), minlength=4).double() / n
    torch.testing.assert_close(freq, row[0].double().softmax(-1).cpu(), atol=0.01, rtol=0)


def test_sample_on_device_kernel_draws_what_the_sorting_ops_draw(monkeypatch):
    """The rows are drawn by one kernel (``kernels.sampling``): from the same generators,
    the same picks as the sorting torch ops, seeded rows, greedy rows and top-k rows
    included."""
    from lockstep.runtime import sampling

    g0 = torch.Generator(device=DEV).manual_seed(5)
    logits = torch.randn(6, 300, generator=g0, device=DEV) * 3
    temp = np.array([0.0, 1.0, 0.8, 0.5, 1.0, 0.0])
    top_p, top_k = np.array([1.0, 1.0, 0.9, 0.3, 0.95, 1.0]), -np.ones(6, np.int64)
    seeds, pos = np.array([-1, 3, -1, 7, -1, -1]), np.arange(6) * 10
    calls, (kernel, interpret) = [], sampling._kernel()
    monkeypatch.setattr(sampling, "_kernel", lambda: (lambda *a: calls.append(len(a[0])) or kernel(*a), interpret))
    got = {}
    for fused in (True, False):
        monkeypatch.setattr(sampling, "SAMPLE_KERNEL", fused)
        got[fused] = sample_on_device(logits, temp, top_p, top_k, seeds, pos, torch.Generator(device=DEV).manual_seed(9))
    assert calls == [6] and torch.equal(got[True], got[False])
    assert got[True][[0, 5]].tolist() == logits[[0, 5]].argmax(-1).tolist()
    top_k[[2, 4]] = 5, 400  # 400: more than the vocabulary, every token
    monkeypatch.setattr(sampling, "SAMPLE_KERNEL", True)
    sample_on_device(logits, temp, top_p, top_k, seeds, pos, torch.Generator(device=DEV).manual_seed(9))
    assert calls == [6]  # a few rows with top-k: the torch ops (the kernel's select is slower there)
    monkeypatch.setattr(sampling, "TOP_K_KERNEL_MIN_ROWS", 1)
    for fused in (True, False):
        monkeypatch.setattr(sampling, "SAMPLE_KERNEL", fused)
        got[fused] = sample_on_device(logits, temp, top_p, top_k, seeds, pos, torch.Generator(device=DEV).manual_seed(9))
    assert calls == [6, 6] and torch.equal(got[True], got[False])
    assert got[True][2] in logits[2].topk(5).indices


def test_sampled_speculation_on_the_fast_path_draws_what_the_eager_path_draws():
    """Seeded sampled requests (rejection sampling of the draft's proposals) through the
    graph path's padded buffers draw the tokens the same runtime draws eagerly: the rows a
    sampled request reads from a verify or a draft pass are its own."""
    kw = dict(fast=True, compile=False, draft_model="layers:1", num_spec_tokens=2)
    graph, eager = _runtime(cuda_graphs="on" if DEV == "cuda" else "padded", **kw), _runtime(cuda_graphs="off", **kw)
    prompts = [[5] * 30, list(range(3, 23)), [9, 8, 7]]
    got = _serve(graph, prompts, spec_tokens=2, temperature=0.8, max_tokens=6)
    assert got == _serve(eager, prompts, spec_tokens=2, temperature=0.8, max_tokens=6)
    assert graph.runner.replays and graph.spec.runner.replays and not eager.runner.replays



def _serve_ahead(rt, prompts, *, ahead: bool, max_tokens=6) -> tuple[list, list]:
    """Greedy tokens served with async scheduling (step N+1 planned before step N's result),
    each step through ``launch``/``finish`` (``ahead``: step N+1 launched before step N is
    finished, as the runtime process does) or ``execute``. Returns (each step's sampled ids,
    each request's tokens)."""
    cfg = SchedulerConfig(num_blocks=64, block_size=BS, max_num_seqs=4, max_num_batched_tokens=24,
                          max_model_len=256, async_scheduling=True)
    core = SchedulerCore(cfg, BlockHasher(b"k", BS))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(Request(id=i, prompt=np.asarray(p, np.int32), params=params))
        rt.add_requests(NewRequests([i], [0.0], [1.0], [-1], [-1], [-1]))
    steps, out, in_flight, t = [], {i: [] for i in range(len(prompts))}, [], 0
    while core.has_work() or in_flight:
        plan = core.schedule(float(t))
        if plan.num_reqs:
            started = rt.launch(plan) if ahead else None
            if started is None:  # execute only with nothing launched outstanding
                in_flight = [(p, x if isinstance(x, StepResult) else rt.finish(x)) for p, x in in_flight]
                started = rt.execute(plan)
            in_flight.append((plan, started))
        if len(in_flight) > 1 or (in_flight and not plan.num_reqs):
            done, got = in_flight.pop(0)
            res = got if isinstance(got, StepResult) else rt.finish(got)
            _record(done, res, steps, out)
            core.update(done, res, float(t))
        t += 1
    return steps, out


def _record(plan, res, steps: list, out: dict) -> None:
    """Note a step's sampled ids, and each request's tokens."""
    steps.append(res.token_ids.tolist())
    offs = np.concatenate([[0], np.cumsum(res.num_sampled)])
    for j, rid in enumerate(plan.req_ids.tolist()):
        out[rid] += res.token_ids[offs[j]:offs[j + 1]].tolist()


def test_steps_launched_ahead_read_last_tokens_on_the_device():
    """The fast path launches step N+1 before step N's tokens reach the host: its
    placeholders are read from the device's last tokens (the host's are not updated until
    step N is finished). Every step samples what executing one by one samples."""
    prompts = [[5] * 30, list(range(3, 23)), [9, 8, 7]]
    want = _serve_ahead(_runtime(fast=True, cuda_graphs="padded", compile=False), prompts, ahead=False)
    rt = _runtime(fast=True, cuda_graphs="padded", compile=False)
    got = _serve_ahead(rt, prompts, ahead=True)
    assert got == want and all(len(t) >= 6 for t in got[1].values())
    assert rt.runner.replays and rt.runner.eager_steps  # decode steps and prefill chunks both ran ahead
    assert _runtime(fast=False).launch(_plan_of(rt)) is None  # the reference path: execute only


def test_prefill_pieces_launched_ahead_sample_what_one_by_one_samples():
    """Prefill and mixed steps through the pieces (staged in turn, their sampled rows' slots
    read by ``keep_sampled``), launched ahead of the step before's finish: the same tokens
    as the eager forward executing one step at a time."""
    prompts = [[5] * 30, list(range(3, 23)), [9, 8, 7], list(range(40, 75))]
    want = _serve_ahead(_runtime(fast=True, cuda_graphs="padded", compile=False, prefill_graph_sizes=[]),
                        prompts, ahead=False)
    rt = _runtime(fast=True, cuda_graphs="padded", compile=False, prefill_graph_sizes=[24, 32])
    got = _serve_ahead(rt, prompts, ahead=True)
    assert got == want
    assert rt.runner.prefill.replays >= 3 and rt.runner.replays  # prefill pieces and decode graph steps


def _plan_of(rt) -> StepPlan:
    """A one-token decode of slot 0 (for asking a runtime whether it launches it)."""
    k = decode_constants(1)
    return StepPlan(step_id=0, req_ids=np.zeros(1, np.int64), slots=np.zeros(1, np.int32), num_new=k.ones,
                    start_pos=np.ones(1, np.int32), samples=k.trues, token_ids=k.placeholders,
                    token_offsets=k.arange, block_start=np.zeros(1, np.int32), block_ids=np.zeros(0, np.int32),
                    block_offsets=k.zeros, num_tokens=1, num_padded_tokens=1)


def test_runtime_process_loop_sends_results_in_order_with_steps_launched_ahead():
    """The runtime process's loop over real rings, the engine's side played here with async
    scheduling (plan N+1 sent before result N is read): results come back in plan order with
    the tokens that executing one by one gives, and a plan that cannot be launched (one asking
    for logprobs) waits for the steps in flight."""
    import socket
    import threading

    from lockstep.runtime.main import _serve as serve_loop
    from lockstep.transports.shm_ring import Ring
    from lockstep.transports.step_codec import decode, encode

    prompts = [[5] * 30, list(range(3, 23)), [9, 8, 7]]
    want_steps, want = _serve_ahead(_runtime(fast=True, cuda_graphs="padded", compile=False), prompts, ahead=False)
    rt = _runtime(fast=True, cuda_graphs="padded", compile=False)
    to_rt, from_rt = Ring.create(1 << 20), Ring.create(1 << 20)
    a, b = socket.socketpair()
    launched, most, real_launch, real_finish = [], [0], rt.launch, rt.finish

    class NotYet:
        """On the CPU a launched step is done at once; this one says it is not for a while,
        so the loop takes the next plan (and launches it) before finishing this one."""

        def __init__(self, handle):
            self.handle, self.polls = handle, 0

        def ready(self) -> bool:
            self.polls += 1
            return self.polls > 200

    def launch(plan):
        started = real_launch(plan)
        launched.append(started is not None)
        most[0] = max(most[0], rt._outstanding)
        return None if started is None else NotYet(started)

    rt.launch, rt.finish = launch, lambda h: real_finish(h.handle)
    thread = threading.Thread(target=serve_loop, args=(rt, to_rt, from_rt, b), daemon=True)
    thread.start()
    try:
        cfg = SchedulerConfig(num_blocks=64, block_size=BS, max_num_seqs=4, max_num_batched_tokens=24,
                              max_model_len=256, async_scheduling=True)
        core = SchedulerCore(cfg, BlockHasher(b"k", BS))
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            core.add_request(Request(id=i, prompt=np.asarray(p, np.int32), params=params))
            rt.add_requests(NewRequests([i], [0.0], [1.0], [-1], [-1], [2 if i == 2 else -1]))
        got, in_flight, t, steps = {i: [] for i in range(len(prompts))}, [], 0, []
        while core.has_work() or in_flight:
            plan = core.schedule(float(t))
            if plan.num_reqs:
                kind, parts = encode(plan)
                to_rt.send(kind, *parts)
                in_flight.append(plan)
            if len(in_flight) > 1 or (in_flight and not plan.num_reqs):
                done = in_flight.pop(0)
                kind, _, payload = from_rt.recv(timeout=60)
                res = decode(kind, payload)
                assert res.step_id == done.step_id
                _record(done, res, steps, got)
                core.update(done, res, float(t))
            t += 1
        assert (steps, got) == (want_steps, want)
        assert True in launched and False in launched  # those sampling request 2 (logprobs): execute
        assert most[0] == 2  # a step was launched while the one before it was in flight
    finally:
        to_rt.send(0)
        thread.join(60)
        for x in (to_rt, from_rt, a, b):
            x.close()
    assert not thread.is_alive()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-device syncs exist on CUDA only")
def test_launching_a_step_makes_the_host_wait_for_nothing_on_the_device():
    """``launch`` queues the step and returns: no copy from pageable memory, no sync. Sampled
    requests (temperature, top-p) at staggered lengths, so decode steps bring new blocks,
    and prefill chunks: every launch runs under torch's sync debug mode set to error."""
    rt = _runtime(fast=True, compile=False)
    cfg = SchedulerConfig(num_blocks=64, block_size=BS, max_num_seqs=4, max_num_batched_tokens=24,
                          max_model_len=256, async_scheduling=True)
    core = SchedulerCore(cfg, BlockHasher(b"k", BS))
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, ignore_eos=True)
    for i, n in enumerate((5, 19, 40)):
        core.add_request(Request(id=i, prompt=np.arange(3, 3 + n, dtype=np.int32), params=params))
        rt.add_requests(NewRequests([i], [0.8], [0.9], [-1], [i], [-1]))
    in_flight, t, with_blocks = [], 0, 0
    while core.has_work() or in_flight:
        plan = core.schedule(float(t))
        if plan.num_reqs:
            torch.cuda.set_sync_debug_mode("error")
            try:
                started = rt.launch(plan)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert started is not None
            with_blocks += len(plan.block_ids) > 0
            in_flight.append((plan, started))
        if len(in_flight) > 1 or (in_flight and not plan.num_reqs):
            done, handle = in_flight.pop(0)
            core.update(done, rt.finish(handle), float(t))
        t += 1
    assert with_blocks > 3
