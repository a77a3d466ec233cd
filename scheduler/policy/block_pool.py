"""KV block pool with a prefix cache: refcounts, a hash table, LRU eviction of free blocks.

Invariants (``check_integrity``):
- a block is on the free list exactly when its refcount is 0;
- every cached hash maps to a block that carries that hash, and a block carries a hash only
  while it is in the table (free blocks keep theirs until they are evicted: that is the cache);
- free blocks are evicted least recently freed first; blocks without a hash go to the front,
  since nothing is lost by reusing them.
Lookups key the table by the first 64-bit lane and check the second, so a 128-bit hash costs
one Python int per block.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class BlockPool:
    def __init__(self, num_blocks: int, *, enable_prefix_cache: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_cache = enable_prefix_cache
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        self._hash = np.zeros((num_blocks, 2), dtype=np.uint64)
        self._hashed = np.zeros(num_blocks, dtype=bool)
        self._table: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, including cached-but-unused ones)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def match_prefix(self, hashes: np.ndarray) -> list[int]:
        """Block ids holding the longest cached prefix of ``hashes`` ((n, 2) uint64)."""
        if not self.enable_prefix_cache or len(hashes) == 0:
            return []
        table, lane1 = self._table, self._hash[:, 1]
        found: list[int] = []
        for i, key in enumerate(hashes[:, 0].tolist()):
            block = table.get(key)
            if block is None or lane1[block] != hashes[i, 1]:
                break
            found.append(block)
        return found

    def cached_prefix_len(self, hashes: np.ndarray) -> int:
        """Length of the cached prefix in blocks, by binary search (for routing)."""
        if not self.enable_prefix_cache:
            return 0
        lo, hi = 0, len(hashes)
        while lo < hi:  # chained hashes: block i cached implies its prefix was computed
            mid = (lo + hi + 1) // 2
            if self._lookup(hashes[mid - 1]) is None:
                hi = mid - 1
            else:
                lo = mid
        return lo

    # -- commands ------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take n free blocks (evicting cached ones, least recently freed first)."""
        if n > len(self._free):
            raise RuntimeError(f"allocate({n}) with only {len(self._free)} free blocks")
        out = [self._free.popitem(last=False)[0] for _ in range(n)]
        for block in out:
            if self._hashed[block]:
                self._evict(block)
        self.ref[out] = 1
        return out

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks found by ``match_prefix``."""
        for block in blocks:
            if self.ref[block] == 0:
                del self._free[block]
            self.ref[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference on each block; pass a request's blocks tail first."""
        for block in blocks:
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self._free[block] = None
                if not self._hashed[block]:
                    self._free.move_to_end(block, last=False)

    def cache(self, blocks: list[int], hashes: np.ndarray) -> None:
        """Publish full blocks under their hashes; a hash already present keeps its block."""
        if not self.enable_prefix_cache:
            return
        table = self._table
        for block, key, h in zip(blocks, hashes[:, 0].tolist(), hashes):
            if key in table or self._hashed[block]:
                continue
            table[key] = block
            self._hash[block] = h
            self._hashed[block] = True

    def reset_prefix_cache(self) -> None:
        for block in list(self._table.values()):
            self._evict(block)

    # -- internals -----------------------------------------------------------------------
    def _lookup(self, h: np.ndarray) -> int | None:
        block = self._table.get(int(h[0]))
        if block is None or self._hash[block, 1] != h[1]:
            return None
        return block

    def _evict(self, block: int) -> None:
        del self._table[int(self._hash[block, 0])]
        self._hashed[block] = False

    def check_integrity(self) -> None:
        free = np.zeros(self.num_blocks, dtype=bool)
        free[list(self._free)] = True
        assert (self.ref >= 0).all(), "negative refcount"
        assert ((self.ref == 0) == free).all(), "free list and refcounts disagree"
        assert len(self._table) == int(self._hashed.sum()), "hash table and flags disagree"
        for key, block in self._table.items():
            assert self._hashed[block] and int(self._hash[block, 0]) == key, "stale table entry"
