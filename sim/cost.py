"""Analytic step-time model for one DEP instance: what a step costs on the GPU, without one.

For rank r of a DEPn instance in one step (all ranks step together, so the instance's step
time is the slowest rank's):

    pad       = the largest rank's token count: every rank pads to it (the DP sync rule), so
                GEMMs, MoE and the all-to-all run pad tokens on every rank, dummy steps included
    T         = n * pad tokens through the MoE layers (every token visits top_k experts)
    distinct  = E * (1 - (1 - k/E) ** T)          expected distinct experts touched per layer
    experts_r = min(distinct / n / balancedness, E / n)   experts the busiest rank reads per layer
    bytes_r   = dense_bytes                        attention, dense MLPs, shared experts
              + moe_layers * experts_r * expert_bytes
              + kv_bytes_per_token * ctx_r         KV the rank's attention reads
              + kv_bytes_per_token * tokens_r      KV it writes
    gemm_r    = 2 * pad * dense_params
              + 2 * (T * k / n / balancedness) * 3 * hidden * moe_inter * moe_layers
    attn_r    = attn_flops_per_pair * pairs_r * num_layers    (BF16; GEMMs run at 2x with FP8)
    a2a_r     = moe_layers * (pad * k * hidden * 3 bytes / link_bandwidth   (n > 1 only:
                FP8 dispatch + BF16 combine) + 2 * a2a_latency_s), of which ``a2a_overlap``
                hides behind compute; with n > gpus_per_node the off-node share (n - g) / n
                of the bytes goes over scaleout_bandwidth instead, in parallel (``_a2a``)
    t_r       = max(bytes_r / hbm_bandwidth, gemm_r / gemm_flops + attn_r / flops)
              + (1 - overlap) * a2a_r
              + kv_bytes_per_token * loaded_r / host_bandwidth    (host-tier prefix loads)
    step      = max(max_r t_r, host_floor) + host_added      (see HostSpec: the scheduler and
                dispatch hide behind the GPU step with async scheduling; the DP sync does not)

With speculative decoding a step also runs the draft model's passes before the target's
(``draft_s``: the draft's layers priced by a second AnalyticCost over its shape, its head
apart, see lockstep.sim.spec): step = max(max_r t_r + draft_s, host_floor) + host_added.

Host work a step adds on some ranks (``host_extra``: P/D pulls started and completed, see
KVTransferSpec) joins the host floor when async scheduling overlaps host and GPU, so it
shows only when it outlasts the GPU step: max(max_r t_r, host_floor + max_r extra_r);
without overlap each rank's extra adds to its own time.

``ctx_r`` is the KV the rank's attention reads: each scheduled request's context (s + c for
a chunk of c tokens after s), read once per step; ``pairs_r`` the (query, key) pairs, which
for that chunk is c*s + c*(c+1)/2.
Everything is vectorized over steps so ``advance(k)`` costs one call for k steps.
"""

from __future__ import annotations

import attrs
import numpy as np

from lockstep.policy.deployment import CostSpec, HardwareSpec, HostSpec, ModelSpec


@attrs.frozen
class StepLoad:
    """Per-rank load of one step (arrays over ranks, or over ranks x steps)."""

    tokens: np.ndarray  # tokens fed
    ctx: np.ndarray  # KV tokens attention reads: each request's context, once
    pairs: np.ndarray  # attention (query, key) pairs
    loaded: np.ndarray | float = 0.0  # tokens of KV loaded from the host tier


VECTOR_RUN = 48  # runs from this many steps are priced with numpy (a Python loop below it: ~1 us
# a step, where numpy's dozen calls cost ~50 us whatever the run's length)


