"""Model definitions for the torch runtime: DeepSeek-V3 family (MLA + MoE), its config,
the forward-batch layout and weight loading from Hugging Face safetensors.

Only the config is imported eagerly: the frontend reads presets and checkpoint configs
without importing torch. The torch-backed names load on first use.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.runtime.models.config import (
    ModelConfig,
    ModelConfigError,
    RopeScaling,
    preset,
    preset_names,
)

if TYPE_CHECKING:
    import torch

    from lockstep.runtime.models.batch import ForwardBatch
    from lockstep.runtime.models.deepseek_v3 import DeepseekV3
    from lockstep.runtime.models.weights import WeightLoadError

__all__ = [
    "DeepseekV3", "ForwardBatch", "ModelConfig", "ModelConfigError", "RopeScaling",
    "WeightLoadError", "load_model", "preset", "preset_names",
]

_LAZY = {"DeepseekV3": "deepseek_v3", "ForwardBatch": "batch", "WeightLoadError": "weights"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_model(model: str | Path, *, dtype: torch.dtype, device: torch.device | str,
               seed: int = 0, overrides: dict | None = None, draw_on_device: bool = False) -> DeepseekV3:
    """A preset name gives random weights (seeded; ``overrides`` change its config fields,
    e.g. fewer layers for a timing run; ``draw_on_device``: see ``DeepseekV3.random_init``);
    anything else is a checkpoint directory."""
    from lockstep.runtime.models.deepseek_v3 import DeepseekV3

    if str(model) in preset_names():
        cfg = preset(str(model), **(overrides or {}))
        return DeepseekV3.random_init(cfg, seed=seed, dtype=dtype, device=device, draw_on_device=draw_on_device)
    if not Path(model).is_dir():
        raise ModelConfigError(f"model {str(model)!r} is neither a preset {preset_names()} "
                               "nor a checkpoint directory")
    return DeepseekV3.from_pretrained(model, dtype=dtype, device=device)
