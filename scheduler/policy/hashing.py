"""Prefix-cache block hashes: chained, keyed, 128-bit, vectorized over a whole prompt.

A block's hash names the KV of every token up to the end of that block, so equal hashes
must mean equal prefixes: a collision would hand one tenant's KV to another's request.
Hashes are keyed by a deployment secret (all ranks, pools, the router and the simulator
share it) and by a per-request ``cache_salt``.

The fast method ("keyed") works on 64-bit words (two int32 tokens each, little-endian):

    x_j   = xorshift32((w_j ^ T[j mod P]) * M[j div P])
                                              keyed bijection of word j: T holds P = 2**13
                                              secret keys and M one secret odd multiplier
                                              per period of P words, so no two absolute
                                              word positions share both
    a_i   = sum of the x_j of block i         two 64-bit lanes per block; lane b multiplies
    b_i   = sum of x_2j * x_2j+1 of block i   word pairs, so it is not a function of lane a
                                              (an odd last word adds x * (x >> 32))
    A_i   = salt + cumsum(a)_i, B_i likewise  the chain: a prefix sum over blocks
    u_i   = (A_i + i*K) * K1                  K, K1, K2 secret, K1 and K2 odd:
    H_i   = ((u_i ^ B_i) * K2, u_i)           a bijection of (A_i, B_i) for each i

Every step per word is non-linear in the tokens (a multiply-xorshift permutation keyed by
the absolute position), so the algebraic collisions of a polynomial hash (Thue-Morse strings
collide for every odd base mod 2**64) do not exist here, and moving a block changes every
later hash (two blocks at the same offset of different periods meet the same table key but
different multipliers). Two prefixes collide only if their 128-bit (A, B) do at the same
block index. Lane 0, which the block pool keys its table by, mixes both accumulators, so it
does not inherit a collision of lane A alone.

Cost, not security, shaped the rest. The key table repeats every P words, 64 KiB that stay
in cache: streaming a key per word, as long as the prompt, from memory made the hash 15%
slower. The lanes fold words by halving with strided adds. Each cache-sized chunk of the
prompt is mixed, folded, chained and finalized in reused buffers before the next is read:
about 15 numpy calls per 65K words and no Python loop per block, with admission's token-range
check riding along (``hash_prompt(vocab_size=...)``); an 855K-token prompt takes about
1.6 ms on one idle core here. Prompts of 512K tokens and more hash their two halves at once,
the second on a helper thread (``_hash_halves``). The finalization is four passes over
blocks, not fourteen: its multipliers are secret, so it needs no public avalanche mixer to
hide (A, B).
Method "sha256" chains ``sha256(secret, parent, block)`` per block for users who want a
cryptographic hash and can pay a Python loop per block.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .request import RequestError

_U64 = np.uint64
_M1 = _U64(0xBF58476D1CE4E5B9)
_M2 = _U64(0x94D049BB133111EB)
_S32 = _U64(32)
_S29 = _U64(29)
_S33 = _U64(33)
METHODS = ("keyed", "sha256")
# Part of the hash's definition: changing the period changes the hashes of long prompts.
_PERIOD_BITS = 13
_PERIOD = 1 << _PERIOD_BITS
_CHUNK_WORDS = 1 << 16  # words per pass of _hash_words, a multiple of _PERIOD
_PARALLEL_WORDS = 4 * _CHUNK_WORDS  # prompts of this many words (512K tokens) hash in two halves at once


class HashConfigError(ValueError):
    pass


_MASK = (1 << 64) - 1
_SCALAR_MAX = 4  # extend() on at most this many blocks uses Python ints


def _fmix(z: np.ndarray, mul: np.uint64) -> np.ndarray:
    z ^= z >> _S33
    z *= mul
    z ^= z >> _S29
    return z


def check_token_range(tokens: np.ndarray, vocab_size: int) -> None:
    """Raise RequestError unless every token id is in [0, vocab_size)."""
    if not _in_range(tokens, vocab_size):
        _raise_token_range(tokens, vocab_size)


def _in_range(tokens: np.ndarray, vocab_size: int) -> bool:
    """For int32 ids one pass, not a min and a max: a negative id read as uint32 is >= 2**31."""
    if not len(tokens):
        return True
    if tokens.dtype == np.int32:
        return int(tokens.view(np.uint32).max()) < vocab_size
    return int(tokens.min()) >= 0 and int(tokens.max()) < vocab_size


_HELPER: tuple[int, ThreadPoolExecutor] | None = None


def _helper() -> ThreadPoolExecutor:
    """The thread that hashes the second half of long prompts (one per process: a forked
    child makes its own)."""
    global _HELPER
    if _HELPER is None or _HELPER[0] != os.getpid():
        _HELPER = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="lockstep-hash"))
    return _HELPER[1]


def _raise_token_range(tokens: np.ndarray, vocab_size: int) -> None:
    """The error for the first id of ``tokens`` out of range."""
    bad = int(np.flatnonzero((tokens < 0) | (tokens >= vocab_size))[0])
    raise RequestError(f"prompt token ids must be in [0, {vocab_size}), got {int(tokens[bad])} "
                       f"at position {bad}", field="prompt")


class BlockHasher:
    """Hashes full blocks of a token sequence; see the module docstring for the scheme.

    ``hash_prompt`` returns ``(hashes, acc)``: hashes ``(n_full_blocks, 2)`` uint64 and the
    chain accumulator after the last full block (``(2,)``; the salt's starting value when
    there is none), which ``extend`` needs to hash the blocks decoding completes later.
    """

    def __init__(self, secret: bytes, block_size: int = 16, method: str = "keyed"):
        if block_size <= 0 or block_size % 2:
            raise HashConfigError(
                f"block_size must be a positive even number of tokens, got {block_size}"
            )
        if method not in METHODS:
            raise HashConfigError(f"hash method must be one of {METHODS}, got {method!r}")
        self.block_size = block_size
        self.method = method
        self._secret = hashlib.sha256(b"lockstep-prefix-v1" + bytes(secret)).digest()
        seed = int.from_bytes(self._secret[:16], "little")
        self._table = np.random.PCG64(seed).random_raw(_PERIOD).astype(np.uint64)
        consts = np.random.Generator(np.random.PCG64(seed ^ 0x5EED)).integers(
            1, 2**63, size=4, dtype=np.uint64
        )
        self._mul = consts | _U64(1)  # odd multipliers are bijections mod 2**64
        self._mul_ints = tuple(int(v) for v in self._mul[1:])  # K1, K2, K of the docstring
        self._period_base = _U64(int.from_bytes(self._secret[16:24], "little"))
        self._mults = self._mul[:1].copy()  # one per period of words; period 0 uses _mul[0]
        self._words_per_block = wpb = block_size // 2
        self._chunked = wpb >= 2 and not wpb & (wpb - 1)  # _hash_words halves blocks of words
        self._local = threading.local()
        self._init_unsalted = np.zeros(2, np.uint64)
        self._init_unsalted = self.initial(b"")

    # -- salts ---------------------------------------------------------------------------
    def initial(self, cache_salt: bytes | str | None = None) -> np.ndarray:
        """The chain's starting accumulator for a salt (shape (2,), uint64)."""
        if cache_salt is None:
            return self._init_unsalted.copy()
        salt = cache_salt.encode() if isinstance(cache_salt, str) else cache_salt
        digest = hashlib.sha256(self._secret + b"salt" + salt).digest()
        return np.frombuffer(digest[:16], dtype=np.uint64).copy()

    # -- whole prompts -------------------------------------------------------------------
    def hash_prompt(
        self, tokens: np.ndarray, cache_salt: bytes | str | None = None, *,
        vocab_size: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Hashes of the prompt's full blocks and the chain accumulator after them.

        ``vocab_size``: also check that every token id (the trailing partial block's too) is
        in [0, vocab_size), raising RequestError, inside the hashing pass rather than as
        another pass over the prompt.
        """
        if not isinstance(tokens, np.ndarray):
            tokens = np.asarray(tokens)
        bs = self.block_size
        n_blocks = len(tokens) // bs
        init = self.initial(cache_salt)
        fused = (vocab_size is not None and self.method == "keyed" and self._chunked
                 and tokens.dtype == np.int32)
        if vocab_size is not None:  # fused: _hash_words checks the full blocks as it goes
            if not _in_range(tokens[n_blocks * bs :] if fused else tokens, vocab_size):
                _raise_token_range(tokens, vocab_size)
        if n_blocks == 0:
            return np.empty((0, 2), dtype=np.uint64), init
        body = np.ascontiguousarray(tokens[: n_blocks * bs], dtype=np.int32)
        if self.method == "sha256":
            return self._sha256_chain(body.reshape(n_blocks, -1), init)
        words = body.view(np.uint64)
        if self._chunked:
            check = vocab_size if fused else None
            if len(words) >= _PARALLEL_WORDS:
                return self._hash_halves(words, init, check, tokens)
            return self._hash_words(words, init, check)
        # Blocks of an odd or non-power-of-two number of words: the same math, unchunked.
        a, b = self._block_lanes(self._mix(words, np.arange(len(words)), len(words) - 1))
        np.cumsum(a, out=a)
        np.cumsum(b, out=b)
        a += init[0]
        b += init[1]
        last = np.array([a[-1], b[-1]], dtype=np.uint64)
        return self._finalize(a, b, np.arange(n_blocks, dtype=np.uint64)), last

    def hash_prompts(self, prompts: list[np.ndarray],
                     acc_at: list[int] | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """``hash_prompt`` (unsalted) of many prompts in one pass: what a simulator admits
        next, without paying numpy's per-call cost once per prompt. ``acc_at``: per prompt,
        the number of leading blocks after which to report the accumulator (all of them by
        default): a simulator hashes a prompt together with the output it will generate, and
        admits the prompt alone."""
        if self.method == "sha256" or len(prompts) < 2:
            return [self._hash_upto(p, at) for p, at in zip(prompts, acc_at or [None] * len(prompts))]
        bs, wpb, init = self.block_size, self._words_per_block, self._init_unsalted
        nblk = np.array([len(p) // bs for p in prompts], dtype=np.int64)
        if not nblk.any():
            return [self.hash_prompt(p) for p in prompts]
        body = np.concatenate([np.asarray(p[: n * bs], dtype=np.int32) for p, n in zip(prompts, nblk.tolist())])
        first_block = np.cumsum(nblk) - nblk
        block_no = np.arange(int(nblk.sum())) - np.repeat(first_block, nblk)
        pos = (block_no[:, None] * wpb + np.arange(wpb)).ravel()  # words restart per prompt
        a, b = self._block_lanes(self._mix(body.view(np.uint64), pos, int(nblk.max()) * wpb - 1))
        np.cumsum(a, out=a)
        np.cumsum(b, out=b)
        # Each prompt's chain: the running sums since its first block (exact mod 2**64).
        before = np.flatnonzero(block_no == 0) - 1
        a -= np.repeat(np.where(before >= 0, a[before], _U64(0)), nblk[nblk > 0])
        b -= np.repeat(np.where(before >= 0, b[before], _U64(0)), nblk[nblk > 0])
        a += init[0]
        b += init[1]
        hashes = self._finalize(a, b, block_no.astype(np.uint64))
        out, lo = [], 0
        nl = nblk.tolist()
        for n, at in zip(nl, acc_at or nl):
            hi = lo + n
            last = np.array([a[lo + at - 1], b[lo + at - 1]], dtype=np.uint64) if at else init.copy()
            out.append((hashes[lo:hi] if n else np.empty((0, 2), dtype=np.uint64), last))
            lo = hi
        return out

    def _hash_upto(self, tokens: np.ndarray, at: int | None) -> tuple[np.ndarray, np.ndarray]:
        """``hash_prompt``, with the accumulator after the first ``at`` blocks."""
        hashes, acc = self.hash_prompt(tokens)
        if at is not None and at < len(hashes):
            acc = self.hash_prompt(tokens[: at * self.block_size])[1]
        return hashes, acc

    def extend(
        self, parent_acc: np.ndarray, blocks: np.ndarray, block_index: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Hash one more block for each of m chains at once.

        parent_acc: (m, 2) accumulators of each chain's previous block (``initial`` for the
        first); blocks: (m, block_size) int32 tokens; block_index: (m,) index of the block.
        """
        blocks = np.ascontiguousarray(blocks, dtype=np.int32)
        m = len(blocks)
        if self.method == "sha256":
            out_h = np.empty((m, 2), dtype=np.uint64)
            for r in range(m):
                h, _ = self._sha256_chain(blocks[r : r + 1], parent_acc[r])
                out_h[r] = h[0]
            return out_h, out_h.copy()  # for sha256 the accumulator is the hash itself
        if m <= _SCALAR_MAX:  # numpy's per-call cost dominates a few blocks: same math in ints
            return self._extend_ints(parent_acc, blocks, block_index)
        wpb = self._words_per_block
        pos = (block_index.astype(np.int64)[:, None] * wpb + np.arange(wpb)).ravel()
        max_pos = (int(block_index.max()) + 1) * wpb - 1
        a, b = self._block_lanes(self._mix(blocks.view(np.uint64).ravel(), pos, max_pos))
        acc = parent_acc.astype(np.uint64, copy=True)
        acc[:, 0] += a
        acc[:, 1] += b
        a, b = acc[:, 0].copy(), acc[:, 1].copy()
        return self._finalize(a, b, block_index.astype(np.uint64)), acc

    def extend_chain(
        self, parent_acc: np.ndarray, blocks: np.ndarray, first_index: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Hash m consecutive blocks of one chain: what m calls of ``extend`` would give,
        each from the accumulator the previous one returned.

        parent_acc: (2,) accumulator before block ``first_index``; blocks: (m, block_size).
        """
        blocks = np.ascontiguousarray(blocks, dtype=np.int32)
        m = len(blocks)
        if self.method == "sha256":
            out_h, _ = self._sha256_chain(blocks, parent_acc)
            return out_h, out_h.copy()
        wpb = self._words_per_block
        if m <= _SCALAR_MAX:
            pa, pb = parent_acc.tolist()
            rows = blocks.view(np.uint64).tolist()
            return self._chain_ints(pa, pb, rows, range(first_index, first_index + m))
        pos = np.arange(first_index * wpb, (first_index + m) * wpb)
        a, b = self._block_lanes(self._mix(blocks.view(np.uint64).ravel(), pos, int(pos[-1])))
        np.cumsum(a, out=a)
        np.cumsum(b, out=b)
        a += parent_acc[0]
        b += parent_acc[1]
        index = np.arange(first_index, first_index + m, dtype=np.uint64)
        return self._finalize(a, b, index), np.stack([a, b], axis=1)

    def _extend_ints(self, parent_acc, blocks, block_index) -> tuple[np.ndarray, np.ndarray]:
        """``extend`` in Python ints mod 2**64: bit-identical to the numpy path."""
        hashes = np.empty((len(blocks), 2), dtype=np.uint64)
        accs = np.empty((len(blocks), 2), dtype=np.uint64)
        for r, (words, i, (pa, pb)) in enumerate(
            zip(blocks.view(np.uint64).tolist(), block_index.tolist(), parent_acc.tolist())
        ):
            h, a = self._chain_ints(pa, pb, [words], (i,))
            hashes[r], accs[r] = h[0], a[0]
        return hashes, accs

    def _chain_ints(self, pa: int, pb: int, rows: list, indices) -> tuple[np.ndarray, np.ndarray]:
        """Blocks ``rows`` (lists of 64-bit words) chained from accumulator (pa, pb)."""
        wpb, mask = self._words_per_block, _MASK
        k1, k2, ki = self._mul_ints
        hashes, accs = [], []
        for words, i in zip(rows, indices):
            xs = []
            for w, key, m in zip(words, *self._word_keys(i * wpb, wpb)):
                x = ((w ^ key) * m) & mask
                xs.append(x ^ (x >> 32))
            b = sum(xs[j] * xs[j + 1] for j in range(0, wpb - 1, 2))
            if wpb % 2:
                b += xs[-1] * (xs[-1] >> 32)
            pa, pb = (pa + sum(xs)) & mask, (pb + b) & mask
            u = ((pa + i * ki) * k1) & mask
            hashes.append((((u ^ pb) * k2) & mask, u))
            accs.append((pa, pb))
        return np.array(hashes, dtype=np.uint64), np.array(accs, dtype=np.uint64)

    # -- internals -----------------------------------------------------------------------
    def _mults_upto(self, n_periods: int) -> np.ndarray:
        """The multipliers of the first ``n_periods`` periods of words (at least)."""
        if n_periods > len(self._mults):
            # A pure function of the period number, so growing (from any thread) keeps the
            # multipliers already handed out.
            c = np.arange(max(n_periods, 2 * len(self._mults), 64), dtype=np.uint64)
            more = _fmix(_fmix(self._period_base + c * _U64(0x9E3779B97F4A7C15), _M1), _M2)
            more |= _U64(1)
            more[0] = self._mul[0]
            self._mults = more
        return self._mults

    def _mix(self, words: np.ndarray, pos: np.ndarray, max_pos: int) -> np.ndarray:
        """x_j of the module docstring for ``words`` at absolute word positions ``pos`` (the
        largest is ``max_pos``)."""
        if max_pos < _PERIOD:  # one period: one multiplier, and no wrap of the key table
            x = words ^ self._table[pos]
            x *= self._mul[0]
        else:
            x = words ^ self._table[pos & (_PERIOD - 1)]
            x *= self._mults_upto((max_pos >> _PERIOD_BITS) + 1)[pos >> _PERIOD_BITS]
        x ^= x >> _S32
        return x

    def _word_keys(self, first: int, n: int) -> tuple[list[int], list[int]]:
        """Keys and multipliers of words first..first+n-1, as Python ints."""
        off, period = first & (_PERIOD - 1), first >> _PERIOD_BITS
        if off + n <= _PERIOD:  # the usual case: a block lies inside one period
            mult = int(self._mults_upto(period + 1)[period])
            return self._table[off : off + n].tolist(), [mult] * n
        pos = np.arange(first, first + n)
        mults = self._mults_upto(((first + n - 1) >> _PERIOD_BITS) + 1)
        return self._table[pos & (_PERIOD - 1)].tolist(), mults[pos >> _PERIOD_BITS].tolist()

    def _hash_halves(self, words: np.ndarray, init: np.ndarray, vocab_size: int | None,
                     tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``_hash_words`` of a long prompt in two halves at once: the second half on a
        helper thread (numpy lets go of the GIL inside each pass), its chain started from
        zero and its blocks left unfinalized, then shifted by the first half's accumulator
        (the chain is a sum) and finalized. An 855K-token prompt on this 2-core VM, 400 runs
        interleaved with the one-pass way: median 2.5 -> 2.1 ms (twice the CPU time: the
        cost is latency, not throughput)."""
        wpb = self._words_per_block
        split = len(words) // 2 // _CHUNK_WORDS * _CHUNK_WORDS  # a whole number of periods
        out = np.empty((len(words) // wpb, 2), np.uint64)
        k = split // wpb
        second = _helper().submit(self._hash_words, words[split:], np.zeros(2, np.uint64), vocab_size,
                                  base=split, out=out[k:], final=False)
        try:
            _, (pa, pb) = self._hash_words(words[:split], init, vocab_size, out=out[:k])
        except RequestError:
            try:
                second.result()
            except RequestError:
                pass
            raise
        try:
            _, (qa, qb) = second.result()
        except RequestError:
            _raise_token_range(tokens, vocab_size)  # the first bad id of the whole prompt
            raise
        rest = out[k:]
        z, b = rest[:, 1], rest[:, 0]  # A + i K and B of the second half, chained from zero
        np.add(z, pa, z)
        np.add(b, pb, b)
        np.multiply(z, self._mul[1], z)  # u, as _hash_words finalizes
        np.bitwise_xor(b, z, b)
        np.multiply(b, self._mul[2], b)
        return out, np.array([pa, pb], dtype=np.uint64) + np.array([qa, qb], dtype=np.uint64)

    def _hash_words(self, words: np.ndarray, init: np.ndarray, vocab_size: int | None, *, base: int = 0,
                    out: np.ndarray | None = None, final: bool = True):
        """``hash_prompt`` of whole blocks of 64-bit words, for blocks of 2**k >= 2 words.

        One chunk of the prompt at a time is mixed, checked, folded into lanes, chained and
        finalized into ``out`` in two reused buffers, so numpy's passes run from cache and
        touch no fresh pages. The views of those buffers that each pass reads and writes
        are made once per thread (``_Chunk``): with a few dozen numpy calls per chunk, making
        views was a third of the cost of a chunk.

        ``base``: the words' position in the prompt (a whole number of periods); ``final``
        False leaves each block as (B, A + i K), the chain unfinalized (``_hash_halves``).
        """
        wpb = self._words_per_block
        n_blocks = len(words) // wpb
        if out is None:
            out = np.empty((n_blocks, 2), np.uint64)
        h0_all, u_all = out[:, 0], out[:, 1]
        b0 = base // wpb
        mults = self._mults_upto(((base + len(words) - 1) >> _PERIOD_BITS) + 1)
        table, k1, k2, ki = self._table, self._mul[1], self._mul[2], self._mul_ints[2]
        xor, mul, add = np.bitwise_xor, np.multiply, np.add
        full, steps = self._scratch()
        pa, pb = init.tolist()
        for start in range(0, len(words), _CHUNK_WORDS):
            w = words[start : start + _CHUNK_WORDS]
            c = full if len(w) == _CHUNK_WORDS else _Chunk(full.x_buf, full.t_buf, len(w), wpb)
            at = base + start
            period, lo, hi = at >> _PERIOD_BITS, at // wpb, (at + len(w)) // wpb
            if c.periods:  # x = (w ^ T[j mod P]) * M[j div P], the table broadcast over periods
                xor(w[: c.full].reshape(c.periods, _PERIOD), table, c.x_periods)
                mul(c.x_periods, mults[period : period + c.periods, None], c.x_periods)
            if c.full < len(w):
                xor(w[c.full :], table[: len(c.x_rest)], c.x_rest)
                mul(c.x_rest, mults[period + c.periods], c.x_rest)
            if vocab_size is not None and int(w.view(np.uint32).max()) >= vocab_size:
                _raise_token_range(words.view(np.int32), vocab_size)
            xor(c.x_lo, c.x_hi, c.x_lo)  # x ^= x >> 32
            add(c.x_even, c.x_odd, c.sums)
            mul(c.x_even, c.x_odd, c.products)
            for even, odd, halves in c.halvings:
                add(even, odd, halves)
            a, b = c.a, c.b
            # The chain carried in from the previous chunk, and lo * K of the finalization's
            # A + i * K riding along (i * K = lo * K + (i - lo) * K): a pass saved.
            a[0] = (int(a[0]) + pa + lo * ki) & _MASK
            b[0] = (int(b[0]) + pb) & _MASK
            np.add.accumulate(c.ab_int64, axis=1, out=c.ab_int64)  # int64 runs 2x faster here
            pa, pb = (int(a[-1]) - lo * ki) & _MASK, int(b[-1])
            u, z = u_all[lo - b0 : hi - b0], c.z  # finalize: see _finalize
            if not final:
                add(a, steps[: hi - lo], u)
                h0_all[lo - b0 : hi - b0] = b
                continue
            add(a, steps[: hi - lo], z)
            mul(z, k1, u)
            xor(u, b, z)
            mul(z, k2, h0_all[lo - b0 : hi - b0])
        return out, np.array([pa, pb], dtype=np.uint64)

    def _scratch(self) -> tuple[_Chunk, np.ndarray]:
        """Buffers and views for ``_hash_words``'s full chunks, one set per thread (the
        engine hashes in workers), and (i - lo) * K for the blocks of a chunk."""
        local = self._local
        if not hasattr(local, "chunk"):
            buf = np.empty(_CHUNK_WORDS, np.uint64), np.empty(_CHUNK_WORDS, np.uint64)
            local.chunk = _Chunk(*buf, _CHUNK_WORDS, self._words_per_block)
            local.steps = np.arange(len(local.chunk.z), dtype=np.uint64) * self._mul[3]
        return local.chunk, local.steps

    def _block_lanes(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-block lane sums of the mixed words x (whole blocks, flat)."""
        wpb = self._words_per_block
        if wpb & (wpb - 1) or wpb < 2:  # not a power of two: the same sums, by a slower path
            w = x.reshape(-1, wpb)
            pairs = w[:, : wpb - wpb % 2].reshape(len(w), -1, 2)
            b = (pairs[:, :, 0] * pairs[:, :, 1]).sum(axis=1, dtype=np.uint64)
            if wpb % 2:  # an odd last word pairs with itself shifted, so it still counts
                b += w[:, -1] * (w[:, -1] >> _S32)
            return w.sum(axis=1, dtype=np.uint64), b
        a = x[0::2] + x[1::2]  # halving with strided adds beats reshape(-1, 8).sum(axis=1) 4x
        b = x[0::2] * x[1::2]
        while len(a) > len(x) // wpb:
            a = a[0::2] + a[1::2]
            b = b[0::2] + b[1::2]
        return a, b

    def _finalize(self, a: np.ndarray, b: np.ndarray, index: np.ndarray) -> np.ndarray:
        """(A, B, i) -> the 128-bit hash H of the module docstring, shape (len(a), 2)."""
        u = (a + index * self._mul[3]) * self._mul[1]
        return np.stack([(u ^ b) * self._mul[2], u], axis=1)

    def _sha256_chain(self, blocks: np.ndarray, init: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = np.empty((len(blocks), 2), dtype=np.uint64)
        parent = init.tobytes()
        for i, block in enumerate(blocks):
            parent = hashlib.sha256(self._secret + parent + block.tobytes()).digest()[:16]
            out[i] = np.frombuffer(parent, dtype=np.uint64)
        return out, (out[-1].copy() if len(out) else init)


class _Chunk:
    """Views into two scratch buffers for hashing a chunk of n words, wpb words a block:
    x, then [pair sums | pair products] of x in t, halved in turn into x and t until
    [a | b] holds one sum per block, leaving the other buffer's head as scratch z."""

    def __init__(self, x_buf: np.ndarray, t_buf: np.ndarray, n: int, wpb: int):
        k = n // wpb
        self.x_buf, self.t_buf = x_buf, t_buf
        self.x, self.t = x_buf[:n], t_buf[:n]
        self.periods, self.full = n >> _PERIOD_BITS, (n >> _PERIOD_BITS) << _PERIOD_BITS
        self.x_periods = self.x[: self.full].reshape(self.periods, _PERIOD)
        self.x_rest = self.x[self.full :]
        self.x_even, self.x_odd = self.x[0::2], self.x[1::2]
        halves = self.x.view(np.uint32)  # x ^= x >> 32 is lo ^= hi (little-endian, as the
        # words themselves are): one pass, not two
        self.x_lo, self.x_hi = halves[0::2], halves[1::2]
        self.sums, self.products = self.t[: n // 2], self.t[n // 2 :]
        # Halving in place would make numpy copy its overlapping input first: ping-pong.
        self.halvings, src, dst, length = [], self.t, self.x, n
        while length > 2 * k:
            length //= 2
            self.halvings.append((src[0 : 2 * length : 2], src[1 : 2 * length : 2], dst[:length]))
            src, dst = dst, src
        self.ab = src[: 2 * k].reshape(2, k)
        self.a, self.b = self.ab
        self.ab_int64 = self.ab.view(np.int64)  # the same bits: adds wrap alike mod 2**64
        self.z = dst[:k]

