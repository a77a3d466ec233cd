"""The issue's baseline on the GPU: transformers' DeepseekV3ForCausalLM with the v2-lite
shape (random weights, bf16), its eager forward loop at one batch after a prompt (run by
``bench_decode.py``, section 5)."""

from __future__ import annotations

import gc
import statistics
import time

import torch

from lockstep.runtime.models import preset

# Issue 8's H200 facts (transformers 5.17, prompts of 512 tokens): the forward loop's ms a step.
ISSUE_HF = {"forward_loop_ms": {1: 102, 8: 135, 64: 123, 256: 113},
            "best_ms": {1: 6.7, 64: 138}}  # best: generate with a static cache and compile


def hf_config(cfg):
    import transformers

    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
              moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
              num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
              n_shared_experts=cfg.n_shared_experts, n_routed_experts=cfg.n_routed_experts,
              num_experts_per_tok=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
              first_k_dense_replace=cfg.first_k_dense_replace, q_lora_rank=cfg.q_lora_rank,
              kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
              qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim,
              routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob,
              max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps)
    rs = cfg.rope_scaling
    rope = dict(rope_type="yarn", rope_theta=cfg.rope_theta, factor=rs.factor, mscale=rs.mscale,
                mscale_all_dim=rs.mscale_all_dim, original_max_position_embeddings=rs.original_max_position_embeddings)
    try:
        return transformers.DeepseekV3Config(**kw, rope_parameters=rope)
    except TypeError:  # transformers 4.x spelling
        return transformers.DeepseekV3Config(**kw, rope_theta=cfg.rope_theta,
                                             rope_scaling={**rope, "type": "yarn"})


def bench_transformers(run, batch: int, prompt: int, steps: int) -> None:
    import transformers

    run.info["transformers"] = transformers.__version__
    cfg = preset("v2-lite")
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            hf = transformers.DeepseekV3ForCausalLM(hf_config(cfg)).eval()
    finally:
        torch.set_default_dtype(old)
    try:
        ids = torch.randint(3, cfg.vocab_size, (batch, prompt), device="cuda")
        with torch.inference_mode():
            try:  # logits of the last position only (a 64 x 512 x vocab tensor is 13 GB)
                out = hf(input_ids=ids, use_cache=True, logits_to_keep=1)
            except TypeError:
                out = hf(input_ids=ids, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            times = []
            for i in range(steps + 1):
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = hf(input_ids=nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                if i:
                    times.append(time.perf_counter() - t)
        ms = 1e3 * statistics.median(times)
        run.info["hf_forward_loop_ms"] = {batch: ms}
        run.row(section="transformers", case="DeepseekV3ForCausalLM forward loop (eager)", batch=batch, ctx=prompt,
                step_ms=ms, tokens_per_s=batch / (ms / 1e3),
                note=f"issue: {ISSUE_HF['forward_loop_ms'].get(batch)} ms; best (generate, static cache, compile) "
                     f"{ISSUE_HF['best_ms'].get(batch)} ms")
    finally:
        del hf
        gc.collect()
        torch.cuda.empty_cache()
