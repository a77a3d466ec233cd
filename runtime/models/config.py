"""The shape of a DeepSeek-V3-family model, read from a Hugging Face ``config.json`` or
taken from a named preset.

The torch model, the weight loader and the KV-cache allocator all read this one frozen
object. It mirrors the fields of Hugging Face's ``deepseek_v3`` config that change the
math; fields that do not (initializer ranges, dropout) are ignored, and fields whose
non-default values we do not implement (biased attention projections, tied embeddings,
activations other than SiLU) are rejected here, at the boundary, rather than silently
computing something else.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs


class ModelConfigError(ValueError):
    """A config.json (or a preset override) that this runtime cannot serve."""


@attrs.frozen
class RopeScaling:
    """YaRN scaling as DeepSeek checkpoints configure it (``rope_scaling`` with type yarn)."""

    factor: float = attrs.field(converter=float)
    original_max_position_embeddings: int = attrs.field(converter=int)
    beta_fast: float = attrs.field(default=32.0, converter=float)
    beta_slow: float = attrs.field(default=1.0, converter=float)
    mscale: float = attrs.field(default=1.0, converter=float)
    mscale_all_dim: float = attrs.field(default=0.0, converter=float)
    attention_factor: float | None = None  # overrides the mscale ratio when given
    truncate: bool = True


@attrs.frozen
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP of the first `first_k_dense_replace` layers
    moe_intermediate_size: int  # one routed (or shared) expert
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    q_lora_rank: int | None  # None: a plain q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    rope_scaling: RopeScaling | None = None
    rope_interleave: bool = True
    num_nextn_predict_layers: int = 0  # MTP layers stored after the last layer; not run
    initializer_range: float = 0.02

    def __attrs_post_init__(self) -> None:
        _validate(self, "ModelConfig")

    # -- derived shapes ---------------------------------------------------------------
    @property
    def eos_token_id(self) -> int:
        return self.eos_token_ids[0]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one cached token in one layer: MLA caches the normalized latent and k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        # YaRN sharpens attention by mscale(factor, mscale_all_dim)^2 on top of 1/sqrt(d);
        # DeepSeek-V3 checkpoints (factor 40) are wrong by ~1.6x in logit scale without it.
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    # -- constructors -----------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Read a Hugging Face ``deepseek_v3`` config dict; errors name `source` and the field."""
        return _from_hf_dict(d, source)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelConfigError(f"{path} does not exist: a model directory needs a "
                                   "Hugging Face config.json") from None
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ModelConfigError(f"{path}: expected a JSON object, got {type(d).__name__}")
        return _from_hf_dict(d, str(path))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# -- presets ---------------------------------------------------------------------------
# Shapes agree with lockstep.policy.deployment.MODEL_PRESETS where both describe them
# (layers, dense layers, hidden, experts, top-k, expert width, KV width, vocab, eos).
_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=24, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=4096, bos_token_id=0, eos_token_ids=(1,),
    ),
    # A smaller model with tiny's vocabulary: a draft for speculative decoding tests.
    "tiny-draft": dict(
        vocab_size=512, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=4096, bos_token_id=0, eos_token_ids=(1,),
    ),
    # DeepSeek-V2-Lite's shape (and its YaRN settings) in the V3 architecture: sigmoid
    # routing, so it is not V2-Lite's checkpoint math, but the same weights and KV bytes.
    "v2-lite": dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, n_group=1, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, routed_scaling_factor=1.0, norm_topk_prob=False, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=32768, bos_token_id=100000,
        eos_token_ids=(100001,),
        rope_scaling=RopeScaling(factor=40.0, original_max_position_embeddings=4096,
                                 mscale=0.707, mscale_all_dim=0.707),
    ),
}


def preset_names() -> list[str]:
    return sorted(_PRESETS)


def preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in _PRESETS:
        raise ModelConfigError(f"unknown model preset {name!r}: choose one of {preset_names()}")
    return ModelConfig(**{**_PRESETS[name], **overrides})


