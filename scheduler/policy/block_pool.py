"""KV block pool with a prefix cache: refcounts, a hash table, LRU eviction of free blocks.

Invariants (``check_integrity``):
- a block is on the free list exactly when its refcount is 0;
- every cached hash maps to a block that carries that hash, and a block carries a hash only
  while it is in the table (free blocks keep theirs until they are evicted: that is the cache);
- free blocks are evicted least recently freed first; blocks without a hash go to the front,
  since nothing is lost by reusing them.
Lookups key the table by the first 64-bit lane and check the second, so a 128-bit hash costs
one Python int per block.

A caller that knows no other request will ever look a block's hash up (the simulator knows
its whole workload: see ``Request.private_prefix``) publishes it unindexed: the block carries
its hash (it is evicted like any cached block, and offloaded to the host tier), but it is not
in the table, which spares two dict operations on a table too large for the CPU's caches.
Where no host tier reads hashes either, such a block is published before the pool is told
its hash (``cache_unhashed``; ``fill_hashes`` gives it). ``index`` enters such blocks when
that knowledge lapses (their request is preempted and will look its own blocks up).
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

_SMALL = 8  # allocations up to this many blocks take the Python path


class HostTier:
    """A second prefix-cache level in host memory: which block hashes it holds, in LRU order.

    The bytes live with the runtime; the policy only needs to know what a load would find.
    GPU blocks evicted from the prefix cache are offloaded here.
    """

    def __init__(self, capacity_blocks: int):
        self.capacity = capacity_blocks
        self._lru: OrderedDict[int, int] = OrderedDict()  # lane 0 -> lane 1

    def __len__(self) -> int:
        return len(self._lru)

    def put(self, lane0: list[int], lane1: list[int]) -> None:
        lru = self._lru
        if len(lane0) > 1 and lru.keys().isdisjoint(lane0) and len(set(lane0)) == len(lane0):
            lru.update(zip(lane0, lane1))  # all new: appended in order, as one at a time
        else:
            for k, v in zip(lane0, lane1):
                lru[k] = v
                lru.move_to_end(k)
        pop = lru.popitem
        for _ in range(len(lru) - self.capacity):
            pop(last=False)

    def match(self, hashes: np.ndarray, *, touch: bool = True) -> int:
        """How many leading blocks of ``hashes`` the tier holds."""
        lru = self._lru
        if not len(hashes) or lru.get(hashes.item(0, 0)) != hashes.item(0, 1):
            return 0  # the usual miss (routing asks every rank): no rows to convert
        n = 0
        while n < len(hashes):  # in chunks: a short match converts a short slice only
            chunk = hashes[n : n + 64]
            for k, v in zip(chunk[:, 0].tolist(), chunk[:, 1].tolist()):
                if lru.get(k) != v:
                    return n
                if touch:
                    lru.move_to_end(k)
                n += 1
        return n


_FIRST_CAPACITY = 1024  # blocks the per-block arrays start with; they double as blocks are first used


class BlockPool:
    """Blocks never used yet take no memory: the per-block arrays cover the blocks handed
    out so far (``_fresh`` of them, ids 0 up) and grow by doubling, so a simulated rack of
    many ranks with millions of KV blocks each costs what its requests touch."""

    def __init__(self, num_blocks: int, *, enable_prefix_cache: bool = True, host_blocks: int = 0):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_cache = enable_prefix_cache
        cap = min(num_blocks, _FIRST_CAPACITY)
        self.ref = np.zeros(cap, dtype=np.int32)  # refcounts of blocks 0 .. capacity - 1 (0 above)
        self._hash = np.zeros((cap, 2), dtype=np.uint64)
        self._hashed = np.zeros(cap, dtype=bool)
        self._table: dict[int, int] = {}
        self._unindexed = np.zeros(cap, dtype=bool)  # hashed, but not in the table
        self._n_unindexed = 0
        # Free blocks without a hash: a stack (reused first, most recently freed on top),
        # above the blocks never used, which come next in id order (ids ``_fresh`` up).
        self._stack = np.zeros(cap, dtype=np.int64)
        self._n_stack = 0
        self._fresh = 0
        # Free blocks with a hash: a FIFO ring in free order. A touched block leaves it
        # lazily: its entry stays but no longer matches ``_ring_pos``.
        self._ring = np.zeros(2 * cap + 16, dtype=np.int64)
        self._head = self._tail = 0
        self._ring_pos = np.full(cap, -1, dtype=np.int64)
        self._n_ring = 0
        self.host = HostTier(host_blocks) if host_blocks and enable_prefix_cache else None

    def _take_fresh(self, n: int) -> range:
        """The next n never-used block ids, the per-block arrays grown to hold them."""
        lo, hi = self._fresh, self._fresh + n
        if hi > len(self.ref):
            self._grow(min(max(hi, 2 * len(self.ref)), self.num_blocks))
        self._fresh = hi
        return range(lo, hi)

    def _grow(self, cap: int) -> None:
        old = len(self.ref)

        def grown(a: np.ndarray, fill=0) -> np.ndarray:
            out = np.full((cap, *a.shape[1:]), fill, dtype=a.dtype)
            out[:old] = a
            return out

        self.ref, self._hash, self._hashed = grown(self.ref), grown(self._hash), grown(self._hashed)
        self._unindexed, self._stack = grown(self._unindexed), grown(self._stack)
        self._ring_pos = grown(self._ring_pos, -1)
        live = self._live_ring()  # the ring, compacted into its new room
        self._ring = np.zeros(2 * cap + 16, dtype=np.int64)
        self._ring[: len(live)] = live
        self._ring_pos[live] = np.arange(len(live))
        self._head, self._tail = 0, len(live)

    def refcounts(self) -> np.ndarray:
        """Every block's refcount (num_blocks of them: for checks, not the hot path)."""
        out = np.zeros(self.num_blocks, dtype=np.int32)
        out[: len(self.ref)] = self.ref
        return out

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, including cached-but-unused ones)."""
        return self._n_stack + self._n_ring + self.num_blocks - self._fresh

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def match_prefix(self, hashes: np.ndarray, hint: list[int] | None = None) -> list[int]:
        """Block ids holding the longest cached prefix of ``hashes`` ((n, 2) uint64).

        ``hint``: what an earlier call on this pool returned for the same hashes. It is checked in one
        vector pass and the search goes on from where it stops holding, so a request that
        waits at the head of the queue does not redo 53K dict lookups every step.
        """
        if not self.enable_prefix_cache or len(hashes) == 0:
            return []
        found: list[int] = []
        if hint:
            h = np.asarray(hint[: len(hashes)], dtype=np.int64)
            # Found only as the table would find it: an unindexed block's hash may be stale
            # (published unhashed by a later owner, it keeps the one it had), so it must not count.
            ok = self._hashed[h] & ~self._unindexed[h] & (self._hash[h] == hashes[: len(h)]).all(axis=1)
            found = hint[: len(h) if ok.all() else int(np.argmin(ok))]
        table, n = self._table, len(found)
        if n < len(hashes) and hashes.item(n, 0) not in table:  # the usual miss: no slice to convert
            return found
        while n < len(hashes):  # in chunks: a short match converts a short slice only
            chunk = hashes[n : n + 64]
            for key, lane1 in zip(chunk[:, 0].tolist(), chunk[:, 1].tolist()):
                block = table.get(key)
                if block is None or self._hash.item(block, 1) != lane1:
                    return found
                found.append(block)
            n += len(chunk)
        return found

    def match_host(self, hashes: np.ndarray, start: int, *, touch: bool = False) -> int:
        """Blocks after the first ``start`` that the host tier can load (a query unless
        ``touch``: only an admission marks them recently used)."""
        if self.host is None or start >= len(hashes):
            return 0
        return self.host.match(hashes[start:], touch=touch)

    def cached_prefix_len(self, hashes: np.ndarray) -> int:
        """Length of the cached prefix in blocks, GPU then host tier (for routing)."""
        if not self.enable_prefix_cache:
            return 0
        gpu = self._gpu_prefix_len(hashes)
        if self.host is None or gpu == len(hashes):
            return gpu
        return gpu + self.host.match(hashes[gpu:], touch=False)

    def _gpu_prefix_len(self, hashes: np.ndarray) -> int:
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
        """Take n free blocks: unhashed ones first, then cached ones least recently freed."""
        if n > self.num_free:
            raise RuntimeError(f"allocate({n}) with only {self.num_free} free blocks")
        if n <= _SMALL:  # a decode's block or two: numpy's per-call cost would dominate
            return self._allocate_small(n)
        take = min(n, self._n_stack)
        out = self._stack[self._n_stack - take : self._n_stack][::-1]
        self._n_stack -= take
        fresh = min(n - take, self.num_blocks - self._fresh)
        if fresh:
            got = self._take_fresh(fresh)
            out = np.concatenate([out, np.arange(got.start, got.stop, dtype=np.int64)])
        if take + fresh < n:
            out = np.concatenate([out, self._pop_ring(n - take - fresh)])
        self.ref[out] = 1
        return out.tolist()

    def _allocate_small(self, n: int) -> list[int]:
        """``allocate`` one block at a time in Python: the same blocks in the same order."""
        out, stack = [], self._stack
        while len(out) < n and self._n_stack:
            self._n_stack -= 1
            out.append(stack.item(self._n_stack))
        if len(out) < n and self._fresh < self.num_blocks:
            out += self._take_fresh(min(n - len(out), self.num_blocks - self._fresh))
        ref = self.ref  # (after any growth)
        if len(out) < n:
            ring, ring_pos, hashes, hashed = self._ring, self._ring_pos, self._hash, self._hashed
            table, head, unindexed = self._table, self._head, self._unindexed
            while len(out) < n:  # skips entries touched since they were freed, as _pop_ring
                b = ring.item(head)
                if ring_pos.item(b) == head:
                    ring_pos[b] = -1
                    self._n_ring -= 1
                    lane0 = hashes.item(b, 0)
                    if unindexed.item(b):
                        unindexed[b] = False
                        self._n_unindexed -= 1
                    else:
                        del table[lane0]
                    if self.host is not None:
                        self.host.put([lane0], [hashes.item(b, 1)])
                    hashed[b] = False
                    out.append(b)
                head += 1
            self._head = head
        for b in out:
            ref[b] = 1
        return out

    def _pop_ring(self, n: int) -> np.ndarray:
        parts, got = [], 0
        while got < n:
            hi = min(self._head + (n - got), self._tail)
            chunk = self._ring[self._head : hi]
            live = chunk[self._ring_pos[chunk] == np.arange(self._head, hi)]
            self._head = hi
            parts.append(live)
            got += len(live)
        out = np.concatenate(parts) if len(parts) > 1 else parts[0]
        self._ring_pos[out] = -1
        self._n_ring -= len(out)
        indexed = out
        if self._n_unindexed:
            unindexed = self._unindexed.take(out)
            n_unindexed = np.count_nonzero(unindexed)
            if n_unindexed:
                indexed = out[~unindexed]
                self._unindexed[out] = False
                self._n_unindexed -= n_unindexed
        if len(indexed):
            deque(map(self._table.__delitem__, self._hash[indexed, 0].tolist()), maxlen=0)  # a loop in C
        if self.host is not None:  # offload what the GPU cache drops
            self.host.put(self._hash[out, 0].tolist(), self._hash[out, 1].tolist())
        self._hashed[out] = False
        return out

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks found by ``match_prefix``."""
        if not blocks:
            return
        idx = np.asarray(blocks, dtype=np.int64)
        idle = np.unique(idx[self.ref[idx] == 0])  # a block listed twice leaves the ring once
        self._ring_pos[idle] = -1  # leave the ring lazily
        self._n_ring -= len(idle)
        np.add.at(self.ref, idx, 1)  # counts every occurrence, unlike ref[idx] += 1

    def free(self, blocks: list[int], *, distinct: bool = False) -> None:
        """Drop one reference on each block; pass a request's blocks tail first
        (``distinct``: the caller knows no block is listed twice, as in a request's table)."""
        if not blocks:
            return
        idx = np.array(blocks, dtype=np.int64)
        ref = self.ref
        if distinct or len(set(blocks)) == len(blocks):  # ufunc.at is slow, not needed
            left = ref.take(idx)
            left -= 1
            ref[idx] = left
            zero = idx[left == 0] if left.any() else idx
        else:
            np.subtract.at(ref, idx, 1)  # counts every occurrence, unlike ref[idx] -= 1
            zero = idx[ref[idx] == 0]
            if len(zero) > 1 and len(np.unique(zero)) < len(zero):  # keep the first of repeats
                zero = np.asarray(list(dict.fromkeys(zero.tolist())), dtype=np.int64)
        hashed = self._hashed.take(zero)
        n_hashed = np.count_nonzero(hashed)
        if n_hashed < len(zero):
            plain = zero[~hashed] if n_hashed else zero
            self._stack[self._n_stack : self._n_stack + len(plain)] = plain
            self._n_stack += len(plain)
        if n_hashed:
            self._push_ring(zero[hashed] if n_hashed < len(zero) else zero)

    def _push_ring(self, blocks: np.ndarray) -> None:
        n = len(blocks)
        if self._tail + n > len(self._ring):
            live = self._live_ring()
            self._ring[: len(live)] = live
            self._ring_pos[live] = np.arange(len(live))
            self._head, self._tail = 0, len(live)
        tail = self._tail
        self._ring[tail : tail + n] = blocks
        self._ring_pos[blocks] = np.arange(tail, tail + n)
        self._tail = tail + n
        self._n_ring += n

    def cache(self, blocks: list[int], hashes: np.ndarray, *, index: bool = True) -> None:
        """Publish full blocks under their hashes; a hash already present keeps its block.
        ``index=False``: nobody else will look these hashes up, so none is present and the
        blocks need not enter the table (see the module docstring)."""
        if not self.enable_prefix_cache or not blocks:
            return
        if not index:
            self._cache_unindexed(blocks, hashes)
            return
        if len(blocks) == 1:  # a block closed by decoding: the same rules, without numpy
            block, key = blocks[0], int(hashes[0, 0])
            if not self._hashed[block] and key not in self._table:
                self._table[key] = block
                self._hash[block] = hashes[0]
                self._hashed[block] = True
            return
        idx = np.array(blocks, dtype=np.int64)
        open_ = ~self._hashed.take(idx)
        if np.count_nonzero(open_) < len(idx):
            idx, hashes = idx[open_], hashes[open_]
        keys, ids = hashes[:, 0].tolist(), idx.tolist()
        # One lookup per key, in a loop in C: an open block is in no table entry, so
        # setdefault returns it only where it took the key (a key already present, or
        # repeated in this batch, keeps its first block).
        got = list(map(self._table.setdefault, keys, ids))
        if got != ids:
            keep = [g == b for g, b in zip(got, ids)]
            idx, hashes = idx[keep], hashes[keep]
        self._hash[idx] = hashes
        self._hashed[idx] = True

    def _cache_unindexed(self, blocks: list[int], hashes: np.ndarray | None) -> None:
        """Mark the open ones of ``blocks`` cached but out of the table, with ``hashes``
        (None: given later, by ``fill_hashes``)."""
        if len(blocks) == 1:
            block = blocks[0]
            if not self._hashed.item(block):
                if hashes is not None:
                    self._hash[block] = hashes[0]
                self._hashed[block] = True
                self._unindexed[block] = True
                self._n_unindexed += 1
            return
        idx = np.array(blocks, dtype=np.int64)
        open_ = ~self._hashed.take(idx)
        if np.count_nonzero(open_) < len(idx):
            idx = idx[open_]
            hashes = None if hashes is None else hashes[open_]
        if hashes is not None:
            self._hash[idx] = hashes
        self._hashed[idx] = True
        self._unindexed[idx] = True
        self._n_unindexed += len(idx)

    def cache_unhashed(self, blocks: list[int]) -> None:
        """Publish full blocks unindexed before their hashes are given (``fill_hashes``),
        where nobody reads them meanwhile: as ``cache(index=False)`` does with them."""
        if self.enable_prefix_cache and blocks:
            self._cache_unindexed(blocks, None)

    def fill_hashes(self, blocks: list[int], hashes: np.ndarray) -> None:
        """The hashes of blocks published with ``cache_unhashed`` (others keep theirs)."""
        if not self.enable_prefix_cache or not blocks:
            return
        idx = np.asarray(blocks, dtype=np.int64)
        mine = self._hashed[idx] & self._unindexed[idx]
        self._hash[idx[mine]] = hashes[mine]

    def index(self, blocks: list[int]) -> None:
        """Enter the unindexed hashed blocks among ``blocks`` into the table (their hashes
        are in no other block: nobody else was to look them up)."""
        if not self._n_unindexed or not blocks:
            return
        idx = np.asarray(blocks, dtype=np.int64)
        idx = idx[self._unindexed[idx]]
        if len(idx):
            self._table.update(zip(self._hash[idx, 0].tolist(), idx.tolist()))
            self._unindexed[idx] = False
            self._n_unindexed -= len(idx)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (free cached blocks become plain free blocks)."""
        live = self._live_ring()
        self._ring_pos[live] = -1
        self._n_ring = 0
        self._head = self._tail = 0
        self._stack[self._n_stack : self._n_stack + len(live)] = live
        self._n_stack += len(live)
        self._table.clear()
        self._hashed[:] = False
        self._unindexed[:] = False
        self._n_unindexed = 0

    # -- internals -----------------------------------------------------------------------
    def _lookup(self, h: np.ndarray) -> int | None:
        block = self._table.get(int(h[0]))
        if block is None or self._hash[block, 1] != h[1]:
            return None
        return block

    def _live_ring(self) -> np.ndarray:
        """The ring's entries that still stand for a free cached block, oldest first."""
        live = self._ring[self._head : self._tail]
        return live[self._ring_pos[live] == np.arange(self._head, self._tail)]

    def free_blocks(self) -> np.ndarray:
        """The free blocks in reuse order from the last: the stack bottom up (the never-used
        blocks below the freed ones), then the cached ones."""
        never = np.arange(self.num_blocks - 1, self._fresh - 1, -1, dtype=np.int64)
        return np.concatenate([never, self._stack[: self._n_stack], self._live_ring()])

    def check_integrity(self) -> None:
        free_list = self.free_blocks()
        assert len(np.unique(free_list)) == len(free_list), "a block is free twice"
        free = np.zeros(self.num_blocks, dtype=bool)
        free[free_list] = True
        refs = self.refcounts()
        assert (refs >= 0).all(), "negative refcount"
        assert ((refs == 0) == free).all(), "free list and refcounts disagree"
        assert not self.ref[self._fresh :].any() and not self._hashed[self._fresh :].any(), "a never-used block in use"
        assert not self._hashed[self._stack[: self._n_stack]].any(), "hashed block on the plain stack"
        assert not (self._unindexed & ~self._hashed).any(), "an unindexed block without a hash"
        assert self._n_unindexed == int(self._unindexed.sum()), "unindexed count out of date"
        assert len(self._table) == int((self._hashed & ~self._unindexed).sum()), "hash table and flags disagree"
        for key, block in self._table.items():
            assert self._hashed[block] and not self._unindexed[block], "stale table entry"
            assert int(self._hash[block, 0]) == key, "stale table entry"
