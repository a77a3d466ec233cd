"""Routing a request to one data-parallel rank: least loaded, with prefix affinity.

Each rank has its own prefix cache, so sending a request where its leading blocks already
live saves their prefill; sending everything there would overload that rank. The rule
(close to SGLang's cache-aware router): among ranks whose load is within ``slack`` of the
least loaded (``slack_ratio`` times its load plus ``slack_tokens``), take the one caching the
longest prefix; ties go to the least loaded.
"""

from __future__ import annotations

import numpy as np

from .block_pool import BlockPool


class PrefixAffinityRouter:
    def __init__(self, slack_tokens: int = 32768, slack_ratio: float = 1.5):
        self.slack_tokens = slack_tokens
        self.slack_ratio = slack_ratio

    def choose(self, hashes: np.ndarray, pools: list[BlockPool], loads: list[int]) -> int:
        limit = min(loads) * self.slack_ratio + self.slack_tokens
        best, best_key = 0, None
        for rank, (pool, load) in enumerate(zip(pools, loads)):
            if load > limit:
                continue
            key = (pool.cached_prefix_len(hashes), -load, -rank)
            if best_key is None or key > best_key:
                best, best_key = rank, key
        return best
