"""BlockHasher: chained 128-bit prefix hashes; equal prefixes hash equal, nothing else does."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.policy import hashing
from lockstep.policy.hashing import _PERIOD, BlockHasher, HashConfigError
from lockstep.policy.request import RequestError

BS = 16
METHODS = ("keyed", "sha256")


def tokens_strategy(min_size=0, max_size=200):
    return st.lists(st.integers(0, 2**31 - 1), min_size=min_size, max_size=max_size).map(
        lambda xs: np.asarray(xs, dtype=np.int32)
    )


def rows(h: np.ndarray) -> list[tuple[int, int]]:
    return [tuple(r) for r in h.tolist()]


# --- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [0, -2, 1, 3, 15, 17])
def test_bad_block_size_raises(block_size):
    with pytest.raises(HashConfigError, match="block_size"):
        BlockHasher(b"k", block_size)


def test_unknown_method_raises():
    with pytest.raises(HashConfigError, match="method"):
        BlockHasher(b"k", 16, method="md5")


@pytest.mark.parametrize("method", METHODS)
def test_shapes_and_partial_blocks(method):
    h = BlockHasher(b"k", BS, method=method)
    for n in (0, 1, 15):
        hashes, acc = h.hash_prompt(np.arange(n, dtype=np.int32), "salt")
        assert hashes.shape == (0, 2)
        assert (acc == h.initial("salt")).all()  # no full block: the chain's start
    hashes, acc = h.hash_prompt(np.arange(16 * 3 + 5, dtype=np.int32))
    assert hashes.shape == (3, 2) and acc.shape == (2,)
    assert hashes.dtype == acc.dtype == np.uint64
    # the trailing partial block changes neither the full blocks' hashes nor the accumulator
    h48, acc48 = h.hash_prompt(np.arange(48, dtype=np.int32))
    assert (hashes == h48).all() and (acc == acc48).all()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("block_size", [2, 6, 16, 32, 64])
def test_block_sizes_work(method, block_size):
    h = BlockHasher(b"k", block_size, method=method)
    toks = np.random.default_rng(0).integers(0, 2**31, block_size * 9, dtype=np.int32)
    hashes, _ = h.hash_prompt(toks)
    assert len(set(rows(hashes))) == 9
    again, _ = BlockHasher(b"k", block_size, method=method).hash_prompt(toks)
    assert (again == hashes).all()  # same secret, same hashes: deterministic across instances


# --- prefix properties -------------------------------------------------------------------------


@settings(deadline=None)
@given(
    data=st.data(),
    shared=tokens_strategy(max_size=120),
    method=st.sampled_from(METHODS),
    salt=st.sampled_from([None, "tenant-a", b"tenant-b"]),
)
def test_equal_prefixes_equal_hashes(data, shared, method, salt):
    tail_a = data.draw(tokens_strategy(max_size=80))
    tail_b = data.draw(tokens_strategy(max_size=80))
    a, b = np.concatenate([shared, tail_a]), np.concatenate([shared, tail_b])
    h = BlockHasher(b"secret", BS, method=method)
    ha, _ = h.hash_prompt(a, salt)
    hb, _ = h.hash_prompt(b, salt)
    common = len(shared) // BS
    assert (ha[:common] == hb[:common]).all()
    # past the first differing token, blocks differ
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    if len(diff):
        first = int(diff[0]) // BS
        m = min(len(ha), len(hb))
        assert (ha[:first] == hb[:first]).all()
        for i in range(first, m):
            assert tuple(ha[i]) != tuple(hb[i])


@settings(deadline=None)
@given(
    toks=tokens_strategy(min_size=BS, max_size=160),
    data=st.data(),
    method=st.sampled_from(METHODS),
)
def test_one_token_changes_its_block_and_all_later(toks, data, method):
    h = BlockHasher(b"secret", BS, method=method)
    n_full = len(toks) // BS * BS
    pos = data.draw(st.integers(0, n_full - 1))
    new = data.draw(st.integers(0, 2**31 - 1).filter(lambda v: v != int(toks[pos])))
    changed = toks.copy()
    changed[pos] = new
    before, _ = h.hash_prompt(toks)
    after, _ = h.hash_prompt(changed)
    blk = pos // BS
    assert (before[:blk] == after[:blk]).all()
    assert ((before[blk:] != after[blk:]).any(axis=1)).all()


@settings(deadline=None)
@given(toks=tokens_strategy(max_size=200), method=st.sampled_from(METHODS),
       salt=st.sampled_from([None, "s1", b"s2"]))
def test_extend_reproduces_hash_prompt(toks, method, salt):
    h = BlockHasher(b"secret", BS, method=method)
    hashes, acc = h.hash_prompt(toks, salt)
    n = len(hashes)
    blocks = toks[: n * BS].reshape(n, BS)
    # one block at a time, chaining the accumulator extend returns
    parent = h.initial(salt)
    accs = []
    for i in range(n):
        hi, ai = h.extend(parent[None], blocks[i : i + 1], np.array([i]))
        assert (hi[0] == hashes[i]).all()
        parent = ai[0]
        accs.append(parent)
        # hash_prompt of the prefix ends with the same accumulator
        assert (h.hash_prompt(toks[: (i + 1) * BS], salt)[1] == parent).all()
    assert (parent == acc).all()
    # all blocks at once: m chains in one call, each from its parent's accumulator
    if n:
        parents = np.stack([h.initial(salt)] + accs[:-1])
        hall, aall = h.extend(parents, blocks, np.arange(n))
        assert (hall == hashes).all() and (aall == np.stack(accs)).all()


@pytest.mark.parametrize("method", METHODS)
def test_extend_continues_a_prompt(method):
    """Blocks completed by decoding hash as if they had been part of the prompt."""
    h = BlockHasher(b"secret", BS, method=method)
    rng = np.random.default_rng(1)
    full = rng.integers(0, 50_000, BS * 12, dtype=np.int32)
    ref, ref_acc = h.hash_prompt(full, "salt")
    prompt = full[: BS * 5 + 3]
    hashes, parent = h.hash_prompt(prompt, "salt")
    assert (hashes == ref[:5]).all()
    for i in range(5, 12):
        hi, ai = h.extend(parent[None], full[i * BS : (i + 1) * BS][None], np.array([i]))
        assert (hi[0] == ref[i]).all()
        parent = ai[0]
    assert (parent == ref_acc).all()


@pytest.mark.parametrize("method", METHODS)
def test_secrets_and_salts_separate_hashes(method):
    toks = np.random.default_rng(2).integers(0, 1000, BS * 8, dtype=np.int32)
    base, _ = BlockHasher(b"secret", BS, method=method).hash_prompt(toks)
    other, _ = BlockHasher(b"secret2", BS, method=method).hash_prompt(toks)
    assert not set(rows(base)) & set(rows(other))
    h = BlockHasher(b"secret", BS, method=method)
    salted = {s: rows(h.hash_prompt(toks, s)[0]) for s in ("a", "b", "tenant-1")}
    groups = [set(rows(base))] + [set(v) for v in salted.values()]
    for i in range(len(groups)):
        for j in range(i + 1, len(groups)):
            assert not groups[i] & groups[j]
    # str and bytes name the same salt
    assert rows(h.hash_prompt(toks, b"a")[0]) == salted["a"]
    assert (h.initial("a") == h.initial(b"a")).all()
    assert not (h.initial("a") == h.initial("b")).all()


def test_methods_differ():
    toks = np.arange(BS * 4, dtype=np.int32)
    a, _ = BlockHasher(b"k", BS, method="keyed").hash_prompt(toks)
    b, _ = BlockHasher(b"k", BS, method="sha256").hash_prompt(toks)
    assert not set(rows(a)) & set(rows(b))


def test_hasher_state_does_not_leak_between_prompts():
    """Key arrays grow on demand; a long prompt first must not change a short one's hashes."""
    toks = np.random.default_rng(3).integers(0, 2**31, BS * 40, dtype=np.int32)
    fresh, _ = BlockHasher(b"k", BS).hash_prompt(toks)
    h = BlockHasher(b"k", BS)
    h.hash_prompt(np.zeros(BS * 200_000, dtype=np.int32))
    again, _ = h.hash_prompt(toks)
    assert (fresh == again).all()


