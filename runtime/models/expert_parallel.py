"""Expert parallelism: each MoE layer's routed experts spread over the ranks of a DEP
instance as physical expert slots.

A layer has S physical slots, S / n per rank (slot s lives on rank s // (S / n)). Its
placement (phy2log: the logical expert in each slot) may replicate hot experts in redundant
slots; the load balancer (``lockstep.policy.eplb``) chooses it. Attention and shared experts
stay data-parallel. In every MoE layer each rank sends each (token, expert) pair to one
replica of that expert (all-to-all dispatch), the owners run their slots, and the results
come back (all-to-all combine) to be weighted and summed. The replica is chosen
deterministically: the n-th pair for expert e on rank r goes to replica (n + r) mod
replicas(e), so a rank's pairs split evenly and the ranks start at different replicas. A
pair's math does not depend on where it runs, so a placement changes speed, never tokens.

Slots read their weights through an indirection (slot -> storage entry). A new placement's
missing experts are copied into storage entries that no slot of the active placement reads
(``spare`` entries) while steps keep running on the active placement; switching is then
replacing the tables, with no copy. torch.distributed carries the all-to-alls: Gloo on CPU,
NCCL on GPU. Every rank must run every layer's collectives in every step, so a rank with no
tokens (a dummy step) sends and receives empty buffers.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lockstep.policy.eplb import Placement


class Tables(NamedTuple):
    """One placement of one layer, as this rank uses it."""

    phy2log: np.ndarray  # (S,) logical expert of every slot (all ranks)
    log2phy: torch.Tensor  # (E, max replicas) slots of each expert, -1 padded
    replicas: torch.Tensor  # (E,)
    store_of: torch.Tensor  # (S / n,) storage entry of each of this rank's slots
    store_np: np.ndarray  # the same on the host


class Staged(NamedTuple):
    """A placement prepared on this rank: its tables, and the (storage entry, logical
    expert) copies that must land before a switch to it."""

    tables: Tables
    copies: list[tuple[int, int]]


def choose_slots(flat: torch.Tensor, log2phy: torch.Tensor, replicas: torch.Tensor, rank: int) -> torch.Tensor:
    """The physical slot of each (token, expert) pair, ``flat`` being the experts in token
    order: the n-th pair for expert e goes to replica (n + rank) mod replicas[e]."""
    order = torch.argsort(flat, stable=True)
    count = torch.bincount(flat, minlength=len(replicas))
    start = torch.cumsum(count, 0) - count
    nth = torch.empty_like(flat)
    nth[order] = torch.arange(len(flat), device=flat.device) - start[flat[order]]
    return log2phy[flat, (nth + rank) % replicas[flat]]


def proportional_slots(flat: torch.Tensor, log2phy: torch.Tensor, replicas: torch.Tensor, rank: int, world: int,
                       total: torch.Tensor, k: int) -> torch.Tensor:
    """The physical slot of each (token, expert) pair when each replicated expert's tokens
    split so the GPUs holding its replicas come out level (``total``: this batch's pairs per
    logical expert summed over all ranks, so every rank computes the same split).

    Against each GPU's load under the even split, less this expert's own even share, the
    expert's pairs are poured in (water-filling: one Jacobi sweep of what
    ``lockstep.policy.eplb_split`` evaluates); every rank then sends its own pairs of the
    expert to the replicas in those proportions, starting at a rank-dependent offset, so the
    ranks' pairs add up to the split."""
    E, m = log2phy.shape
    valid = log2phy >= 0
    total = total.to(torch.float64)
    even = total / replicas.clamp(min=1).to(torch.float64)
    gpu = torch.where(valid, torch.div(log2phy, k, rounding_mode="floor"), 0)
    load = torch.zeros(world, dtype=torch.float64, device=flat.device)
    load.index_add_(0, gpu[valid], even[:, None].expand(E, m)[valid])
    base = torch.where(valid, load[gpu] - even[:, None], torch.full_like(load[gpu], float("inf")))
    srt, _ = base.sort(dim=1)
    finite = torch.isfinite(srt)
    lam = (total[:, None] + torch.cumsum(torch.where(finite, srt, 0.0), 1)) / torch.arange(
        1, m + 1, device=flat.device, dtype=torch.float64)
    wet = (finite & (lam >= srt)).sum(1).clamp(min=1) - 1
    level = lam.gather(1, wet[:, None])
    share = torch.where(valid, (level - base).clamp(min=0), 0.0)
    frac = torch.where(total[:, None] > 0, share / total.clamp(min=1e-30)[:, None], valid / replicas[:, None])
    cum = torch.cumsum(frac, 1)
    # The n-th of this rank's c pairs of expert e sits at (n + 1/2) / c of the way, shifted
    # by rank / world; it goes to the replica whose cumulative share covers that point.
    order = torch.argsort(flat, stable=True)
    count = torch.bincount(flat, minlength=E)
    start = torch.cumsum(count, 0) - count
    nth = torch.empty_like(flat)
    nth[order] = torch.arange(len(flat), device=flat.device) - start[flat[order]]
    u = torch.remainder((nth.to(torch.float64) + 0.5) / count[flat].clamp(min=1) + rank / world, 1.0)
    j = (cum[flat] <= u[:, None]).sum(1).clamp(max=replicas[flat] - 1)
    return log2phy[flat, j]


