"""Expert parallelism: the routed experts sharded over the ranks of a DEP instance.

Rank r keeps experts [r*E/n, (r+1)*E/n). Attention and shared experts stay data-parallel:
each rank runs them on its own tokens. In every MoE layer each rank sends each (token,
expert) pair to the expert's owner (all-to-all dispatch), the owners run their experts, and
the results come back (all-to-all combine) to be weighted and summed. torch.distributed
carries it: Gloo on CPU, NCCL on GPU. Every rank must run every layer's collectives in
every step, so a rank with no tokens (a dummy step) sends and receives empty buffers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class ShardedExperts(nn.Module):
    def __init__(self, experts: nn.Module, num_experts: int, rank: int, world: int, group=None):
        super().__init__()
        if num_experts % world:
            raise ValueError(f"{num_experts} routed experts do not split evenly over {world} ranks")
        self.per_rank = num_experts // world
        self.lo = rank * self.per_rank
        self.world, self.group = world, group
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj[self.lo:self.lo + self.per_rank].clone(),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(experts.down_proj[self.lo:self.lo + self.per_rank].clone(),
                                      requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        k = ids.shape[1]
        flat = ids.flatten()
        dest = torch.div(flat, self.per_rank, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)[order]
        send_n = torch.bincount(dest, minlength=self.world)
        recv_n = torch.empty_like(send_n)
        dist.all_to_all_single(recv_n, send_n, group=self.group)
        send_split, recv_split = send_n.tolist(), recv_n.tolist()
        rx = self._exchange(x[token], recv_split, send_split)
        re = self._exchange((flat[order] - dest[order] * self.per_rank)[:, None], recv_split, send_split)[:, 0]
        back = self._exchange(self._local(rx, re), send_split, recv_split)
        out = torch.zeros_like(x)
        out.index_add_(0, token, (back * weights.flatten()[order, None]).to(x.dtype))
        return out

    def _exchange(self, t: torch.Tensor, recv_split: list[int], send_split: list[int]) -> torch.Tensor:
        out = t.new_empty((sum(recv_split), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), recv_split, send_split, group=self.group)
        return out

    def _local(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Each received row through its (local) expert, unweighted."""
        out = torch.empty_like(x)
        for e in local_ids.unique().tolist():
            rows = (local_ids == e).nonzero(as_tuple=True)[0]
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            out[rows] = F.linear(F.silu(gate) * up, self.down_proj[e])
        return out


def shard_experts(model: nn.Module, rank: int, world: int, group=None) -> None:
    """Replace every MoE layer's experts by this rank's shard (the full weights are dropped)."""
    from .deepseek_v3 import MoE

    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            layer.mlp.experts = ShardedExperts(layer.mlp.experts, model.cfg.n_routed_experts, rank, world, group)