def test_input_not_modified_and_dtype_independent():
    toks = np.arange(BS * 3, dtype=np.int32)
    copy = toks.copy()
    h = BlockHasher(b"k", BS)
    a, _ = h.hash_prompt(toks)
    assert (toks == copy).all()
    b, _ = h.hash_prompt(toks.astype(np.int64))
    assert (a == b).all()


# --- long prompts: chunks of the whole-prompt path, periods of the key table -------------------

BLOCKS_PER_PERIOD = _PERIOD * 2 // BS  # the key table repeats every _PERIOD words (2 tokens each)
LONG = 2 * (1 << 17) + 3 * 2 * _PERIOD + 5 * BS + 7  # chunks, whole periods, a part, a tail


@pytest.mark.parametrize("block_size", [4, 6, 16, 64])
def test_long_prompt_paths_agree(block_size):
    """hash_prompt's chunked pass, extend_chain's numpy pass and extend's Python ints give
    the same chain across chunk and key-period boundaries, for any split of the prompt."""
    h = BlockHasher(b"k", block_size)
    toks = np.random.default_rng(block_size).integers(0, 2**31, LONG, dtype=np.int32)
    hashes, acc = h.hash_prompt(toks, "s")
    n = len(hashes)
    blocks = toks[: n * block_size].reshape(n, block_size)
    again, accs = h.extend_chain(h.initial("s"), blocks, 0)
    assert (again == hashes).all() and (accs[-1] == acc).all()
    for i in np.random.default_rng(1).integers(1, n, 20).tolist() + [BLOCKS_PER_PERIOD]:
        one, one_acc = h.extend(accs[i - 1][None], blocks[i : i + 1], np.array([i]))
        assert (one[0] == hashes[i]).all() and (one_acc[0] == accs[i]).all()
    j = n // 3
    head, head_acc = h.hash_prompt(toks[: j * block_size + 1], "s")
    tail, _ = h.extend_chain(head_acc, blocks[j:], j)
    assert (np.concatenate([head, tail]) == hashes).all()
    prompts = [toks[:999], toks, toks[:70_000]]
    for got, want in zip(h.hash_prompts(prompts), prompts):
        ref, ref_acc = h.hash_prompt(want)
        assert (got[0] == ref).all() and (got[1] == ref_acc).all()


