"""The fast path's view of one decoder layer's weights (``models.fast``): projections that
read the same input concatenated once (the model's own parameters re-pointed at views of
the result, so the reference forward and the fast one share every byte), the absorbed MLA
factors as views, and optionally the shared experts as extra expert slots after the routed
ones (``fuse_shared_experts``).
"""

from __future__ import annotations

import torch
from torch import nn

from .deepseek_v3 import MoE


def _fuse_rows(linears: list[nn.Module]) -> torch.Tensor:
    """One weight for projections of the same input; each module keeps a view of its rows."""
    w = torch.cat([m.weight.detach() for m in linears])
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(w[start:start + n], requires_grad=False)
        start += n
    return w


class LayerWeights:
    """One decoder layer's weights as the fast path reads them (views of the model's)."""

    def __init__(self, layer: nn.Module, cfg):
        a = layer.self_attn
        h, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        self.in_norm, self.post_norm = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        if cfg.q_lora_rank is None:
            self.w_in, self.q_a_norm, self.q_b = _fuse_rows([a.q_proj, a.kv_a_proj_with_mqa]), None, None
        else:
            self.w_in = _fuse_rows([a.q_a_proj, a.kv_a_proj_with_mqa])
            self.q_a_norm, self.q_b = a.q_a_layernorm.weight, a.q_b_proj.weight
        self.kv_norm = a.kv_a_layernorm.weight
        self.kv_b = a.kv_b_proj.weight  # (H * (dn + dv), dl)
        per_head = self.kv_b.view(h, dn + dv, cfg.kv_lora_rank)
        self.w_uk = per_head[:, :dn]  # (H, dn, dl): q_nope @ w_uk is q in latent space
        self.w_uv = per_head[:, dn:].transpose(1, 2)  # (H, dl, dv): latent output to values
        self.o_proj = a.o_proj.weight
        mlp = layer.mlp
        self.moe = mlp if isinstance(mlp, MoE) else None
        shared = mlp.shared_experts if self.moe is not None else mlp
        self.gate_up = self.down = None
        self.fp8 = None  # (gate_up, its scales, down, its scales) with moe_fp8
        self.with_shared = None  # (gate_up, down, routed count): the routed experts, then the shared
        self.gate_split = None  # the router's float32 gate as three bf16 pieces (FastDeepseek's router_split)
        if shared is not None:
            self.gate_up, self.down = _fuse_rows([shared.gate_proj, shared.up_proj]), shared.down_proj.weight


def fuse_shared_experts(lw: LayerWeights) -> None:
    """Give ``lw`` its routed experts followed by its shared experts as expert slots (see the
    module's docstring); the routed experts' parameters become views of the result. Nothing
    when the layer has no shared experts or their width is not a multiple of an expert's."""
    if lw.moe is None or lw.gate_up is None or lw.with_shared is not None:
        return
    ex = lw.moe.experts
    e, two_i, hidden = ex.gate_up_proj.shape
    i, width = two_i // 2, lw.gate_up.shape[0] // 2
    if width % i or lw.down.shape != (hidden, width) or ex.down_proj.shape != (e, hidden, i):
        return
    s = width // i
    w13 = ex.gate_up_proj.new_empty(e + s, two_i, hidden)
    w2 = ex.down_proj.new_empty(e + s, hidden, i)
    w13[:e].copy_(ex.gate_up_proj)
    w2[:e].copy_(ex.down_proj)
    gate, up = lw.gate_up[:width].view(s, i, hidden), lw.gate_up[width:].view(s, i, hidden)
    w13[e:, :i].copy_(gate)
    w13[e:, i:].copy_(up)
    w2[e:].copy_(lw.down.view(hidden, s, i).transpose(0, 1))
    ex.gate_up_proj.data, ex.down_proj.data = w13[:e], w2[:e]
    lw.with_shared = (w13, w2, e)


def layer_weights(layer: nn.Module, cfg) -> LayerWeights:
    """Prepared once per layer module, so a draft that shares the target's layers shares these."""
    lw = getattr(layer, "_fast_weights", None)
    if lw is None:
        lw = layer._fast_weights = LayerWeights(layer, cfg)
    return lw
