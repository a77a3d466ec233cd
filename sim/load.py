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
    loaded = np.array([float(p.kv_load_num_blocks.sum()) * block_size for p in plans])
    for r, p in enumerate(plans):
        if p.num_reqs:
            c = p.num_new.astype(np.float64)
            s = p.start_pos.astype(np.float64)
            ctx[r] = float((s + c).sum())
            pairs[r] = float((c * s + c * (c + 1) / 2).sum())
    return StepLoad(tokens=tokens, ctx=ctx, pairs=pairs, loaded=loaded)
