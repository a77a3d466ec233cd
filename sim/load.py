"""What a step asks of the GPU, from its plans: the cost model's input.

Shared by the simulator and the engine's ``timing`` runtime, so both charge a plan the same.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from lockstep.policy.step import StepPlan

from .cost import StepLoad


def plan_load(plans: Sequence[StepPlan], block_size: int) -> StepLoad:
    """One entry per rank: tokens fed, context read, (query, key) pairs, tokens loaded."""
    tokens = np.array([p.num_tokens for p in plans], dtype=np.float64)
    ctx = np.zeros(len(plans))
    pairs = np.zeros(len(plans))
    loaded = np.array([host_loaded_tokens(p, block_size) for p in plans])
    for r, p in enumerate(plans):
        if p.num_reqs:
            c = p.num_new.astype(np.float64)
            s = p.start_pos.astype(np.float64)
            ctx[r] = float((s + c).sum())
            pairs[r] = float((c * s + c * (c + 1) / 2).sum())
    return StepLoad(tokens=tokens, ctx=ctx, pairs=pairs, loaded=loaded)


def host_loaded_tokens(plan: StepPlan, block_size: int) -> float:
    """Tokens of KV the step loads from the host tier, which the step waits for. A pull
    from a prefill pool (a plan entry that feeds no tokens: its whole table arrives from
    elsewhere) runs in the background and is not charged here."""
    nl = plan.kv_load_num_blocks
    if not len(nl):
        return 0.0
    if not (plan.num_new == 0).any():
        return float(int(nl.sum())) * block_size
    remote = set(plan.req_ids[plan.num_new == 0].tolist())
    host = [n for r, n in zip(plan.kv_load_req_ids.tolist(), nl.tolist()) if r not in remote]
    return float(sum(host)) * block_size