# -- parsing ---------------------------------------------------------------------------
_REQUIRED_INT = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "n_group", "topk_group", "first_k_dense_replace", "kv_lora_rank",
    "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "max_position_embeddings",
)
_REQUIRED_FLOAT = ("routed_scaling_factor", "rms_norm_eps")
# Fields whose only value we implement; anything else would silently change the math.
# DeepSeek's own configs also spell out the routing (transformers ignores those keys).
_MUST_EQUAL = {"hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
               "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


def _from_hf_dict(d: dict[str, Any], source: str) -> ModelConfig:
    def fail(msg: str) -> ModelConfigError:
        return ModelConfigError(f"{source}: {msg}")

    model_type = d.get("model_type")
    if model_type != "deepseek_v3":
        raise fail(f"model_type must be 'deepseek_v3', got {model_type!r} "
                   "(only the DeepSeek-V3 architecture is implemented)")
    for key, want in _MUST_EQUAL.items():
        if key in d and d[key] != want:
            raise fail(f"field {key!r} is {d[key]!r}; only {want!r} is supported")
    if d.get("quantization_config") is not None:
        raise fail("quantized checkpoints (quantization_config) are not supported yet; "
                   "use a bf16 conversion")
    missing = [k for k in (*_REQUIRED_INT, *_REQUIRED_FLOAT, "norm_topk_prob", "q_lora_rank",
                           "eos_token_id") if k not in d]
    if missing:
        raise fail(f"missing field(s) {missing}")
    kw: dict[str, Any] = {k: _int(d, k, fail) for k in _REQUIRED_INT}
    kw |= {k: _float(d, k, fail) for k in _REQUIRED_FLOAT}
    kw["norm_topk_prob"] = _bool(d, "norm_topk_prob", fail)
    kw["q_lora_rank"] = None if d["q_lora_rank"] is None else _int(d, "q_lora_rank", fail)
    kw["rope_interleave"] = _bool(d, "rope_interleave", fail) if "rope_interleave" in d else True
    kw["num_nextn_predict_layers"] = (_int(d, "num_nextn_predict_layers", fail)
                                      if d.get("num_nextn_predict_layers") is not None else 0)
    kw["eos_token_ids"] = _token_ids(d["eos_token_id"], "eos_token_id", fail)
    bos = d.get("bos_token_id")
    kw["bos_token_id"] = None if bos is None else _token_ids(bos, "bos_token_id", fail)[0]
    kw["rope_theta"], kw["rope_scaling"] = _rope(d, kw["max_position_embeddings"], fail)
    try:
        return ModelConfig(**kw)
    except ModelConfigError as e:
        raise fail(str(e).removeprefix("ModelConfig: ")) from None


def _int(d: dict, key: str, fail) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise fail(f"field {key!r} must be an integer, got {v!r}")
    return v


def _float(d: dict, key: str, fail) -> float:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise fail(f"field {key!r} must be a finite number, got {v!r}")
    return float(v)


def _bool(d: dict, key: str, fail) -> bool:
    if not isinstance(d[key], bool):
        raise fail(f"field {key!r} must be true or false, got {d[key]!r}")
    return d[key]


def _token_ids(v: Any, key: str, fail) -> tuple[int, ...]:
    ids = v if isinstance(v, list) else [v]
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise fail(f"field {key!r} must be a token id or a list of them, got {v!r}")
    return tuple(ids)


def _rope(d: dict, max_pos: int, fail) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters` (theta inside); DeepSeek's own config.json has
    # top-level `rope_theta` and `rope_scaling` whose kind is under "type".
    key = "rope_parameters" if d.get("rope_parameters") is not None else "rope_scaling"
    params = d.get(key) or {}
    if not isinstance(params, dict):
        raise fail(f"field {key!r} must be an object or null, got {params!r}")
    theta = params.get("rope_theta", d.get("rope_theta"))
    if theta is None:
        raise fail("missing field 'rope_theta'")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise fail(f"field 'rope_theta' must be a positive number, got {theta!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "yarn":
        raise fail(f"{key}.rope_type {kind!r} is not supported (only 'default' and 'yarn')")
    fields = {f.name for f in attrs.fields(RopeScaling)}
    kw = {k: v for k, v in params.items() if k in fields and v is not None}
    kw.setdefault("original_max_position_embeddings", max_pos)
    if "factor" not in kw:  # transformers' fallback for DeepSeek-style configs
        kw["factor"] = max_pos / kw["original_max_position_embeddings"]
    try:
        scaling = RopeScaling(**kw)
    except (TypeError, ValueError) as e:
        raise fail(f"{key}: {e}") from None
    if not (scaling.factor > 0 and scaling.original_max_position_embeddings > 0):
        raise fail(f"{key}: factor and original_max_position_embeddings must be positive")
    return float(theta), scaling


def _validate(c: ModelConfig, where: str) -> None:
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ModelConfigError(f"{where}: {msg}")

    for f in attrs.fields(ModelConfig):
        v = getattr(c, f.name)
        if f.name in _REQUIRED_INT:
            need(isinstance(v, int) and (v > 0 or f.name in ("n_shared_experts",
                                                             "first_k_dense_replace")),
                 f"field {f.name!r} must be a positive integer, got {v!r}")
    need(c.q_lora_rank is None or c.q_lora_rank > 0, "q_lora_rank must be positive or null")
    need(c.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim must be even, got {c.qk_rope_head_dim}")
    need(c.first_k_dense_replace <= c.num_hidden_layers,
         "first_k_dense_replace must be <= num_hidden_layers")
    need(c.n_routed_experts % c.n_group == 0,
         f"n_routed_experts ({c.n_routed_experts}) must be a multiple of n_group ({c.n_group})")
    # Group scores are the sum of each group's top two experts, as in DeepSeek-V3.
    need(c.n_routed_experts // c.n_group >= 2, "each expert group needs at least 2 experts")
    need(c.topk_group <= c.n_group, "topk_group must be <= n_group")
    need(c.num_experts_per_tok <= c.topk_group * (c.n_routed_experts // c.n_group),
         "num_experts_per_tok must be <= the experts in the top groups")
    need(bool(c.eos_token_ids) and all(0 <= t < c.vocab_size for t in c.eos_token_ids),
         f"eos_token_id {list(c.eos_token_ids)} must be within the vocabulary")
    need(c.rms_norm_eps > 0 and c.rope_theta > 0, "rms_norm_eps and rope_theta must be positive")