@pytest.mark.parametrize("block_size", [4, 16, 64])
def test_long_prompts_hash_in_two_halves_as_in_one(block_size, monkeypatch):
    """Prompts of _PARALLEL_WORDS words and more hash their second half on a helper thread,
    chained from zero and shifted after: the same hashes and accumulator as one pass, and a
    bad id in either half is reported at its position in the whole prompt."""
    n = 2 * 2 * hashing._PARALLEL_WORDS + 3 * 2 * _PERIOD + 5 * block_size + 7  # an odd split, a tail
    h = BlockHasher(b"k", block_size)
    toks = np.random.default_rng(block_size).integers(0, VOCAB, n, dtype=np.int32)
    got = h.hash_prompt(toks, "s", vocab_size=VOCAB)
    for where in (n // 4, n - 3 * block_size):  # the first half, the second
        bad = toks.copy()
        bad[where] = VOCAB
        with pytest.raises(RequestError, match=rf"got {VOCAB} at position {where}"):
            h.hash_prompt(bad, vocab_size=VOCAB)
    monkeypatch.setattr(hashing, "_PARALLEL_WORDS", 1 << 62)
    want = h.hash_prompt(toks, "s", vocab_size=VOCAB)
    assert (got[0] == want[0]).all() and (got[1] == want[1]).all()


def test_block_swap_across_key_periods_changes_later_hashes():
    """Blocks at the same offset of two key periods share their table keys, not their
    multiplier: swapping them must still change every later hash (a per-period key without
    it would leave the sums, and so the hashes after both blocks, unchanged)."""
    h = BlockHasher(b"k", BS)
    n = 3 * BLOCKS_PER_PERIOD * BS + 40
    toks = np.random.default_rng(4).integers(0, 2**31, n, dtype=np.int32)
    per = BLOCKS_PER_PERIOD
    for j, far in [(5, 5 + per), (0, 2 * per), (7, 8 + per)]:
        swapped = toks.copy()
        a, b = slice(j * BS, (j + 1) * BS), slice(far * BS, (far + 1) * BS)
        swapped[a], swapped[b] = toks[b], toks[a]
        before, _ = h.hash_prompt(toks)
        after, _ = h.hash_prompt(swapped)
        assert (before[:j] == after[:j]).all()
        assert (before[j:] != after[j:]).any(axis=1).all()


def test_no_collisions_across_key_periods():
    """Long prompts whose content repeats with the key table's period (so equal blocks meet
    equal table keys), shifted by a block, or with blocks swapped across periods."""
    h = BlockHasher(b"collision-test", BS)
    rng = np.random.default_rng(5)
    period_toks = BLOCKS_PER_PERIOD * BS
    parts = []
    for g in range(24):
        unit = rng.integers(0, 2**31 if g % 2 else 2, period_toks, dtype=np.int32)
        prompts = [np.tile(unit, 4), np.tile(unit[: period_toks - BS], 4),
                   np.tile(unit[: period_toks + BS // 2], 3)]
        swap = np.tile(unit, 3)
        swap[: BS], swap[period_toks : period_toks + BS] = unit[BS : 2 * BS], unit[:BS]
        prompts.append(swap)
        for i, p in enumerate(prompts):
            # a header block per prompt: prompts share nothing
            header = np.array([7000 + g, i] + [0] * (BS - 2), dtype=np.int32)
            parts.append(h.hash_prompt(np.concatenate([header, p]))[0])
    hashes = np.concatenate(parts)
    assert len(hashes) > 300_000
    _assert_unique_rows(hashes)


# --- the token-range check that rides along ----------------------------------------------------

VOCAB = 129_280
N_CHECK = BS * 9000 + 7


@pytest.mark.parametrize("where", [0, 17, BS * 5000 + 3, N_CHECK - 1])  # chunks, the tail
@pytest.mark.parametrize("bad", [VOCAB, 2**31 - 1, -1])
@pytest.mark.parametrize("block_size", [16, 6])
def test_vocab_size_rejects_ids_out_of_range(where, bad, block_size):
    h = BlockHasher(b"k", block_size)
    toks = np.random.default_rng(6).integers(0, VOCAB, N_CHECK, dtype=np.int32)
    toks[where] = bad
    message = rf"\[0, {VOCAB}\), got {bad} at position {where}"
    with pytest.raises(RequestError, match=message):
        h.hash_prompt(toks, vocab_size=VOCAB)


@pytest.mark.parametrize("method", METHODS)
def test_vocab_size_accepts_ids_in_range_and_changes_nothing(method):
    h = BlockHasher(b"k", BS, method=method)
    n = N_CHECK if method == "keyed" else 1000
    toks = np.random.default_rng(7).integers(0, VOCAB, n, dtype=np.int32)
    toks[:2] = 0, VOCAB - 1
    checked, acc = h.hash_prompt(toks, "s", vocab_size=VOCAB)
    plain, plain_acc = h.hash_prompt(toks, "s")
    assert (checked == plain).all() and (acc == plain_acc).all()
    with pytest.raises(RequestError):
        h.hash_prompt(np.append(toks, VOCAB).astype(np.int32), vocab_size=VOCAB)


def test_vocab_size_checks_wide_ids_before_narrowing():
    """An int64 id of 2**32 + 5 would read as 5 once narrowed to int32: it must be refused."""
    h = BlockHasher(b"k", BS)
    toks = np.zeros(BS * 4, dtype=np.int64)
    toks[20] = 2**32 + 5
    with pytest.raises(RequestError, match="position 20"):
        h.hash_prompt(toks, vocab_size=VOCAB)


def test_misaligned_and_concurrent_prompts_hash_alike():
    """A prompt viewed at an odd int32 offset, and threads hashing at once (each has its own
    scratch buffers), give the hashes of a fresh contiguous copy."""
    import threading

    h = BlockHasher(b"k", BS)
    toks = np.random.default_rng(8).integers(0, VOCAB, 300_001, dtype=np.int32)
    want, want_acc = h.hash_prompt(toks[1:].copy(), "s")
    results = [None] * 4

    def work(i):
        results[i] = h.hash_prompt(toks[1:], "s", vocab_size=VOCAB)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, got_acc in results:
        assert (got == want).all() and (got_acc == want_acc).all()


# --- no collisions: 10 million blocks of random and structured content ---------------------------

PROMPT_BLOCKS = 512  # 8192 tokens: past the 2**11 tokens where Thue-Morse beats polynomial hashes
MEMBERS = 16
_TM = np.zeros(1, dtype=np.int32)
while len(_TM) < 1 << 21:
    _TM = np.concatenate([_TM, 1 - _TM])
BIG = np.int64(2**31 - 1)


def _family_bodies(family: str, g: int, rng: np.random.Generator, n: int) -> np.ndarray:
    """MEMBERS bodies of n tokens for group g; members often share long prefixes."""
    m = np.arange(MEMBERS)[:, None]
    pos = np.arange(n)[None, :]
    if family == "zeros":  # all zero, and single-token variants of it anywhere in the body
        body = np.zeros((MEMBERS, n), dtype=np.int64)
        where = rng.integers(0, n, MEMBERS)
        values = rng.choice(np.array([1, 2, 3, 2**31 - 1, 2**30, 65535]), MEMBERS)
        body[np.arange(1, MEMBERS), where[1:]] = values[1:]
        return body
    if family in ("tm01", "tm_big"):  # Thue-Morse windows and their complements
        offs = (g * MEMBERS + m // 2) * 4099 % ((1 << 21) - n)
        bits = _TM[offs + pos]
        bits = np.where(m % 2 == 1, 1 - bits, bits)
        lo, hi = (0, 1) if family == "tm01" else [(BIG, BIG - 1), (0x55555555, 0x2AAAAAAA)][g % 2]
        return np.where(bits == 1, hi, lo)
    if family == "ap":  # arithmetic progressions, including constants
        steps = np.array([0, 1, 2, 3, 16, 17, 255, 256, 65536, 2**20 + 1, 2**30, 2**30 + 1,
                          2**31 - 1, 7, 1 << 24, 12345])
        c = g % 1000
        return (c + steps[:, None] * pos) % (BIG + 1)
    if family == "pattern":  # short random patterns repeated; periods that do and don't divide BS
        periods = np.array([1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 100])
        out = np.empty((MEMBERS, n), dtype=np.int64)
        alphabet = 2 if g % 2 else 2**31
        for i, p in enumerate(periods):
            pat = rng.integers(0, alphabet, p)
            out[i] = np.resize(pat, n)
        return out
    if family == "swap":  # one random body, then copies with two blocks or two tokens swapped
        base = rng.integers(0, 2**31, n)
        out = np.tile(base, (MEMBERS, 1))
        nb = n // BS
        for i in range(1, MEMBERS):
            if i % 2:
                j = int(rng.integers(0, nb - 1))
                a, b = out[i, j * BS : (j + 1) * BS].copy(), out[i, (j + 1) * BS : (j + 2) * BS].copy()
                out[i, j * BS : (j + 1) * BS], out[i, (j + 1) * BS : (j + 2) * BS] = b, a
            else:
                j = int(rng.integers(0, n - 1))
                out[i, [j, j + 1]] = out[i, [j + 1, j]]
        return out
    if family == "random":
        return rng.integers(0, 2**31, (MEMBERS, n))
    raise AssertionError(family)


FAMILIES = ("zeros", "tm01", "tm_big", "ap", "pattern", "swap", "random")


def _shared_blocks(toks: np.ndarray, i: int) -> np.ndarray:
    """Full blocks member i shares with each earlier member (its place in the prompt trie)."""
    diff = toks[:i] != toks[i]
    first = np.where(diff.any(axis=1), diff.argmax(axis=1), toks.shape[1])
    return first // BS


def _collect_hashes(h: BlockHasher, n_blocks_target: int, seed: int) -> tuple[np.ndarray, int]:
    """Hashes of every distinct block prefix of MEMBERS-prompt groups of every family."""
    rng = np.random.default_rng(seed)
    n_body = (PROMPT_BLOCKS - 1) * BS
    parts, total, g = [], 0, 0
    while total < n_blocks_target:
        for fam_id, family in enumerate(FAMILIES):
            body = _family_bodies(family, g, rng, n_body)
            # a header block unique to (family, group): prompts of different groups share nothing
            header = np.zeros((MEMBERS, BS), dtype=np.int64)
            header[:, 0], header[:, 1] = 1000 + fam_id, g + 1
            toks = np.concatenate([header, body], axis=1).astype(np.int32)
            hashes = [h.hash_prompt(t)[0] for t in toks]
            parts.append(hashes[0])
            total += len(hashes[0])
            for i in range(1, MEMBERS):
                shared = _shared_blocks(toks, i)
                j = int(shared.argmax())
                lcp = int(shared[j])
                # blocks shared with an earlier prompt hash the same, and count once
                assert (hashes[j][:lcp] == hashes[i][:lcp]).all()
                parts.append(hashes[i][lcp:])
                total += len(hashes[i]) - lcp
        g += 1
    return np.concatenate(parts), total


def _assert_unique_rows(hashes: np.ndarray) -> None:
    """No two equal 128-bit rows. Sorting lane 0 alone is 40x faster than a lexsort of 10M
    rows; only rows whose lane 0 repeats need the second lane compared."""
    lane0 = hashes[:, 0]
    s = np.sort(lane0)
    repeated = np.unique(s[1:][s[1:] == s[:-1]])
    if len(repeated) == 0:
        return
    at = np.searchsorted(repeated, lane0).clip(max=len(repeated) - 1)
    sub = hashes[repeated[at] == lane0]
    sub = sub[np.lexsort((sub[:, 1], sub[:, 0]))]
    same = (sub[1:] == sub[:-1]).all(axis=1)
    assert not same.any(), f"{int(same.sum())} colliding 128-bit block hashes, e.g. {sub[1:][same][:3]}"


def test_assert_unique_rows_finds_duplicates():
    rows_ = np.array([[1, 2], [3, 4], [1, 5], [7, 8], [1, 2]], dtype=np.uint64)
    with pytest.raises(AssertionError, match="1 colliding"):
        _assert_unique_rows(rows_)
    _assert_unique_rows(rows_[:4])  # equal lane 0, different lane 1: no collision


@pytest.mark.slow
def test_no_collisions_in_10m_structured_blocks():
    h = BlockHasher(b"collision-test", BS)
    hashes, total = _collect_hashes(h, 10_000_000, seed=0)
    assert len(hashes) == total >= 10_000_000
    _assert_unique_rows(hashes)


def test_no_collisions_sha256_structured_blocks():
    h = BlockHasher(b"collision-test", BS, method="sha256")
    hashes, total = _collect_hashes(h, 20_000, seed=1)
    assert len(hashes) == total
    _assert_unique_rows(hashes)


def _high_bit_variants() -> np.ndarray:
    """Last-block hashes of 2-block zero prompts with token 2**30 at one odd position."""
    h = BlockHasher(b"k", BS)
    out = []
    for p in range(1, 2 * BS, 2):
        t = np.zeros(2 * BS, dtype=np.int32)
        t[p] = 2**30
        out.append(h.hash_prompt(t)[0][-1])
    return np.array(out)


def test_high_bit_edits_differ_in_128_bits():
    _assert_unique_rows(_high_bit_variants())


def test_lane0_separates_high_bit_edits():
    lane0 = _high_bit_variants()[:, 0]
    assert len(np.unique(lane0)) == len(lane0)


def test_thue_morse_pair_does_not_collide():
    """Thue-Morse and its complement collide in every polynomial hash mod 2**64 past 2**11."""
    h = BlockHasher(b"k", BS)
    for k in range(4, 16):
        n = 1 << k
        t = _TM[:n].astype(np.int32)
        a, _ = h.hash_prompt(t)
        b, _ = h.hash_prompt(1 - t)
        assert ((a != b).any(axis=1)).all()
