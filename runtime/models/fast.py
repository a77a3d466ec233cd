"""The DeepSeek-V3 model's fast path (CUDA; the CPU interpreter runs it in tests): the same
weights as ``DeepseekV3``, run through the Triton kernels with host work kept out of the
forward, so a decode forward can be captured as a CUDA graph.

- MLA, absorbed for tokens that decode: q_nope is folded through kv_b_proj's K part into
  latent space, ``kernels.mla_decode`` attends over the paged latent cache, and the latent
  output goes through kv_b_proj's V part, then o_proj. Every token attends as a query of
  its own (seq_len = its position + 1), so a sequence feeding a few tokens (speculative
  verification, a short chunk) decodes them too.
- Sequences feeding more than ``DECODE_MAX_NEW`` tokens (prefill chunks) go through
  ``kernels.mla_prefill``: causal over their new tokens, then their cached prefix in chunks.
- New latents reach the cache through ``kernels.kv_store.mla_prep_store`` (the latent's norm,
  the rope of q_pe and k_pe and the store in one launch; ``kv_store`` after a compiled step
  with MLA_PREP_KERNEL off), before attention (a sequence's new tokens attend to themselves
  through the cache, as in the reference model).
- The cache is the model's block-major pool, read through per-layer views: bf16, or FP8
  (``FP8Cache``: e4m3 values with a float32 scale per token, each a strided view of the same
  bytes), which every kernel takes with its ``scale`` argument. The pool's layout is the
  reference path's, so P/D moves the same block spans either way.
- Routed experts through ``kernels.fused_moe`` when this rank holds them all; expert
  parallelism keeps the model's own ``experts`` module: with exact dispatch its all-to-alls
  sync the host, with padded dispatch they do not and its local experts run through
  ``kernels.fused_moe`` too (one row per received pair).
  ``moe_fp8``: the experts also as e4m3 with 128x128 block scales (DeepSeek's layout), which
  the kernel reads instead (half the bytes; the bf16 copy stays for the reference path).
  ``fuse_shared`` (bf16/fp16 experts, not with ``moe_fp8``; all experts on this rank; steps
  of at most FUSE_SHARED_MAX_TOKENS tokens): the shared experts run inside the same fused MoE
  launch, as extra experts every token picks with weight 1. A shared MLP of intermediate s*I
  is the sum of s MLPs of intermediate I (SiLU·mul is per unit), so its
  gate/up/down rows are split into s expert slots after the routed ones. That saves the
  shared MLP's three launches per layer and streams its weights at the fused kernel's rate
  (the routed experts' storage moves into the larger tensor, the model's parameters
  re-pointed at it; only the shared weights, ~35 MB a layer in v2-lite, exist twice).
- The small elementwise steps between GEMMs (norms, SiLU·mul; the MoE's sum over its k terms
  inside the next add + norm; rope and the latent's norm only with MLA_PREP_KERNEL off) are
  pure functions shared with the reference model, optionally ``torch.compile``d (once for
  every layer: weights are arguments) so a step launches a few hundred kernels, not
  thousands (``fast_ops``). The router
  is two kernels (``kernels.router``: up to ROUTER_GEMM_MAX_TOKENS tokens the float32 logits
  GEMM from bf16 activations, else cuBLAS's; then sigmoid, bias, group limit, top-k, and with
  fuse_shared the shared experts' columns).

Weights are not copied: projections that read the same input (q and kv_a; gate and up) are
concatenated once and the model's own parameters re-pointed at views of the result, so the
reference forward and this one share every byte.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from .batch import ForwardBatch
from .deepseek_v3 import FP8Cache, DeepseekV3
from .fast_inputs import AttnPlan, FastInputs
from .fast_ops import FastOps
from .fast_weights import LayerWeights, fuse_shared_experts, layer_weights

log = logging.getLogger(__name__)

# The shared experts run inside the fused MoE launch up to this many tokens. Beyond, their
# tokens fill many row tiles of the same weights, and cuBLAS does that GEMM better: on the
# H200 the fused form took v2-lite's step at batch 1 from 3.04 to 2.83 ms, was even at 8 and
# 64, and cost 0.34 ms at 256.
FUSE_SHARED_MAX_TOKENS = 64
# The router's float32 GEMM runs as one Triton launch up to this many tokens (on the H200,
# 2.4 us a layer at batch 1 against ~6 us for the conversion, cuBLAS's gemv and its
# reduction); beyond, float32 tiles without tensor cores lose to cuBLAS (44 us a layer at
# batch 256 through tl.dot's IEEE path, against ~10).
ROUTER_GEMM_MAX_TOKENS = 8
# Beyond, cuBLAS's float32 GEMM (after a float32 copy of the activations). With
# ``router_split`` (off by default), in steps with a prefill chunk, on Hopper, the gate is
# held as three bf16 pieces that sum to it exactly (``kernels.router.split_gate``) and the
# GEMM runs on tensor cores in one launch (``router_logits_split``). Alone it is 1.85x / 3.3x
# faster at 1,024 / 4,096 tokens (H200, cold L2), but through the whole model it gained
# nothing measurable: prefill chunks of 256-8,192 tokens and decode at batch 64 / 256 took
# the same time either way (session 16), while its sums are 10x further from the exact product
# (tensor cores add float32 products in their own way: 2e-5 against 2e-6 at logits of ~2) and
# the pieces cost 1.5x the gate's memory (~610 MiB a rank for DeepSeek-V3). The rule is by
# the step's kind, not its token count, so a chunk routes the same padded or eager.
# With fuse_shared, the router kernel writes the shared experts' columns itself (False: two
# concatenations a layer add them, the form before; kept for A/B runs on the GPU).
ROUTER_WRITES_SHARED = True
# The latent's norm, the rope of q_pe and k_pe and the cache store run as one kernel
# (kernels.kv_store.mla_prep_store; False: a compiled step for norm and rope, then kv_store:
# three launches a layer, the form before, kept for A/B runs on the GPU). On the H200 v2-lite's
# step went 2.34 -> 2.31 ms at batch 1, 6.36 -> 6.29 at 8, 9.99 -> 9.92 at 64, even at 256
# (raw/2026-11-30-h200-session11-mla-prep-ab.txt).
MLA_PREP_KERNEL = True
# Up to this many tokens the fused MoE's terms are summed inside the next add + norm step, one
# launch fewer a layer: on the H200 v2-lite's step went (medians of rounds) 2.55 -> 2.48 ms at
# batch 1, 6.43 -> 6.36 at 8, 10.07 -> 9.99 at 64, but 12.45 -> 12.60 at 256, where the norm's
# looped reduction reads the k terms twice (raw/2026-11-30-h200-session11-moe-sum-ab.txt).
# 0: the kernel's own sum launch everywhere.
MOE_SUM_IN_NORM_MAX_TOKENS = 64
# At one decoding token, up to this many attention splits are merged inside the W_UV
# product's launch (kernels.dense.merge_bmm_row) where that launch fuses (a tuned bf16 bmm_row
# config for W_UV's shape), one launch fewer a layer. Each of its programs redoes its head's
# merge. On the H200, v2-lite's batch-1 step went 2.277 -> 2.247 ms at 16 splits (a
# 1024-token launch bound), 2.313 -> 2.259 at 32 (2048: the bench's 1K context), but 2.312 ->
# 2.596 at 64 and 2.340 -> 2.993 at 128 (raw/2026-11-30-h200-session12-merge-ab*.txt).
# 0: mla_decode's own merge launch, then bmm_row, everywhere (kept for A/B runs).
MERGE_IN_W_UV_MAX_SPLITS = 32


class Step:
    """Per-forward tensors every layer reads."""

    def __init__(self, inp: FastInputs, model: FastDeepseek, kv: list, rope: bool = True):
        plan = inp.plan
        self.caches = [_cache_views(c) for c in kv]
        self.valid = inp.slot_mapping >= 0 if inp.padded else None
        # rope False: a step for attention cores alone, whose inputs come rotated
        self.cos, self.sin = model.rope.cos_sin(inp.positions, torch.float32) if rope else (None, None)
        self.dec_tables = self.dec_lens = self.pf_tables = None
        self.has_prefill = bool(plan.n_pf)  # some sequence feeds a prefill chunk
        if plan.n_dec:
            rows, pos = inp.tok_rows, inp.positions
            if plan.dec is not None:
                rows, pos = rows[plan.dec], pos[plan.dec]
            self.dec_tables = inp.tables.index_select(0, rows)
            lens = (pos + 1).to(torch.int32)
            if self.valid is not None:
                lens = torch.where(self.valid, lens, 0)
            self.dec_lens = lens
        if plan.n_pf:
            self.pf_tables = inp.tables.index_select(0, plan.pf_rows)
        self.prefix = None  # kernels.mla_prefill.prefix_chunks, made by the first layer
        self._shared: dict = {}

    def shared_choice(self, t: int, e: int, s: int, ids_dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [t, s] = e..e+s-1, weights [t, s] = 1): every token's pick of the shared
        experts fused as slots e.. (made once a step, for every layer)."""
        key = (t, e, s, ids_dtype)
        got = self._shared.get(key)
        if got is None:
            ids = torch.arange(e, e + s, dtype=ids_dtype, device=device).expand(t, s)
            got = self._shared[key] = (ids, torch.ones(t, s, dtype=torch.float32, device=device))
        return got


