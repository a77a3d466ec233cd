"""lockstep: the host side of Mixture-of-Experts LLM serving.

The scheduler core (``lockstep.policy``) is sans-I/O; the trio engine (``lockstep.engine``)
and the discrete-event simulator (``lockstep.sim``) both drive the same policy objects.
The engine's names load on first use, so ``lockstep sim`` never imports trio's engine or torch.
"""

from __future__ import annotations

from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "open_engine": "lockstep.api", "LLM": "lockstep.llm", "Engine": "lockstep.api",
    "RequestOutput": "lockstep.api", "Completion": "lockstep.api",
    "EngineConfig": "lockstep.engine.config", "SchedulerConfig": "lockstep.policy.config",
    "SamplingParams": "lockstep.policy.request", "RequestError": "lockstep.policy.request",
    "StructuredOutputsParams": "lockstep.policy.request", "ConfigError": "lockstep.policy.config",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lockstep' has no attribute {name!r}")
