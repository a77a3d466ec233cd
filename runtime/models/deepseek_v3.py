"""DeepSeek-V3-family model (MLA attention + MoE with shared experts) for the torch runtime.

This is the readable reference that later Triton kernels are tested against: a loop over
sequences for attention and over active experts for the MoE. Semantics follow Hugging
Face's ``modeling_deepseek_v3`` (transformers 5.x), checked by tests/test_model_hf.py.

Attention uses MLA's *expanded* form: each layer caches only the normalized KV latent and
the rotated k_pe (``kv_lora_rank + qk_rope_head_dim`` values per token, in a paged cache),
and at attention time kv_b_proj decompresses the cached latents into per-head k_nope and v.
The absorbed form (folding kv_b_proj into the query and output) computes the same thing
with less work for decode: ``models/fast.py`` runs it through the Triton kernels on CUDA,
on these same weights.

Parameter names are Hugging Face's without the ``model.`` prefix, so loading is a lookup;
routed experts are stacked per layer — gate_up (E, 2*I, H) and down (E, H, I) — so an
expert-placement swap is an in-place copy of one slot.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from lockstep.runtime.models.batch import ForwardBatch
from lockstep.runtime.models.config import ModelConfig
from lockstep.runtime.models.rope import Rope


def _param(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    # Uninitialized: a checkpoint load or random_init fills every parameter, and skipping
    # nn.Linear's init saves minutes on a 16B-parameter model.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, n_in: int, n_out: int, dtype: torch.dtype, device):
        super().__init__()
        self.weight = _param(n_out, n_in, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int, dtype: torch.dtype, device):
        super().__init__()
        self.weight = _param(vocab, dim, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device):
        super().__init__()
        self.weight = _param(dim, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalize in float32 (at least), cast back, then scale: transformers' order,
    # which matters for bit-level agreement in bf16.
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU MLP: the dense layers and the shared experts."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, dtype, device)
        self.up_proj = Linear(hidden, inter, dtype, device)
        self.down_proj = Linear(inter, hidden, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _SeqSpan:
    """Where one sequence's queries and keys are, resolved once per forward (host ints)."""

    __slots__ = ("start", "end", "seq_len", "blocks")

    def __init__(self, start: int, end: int, seq_len: int, blocks: torch.Tensor):
        self.start, self.end, self.seq_len, self.blocks = start, end, seq_len, blocks


