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
replacing the tables, with no copy. (``copy_all``, for benchmarks and tests: an expert that
changes slot is copied too, as if it arrived from another rank; one rank holds every expert,
so only then does a switch there copy weights.) torch.distributed carries the all-to-alls:
Gloo on CPU, NCCL on GPU. Every rank must run every layer's collectives in every step, so a
rank with no tokens (a dummy step) sends and receives empty buffers.

Two dispatches:
- ``exact``: the ranks first exchange how many pairs each sends each, then exactly those
  rows. The sizes reach the host (a sync in every MoE layer), so no CUDA graph can hold it.
- ``padded`` (the shape of DeepEP's low-latency mode): every rank sends every rank a buffer
  of ``pad_tokens * top_k`` rows, enough for all its pairs, whose unused rows carry no
  expert; each row carries the slot it runs through in two extra bytes, so a layer takes two
  exchanges (rows out, results back). No sizes travel and nothing waits on the
  host, so a decode step, all-to-alls included, replays as one CUDA graph. The exchanges
  run as NCCL (Gloo) all-to-alls, or, with a ``PeerExchange`` attached
  (``attach_peer_exchange``; runtime option ``ep_exchange`` "peer"), as copies into the
  peers' memory and a barrier, which cost a fraction of an NCCL call's fixed latency. ``pad_tokens`` must be the same on every rank in a
  step (the runtime sets it from the DP sync's padded token count) and at least the tokens
  this rank feeds. The local experts run as one fused MoE over the received rows (``local``,
  the fast path's kernel) or, on CPU, per expert.
The tables a placement switch changes are updated in place, so a captured graph reads the
active placement.
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


def _bincount(v: torch.Tensor, n: int) -> torch.Tensor:
    """``torch.bincount(v, minlength=n)`` for v in [0, n), without reading max(v) on the host."""
    return torch.zeros(n, dtype=torch.int64, device=v.device).scatter_add_(0, v, torch.ones_like(v))


def _nth(flat: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(how many earlier entries of ``flat`` equal each entry, how many entries equal each
    value in [0, n))."""
    order = torch.argsort(flat, stable=True)
    count = _bincount(flat, n)
    start = torch.cumsum(count, 0) - count
    nth = torch.empty_like(flat)
    nth[order] = torch.arange(len(flat), device=flat.device) - start[flat[order]]
    return nth, count


def choose_slots(flat: torch.Tensor, log2phy: torch.Tensor, replicas: torch.Tensor, rank: int) -> torch.Tensor:
    """The physical slot of each (token, expert) pair, ``flat`` being the experts in token
    order: the n-th pair for expert e goes to replica (n + rank) mod replicas[e]."""
    nth, _ = _nth(flat, len(replicas))
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
    nth, count = _nth(flat, E)
    u = torch.remainder((nth.to(torch.float64) + 0.5) / count[flat].clamp(min=1) + rank / world, 1.0)
    j = (cum[flat] <= u[:, None]).sum(1).clamp(max=replicas[flat] - 1)
    return log2phy[flat, j]


SPLITS = ("even", "proportional")
DISPATCHES = ("exact", "padded")


class ShardedExperts(nn.Module):
    def __init__(self, experts: nn.Module, phy2log: np.ndarray, rank: int, world: int, *,
                 spare: int = 0, group=None, split: str = "even", dispatch: str = "exact", copy_all: bool = False):
        super().__init__()
        if split not in SPLITS:
            raise ValueError(f"expert token split must be one of {SPLITS}, got {split!r}")
        if dispatch not in DISPATCHES:
            raise ValueError(f"expert dispatch must be one of {DISPATCHES}, got {dispatch!r}")
        self.split, self.dispatch, self.copy_all = split, dispatch, copy_all
        self.pad_tokens = 0  # padded dispatch: tokens every rank's buffers hold this step
        self.peer = None  # padded dispatch's exchanges through the peers' memory (attach_peer_exchange)
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
        # An expert has at most one replica per rank (``prepare`` checks), so a table of
        # ``world`` columns holds any placement: switches copy into the same tensors.
        log2phy = np.full((self.num_experts, max(self.world, p.log2phy.shape[2])), -1, np.int64)
        log2phy[:, :p.log2phy.shape[2]] = p.log2phy[0]
        return Tables(phy2log, torch.tensor(log2phy, device=dev), torch.tensor(p.replicas[0], device=dev),
                      torch.as_tensor(store, dtype=torch.int64, device=dev), store)

    def prepare(self, phy2log: np.ndarray) -> Staged:
        """What switching to ``phy2log`` takes here: an expert this rank holds now keeps its
        storage entry (whichever slot it moves to); any other goes to a spare entry. With
        ``copy_all`` only an expert that keeps its slot keeps its entry."""
        phy2log = np.asarray(phy2log, dtype=np.int64)
        if phy2log.shape != self.tables.phy2log.shape:
            raise ValueError(f"placement has {phy2log.shape} slots, this layer {self.tables.phy2log.shape}")
        new = self._own(phy2log).tolist()
        if len(set(new)) < len(new):
            raise ValueError(f"placement puts two replicas of one expert on rank {self.rank}: {new}")
        old, entries = self._own(self.tables.phy2log).tolist(), self.tables.store_np.tolist()
        held = dict(zip(old, entries))
        spare = iter(sorted(set(range(len(self.gate_up_proj))) - set(entries)))  # none the active one reads
        if self.copy_all:  # an expert that changes slot arrives as on a rank that lacked it
            held = {e: s for e, s, n in zip(old, entries, new) if e == n}
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
        """Make ``staged`` the active placement: its tables copied into the active tensors
        (a captured graph reads those), queued after any step already launched."""
        old, new = self.tables, staged.tables
        for a, b in zip(old[1:4], new[1:4]):
            a.copy_(b, non_blocking=True)
        self.tables = Tables(new.phy2log, old.log2phy, old.replicas, old.store_of, new.store_np)

    # -- forward ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, local=None) -> torch.Tensor:
        """The routed experts' output for ``x`` (tokens, hidden) with ``weights`` and ``ids``
        (tokens, top_k); ids outside [0, experts) (padding tokens) choose nothing. ``local``:
        a fused kernel (x, gate_up, down, weights, ids) that runs this rank's received rows
        through their experts in one go (else a loop over the experts, a host sync each)."""
        t = self.tables
        if self.dispatch == "exact" and ids.numel() and int(ids.max()) >= self.num_experts:
            keep = (ids < self.num_experts).all(1)  # padding tokens (exact dispatch syncs anyway)
            out = torch.zeros_like(x)
            out[keep] = self.forward(x[keep], weights[keep], ids[keep], local)
            return out
        flat = ids.flatten()
        real = None
        if self.dispatch == "padded":  # padding tokens' pairs count for expert 0 and go nowhere
            real = (flat >= 0) & (flat < self.num_experts)
            flat = torch.where(real, flat, 0)
        if self.split == "proportional":  # every rank, every layer, every step: one all-reduce
            total = _bincount(flat, self.num_experts) if real is None else torch.zeros(
                self.num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, real.long())
            if self.world > 1:
                dist.all_reduce(total, group=self.group)
            slot = proportional_slots(flat, t.log2phy, t.replicas, self.rank, self.world, total, self.k)
        elif len(t.phy2log) == self.num_experts:  # one slot per expert: no replica to choose
            slot = t.log2phy[flat, 0]
        else:
            slot = choose_slots(flat, t.log2phy, t.replicas, self.rank)
        if real is not None:
            if self.peer is not None and self.peer.direct and self.pad_tokens * ids.shape[1] <= self.peer.rows:
                return self._padded_direct(x, weights, ids.shape[1], slot, real, local)
            return self._padded(x, weights, ids.shape[1], slot, real, local)
        dest = torch.div(slot, self.k, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(ids.shape[1])[order]
        send_n = torch.bincount(dest, minlength=self.world)
        recv_n = self._exchange(send_n, None, None)
        send_split, recv_split = send_n.tolist(), recv_n.tolist()
        rx = self._exchange(x[token], recv_split, send_split)
        r_slot = self._exchange((slot[order] - dest[order] * self.k)[:, None], recv_split, send_split)[:, 0]
        y = self._run_experts(rx, t.store_of[r_slot], local)
        back = self._exchange(y.to(x.dtype), send_split, recv_split)
        acc = torch.promote_types(x.dtype, torch.float32)  # summed in float32 (or wider), rounded once
        out = torch.zeros(x.shape, dtype=acc, device=x.device)
        out.index_add_(0, token, back.to(acc) * weights.flatten()[order, None])
        return out.to(x.dtype)

    def _padded(self, x: torch.Tensor, weights: torch.Tensor, top_k: int, slot: torch.Tensor, real: torch.Tensor,
                local) -> torch.Tensor:
        tokens, world = x.shape[0], self.world
        cap = self.pad_tokens * top_k  # rows per destination: room for every pair of this rank
        if tokens > self.pad_tokens:
            raise ValueError(f"padded expert dispatch: {tokens} tokens exceed the step's pad_tokens {self.pad_tokens}")
        # Row of each pair in the (world * cap) send buffer: its destination's block, in
        # token order; a padding token's pairs go to one extra row that is never sent.
        dest = torch.where(real, torch.div(slot, self.k, rounding_mode="floor"), world)
        nth, _ = _nth(dest, world + 1)
        row = torch.where(real, dest * cap + nth, world * cap)
        token = torch.arange(tokens, device=x.device).repeat_interleave(top_k)
        # One exchange carries each row and, in two more bytes, the slot it runs through on
        # its destination (-1: an unused row), all as bytes (NCCL and Gloo move uint8; no
        # 16-bit integer type), so nothing on the way reads the slot as a float.
        h = x.shape[1] * x.element_size()  # a row's bytes
        send = torch.zeros((world * cap + 1, h + 2), dtype=torch.uint8, device=x.device)
        send[:, h:] = 255  # int16 -1
        send[row, :h] = x[token].view(torch.uint8)
        send[row, h:] = (slot - dest * self.k).to(torch.int16)[:, None].view(torch.uint8)
        peer = self.peer if self.peer is not None and not self.peer.direct and cap <= self.peer.rows else None
        if peer is not None and peer.row_bytes != (h + 2, h):
            raise ValueError(f"peer exchange rows of {peer.row_bytes} bytes, this layer's {(h + 2, h)}")
        recv = self._exchange(send[:-1], None, None) if peer is None else peer.exchange(0, send[:-1])
        rx = recv[:, :h].contiguous().view(x.dtype)
        r_local = recv[:, h:].contiguous().view(torch.int16)[:, 0].to(torch.int64)
        none = len(self.gate_up_proj)  # the storage entry "none": past the end
        r_entry = torch.where(r_local >= 0, self.tables.store_of[r_local.clamp(min=0)], none)
        y = self._run_experts(rx, r_entry, local).to(x.dtype).contiguous()
        back = self._exchange(y, None, None) if peer is None else peer.exchange(1, y.view(torch.uint8)).view(x.dtype)
        back = torch.cat([back, y.new_zeros(1, y.shape[1])])
        # Summed in float32 and rounded once, as the direct path's combine sums them.
        acc = torch.promote_types(x.dtype, torch.float32)
        out = torch.zeros(x.shape, dtype=acc, device=x.device)
        w = torch.where(real, weights.flatten(), 0)
        out.index_add_(0, token, back[row].to(acc) * w[:, None])
        return out.to(x.dtype)

    def _padded_direct(self, x: torch.Tensor, weights: torch.Tensor, top_k: int, slot: torch.Tensor,
                       real: torch.Tensor, local) -> torch.Tensor:
        """Padded dispatch by kernels that write the pairs' rows into their owners' memory and
        read the results back from there (``kernels.ep_dispatch``): no send buffer, no
        padding rows moved, two barriers."""
        from lockstep.kernels.ep_dispatch import combine_rows, dispatch_rows, take_tags

        if x.shape[0] > self.pad_tokens:
            raise ValueError(f"padded expert dispatch: {x.shape[0]} tokens exceed the step's pad_tokens "
                             f"{self.pad_tokens}")
        ex, n, h = self.peer, self.pad_tokens * top_k, x.shape[1]
        if ex.row_bytes != (h * x.element_size(), 4, h * x.element_size()):
            raise ValueError(f"peer exchange rows of {ex.row_bytes} bytes; {x.dtype} activations of "
                             f"{h} need {(h * x.element_size(), 4, h * x.element_size())}")
        slot = torch.where(real, slot, -1)
        pos = dispatch_rows(x, slot, top_k, self.k, n, self.rank, ex.bases[0], ex.bases[1])
        ex.barrier()
        rx = ex.local(0, n).view(x.dtype)
        entry = take_tags(ex.local(1, n).view(torch.int32)[:, 0], self.tables.store_of, len(self.gate_up_proj))
        self._run_experts(rx, entry, local, out=ex.local(2, n).view(x.dtype))  # where the owners read them
        ex.barrier()
        return combine_rows(ex.bases[2], slot, pos, weights, self.k, n, self.rank, h, x.dtype)

    def _exchange(self, t: torch.Tensor, recv_split: list[int] | None, send_split: list[int] | None) -> torch.Tensor:
        if self.world == 1:  # one rank: every pair is local
            return t
        out = t.new_empty(t.shape if recv_split is None else (sum(recv_split), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), recv_split, send_split, group=self.group)
        return out

    def _run_experts(self, rx: torch.Tensor, entry: torch.Tensor, local, out: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """Each received row through the expert in its storage entry, unweighted, into
        ``out`` if given; an entry past the last (no pair took the row) gives a zero row (or,
        through ``local``, one left unwritten: nobody reads it). ``local``: one fused kernel
        for all of them (one term a row, so nothing to sum: its terms are the rows), else a
        loop over the experts (a host sync each)."""
        if local is not None:
            from lockstep.kernels.fused_moe import moe_config

            ones = torch.ones(len(entry), 1, dtype=torch.float32, device=rx.device)
            # Tiles for the experts this rank serves, not its storage entries (spares for
            # rebalancing hold no slot): what a DEP rank's received rows were tuned as.
            g = self.gate_up_proj
            cfg = moe_config(self.k, g.shape[2], self.down_proj.shape[2], False, len(rx), 1)
            y = local(rx, g, self.down_proj, ones, entry[:, None], reduce=False, out=out, config=cfg)
            return y if out is not None else y.view(rx.shape)
        y = torch.zeros_like(rx) if out is None else out.zero_()
        rows = (entry < len(self.gate_up_proj)).nonzero(as_tuple=True)[0]
        y[rows] = self._local(rx[rows], entry[rows])
        return y

    def _local(self, x: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Each received row through the expert in its storage entry, unweighted."""
        out = torch.empty_like(x)
        for e in entries.unique().tolist():
            rows = (entries == e).nonzero(as_tuple=True)[0]
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            out[rows] = F.linear(F.silu(gate) * up, self.down_proj[e])
        return out


def shard_experts(model: nn.Module, phy2log: np.ndarray, rank: int, world: int, *, spare: int = 0,
                  group=None, split: str = "even", dispatch: str = "exact",
                  copy_all: bool = False) -> list[ShardedExperts]:
    """Replace every MoE layer's experts by this rank's slots of ``phy2log`` (MoE layers,
    slots); the full weights stay only as the host-side source of later copies."""
    from .deepseek_v3 import MoE

    moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    if len(moe) != len(phy2log):
        raise ValueError(f"placement has {len(phy2log)} layers, the model {len(moe)} MoE layers")
    for mlp, row in zip(moe, phy2log):
        mlp.experts = ShardedExperts(mlp.experts, row, rank, world, spare=spare, group=group, split=split,
                                     dispatch=dispatch, copy_all=copy_all)
    return [mlp.experts for mlp in moe]


def attach_peer_exchange(layers: list[ShardedExperts], pad_tokens: int, top_k: int, group, device, *,
                         direct: bool = False):
    """One ``PeerExchange`` for all of ``layers`` (they run one at a time), sized for padded
    steps of up to ``pad_tokens`` tokens a rank of ``top_k`` pairs each; steps padded past
    that take the process group's all-to-all. ``direct``: its areas are laid out for the
    dispatch and combine kernels (rows, tags, outputs: ``ShardedExperts._padded_direct``),
    else for block copies (rows with their slots, outputs). A collective: every rank calls
    it, with the same sizes. Returns the exchange (``close`` it when done)."""
    from .peer_exchange import PeerExchange

    first = layers[0]
    if direct and not first.gate_up_proj.is_cuda:
        from lockstep.kernels import _util  # Triton: on CPU only interpreted

        if not _util.INTERPRET:
            raise ValueError("ep_exchange 'direct' runs Triton kernels: on CPU only under TRITON_INTERPRET=1 "
                             "(use 'peer' or 'nccl')")
    h = first.gate_up_proj.shape[2] * first.gate_up_proj.element_size()  # a row of activations
    rows = pad_tokens * top_k
    ex = PeerExchange(rows, [h, 4, h] if direct else [h + 2, h], first.world, first.rank, group, device)
    ex.direct = direct
    if direct:
        ex.bases = [ex.addresses(c) for c in range(3)]
        ex.fill(1, 255)  # every tag -1: no row taken
    for layer in layers:
        layer.peer = ex
    return ex
