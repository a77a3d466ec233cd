"""Benchmarks' changes to a random-weight model (runtime options), applied at load: random
weights route tokens about evenly and each layer rewrites the next-token choice, where real
checkpoints do neither.

- ``expert_skew``: skewed routing (``skew_routing``), for the load balancer's benchmarks;
- ``layer_output_scale``: smaller layer updates (``scale_layer_outputs``), so a self-draft
  (``layers:N``) agrees with the target at a rate the scale sets, for speculation's.
"""

from __future__ import annotations

import math

import torch


def apply(model, options: dict, seed: int) -> None:
    """The options' changes to ``model``, each checked where it entered."""
    skew = float(options.get("expert_skew", 0.0))
    if skew:
        skew_routing(model, skew, seed)
    raw = options.get("layer_output_scale", 1.0)
    try:
        scale = float(raw)
    except (TypeError, ValueError):
        scale = float("nan")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"runtime option layer_output_scale must be a finite number > 0, got {raw!r}")
    if scale != 1.0:
        scale_layer_outputs(model, scale)


def skew_routing(model, skew: float, seed: int) -> None:
    """Benchmarks only (runtime option ``expert_skew``): random weights route tokens about
    evenly, real checkpoints do not. Set every router's selection bias (DeepSeek-V3's
    e_score_correction_bias, which steers which experts are chosen, not their weights) to
    ``skew`` times a standard normal draw per expert and layer, in units of the spread of the
    router's scores (a quarter of each expert's weight norm: the sigmoid's slope at 0 for
    unit-variance inputs). The same seed gives the same bias on every rank."""
    g = torch.Generator().manual_seed(seed + 7919)
    for layer in model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "e_score_correction_bias"):
            continue
        spread = 0.25 * gate.weight.float().norm(dim=1).mean().item()
        z = torch.randn(gate.e_score_correction_bias.shape, generator=g, dtype=torch.float32)
        with torch.no_grad():
            gate.e_score_correction_bias.copy_((skew * spread * z).to(gate.e_score_correction_bias.device))


def scale_layer_outputs(model, scale: float) -> None:
    """Benchmarks only (runtime option ``layer_output_scale``): multiply every layer's output
    projections (attention's o_proj, the MLPs' and experts' down projections) by ``scale``,
    so each layer adds a smaller update to the residual stream. A random-weight model's
    layers otherwise each rewrite its next-token choice, and a draft made of its first layers
    (``layers:N``) agrees with it almost never; with a small scale the choice is mostly the
    embeddings' and the head's, and a self-draft agrees often. Step times do not change."""
    with torch.no_grad():
        for layer in model.layers:
            mlp = layer.mlp
            outs = [layer.self_attn.o_proj.weight]
            outs += [mlp.down_proj.weight] if hasattr(mlp, "down_proj") else [mlp.experts.down_proj]
            shared = getattr(mlp, "shared_experts", None)
            if shared is not None:
                outs.append(shared.down_proj.weight)
            for w in outs:
                w.mul_(scale)
