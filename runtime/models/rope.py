"""Rotary position embedding for MLA's decoupled rope part, as Hugging Face's deepseek_v3
computes it (default and YaRN frequencies).

Layout: DeepSeek checkpoints pair rope dimensions as (x0, x1), (x2, x3), ...
(``rope_interleave``). Like transformers, we rotate the even/odd pairs and write the
result de-interleaved: ``[rotated evens | rotated odds]``. Queries and keys get the same
permutation, so scores are unchanged, but it fixes the layout of k_pe in the KV cache: any
other producer or consumer of these cache blocks (a kernel, a KV transfer peer) must use it.
"""

from __future__ import annotations

import math

import torch

from lockstep.runtime.models.config import ModelConfig, RopeScaling, yarn_mscale


def inv_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (rope_dim/2,) float32, factor applied to cos and sin)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    rs = cfg.rope_scaling
    if rs is None:
        return 1.0 / pos_freqs, 1.0
    return _yarn(rs, dim, base, pos_freqs), _yarn_attention_factor(rs)


def _yarn_attention_factor(rs: RopeScaling) -> float:
    if rs.attention_factor is not None:
        return rs.attention_factor
    if rs.mscale and rs.mscale_all_dim:
        return yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
    return yarn_mscale(rs.factor)


def _yarn(rs: RopeScaling, dim: int, base: float, pos_freqs: torch.Tensor) -> torch.Tensor:
    # High-frequency dims (many rotations within the original context) keep their
    # frequency; low-frequency ones are interpolated by `factor`; a linear ramp in between.
    def correction_dim(rotations: float) -> float:
        orig = rs.original_max_position_embeddings
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # written as transformers does, so inv_freq is bit-identical
    return (1.0 / (rs.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


class Rope:
    """cos/sin for given positions; built once per model and per device."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None):
        inv_freq, self.attention_factor = inv_frequencies(cfg)
        self.inv_freq = inv_freq.to(device)
        self.interleaved = cfg.rope_interleave

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Each (T, rope_dim/2): angles are computed in float32, then cast, as transformers does."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return ((freqs.cos() * self.attention_factor).to(dtype),
                (freqs.sin() * self.attention_factor).to(dtype))

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x (T, ..., rope_dim); cos/sin (T, rope_dim/2) broadcast over middle dims."""
        return apply_rope(x, cos, sin, self.interleaved)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rope as a pure function; the result has x's dtype (cos/sin may be wider: the fast
    path rotates bf16 inputs in float32)."""
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
