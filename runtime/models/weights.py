"""Loading Hugging Face DeepSeek-V3 weights into ``DeepseekV3``.

Two spellings of the routed experts exist in the wild and both are accepted:
- per expert, as DeepSeek's checkpoints (and transformers' save_pretrained) store them:
  ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``;
- fused, as transformers 5 holds them in memory (``state_dict()``):
  ``model.layers.L.mlp.experts.gate_up_proj`` (E, 2*I, H) and ``...experts.down_proj`` (E, H, I).
Either way they land in the stacked tensors, gate rows before up rows.

Every parameter must be filled exactly once; the error for a bad checkpoint names the
tensor and the expected and actual shapes, because "size mismatch" on a 600-tensor load
is useless. MTP layers (stored after the last decoder layer) are skipped: not run yet.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

_PER_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_LAYER = re.compile(r"layers\.(\d+)\.")
# Tensors some checkpoints carry that hold nothing we need (recomputed rope tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoadError(ValueError):
    """A checkpoint that does not match the model's config."""


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) from every *.safetensors file in model_dir, one tensor at a time."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{model_dir}: no *.safetensors files")
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
                 ) -> None:
    items = weights.items() if isinstance(weights, Mapping) else weights
    loader = _Loader(model)
    for name, tensor in items:
        loader.put(name, tensor)
    loader.finish()


class _Loader:
    def __init__(self, model):
        self.cfg = model.cfg
        self.params = dict(model.named_parameters())
        # The pieces of each parameter still to fill: stacked expert tensors are filled
        # per (part, expert) or all at once from a fused tensor; the rest whole ("all").
        self.todo: dict[str, set] = {name: self._pieces(name) for name in self.params}
        self.first_mtp = self.cfg.num_hidden_layers
        self.stop_mtp = self.first_mtp + self.cfg.num_nextn_predict_layers

    def _pieces(self, name: str) -> set:
        experts = range(self.cfg.n_routed_experts)
        if name.endswith("experts.gate_up_proj"):
            return {(part, e) for part in ("gate", "up") for e in experts}
        if name.endswith("experts.down_proj"):
            return {("down", e) for e in experts}
        return {"all"}

    def put(self, hf_name: str, tensor: torch.Tensor) -> None:
        name = hf_name.removeprefix("model.")
        if name.endswith(_IGNORED_SUFFIXES) or self._is_mtp(name):
            return
        if name.endswith("weight_scale_inv"):
            raise WeightLoadError(f"{hf_name}: FP8 block-quantized checkpoints are not supported; "
                                  "convert the checkpoint to bf16 first")
        m = _PER_EXPERT.fullmatch(name)
        if m:
            self._put_expert(hf_name, int(m[1]), int(m[2]), m[3], tensor)
        elif name in self.params:
            self._copy(hf_name, name, self._pieces(name), self.params[name], tensor)
        else:
            raise WeightLoadError(f"unexpected tensor {hf_name} {tuple(tensor.shape)}: the model "
                                  "has no such parameter (is config.json from this checkpoint?)")

    def finish(self) -> None:
        missing = [_hf_name(name, piece) for name, pieces in self.todo.items()
                   for piece in sorted(pieces, key=str)]
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)"
                                              if len(missing) > 8 else "")
            raise WeightLoadError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")

    def _is_mtp(self, name: str) -> bool:
        m = _LAYER.match(name)
        return m is not None and self.first_mtp <= int(m[1]) < self.stop_mtp

    def _put_expert(self, hf_name: str, layer: int, expert: int, part: str, tensor) -> None:
        kind = "down_proj" if part == "down" else "gate_up_proj"
        target = f"layers.{layer}.mlp.experts.{kind}"
        if target not in self.params or expert >= self.cfg.n_routed_experts:
            raise WeightLoadError(f"unexpected tensor {hf_name}: the model has "
                                  f"{self.cfg.n_routed_experts} routed experts in MoE layers "
                                  f"{self.cfg.first_k_dense_replace}..{self.cfg.num_hidden_layers - 1}")
        inter = self.cfg.moe_intermediate_size
        rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter), "down": slice(None)}[part]
        self._copy(hf_name, target, {(part, expert)}, self.params[target][expert, rows], tensor)

    def _copy(self, hf_name: str, name: str, pieces: set, dest: torch.Tensor,
              src: torch.Tensor) -> None:
        if not pieces <= self.todo[name]:
            raise WeightLoadError(f"{hf_name}: given twice (or both fused and per expert)")
        if tuple(src.shape) != tuple(dest.shape):
            raise WeightLoadError(f"{hf_name}: expected shape {tuple(dest.shape)}, got "
                                  f"{tuple(src.shape)}")
        with torch.no_grad():
            dest.copy_(src)
        self.todo[name] -= pieces


def _hf_name(name: str, piece) -> str:
    if piece == "all":
        return name if name.startswith("lm_head") else f"model.{name}"
    part, expert = piece
    layer = name.split(".")[1]
    return f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"
