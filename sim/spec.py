"""Speculative decoding in the simulator: the runtime's side of a speculative step.

The core plans each speculative decode as 1 + d PLACEHOLDER tokens, counts them in its token
budget and its blocks, and rolls back what the result does not confirm (lockstep.policy.spec).
The simulator plays the runtime (runtime/speculative.py) for those plans:

- Placement. A plan made before the previous step's result assumed all of that step's drafts
  were accepted, so its ``start_pos`` can be ahead. The runtime feeds a decode at its own
  count of the request's tokens (``SpecRuntime.pos``), as the torch runtime and test_core's
  FakeRuntime do, and attention is charged from there.
- Acceptance. A speculative decode accepts a <= d of its drafts, drawn from the deployment's
  acceptance model with a seeded stream of its own, and its request gets 1 + a tokens.
- Cost. The draft model's forward passes are a separate term of the step (``draft_s``):
  pass 1 feeds the prefill chunks (the draft keeps its own cache of every prompt) and, for
  each decode, the tokens the draft has not seen: one, or two after a step that accepted
  every draft (the last draft was proposed but never fed, then the bonus token); passes
  2..d feed one token for each request still drafting. Each pass is a step of the draft on
  the same GPUs and DEP group: its layers priced by AnalyticCost over the draft's shape
  without its output head and with no host terms (the step's host work and DP sync are the
  target's, charged once), then the head (vocab x hidden, part of the preset's dense
  parameters) as a GEMM of its own over the rows that propose a draft: a draft's prefill
  computes no logits, and the head is most of a small draft's parameters. The target then
  runs once over 1 + d tokens per decode: more FLOPs, the same weight reads.
- Adaptive k (``[speculative] adaptive = true``). The runtime proposes
  k_eff = clamp(round(m) + 1, 1, k) drafts per decode, where m is a running mean of the
  drafts accepted per speculative decode over the whole deployment (each decode moves it
  1/16 of the way to its count; it starts at k): one more draft than it expects to keep.
  Global rather than per request because the acceptance models here draw alike for every
  request. The core still reserves budget and blocks for the planned d (it plans a fixed
  k); only the draft passes and the target's verify width shrink.

The counters mirror the core's (drafts, draft tokens, accepted tokens, accepted per
position) but count what the runtime proposed, which differs from the core's draft tokens
only with adaptive k.
"""

from __future__ import annotations

import attrs
import numpy as np

from lockstep.policy.deployment import CostSpec, HardwareSpec, HostSpec, ModelSpec, SpeculativeSpec
from lockstep.policy.step import PLACEHOLDER, StepPlan, StepResult

from .cost import AnalyticCost
from .load import host_loaded_tokens
from .profile import step_mix

SPEC_STREAM = 0x5BEC  # keeps the acceptance draws apart from the seed's other uses
ADAPT_WEIGHT = 1 / 16