def _spans(batch: ForwardBatch, block_size: int) -> list[_SeqSpan]:
    qs, lens = batch.query_start.tolist(), batch.seq_lens.tolist()
    return [_SeqSpan(qs[i], qs[i + 1], n, batch.block_tables[i, :-(-n // block_size)].long())
            for i, n in enumerate(lens)]


class Attention(nn.Module):
    """Multi-head latent attention over a paged latent KV cache (expanded form)."""

    def __init__(self, cfg: ModelConfig, rope: Rope, dtype: torch.dtype, device):
        super().__init__()
        self.cfg, self.rope = cfg, rope
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(h, heads * cfg.qk_head_dim, dtype, device)
        else:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, dtype, device)
            # transformers builds both latent norms with eps 1e-6, not rms_norm_eps.
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, dtype, device)
            self.q_b_proj = Linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, dtype, device)
        self.kv_a_proj_with_mqa = Linear(h, cfg.kv_cache_dim, dtype, device)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6, dtype, device)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                dtype, device)
        self.o_proj = Linear(heads * cfg.v_head_dim, h, dtype, device)

    def _queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(x.shape[0], cfg.num_attention_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        return torch.cat([q_nope, self.rope.apply(q_pe, cos, sin)], dim=-1)

    def _write_latents(self, x: torch.Tensor, cos, sin, cache: torch.Tensor, slots) -> None:
        latent, k_pe = self.kv_a_proj_with_mqa(x).split(
            [self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], dim=-1)
        entry = torch.cat([self.kv_a_layernorm(latent), self.rope.apply(k_pe, cos, sin)], dim=-1)
        bs = cache.shape[1]  # a layer's view of the block-major pool: (blocks, bs, dim), strided
        cache[slots // bs, slots % bs] = entry.to(cache.dtype)

    def _expand(self, cached: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached (L, kv_cache_dim) -> keys (L, heads, qk_head_dim), values (L, heads, v)."""
        cfg, n = self.cfg, cached.shape[0]
        latent, k_pe = cached.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(n, cfg.num_attention_heads, -1)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k_pe = k_pe[:, None, :].expand(n, cfg.num_attention_heads, cfg.qk_rope_head_dim)
        return torch.cat([k_nope, k_pe], dim=-1), v

    def forward(self, x: torch.Tensor, batch: ForwardBatch, spans: list[_SeqSpan],
                cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Write first: a sequence's new tokens attend to themselves through the cache.
        self._write_latents(x, cos, sin, cache, batch.slot_mapping)
        q = self._queries(x, cos, sin)
        out = x.new_empty(x.shape[0], self.cfg.num_attention_heads, self.cfg.v_head_dim)
        for s in spans:
            cached = cache[s.blocks].flatten(0, 1)[:s.seq_len].to(x.dtype)
            k, v = self._expand(cached)
            scores = torch.einsum("thd,lhd->htl", q[s.start:s.end], k).float()
            scores = scores * self.cfg.softmax_scale
            future = (torch.arange(s.seq_len, device=x.device)[None, :]
                      > batch.positions[s.start:s.end, None])
            probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1).to(x.dtype)
            out[s.start:s.end] = torch.einsum("htl,lhd->thd", probs, v)
        return self.o_proj(out.flatten(1))


class Router(nn.Module):
    """Sigmoid scores; the correction bias steers which experts are chosen, not their weights."""

    def __init__(self, cfg: ModelConfig, device):
        super().__init__()
        self.cfg = cfg
        # Kept in float32 whatever the model dtype, as transformers and DeepSeek do.
        self.weight = _param(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32,
                             device=device)
        self.e_score_correction_bias = _param(cfg.n_routed_experts, dtype=torch.float32,
                                              device=device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (T, k) float32, expert ids (T, k) int64)."""
        cfg = self.cfg
        return route(x, self.weight, self.e_score_correction_bias, cfg.num_experts_per_tok, cfg.n_group,
                     cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
          topk_group: int, norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The router as a pure function of its weights (the fast path compiles it once for
    every layer)."""
    scores = F.linear(x.float(), weight).sigmoid()
    choice = scores + bias
    if topk_group < n_group:
        # Group-limited routing: keep the groups with the best top-2 sums, so a token's
        # experts span at most topk_group groups (nodes, in DeepSeek's deployment).
        grouped = choice.view(x.shape[0], n_group, weight.shape[0] // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = group_scores.topk(topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~mask[..., None], float("-inf")).flatten(1)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = _param(e, 2 * i, h, dtype=dtype, device=device)
        self.down_proj = _param(e, h, i, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        self.gate = Router(cfg, device)
        self.experts = Experts(cfg, dtype, device)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                   dtype, device) if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        counts += torch.bincount(ids.flatten(), minlength=counts.shape[0]).to(counts.dtype)
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: Rope, dtype: torch.dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, rope, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = (MoE(cfg, dtype, device) if cfg.is_moe_layer(layer)
                    else MLP(cfg.hidden_size, cfg.intermediate_size, dtype, device))

    def forward(self, x, batch, spans, cache, cos, sin, counts) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, spans, cache, cos, sin)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, counts) if isinstance(self.mlp, MoE) else self.mlp(h))


class FP8Cache:
    """One layer's view of an FP8 KV pool with a scale per token (a per-block scale would
    break when later tokens join a block). Indexing it reads dequantized float32 rows and
    assigning to it quantizes, so the attention code treats it as the plain cache tensor."""

    dtype = torch.float32  # what writers cast to before it quantizes

    def __init__(self, values: torch.Tensor, scales: torch.Tensor):
        self.values, self.scales, self.shape = values, scales, values.shape

    def __setitem__(self, index, entry: torch.Tensor) -> None:
        scale = entry.abs().amax(-1).clamp(min=1e-12) / 448.0  # e4m3's largest finite value
        self.values[index] = (entry / scale[..., None]).to(torch.float8_e4m3fn)
        self.scales[index] = scale

    def __getitem__(self, index) -> torch.Tensor:
        return self.values[index].to(torch.float32) * self.scales[index][..., None]


class DeepseekV3(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__()
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.rope = Rope(cfg, device)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.rope, dtype, device)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype, device)

    # -- construction ---------------------------------------------------------------------
    def truncated(self, num_layers: int) -> DeepseekV3:
        """This model's first ``num_layers`` layers with its embeddings, final norm and head,
        sharing the weights: a draft for self-speculative decoding."""
        m = DeepseekV3.__new__(DeepseekV3)
        nn.Module.__init__(m)
        m.cfg = attrs.evolve(self.cfg, num_hidden_layers=num_layers)
        m.dtype, m.device, m.rope = self.dtype, self.device, self.rope
        m.embed_tokens, m.norm, m.lm_head = self.embed_tokens, self.norm, self.lm_head
        m.layers = nn.ModuleList(list(self.layers)[:num_layers])
        return m

    @classmethod
    def random_init(cls, cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", *, draw_on_device: bool = False) -> DeepseekV3:
        """Weights ~ N(0, initializer_range), norms 1, routing bias 0; same seed, same weights
        on any device (drawn on the CPU). ``draw_on_device``: drawn where they live instead,
        in seconds rather than minutes for a 16B-parameter GPU model (other weights, same
        distribution)."""
        model = cls(cfg, dtype, device)
        gen = torch.Generator(device=device if draw_on_device else "cpu").manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                p.zero_()
            elif draw_on_device:
                p.normal_(0.0, cfg.initializer_range, generator=gen)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * cfg.initializer_range)
        return model

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                        device: torch.device | str = "cpu") -> DeepseekV3:
        from lockstep.runtime.models.weights import iter_safetensors

        model = cls(ModelConfig.from_pretrained(model_dir), dtype, device)
        model.load_weights(iter_safetensors(model_dir))
        return model

    def load_weights(self, weights: Mapping[str, torch.Tensor]
                     | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in (fused or per-expert expert weights); raises
        WeightLoadError naming any missing, unexpected or mis-shaped tensor."""
        from lockstep.runtime.models.weights import load_weights

        load_weights(self, weights)

    def make_kv_cache(self, num_blocks: int, block_size: int,
                      dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Per-layer (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim) views of one
        zeroed block-major pool (see ``make_kv_pool``)."""
        return self.make_kv_pool(num_blocks, block_size, dtype)[1]

    def make_kv_pool(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                     storage: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The KV pool, block-major: (num_blocks, layers, block_size, kv_cache_dim), so one
        block of every layer is one contiguous span (one descriptor moves it in P/D), and
        per-layer views of it. ``storage``: zeroed bytes to lay it over (a shared pool)."""
        dtype = dtype or self.dtype
        if dtype == torch.float8_e4m3fn:
            return self._fp8_pool(num_blocks, block_size, storage)
        shape = (num_blocks, self.cfg.num_hidden_layers, block_size, self.cfg.kv_cache_dim)
        if storage is None:
            pool = torch.zeros(shape, dtype=dtype, device=self.device)
        else:
            pool = storage.view(torch.uint8).view(dtype).view(shape)
            if pool.device != self.device:
                raise ValueError(f"KV pool storage is on {pool.device}, the model on {self.device}")
        return pool, [pool[:, i] for i in range(self.cfg.num_hidden_layers)]

    def kv_block_bytes(self, block_size: int, dtype: torch.dtype | None = None) -> int:
        """Bytes of one block of the pool (every layer), as ``make_kv_pool`` lays it out."""
        per_token = self.cfg.num_hidden_layers * self.cfg.kv_cache_dim
        if (dtype or self.dtype) == torch.float8_e4m3fn:
            return block_size * (per_token + 4 * self.cfg.num_hidden_layers)  # + a float32 scale a layer
        return block_size * per_token * (dtype or self.dtype).itemsize

    def _fp8_pool(self, num_blocks: int, block_size: int, storage: torch.Tensor | None):
        """An FP8 (e4m3) pool with a scale per token and layer. Each block is one span:
        (layers, block_size) float32 scales, then (layers, block_size, dim) values; the
        scales come first so their offset stays 4-byte aligned."""
        L, dim = self.cfg.num_hidden_layers, self.cfg.kv_cache_dim
        nbytes = self.kv_block_bytes(block_size, torch.float8_e4m3fn)
        if storage is None:
            pool = torch.zeros((num_blocks, nbytes), dtype=torch.uint8, device=self.device)
        else:
            pool = storage.view(torch.uint8).view(num_blocks, nbytes)
        scales = pool[:, : 4 * L * block_size].view(torch.float32).view(num_blocks, L, block_size)
        values = pool[:, 4 * L * block_size:].view(torch.float8_e4m3fn).view(num_blocks, L, block_size, dim)
        return pool, [FP8Cache(values[:, i], scales[:, i]) for i in range(L)]

    # -- forward --------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: list[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits (S, vocab) float32 for batch.sample_index, expert token counts
        (layers, experts) int32 for this step, zero rows for dense layers)."""
        cfg = self.cfg
        if len(kv_cache) != cfg.num_hidden_layers:
            raise ValueError(f"kv_cache has {len(kv_cache)} layers, the model {cfg.num_hidden_layers}")
        spans = _spans(batch, kv_cache[0].shape[1])
        cos, sin = self.rope.cos_sin(batch.positions, self.dtype)
        counts = torch.zeros(cfg.num_hidden_layers, cfg.n_routed_experts, dtype=torch.int32,
                             device=self.device)
        x = self.embed_tokens(batch.input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, spans, kv_cache[i], cos, sin, counts[i])
        logits = self.lm_head(self.norm(x[batch.sample_index]))
        return logits.float(), counts