SPLITS = ("even", "proportional")


class ShardedExperts(nn.Module):
    def __init__(self, experts: nn.Module, phy2log: np.ndarray, rank: int, world: int, *,
                 spare: int = 0, group=None, split: str = "even"):
        super().__init__()
        if split not in SPLITS:
            raise ValueError(f"expert token split must be one of {SPLITS}, got {split!r}")
        self.split = split
        phy2log = np.asarray(phy2log, dtype=np.int64)
        if len(phy2log) % world:
            raise ValueError(f"{len(phy2log)} expert slots do not split evenly over {world} ranks")
        self.k, self.rank, self.world, self.group = len(phy2log) // world, rank, world, group
        full_gate_up, full_down = experts.gate_up_proj, experts.down_proj
        self.num_experts = full_gate_up.shape[0]
        # Every expert's weights stay in host memory (pinned on a GPU): new placements copy
        # from there, so no rank has to serve its peers mid-step.
        pin = full_gate_up.is_cuda
        self._source = tuple(t.cpu().pin_memory() if pin else t for t in (full_gate_up, full_down))
        mine = torch.tensor(self._own(phy2log), device=full_gate_up.device)
        entries = self.k + spare
        self.gate_up_proj = nn.Parameter(full_gate_up.new_empty((entries, *full_gate_up.shape[1:])),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(full_down.new_empty((entries, *full_down.shape[1:])), requires_grad=False)
        with torch.no_grad():
            self.gate_up_proj[:self.k] = full_gate_up[mine]
            self.down_proj[:self.k] = full_down[mine]
        self.tables = self._tables(phy2log, np.arange(self.k))

    # -- placements ------------------------------------------------------------------------
    def _own(self, phy2log: np.ndarray) -> np.ndarray:
        return phy2log[self.rank * self.k:(self.rank + 1) * self.k]

    def _tables(self, phy2log: np.ndarray, store: np.ndarray) -> Tables:
        p = Placement.from_phy2log(phy2log[None], self.num_experts)  # checks the expert ids
        if p.replicas.min() < 1:
            raise ValueError(f"placement {phy2log.tolist()} leaves an expert with no slot")
        dev = self.gate_up_proj.device
        return Tables(phy2log, torch.tensor(p.log2phy[0], device=dev), torch.tensor(p.replicas[0], device=dev),
                      torch.as_tensor(store, dtype=torch.int64, device=dev), store)

    def prepare(self, phy2log: np.ndarray) -> Staged:
        """What switching to ``phy2log`` takes here: an expert this rank holds now keeps its
        storage entry (whichever slot it moves to); any other goes to a spare entry."""
        phy2log = np.asarray(phy2log, dtype=np.int64)
        if phy2log.shape != self.tables.phy2log.shape:
            raise ValueError(f"placement has {phy2log.shape} slots, this layer {self.tables.phy2log.shape}")
        new = self._own(phy2log).tolist()
        if len(set(new)) < len(new):
            raise ValueError(f"placement puts two replicas of one expert on rank {self.rank}: {new}")
        held = dict(zip(self._own(self.tables.phy2log).tolist(), self.tables.store_np.tolist()))
        spare = iter(sorted(set(range(len(self.gate_up_proj))) - set(held.values())))
        store, copies = [], []
        for e in new:
            if e not in held:
                held[e] = next(spare, -1)
                if held[e] < 0:
                    raise ValueError(f"rank {self.rank} has no spare expert storage for the new placement; "
                                     "start the runtime with options['redundant_experts'] to get some")
                copies.append((held[e], e))
            store.append(held[e])
        return Staged(self._tables(phy2log, np.array(store, dtype=np.int64)), copies)

    @torch.no_grad()
    def copy_in(self, staged: Staged) -> None:
        """Fill the staged placement's spare entries (any thread: no active slot reads them)."""
        for entry, e in staged.copies:
            self.gate_up_proj[entry].copy_(self._source[0][e], non_blocking=True)
            self.down_proj[entry].copy_(self._source[1][e], non_blocking=True)

    def switch(self, staged: Staged) -> None:
        self.tables = staged.tables

    # -- forward ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        t = self.tables
        flat = ids.flatten()
        if self.split == "proportional":  # every rank, every layer, every step: one all-reduce
            total = torch.bincount(flat, minlength=self.num_experts)
            if self.world > 1:
                dist.all_reduce(total, group=self.group)
            slot = proportional_slots(flat, t.log2phy, t.replicas, self.rank, self.world, total, self.k)
        else:
            slot = choose_slots(flat, t.log2phy, t.replicas, self.rank)
        dest = torch.div(slot, self.k, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(ids.shape[1])[order]
        send_n = torch.bincount(dest, minlength=self.world)
        recv_n = self._exchange(send_n, None, None)
        send_split, recv_split = send_n.tolist(), recv_n.tolist()
        rx = self._exchange(x[token], recv_split, send_split)
        local = self._exchange((slot[order] - dest[order] * self.k)[:, None], recv_split, send_split)[:, 0]
        back = self._exchange(self._local(rx, t.store_of[local]), send_split, recv_split)
        out = torch.zeros_like(x)
        out.index_add_(0, token, (back * weights.flatten()[order, None]).to(x.dtype))
        return out

    def _exchange(self, t: torch.Tensor, recv_split: list[int] | None, send_split: list[int] | None) -> torch.Tensor:
        if self.world == 1:  # one rank: every pair is local
            return t
        out = t.new_empty(t.shape if recv_split is None else (sum(recv_split), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), recv_split, send_split, group=self.group)
        return out

    def _local(self, x: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Each received row through the expert in its storage entry, unweighted."""
        out = torch.empty_like(x)
        for e in entries.unique().tolist():
            rows = (entries == e).nonzero(as_tuple=True)[0]
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            out[rows] = F.linear(F.silu(gate) * up, self.down_proj[e])
        return out


def shard_experts(model: nn.Module, phy2log: np.ndarray, rank: int, world: int, *, spare: int = 0,
                  group=None, split: str = "even") -> list[ShardedExperts]:
    """Replace every MoE layer's experts by this rank's slots of ``phy2log`` (MoE layers,
    slots); the full weights stay only as the host-side source of later copies."""
    from .deepseek_v3 import MoE

    moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    if len(moe) != len(phy2log):
        raise ValueError(f"placement has {len(phy2log)} layers, the model {len(moe)} MoE layers")
    for mlp, row in zip(moe, phy2log):
        mlp.experts = ShardedExperts(mlp.experts, row, rank, world, spare=spare, group=group, split=split)
    return [mlp.experts for mlp in moe]