class Speculation:
    """The deployment-wide half: the acceptance model, the adaptive rule, the counters."""

    def __init__(self, spec: SpeculativeSpec, seed: int):
        self.spec = spec
        self.k = spec.num_spec_tokens
        self.rng = np.random.default_rng([seed & (2**63 - 1), SPEC_STREAM])
        self.rates = None if spec.acceptance == "replay" else np.array(spec.position_rates())
        self._cursor = 0  # replay: the next count
        self.mean_accepted = float(self.k)  # adaptive: the running mean
        self.drafts = self.draft_tokens = self.accepted = 0
        self.per_pos = [0] * self.k
        self.draft_s = 0.0  # seconds of draft passes, over the instances with a draft
        self.step_s = 0.0  # seconds of their steps

    def proposals(self, planned: list[int]) -> list[int]:
        """Drafts the runtime proposes for decodes the core planned with ``planned``."""
        if not self.spec.adaptive:
            return planned
        cap = min(self.k, max(1, int(self.mean_accepted + 1.5)))
        return [min(d, cap) for d in planned]

    def draw(self, d: list[int]) -> list[int]:
        """Drafts accepted by decodes proposing d[i] > 0 drafts each."""
        if self.rates is None:
            vals, n = self.spec.replay, len(self.spec.replay)
            got = [min(vals[(self._cursor + i) % n], di) for i, di in enumerate(d)]
            self._cursor = (self._cursor + len(d)) % n
        else:  # draft j kept if it and every draft before it pass their position's draw
            ok = self.rng.random((len(d), self.k)) < self.rates
            ok &= np.arange(self.k) < np.array(d)[:, None]
            got = np.cumprod(ok, axis=1).sum(axis=1).tolist()
        if self.spec.adaptive:
            for a in got:
                self.mean_accepted += ADAPT_WEIGHT * (a - self.mean_accepted)
        return got

    def count(self, drafts: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafts
        self.accepted += accepted
        for j in range(accepted):
            self.per_pos[j] += 1

    def report(self) -> dict:
        """The report's ``spec_decode`` section (counter names as vLLM's spec_decode_*)."""
        n, s = self.drafts, self.spec
        return {
            "draft_model": s.draft_model, "num_spec_tokens": self.k, "acceptance": s.acceptance,
            "adaptive": s.adaptive,
            "num_drafts": n, "num_draft_tokens": self.draft_tokens, "num_accepted_tokens": self.accepted,
            "num_accepted_tokens_per_pos": list(self.per_pos),
            "draft_acceptance_rate": self.accepted / self.draft_tokens if self.draft_tokens else None,
            "acceptance_rate_per_pos": [c / n for c in self.per_pos] if n else None,
            "mean_acceptance_length": 1 + self.accepted / n if n else None,
            "draft_time_s": self.draft_s,
            "draft_time_fraction": self.draft_s / self.step_s if self.step_s else None,
        }


class DraftCost:
    """One forward pass of the draft model on every rank of a DEP group: its layers, then
    its head over the rows that need logits."""

    def __init__(self, draft: ModelSpec, hw: HardwareSpec, cost: CostSpec, dep: int):
        head = min(float(draft.vocab_size * draft.hidden_size), draft.dense_params)
        body = attrs.evolve(draft, dense_params=draft.dense_params - head)
        no_host = HostSpec(scheduler_s=0.0, dispatch_s=0.0, sync_round_s=0.0, gloo_hop_s=0.0)
        self.layers = AnalyticCost(body, hw, cost, dep, no_host)
        self.head_bytes = head * draft.bytes_per_param / hw.hbm_bandwidth  # seconds to read it
        self.head_flops = 2 * head / (hw.flops * (2.0 if draft.bytes_per_param <= 1 else 1.0))  # per row

    def pass_time(self, per_rank: list[list[int]]) -> float:
        """``per_rank``: [tokens, context, pairs, logit rows] of each rank."""
        zeros = [0.0] * len(per_rank)
        t = self.layers.rank_step_time([float(x[0]) for x in per_rank], [float(x[1]) for x in per_rank],
                                       [float(x[2]) for x in per_rank], zeros)
        rows = max(x[3] for x in per_rank)
        if rows:
            t += max(self.head_bytes, rows * self.head_flops)
        return t


class SpecRuntime:
    """One instance's runtime side: each rank's count of its requests' tokens, what the
    entries of the step in flight sampled, and the step's cost with the draft's passes."""

    def __init__(self, speculation: Speculation, target: AnalyticCost, draft: DraftCost,
                 n_ranks: int, block_size: int):
        self.sp, self.target, self.draft, self.bs = speculation, target, draft, block_size
        # per rank: request id -> (position of its last sampled token, tokens the draft has not seen)
        self.pos: list[dict[int, tuple[int, int]]] = [{} for _ in range(n_ranks)]
        # per rank: tokens each entry of the step in flight sampled, and drafts it proposed
        self.got: list[tuple[list[int], list[int]]] = [([], []) for _ in range(n_ranks)]

    def step(self, plans: list[StepPlan], host: list[float] | None) -> float:
        """Run one step's plans (one per rank) and return its time."""
        n = len(plans)
        tokens, ctx, pairs = [0.0] * n, [0.0] * n, [0.0] * n
        passes: list[list[list[int]]] = []  # pass -> rank -> [tokens, context, pairs, logit rows]
        fed: list[tuple[list[int], list[int]]] = [([], []) for _ in range(n)]  # per rank: (tokens, start) per entry
        for rank, plan in enumerate(plans):
            tokens[rank], ctx[rank], pairs[rank] = self._execute(rank, plan, passes, n, fed[rank])
        draft_s = 0.0
        for per_rank in passes:
            draft_s += self.draft.pass_time(per_rank)
        loaded = [host_loaded_tokens(p, self.bs) for p in plans]
        mix = [step_mix(*f) for f in fed] if self.target.needs_mix else None
        t = self.target.rank_step_time(tokens, ctx, pairs, loaded, host, draft_s, mix=mix)
        self.sp.draft_s += draft_s
        self.sp.step_s += t
        return t

    def _execute(self, rank: int, plan: StepPlan, passes: list, n_ranks: int,
                 fed: tuple[list[int], list[int]]) -> tuple[float, float, float]:
        """One rank's plan: its answers go to ``got``, its draft passes' loads to ``passes``,
        each entry's (tokens, first position) for the target to ``fed``; returns the target's
        (tokens, context read, pairs)."""
        pos = self.pos[rank]
        for rid in plan.finished_req_ids.tolist():  # the core dropped them: forget them
            pos.pop(rid, None)
        n = plan.num_reqs
        ns, props = [0] * n, [0] * n
        self.got[rank] = (ns, props)
        if not n:
            return 0.0, 0.0, 0.0
        rids, num_new, starts = plan.req_ids.tolist(), plan.num_new.tolist(), plan.start_pos.tolist()
        samples, offs, toks = plan.samples.tolist(), plan.token_offsets.tolist(), plan.token_ids
        chunks, decodes = [], []  # (entry, first position, tokens fed / drafts planned)
        for i, c in enumerate(num_new):
            if c == 0:  # a table-only entry: its KV arrives from elsewhere
                continue
            if toks.item(offs[i]) == PLACEHOLDER:  # a decode, at the runtime's own count
                decodes.append((i, pos[rids[i]][0] if rids[i] in pos else starts[i], c - 1))
            else:
                chunks.append((i, starts[i], c))
        eff = self.sp.proposals([d for _, _, d in decodes])
        acc = [0] * len(decodes)
        drafting = [j for j, e in enumerate(eff) if e]
        if drafting:
            for j, a in zip(drafting, self.sp.draw([eff[j] for j in drafting])):
                acc[j] = a
        tok = cx = pr = 0

        def feed(p: int, c: int, s: int, drafts: bool) -> None:  # c tokens from position s into pass p
            while len(passes) <= p:
                passes.append([[0, 0, 0, 0] for _ in range(n_ranks)])
            load = passes[p][rank]
            load[0] += c
            load[1] += s + c
            load[2] += c * s + c * (c + 1) // 2
            load[3] += drafts

        for i, s, c in chunks:
            tok, cx, pr = tok + c, cx + s + c, pr + c * s + c * (c + 1) // 2
            fed[0].append(c)
            fed[1].append(s)
            feed(0, c, s, False)
            if samples[i]:
                ns[i] = 1
                pos[rids[i]] = (s + c, 1)
        for (i, s, _), e, a in zip(decodes, eff, acc):
            c = 1 + e
            tok, cx, pr = tok + c, cx + s + c, pr + c * s + c * (c + 1) // 2
            fed[0].append(c)
            fed[1].append(s)
            pend = pos[rids[i]][1] if rids[i] in pos else 1
            feed(0, pend, s - pend + 1, e > 0)
            for j in range(1, e):  # pass j + 1 feeds draft j, at position s + j
                feed(j, 1, s + j, True)
            ns[i], props[i] = 1 + a, e
            pos[rids[i]] = (s + 1 + a, 2 if e and a == e else 1)
        return float(tok), float(cx), float(pr)

    def result(self, rank: int, plan: StepPlan, s_rid: np.ndarray, s_nout: np.ndarray, out_tokens: np.ndarray,
               out_base: np.ndarray, out_skip: np.ndarray, done: np.ndarray) -> StepResult:
        """The rank's StepResult: each live entry's tokens, looked up from where the
        request's output stands (``s_nout``, the core's confirmed count); entries whose
        request left its slot meanwhile get none, as the core would drop them."""
        ns, props = self.got[rank]
        counts, tokens = [], []
        for i, (s, r) in enumerate(zip(plan.slots.tolist(), plan.req_ids.tolist())):
            m = ns[i] if s_rid.item(s) == r else 0
            counts.append(m)
            if m:
                first = out_base.item(r) + s_nout.item(s) + out_skip.item(r)
                tokens += out_tokens[first : first + m].tolist()
                if props[i]:
                    self.sp.count(props[i], m - 1)
        return StepResult(step_id=plan.step_id, num_sampled=np.array(counts, dtype=np.int32),
                          token_ids=np.array(tokens, dtype=np.int32), kv_loads_done=done)
