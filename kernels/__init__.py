"""Triton kernels, each above its launcher and next to a torch reference.

- `fused_moe`: routed experts (gate/up GEMM + SiLU·mul, down GEMM, top-k sum); bf16 or FP8
  block-scaled weights; `moe_align`: its pairs sorted into per-expert blocks.
- `mla_decode`: absorbed-form MLA decode over the paged latent cache, split-K, bf16 or FP8.
- `mla_prefill`: new tokens over a long cached prefix, chunked, expanded form.
- `topk`: exact top-k over long rows (sparse-attention indexer), two launches;
  `topk_threshold`: the earlier four-launch design, its fallback for large k.
- `kv_store`: new latents into the paged cache, bf16 or FP8 with per-token scales; and
  `mla_prep_store`, the latent's norm, rope of q_pe and k_pe and that store in one launch.
- `dense`: decode projections (tiles or one-row `gemv`) and the absorbed heads' products.
- `router`: the MoE router after its GEMM (sigmoid, bias, group-limited top-k, weights), one launch.

Importing this package imports nothing; each module needs triton. Tuned launch configs live in
dicts at the top of each module (written from benchmarks/gpu/bench_kernels.py on an H200).
"""
