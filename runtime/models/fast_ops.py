"""The fast path's small fused steps: the elementwise work between GEMMs (norms, SiLU·mul,
the MoE's sum inside the next add + norm, the MLA prologue's norm and rope), pure functions
shared with the reference model, each optionally ``torch.compile``d once for every layer
(weights are arguments), so a step launches a few hundred kernels, not thousands; and the
router's kernels (``kernels.router``). ``FastOps`` holds them for ``FastDeepseek``."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from .deepseek_v3 import rms_norm, route
from .rope import apply_rope

try:
    from lockstep.kernels.fused_moe import moe_sum_reference
except ImportError:  # no triton (it installs on x86_64 only): the fast path cannot run anyway
    moe_sum_reference = None

log = logging.getLogger(__name__)

def _add_norm(x, y, w, eps: float):
    s = x + y
    return s, rms_norm(s, w, eps)


def _add2_norm(x, y, z, w, eps: float):
    s = x + (y + z)  # the reference's order: routed + shared, then the residual
    return s, rms_norm(s, w, eps)


def _add_moe_norm(x, y, ids, experts: int, w, eps: float):
    """``_add_norm`` of the fused MoE's unsummed terms y [T, k, H]: the kernel's last launch
    (the sum over k) runs inside this step's."""
    s = x + moe_sum_reference(y, ids, experts)
    return s, rms_norm(s, w, eps)


def _add2_moe_norm(x, y, ids, experts: int, z, w, eps: float):
    s = x + (moe_sum_reference(y, ids, experts) + z)
    return s, rms_norm(s, w, eps)


def _mla_prep(q_pe, tail, cos, sin, kv_w, eps: float, dl: int, interleaved: bool):
    """(rotated q_pe (T, H, dr), normed latent (T, dl), rotated k_pe (T, dr)). k_pe rotates
    as one more head of q_pe (one launch for both); both come back as views with unit last
    stride, which is all the kernels ask."""
    latent = rms_norm(tail[:, :dl], kv_w, eps)
    pe = apply_rope(torch.cat([q_pe, tail[:, None, dl:]], dim=1), cos[:, None], sin[:, None], interleaved)
    return pe[:, :-1], latent, pe[:, -1]


def _silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class _Op:
    """A pure step, compiled when asked. A compile failure is logged and the step runs eagerly
    from then on; inside a CUDA-graph capture it propagates (the capture must not go on)."""

    def __init__(self, fn, compile: bool):
        self.fn, self.name = fn, fn.__name__
        self.compiled = torch.compile(fn, fullgraph=True) if compile else None
        self.error: str | None = None

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as e:  # noqa: BLE001 - any compiler failure: run eagerly instead
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise
                self.error = f"{type(e).__name__}: {e}"
                log.warning("torch.compile of %s failed, running it eagerly: %s", self.name, self.error)
                self.compiled = None
        return self.fn(*args)


class FastOps:
    def __init__(self, compile: bool):
        if compile:
            import torch._dynamo

            # Every op meets a few shapes per model (static, dynamic tokens, one token) and a
            # process may hold two models (a draft): stay above that.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.norm = _Op(rms_norm, compile)
        self.add_norm = _Op(_add_norm, compile)
        self.add2_norm = _Op(_add2_norm, compile)
        self.add_moe_norm = _Op(_add_moe_norm, compile)
        self.add2_moe_norm = _Op(_add2_moe_norm, compile)
        self.mla_prep = _Op(_mla_prep, compile)
        self.silu_mul = _Op(_silu_mul, compile)
        # The router after its GEMM runs as one kernel (compiled, `route`'s torch.topk alone
        # still launches two); `route` stays for settings the kernel does not take.
        from lockstep.kernels.router import moe_route, moe_route_unsupported, router_logits, router_logits_split

        self.moe_route, self.moe_route_unsupported = moe_route, moe_route_unsupported
        self.router_logits = router_logits  # the gate's GEMM in one launch, for a few tokens
        self.router_logits_split = router_logits_split  # and for more, on tensor cores
        self.route = _Op(route, compile)

    def errors(self) -> dict[str, str]:
        return {op.name: op.error for op in vars(self).values() if isinstance(op, _Op) and op.error}