def _cache_views(layer_cache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's (entries (blocks, block_size, dim), per-token scales (blocks, block_size) or
    None): the kernels' cache and scale arguments. Both are views of the pool, strided
    between blocks, which the launchers take as they are."""
    if isinstance(layer_cache, FP8Cache):
        return layer_cache.values, layer_cache.scales
    return layer_cache, None


def _stored_entries(cache, slots: torch.Tensor, dl: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(latent (T, dl), k_pe (T, dr)) of the entries at ``slots`` of an FP8 layer, dequantized."""
    values, scales = cache
    bs = values.shape[1]
    blk, off = slots // bs, slots % bs
    ent = (values[blk, off].float() * scales[blk, off][:, None]).to(dtype)
    return ent[:, :dl], ent[:, dl:]


# -- the model ------------------------------------------------------------------------------------

class FastDeepseek:
    def __init__(self, model: DeepseekV3, *, fused_moe: bool = True, compile: bool = False, moe_fp8: bool = False,
                 fuse_shared: bool = True, router_split: bool = False):
        # Not imported as ``fused_moe``: that name is the flag saying whether to use it.
        from lockstep.kernels.dense import bmm_row, linear, merge_bmm_row, merge_fuses
        from lockstep.kernels.fused_moe import fused_moe as fused_moe_kernel
        from lockstep.kernels.kv_store import kv_store, mla_prep_store
        from lockstep.kernels.mla_decode import mla_decode, mla_decode_partials
        from lockstep.kernels.mla_prefill import mla_prefill, prefix_chunks

        self._kv_store, self._mla_decode = kv_store, mla_decode
        self._mla_prep_store = mla_prep_store
        self._linear = linear  # the decode projections: tuned Triton tiles or cuBLAS, per shape
        self._bmm_row = bmm_row  # the absorbed heads' products at one token: the same, per shape
        self._mla_decode_partials, self._merge_bmm_row = mla_decode_partials, merge_bmm_row
        self._merge_fuses = merge_fuses
        self._mla_prefill, self._fused_moe = mla_prefill, fused_moe_kernel
        self._prefix_chunks = prefix_chunks
        if model.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"the fast path runs bfloat16 or float16 models (the kernels' dtypes), not {model.dtype}")
        self.model, self.cfg, self.rope = model, model.cfg, model.rope
        self.use_fused_moe, self.moe_fp8 = bool(fused_moe), bool(moe_fp8 and fused_moe)
        self.ops = FastOps(compile)
        with torch.no_grad():
            self.layers = [layer_weights(layer, self.cfg) for layer in model.layers]
            if self.moe_fp8:
                from lockstep.kernels.fused_moe import quantize_fp8_blockwise

                for lw in self.layers:
                    if lw.moe is not None and lw.fp8 is None:
                        ex = lw.moe.experts
                        lw.fp8 = (*quantize_fp8_blockwise(ex.gate_up_proj), *quantize_fp8_blockwise(ex.down_proj))
            self.fuse_shared = bool(fuse_shared and self.use_fused_moe and not self.moe_fp8)
            if self.fuse_shared:
                for lw in self.layers:
                    fuse_shared_experts(lw)
            from lockstep.kernels._util import hopper_or_later

            self.router_split = bool(router_split and model.dtype == torch.bfloat16
                                     and hopper_or_later(next(model.parameters()).device))
            if self.router_split:
                from lockstep.kernels.router import split_gate

                for lw in self.layers:
                    gate = lw.moe.gate.weight if lw.moe is not None else None
                    if gate is not None and lw.gate_split is None and gate.dtype == torch.float32:
                        lw.gate_split = split_gate(gate.detach())
        self.first_moe = self.cfg.first_k_dense_replace
        self.len_cap = 1 << 30

    # -- the reference model's interface, for callers holding a ForwardBatch ----------------
    def __call__(self, batch: ForwardBatch, kv: list) -> tuple[torch.Tensor, torch.Tensor]:
        qs, lens = batch.host_meta()
        num_new = np.diff(qs)
        rows = np.arange(len(lens))
        dev = batch.input_ids.device
        plan = AttnPlan.build(num_new, lens, rows, self.len_cap, dev)
        tok_rows = torch.from_numpy(np.repeat(rows, num_new)).to(dev)
        return self.forward(FastInputs(batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables,
                                       tok_rows, plan, batch.sample_index), kv)

    @torch.inference_mode()
    def forward(self, inp: FastInputs, kv: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits (S, vocab) float32, expert token counts (layers, experts) int32), as
        DeepseekV3.forward returns them; padding tokens are not counted. ``kv``: per-layer
        caches as ``DeepseekV3.make_kv_pool`` makes them (tensors, or ``FP8Cache``s).

        A layer is ``attn_in`` (projections, rope, the cache store), ``attn_core`` (the
        attention itself, which alone depends on where each sequence's context lies),
        ``attn_out`` and ``ffn``: ``prefill_graphs.PrefillGraphs`` replays everything but the
        cores as CUDA graphs, in the same order."""
        step = Step(inp, self, kv)
        x, h = self.embed(inp)
        chosen: list[torch.Tensor] = []
        for i, lw in enumerate(self.layers):
            q = self.attn_in(h, lw, i, inp.slot_mapping, step)
            x, h = self.ffn(i, x, self.attn_out(self.attn_core(*q, i, inp, step), lw, inp.plan), step, chosen)
        if inp.sample_index is not None:
            h = h[inp.sample_index]
        logits = self._linear(h, self.model.lm_head.weight).float()
        return logits, self._counts(chosen, len(inp.input_ids), x.device)

    def embed(self, inp: FastInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, the first layer's normed input)."""
        ids = inp.input_ids
        if inp.last is not None:
            ids = torch.where(ids < 0, inp.last[inp.tok_rows], ids)
        x = self.model.embed_tokens(ids)
        return x, self.ops.norm(x, self.layers[0].in_norm, self.cfg.rms_norm_eps)

    def ffn(self, i: int, x, attn, step: Step, chosen: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i after its attention: (residual stream, the next layer's normed input, or
        the final norm's after the last layer). Appends the routed experts' ids to
        ``chosen``."""
        ops, eps, lw = self.ops, self.cfg.rms_norm_eps, self.layers[i]
        x, h = ops.add_norm(x, attn, lw.post_norm, eps)
        nxt = self.layers[i + 1].in_norm if i + 1 < len(self.layers) else self.model.norm.weight
        if lw.moe is None:
            down = self._linear(ops.silu_mul(self._linear(h, lw.gate_up)), lw.down)
            return ops.add_norm(x, down, nxt, eps)
        fuse = self.fuse_shared and lw.with_shared is not None and h.shape[0] <= FUSE_SHARED_MAX_TOKENS
        routed = self._routed(h, lw, step, chosen, fuse)
        shared = None if lw.gate_up is None or fuse else \
            self._linear(ops.silu_mul(self._linear(h, lw.gate_up)), lw.down)
        if isinstance(routed, tuple) and routed[0].dim() == 2:  # summed by the kernel (> 64 tokens)
            routed = routed[0]
        if isinstance(routed, tuple):  # the fused MoE's terms, summed in the next step
            y, ids, n = routed
            return ops.add_moe_norm(x, y, ids, n, nxt, eps) if shared is None else \
                ops.add2_moe_norm(x, y, ids, n, shared, nxt, eps)
        if shared is None:
            return ops.add_norm(x, routed, nxt, eps)
        return ops.add2_norm(x, routed, shared, nxt, eps)

    # -- attention ------------------------------------------------------------------------------
    def attn_in(self, h, lw: LayerWeights, i: int, slots: torch.Tensor, step: Step):
        """(q_nope (T, H, dn), q_pe (T, H, dr) rotated, latent (T, dl) normed, k_pe (T, dr)
        rotated); the new entries are stored in the cache at ``slots`` (-1: not stored)."""
        cfg = self.cfg
        t, heads = h.shape[0], cfg.num_attention_heads
        dn, dr, dl = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        f = self._linear(h, lw.w_in)
        if lw.q_b is None:
            split = heads * (dn + dr)
            q = f[:, :split].view(t, heads, dn + dr)
        else:
            split = cfg.q_lora_rank
            q = F.linear(self.ops.norm(f[:, :split], lw.q_a_norm, 1e-6), lw.q_b).view(t, heads, dn + dr)
        cache = step.caches[i]
        if MLA_PREP_KERNEL:
            q_pe, latent, k_pe = self._mla_prep_store(q[..., dn:], f[:, split:], step.cos, step.sin, lw.kv_norm,
                                                      1e-6, cache[0], slots, cache[1],
                                                      interleaved=cfg.rope_interleave)
        else:
            q_pe, latent, k_pe = self.ops.mla_prep(q[..., dn:], f[:, split:], step.cos, step.sin, lw.kv_norm, 1e-6,
                                                   dl, cfg.rope_interleave)
            self._kv_store(cache[0], latent, k_pe, slots, cache[1])
        return q[..., :dn], q_pe, latent, k_pe

    def attn_core(self, q_nope, q_pe, latent, k_pe, i: int, inp: FastInputs, step: Step) -> torch.Tensor:
        """The attention's values (T, H, dv): per token (decode) or per sequence (prefill),
        as ``inp.plan`` says."""
        plan, lw, cache = inp.plan, self.layers[i], step.caches[i]
        if not plan.n_pf:
            return self._decode(q_nope, q_pe, lw, cache, plan, step)
        if not plan.n_dec:
            return self._prefill(q_nope, q_pe, latent, k_pe, inp.slot_mapping, lw, cache, plan, step)
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], lw.w_uv.shape[2])
        d, p = plan.dec, plan.pf
        out.index_copy_(0, d, self._decode(q_nope[d], q_pe[d], lw, cache, plan, step))
        out.index_copy_(0, p, self._prefill(q_nope[p], q_pe[p], latent[p], k_pe[p], inp.slot_mapping[p], lw,
                                            cache, plan, step))
        return out

    def attn_out(self, vals, lw: LayerWeights, plan: AttnPlan) -> torch.Tensor:
        """The output projection of the values (T, H, dv): cuBLAS for a step with prefill
        tokens (its shape then depends only on the token count), else the tuned tiles."""
        t = vals.shape[0]
        if plan.n_pf:
            return F.linear(vals.reshape(t, -1), lw.o_proj)
        return self._linear(vals.view(t, -1), lw.o_proj)

    def _decode(self, q_nope, q_pe, lw: LayerWeights, cache, plan: AttnPlan, step: Step) -> torch.Tensor:
        """Absorbed MLA: (T, H, dv) values for tokens attending per token. ``cache``: this
        layer's (entries, scales or None), as every cache argument here."""
        one = q_nope.shape[0] == 1  # a token: per-head matrix-vector products (tuned shapes)
        if one:
            q_latent = self._bmm_row(q_nope[0], lw.w_uk)[None]
        else:
            q_latent = torch.bmm(q_nope.transpose(0, 1), lw.w_uk).transpose(0, 1)  # (T, H, dl)
        if one and MERGE_IN_W_UV_MAX_SPLITS and self._merge_fuses(lw.w_uv):
            part, lse = self._mla_decode_partials(q_latent, q_pe, cache[0], step.dec_tables, step.dec_lens,
                                                  self.cfg.softmax_scale, cache[1], max_seq_len=plan.dec_len_bound,
                                                  merge_above=MERGE_IN_W_UV_MAX_SPLITS)
            if lse is None:  # merged already, or one split wrote the output
                return self._bmm_row(part[0], lw.w_uv)[None]
            return self._merge_bmm_row(part[0], lse[0], lw.w_uv)[None]
        o = self._mla_decode(q_latent, q_pe, cache[0], step.dec_tables, step.dec_lens, self.cfg.softmax_scale,
                             cache[1], max_seq_len=plan.dec_len_bound)
        if one:
            return self._bmm_row(o[0], lw.w_uv)[None]
        out = o.new_empty(o.shape[0], o.shape[1], lw.w_uv.shape[2])
        torch.bmm(o.transpose(0, 1), lw.w_uv, out=out.transpose(0, 1))  # cuBLAS writes (T, H, dv) in place
        return out

    def _prefill(self, q_nope, q_pe, latent, k_pe, slots, lw: LayerWeights, cache, plan: AttnPlan,
                 step: Step) -> torch.Tensor:
        cfg = self.cfg
        heads, dn = cfg.num_attention_heads, cfg.qk_nope_head_dim
        if cache[1] is not None:
            # FP8: the new tokens attend to their own entries as stored, as the reference path
            # and every later step see them (unquantized keys move greedy tokens at near-ties).
            latent, k_pe = _stored_entries(cache, slots, latent.shape[1], latent.dtype)
        kv_new = F.linear(latent, lw.kv_b).view(latent.shape[0], heads, -1)
        if step.prefix is None:  # where the cached prefixes lie: the same for every layer
            step.prefix = self._prefix_chunks(step.pf_tables, plan.pf_prefix, cache[0].shape[1])
        return self._mla_prefill(torch.cat([q_nope, q_pe], dim=-1), kv_new[..., :dn], k_pe, kv_new[..., dn:],
                                 plan.pf_cu, plan.pf_max_new, plan.pf_prefix, cache[0], step.pf_tables,
                                 lw.kv_b, cfg.softmax_scale, cache[1], prefix=step.prefix)

    # -- experts ---------------------------------------------------------------------------------
    def _routed(self, h, lw: LayerWeights, step: Step, chosen: list[torch.Tensor], fuse: bool = False):
        """The routed experts' output [T, H]; with the fused MoE (y, ids, experts), where y is
        the unsummed terms [T, k, H] for the next step to sum, or above
        MOE_SUM_IN_NORM_MAX_TOKENS the output [T, H] summed by the kernel. ``fuse``: the
        shared experts' added in (``with_shared``)."""
        cfg, moe, ops = self.cfg, lw.moe, self.ops
        gate, k = moe.gate, cfg.num_experts_per_tok
        args = (k, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
        shared = (0, 0)  # with fuse, the shared experts' columns, made by the router kernel
        if ops.moe_route_unsupported(gate.weight.shape[0], k, cfg.n_group, cfg.topk_group) is None:
            if (h.shape[0] <= ROUTER_GEMM_MAX_TOKENS and gate.weight.dtype == torch.float32
                    and h.stride(-1) == 1 and gate.weight.stride(-1) == 1):
                logits = ops.router_logits(h, gate.weight)
            elif self.router_split and step.has_prefill and lw.gate_split is not None and h.dtype == torch.bfloat16:
                logits = ops.router_logits_split(h, lw.gate_split)
            else:
                logits = F.linear(h.float(), gate.weight)
            if fuse and ROUTER_WRITES_SHARED:
                e = lw.with_shared[2]
                shared = (e, lw.with_shared[0].shape[0] - e)
            weights, ids = ops.moe_route(logits, gate.e_score_correction_bias, *args, shared)
        else:
            weights, ids = ops.route(h, gate.weight, gate.e_score_correction_bias, *args)
        routed = ids[:, :k] if shared[1] else ids
        if step.valid is not None:  # padding tokens choose no expert: they cost no weight reads
            routed = torch.where(step.valid[:, None], routed, cfg.n_routed_experts)
            if not shared[1]:
                ids = routed
        chosen.append(routed)
        if not self.use_fused_moe:  # expert parallelism: this rank's slots, all-to-alls
            return moe.experts(h, weights, ids, local=self._fused_moe)
        if fuse:
            w13, w2, e = lw.with_shared
            n = w13.shape[0]
            if not shared[1]:  # the router's kernel did not take them: add them here
                s_ids, s_w = step.shared_choice(h.shape[0], e, n - e, ids.dtype, h.device)
                ids, weights = torch.cat([ids, s_ids], 1), torch.cat([weights.float(), s_w], 1)
            if step.valid is not None:  # padding: no expert at all, shared ones included
                ids = torch.where(step.valid[:, None], ids, n)
            return self._fused_moe(h, w13, w2, weights, ids, reduce=h.shape[0] > MOE_SUM_IN_NORM_MAX_TOKENS), ids, n
        if self.moe_fp8:
            w13, s13, w2, s2 = lw.fp8
            return self._fused_moe(h, w13, w2, weights, ids, w_gate_up_scale=s13, w_down_scale=s2,
                                   reduce=h.shape[0] > MOE_SUM_IN_NORM_MAX_TOKENS), ids, w13.shape[0]
        w13 = moe.experts.gate_up_proj
        return self._fused_moe(h, w13, moe.experts.down_proj, weights, ids,
                               reduce=h.shape[0] > MOE_SUM_IN_NORM_MAX_TOKENS), ids, w13.shape[0]

    def _counts(self, chosen: list[torch.Tensor], t: int, device) -> torch.Tensor:
        """Tokens per (layer, expert), in a few launches for all layers at once."""
        cfg = self.cfg
        e = cfg.n_routed_experts
        counts = torch.zeros(cfg.num_hidden_layers, e + 1, dtype=torch.int32, device=device)
        if chosen and t:
            ids = torch.stack(chosen)  # (MoE layers, T, k); id e marks padding
            ids = ids + (torch.arange(len(chosen), device=device) * (e + 1))[:, None, None]
            counts[self.first_moe:].view(-1).scatter_add_(
                0, ids.view(-1), torch.ones(ids.numel(), dtype=torch.int32, device=device))
        return counts[:, :e]