class AnalyticCost:
    needs_mix = False  # a measured model (sim.profile) wants each rank's decode/prefill split

    def __init__(self, model: ModelSpec, hw: HardwareSpec, cost: CostSpec, dep: int,
                 host: HostSpec = HostSpec()):
        self.m, self.hw, self.c, self.dep = model, hw, cost, dep
        self.host_floor, self.host_added = host.step_terms(dep)
        self.host_overlap = host.overlap
        self.balancedness = cost.expert_balancedness  # the simulator may move it window by window
        self._distinct: dict[tuple[float, float], tuple[float, float]] = {}

    def _a2a(self, pad):
        """Seconds of a step's all-to-alls (before overlap) at ``pad`` tokens a rank. A DEP
        group wider than one scale-up domain sends the off-node share of its tokens (experts
        spread evenly: (n - g) / n of them) over the scale-out links, in parallel with the
        rest over NVLink; the slower of the two sets the time."""
        m, hw, n = self.m, self.hw, self.dep
        bytes_ = pad * m.top_k * m.hidden_size * 3
        t = bytes_ / hw.link_bandwidth
        if n > hw.gpus_per_node:
            off = (n - hw.gpus_per_node) / n
            t = np.maximum(bytes_ * (1 - off) / hw.link_bandwidth, bytes_ * off / hw.scaleout_bandwidth)
        return m.moe_layers * (t + 2 * self.c.a2a_latency_s)

    def _weights_and_moe(self, total: float) -> tuple[float, float]:
        """(weight bytes a rank reads, MoE GEMM FLOPs) for ``total`` tokens through the MoE
        layers, in ``step_time``'s operations and order, cached by ``total``."""
        bal = self.balancedness
        out = self._distinct.get((total, bal))
        if out is None:
            m, n = self.m, self.dep
            e, k = m.num_routed_experts, m.top_k
            distinct = e * (1.0 - (1.0 - k / e) ** total)
            experts_r = min(distinct / n / bal, e / n)
            moe_flops = 2 * (total * k / n / bal) * m.expert_bytes / m.bytes_per_param
            out = self._distinct[(total, bal)] = (m.dense_bytes + m.moe_layers * experts_r * m.expert_bytes,
                                           moe_flops * m.moe_layers)
        return out

    def rank_step_time(self, tokens: list[float], ctx: list[float], pairs: list[float],
                       loaded: list[float], host_extra: list[float] | None = None, draft_s: float = 0.0,
                       mix: list | None = None) -> float:
        """``step_time`` of one step from per-rank Python floats: the same operations in the
        same order, so the same bits, without numpy's per-call cost on arrays of one or a
        few ranks (most steps of a sparse trace). ``host_extra``: host seconds per rank that
        this step adds (see the module docstring). ``draft_s``: GPU seconds of a draft model's
        passes in the same step (speculative decoding, see lockstep.sim.spec), which run
        before the target's and, like it, in lockstep on every rank. ``mix`` (the plans'
        decode/prefill split, see lockstep.sim.profile) is for measured models: ignored here."""
        m, hw, c, n = self.m, self.hw, self.c, self.dep
        pad = max(tokens)  # the DP sync rule: every rank runs the largest rank's token count
        # Only P/D pulls to start (no colocated plan looks like this, so step_time, the
        # engine's timing runtime's, needs no such case): no forward pass runs.
        if pad == 0 and not any(loaded):
            return self._host_only(host_extra)
        dense_bytes, moe_gemm = self._weights_and_moe(pad * n)
        gemm_rate = hw.flops * (2.0 if m.bytes_per_param <= 1 else 1.0)
        a2a_keep = 1 - c.a2a_overlap
        worst = -np.inf
        gemm = 2 * pad * m.dense_params + moe_gemm
        a2a = a2a_keep * self._a2a(pad)
        serial = host_extra if host_extra is not None and not self.host_overlap else None
        for r, (tok, cx, pr, ld) in enumerate(zip(tokens, ctx, pairs, loaded)):
            bytes_r = dense_bytes + m.kv_bytes_per_token * (cx + tok)
            attn = m.attn_flops_per_pair * pr * m.num_layers
            t = max(bytes_r / hw.hbm_bandwidth, gemm / gemm_rate + attn / hw.flops)
            if n > 1:
                t = t + a2a
            t = t + m.kv_bytes_per_token * ld / hw.host_bandwidth
            if serial is not None:
                t = t + serial[r]
            worst = t if t > worst else worst
        return self._with_host(worst, host_extra, draft_s)

    def _with_host(self, worst: float, host_extra: list[float] | None, draft_s: float) -> float:
        """The step from its slowest rank's GPU time: plus the draft's passes, no shorter than
        the host work async scheduling overlaps with it, plus the host work it cannot."""
        if draft_s:
            worst = worst + draft_s
        floor = self.host_floor
        if host_extra is not None and self.host_overlap:
            floor = floor + max(host_extra)
        return (worst if worst > floor else floor) + self.host_added

    def _host_only(self, host_extra: list[float] | None) -> float:
        extra = max(host_extra) if host_extra is not None else 0.0
        return (self.host_floor + extra if self.host_overlap else extra) + self.host_added

    def decode_run_ends(self, t: float, ns: list[float], bases: list[float], k: int,
                        until: float, last_free: bool = False, through: bool = False) -> list[float]:
        """End times of up to k identical decode steps from t, stopping before the first
        that reaches ``until`` (``last_free``: the k-th step may end later; ``through``: the
        first step that reaches it is the last one given). Rank r feeds
        ns[r] tokens and reads bases[r] + ns[r] * j of context in step j: ``step_time`` on
        those loads, summed one step at a time (as stepping would), in Python floats with its
        operations in its order."""
        m, hw, c, n = self.m, self.hw, self.c, self.dep
        pad = max(ns)  # the DP sync rule, as in rank_step_time
        dense, moe_gemm = self._weights_and_moe(pad * n)
        gemm_rate = hw.flops * (2.0 if m.bytes_per_param <= 1 else 1.0)
        kvb, hbm, flops, afpp, layers = m.kv_bytes_per_token, hw.hbm_bandwidth, hw.flops, m.attn_flops_per_pair, m.num_layers
        ranks, idle = [], -np.inf  # ranks without requests cost the same every step
        a2a = (1 - c.a2a_overlap) * self._a2a(pad) if n > 1 else None
        gemm = (2 * pad * m.dense_params + moe_gemm) / gemm_rate
        for tok, base in zip(ns, bases):
            if tok or base:
                ranks.append((tok, base, gemm, a2a))
                continue
            t_r = max((dense + kvb * (base + tok)) / hbm, gemm + afpp * base * layers / flops)
            idle = max(idle, t_r if a2a is None else t_r + a2a)
        # No step is shorter than reading the weights (or the host floor): a long run that
        # ``until`` cuts is priced up to there only (a running sum: its prefix is the same).
        least = max(dense / hbm, self.host_floor) + self.host_added
        if k >= VECTOR_RUN and least > 0 and (until - t) / least + 3 < k:
            head = int(max(until - t, 0.0) / least) + 3
            got = self.decode_run_ends(t, ns, bases, head, until, through=through)
            if len(got) < head or got[-1] >= until:  # it reached until, as the whole run does
                return got
        if k >= VECTOR_RUN:  # the same operations elementwise, then a sequential running sum
            j = np.arange(k, dtype=np.float64)
            worst = np.full(k, idle)
            for tok, base, gemm, a2a in ranks:
                ctx = base + tok * j
                t_r = np.maximum((dense + kvb * (ctx + tok)) / hbm, gemm + afpp * ctx * layers / flops)
                if a2a is not None:
                    t_r = t_r + a2a
                np.maximum(worst, t_r, out=worst)
            steps = np.empty(k + 1)
            steps[0] = t
            np.add(np.maximum(worst, self.host_floor), self.host_added, out=steps[1:])
            ends = np.add.accumulate(steps)[1:]  # left to right: t + s0, then + s1, ...
            late = ends >= until
            if last_free:
                late[-1] = False
            return ends[: late.argmax() + through if np.count_nonzero(late) else k].tolist()
        if len(ranks) == 1 and idle == -np.inf:
            return self._one_rank_ends(t, ranks[0], dense, kvb, hbm, afpp, layers, flops, k, until, last_free, through)
        floor, added = self.host_floor, self.host_added
        ends = []
        for j in range(k):
            worst = idle
            for tok, base, gemm, a2a in ranks:
                ctx = base + tok * float(j)
                t_r = max((dense + kvb * (ctx + tok)) / hbm, gemm + afpp * ctx * layers / flops)
                if a2a is not None:
                    t_r = t_r + a2a
                worst = t_r if t_r > worst else worst
            t = t + ((worst if worst > floor else floor) + added)
            if t >= until and not (last_free and j == k - 1):
                if through:
                    ends.append(t)
                break
            ends.append(t)
        return ends

    def _one_rank_ends(self, t, rank, dense, kvb, hbm, afpp, layers, flops, k, until, last_free, through):
        """``decode_run_ends``' loop for one busy rank: the same operations in the same order."""
        tok, base, gemm, a2a = rank
        floor, added = self.host_floor, self.host_added
        free_at = k - 1 if last_free else -1
        ends = []
        for j in range(k):
            ctx = base + tok * float(j)
            t_r = (dense + kvb * (ctx + tok)) / hbm
            g = gemm + afpp * ctx * layers / flops
            if g > t_r:  # max(t_r, g)
                t_r = g
            if a2a is not None:
                t_r = t_r + a2a
            t = t + ((t_r if t_r > floor else floor) + added)
            if t >= until and j != free_at:
                if through:
                    ends.append(t)
                break
            ends.append(t)
        return ends

    def step_time(self, load: StepLoad) -> np.ndarray:
        """Step time of the instance; ``load`` arrays are (n_ranks,) or (n_ranks, k)."""
        m, hw, c, n = self.m, self.hw, self.c, self.dep
        tokens = np.asarray(load.tokens, dtype=np.float64)
        pad = tokens.max(axis=0)  # the DP sync rule: every rank runs the largest rank's count
        total = pad * n
        e, k = m.num_routed_experts, m.top_k
        distinct = e * (1.0 - (1.0 - k / e) ** total)
        experts_r = np.minimum(distinct / n / self.balancedness, e / n)  # it holds only E/n
        moe_bytes = m.moe_layers * experts_r * m.expert_bytes
        kv = m.kv_bytes_per_token * (np.asarray(load.ctx, np.float64) + tokens)
        bytes_r = m.dense_bytes + moe_bytes + kv
        moe_flops = 2 * (total * k / n / self.balancedness) * m.expert_bytes / m.bytes_per_param
        gemm = 2 * pad * m.dense_params + moe_flops * m.moe_layers
        attn = m.attn_flops_per_pair * np.asarray(load.pairs, np.float64) * m.num_layers
        gemm_rate = hw.flops * (2.0 if m.bytes_per_param <= 1 else 1.0)  # FP8 GEMMs run 2x
        t = np.maximum(bytes_r / hw.hbm_bandwidth, gemm / gemm_rate + attn / hw.flops)
        if n > 1:
            t = t + (1 - c.a2a_overlap) * self._a2a(pad)
        # Host-tier loads are charged as blocking the step (the engine can overlap them).
        t = t + m.kv_bytes_per_token * np.asarray(load.loaded, np.float64) / hw.host_bandwidth
        return np.maximum(t.max(axis=0), self.host_floor) + self.host_added
