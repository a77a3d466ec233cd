"""Private prefixes change nothing but speed.

A request whose block hashes no other request shares (``Request.private_prefix``: the
simulator knows its whole workload) has its blocks cached unindexed: they carry their hashes
and are evicted and offloaded like any cached block, but stay out of the pool's table until
the request is preempted (it then looks its own blocks up). Scheduling, the free order and
every block's hash are the same as with every block indexed, and so is a whole simulation.
"""

from pathlib import Path

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_core import FAST, Spec, check_outcome, drive, same_schedule, workloads

from lockstep.policy.block_pool import BlockPool
from lockstep.policy.config import SchedulerConfig
from lockstep.policy.deployment_file import load_deployment
from lockstep.policy.hashing import BlockHasher
from lockstep.sim import prompts as prompts_module
from lockstep.sim.simulator import Simulator
from lockstep.sim.traces import TraceRequest, read_trace

ROOT = Path(__file__).parents[1]
DATA = Path(__file__).parent / "data"


def H(*names: int) -> np.ndarray:
    return np.array([[k + 1, 1000 + k] for k in names], dtype=np.uint64).reshape(-1, 2)


def hashed_blocks(pool: BlockPool) -> dict[int, tuple[int, int]]:
    """Every hashed block's hash: the table the pool would keep with every block indexed."""
    return {b: (int(pool._hash[b, 0]), int(pool._hash[b, 1])) for b in np.flatnonzero(pool._hashed).tolist()}


def same_cache(private: BlockPool, plain: BlockPool) -> None:
    """The same blocks hashed; the indexed ones under the same hashes, and the table the
    plain pool's without the unindexed blocks (whose hashes nobody reads: a private
    request's output blocks are hashed only if it is preempted)."""
    assert (private._hashed == plain._hashed).all()
    indexed = private._hashed & ~private._unindexed
    assert (private._hash[indexed] == plain._hash[indexed]).all()
    assert private._table == {k: b for k, b in plain._table.items() if indexed[b]}


# --- the pool ---------------------------------------------------------------------------------


@pytest.mark.parametrize("host", [0, 4])
def test_unindexed_blocks_are_evicted_and_offloaded_alike(host):
    pools = [BlockPool(8, host_blocks=host) for _ in range(2)]
    for pool, index in zip(pools, (True, False)):
        a = pool.allocate(8)
        pool.cache(a[:2], H(0, 1))
        pool.cache(a[2:5], H(2, 3, 4), index=index)
        pool.cache([a[5]], H(5), index=index)
        pool.free(a[::-1])
        pool.check_integrity()
        assert pool.match_prefix(H(0, 1)) == a[:2]
        assert pool.allocate(5) == a[6:] + a[5:2:-1]  # unhashed first, then least recently freed
        pool.check_integrity()
    assert pools[0].free_blocks().tolist() == pools[1].free_blocks().tolist()
    assert hashed_blocks(pools[0]) == hashed_blocks(pools[1])
    if host:
        assert list(pools[0].host._lru.items()) == list(pools[1].host._lru.items())


def test_a_hint_does_not_find_a_block_reused_and_published_unhashed():
    """A request's hint names a block it found once; evicted and taken by a private request
    that publishes it unhashed, the block is hashed again but keeps its old hash. The hint
    must not find it (found by hypothesis: a readmitted request attended to another's KV)."""
    pool = BlockPool(2)
    a = pool.allocate(1)
    pool.cache(a, H(0))
    hint = pool.match_prefix(H(0))
    assert hint == a
    pool.free(a)
    b = pool.allocate(2)  # the unhashed block first, then the cached one: evicted
    assert a[0] in b
    pool.cache_unhashed([a[0]])  # a private owner's block, its hash given only if preempted
    pool.check_integrity()
    assert pool.match_prefix(H(0), hint) == []


def test_unindexed_blocks_are_not_found_until_indexed():
    pool = BlockPool(8)
    a = pool.allocate(4)
    pool.cache(a[:3], H(0, 1, 2), index=False)
    assert pool.match_prefix(H(0, 1, 2)) == [] and pool.cached_prefix_len(H(0, 1, 2)) == 0
    pool.index(a)  # the open last block is skipped
    pool.check_integrity()
    assert pool.match_prefix(H(0, 1, 2)) == a[:3] and pool.cached_prefix_len(H(0, 1, 2)) == 3
    pool.cache([a[3]], H(3), index=False)
    pool.free(a[::-1])
    assert pool.allocate(8)[-4:] == a[::-1]
    pool.check_integrity()
    assert pool.match_prefix(H(0)) == [] and len(pool._table) == 0


def test_blocks_cached_unhashed_take_their_hashes_later():
    pools = [BlockPool(8) for _ in range(2)]
    a = [p.allocate(5) for p in pools]
    pools[0].cache(a[0][:4], H(0, 1, 2, 3))
    pools[1].cache_unhashed(a[1][:3])
    pools[1].cache_unhashed([a[1][3]])
    pools[1].check_integrity()
    assert pools[1].match_prefix(H(0)) == [] and pools[1]._hashed.sum() == 4
    pools[1].fill_hashes(a[1], H(0, 1, 2, 3, 4))  # the open last block stays unhashed
    pools[1].index(a[1])
    for p, blocks in zip(pools, a):
        p.check_integrity()
        assert p.match_prefix(H(0, 1, 2, 3, 4)) == blocks[:4]
    same_cache(pools[1], pools[0])


def test_hash_prompts_reports_the_accumulator_where_asked():
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 1000, n).astype(np.int32) for n in (70, 16, 5, 200)]
    at = [2, 1, 0, 9]
    for method in ("keyed", "sha256"):
        h = BlockHasher(b"secret", 16, method=method)
        for (hashes, acc), seq, a in zip(h.hash_prompts(seqs, at), seqs, at):
            want_h, _ = h.hash_prompt(seq)
            assert (hashes == want_h).all()
            assert (acc == h.hash_prompt(seq[: a * 16])[1]).all()
        (hashes, acc), = h.hash_prompts(seqs[3:], [4])  # one prompt: hashed alone
        assert (acc == h.hash_prompt(seqs[3][:64])[1]).all()


# --- the core ---------------------------------------------------------------------------------




def mark_private(cfg: SchedulerConfig, specs: list) -> list:
    """The specs, those sharing no lane-0 key of their whole token chain with another (what
    the simulator works out for its workload) marked private."""
    hasher = BlockHasher(b"test-secret", cfg.block_size)
    keys = {}
    for s in specs:
        for k in hasher.hash_prompt(s.truth().astype(np.int32), s.salt)[0][:, 0].tolist():
            keys.setdefault(k, []).append(s.rid)
    shared = {r for owners in keys.values() if len(owners) > 1 for r in owners}
    return [attrs.evolve(s, private=s.rid not in shared) for s in specs]


@FAST
@given(workloads())
def test_private_prefixes_schedule_alike(wl):
    """Private requests (preemptions, aborts, KV loads, host tiers and all) give the same
    schedule, the same free order and the same indexed block hashes as the same requests
    indexed."""
    cfg, specs = wl
    marked = mark_private(cfg, specs)
    for adv in (False, True):
        plain, private = drive(cfg, specs, use_advance=adv), drive(cfg, marked, use_advance=adv)
        check_outcome(private, marked, cfg)
        same_schedule(private, plain, specs)
        assert [len(p.block_ids) for p in private.plans] == [len(p.block_ids) for p in plain.plans]
        same_cache(private.core.pool, plain.core.pool)


@FAST
@given(workloads(), st.integers(1, 4), st.integers(0, 2**16))
def test_private_prefixes_schedule_alike_with_speculative_decoding(wl, k, seed):
    cfg, specs = wl
    cfg = attrs.evolve(cfg, num_spec_tokens=k)
    plain, private = drive(cfg, specs, spec_seed=seed), drive(cfg, mark_private(cfg, specs), spec_seed=seed)
    check_outcome(private, specs, cfg)
    same_schedule(private, plain, specs)
    same_cache(private.core.pool, plain.core.pool)


@FAST
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_preempted_private_requests_hash_their_output_blocks_alike(seed, adv):
    """Long outputs in a tight pool: private requests close output blocks unhashed, are
    preempted, hash them then, and find them on readmission as indexed ones would."""
    rng = np.random.default_rng(seed)
    bs = 4
    specs = [Spec(rid=i, prompt=rng.integers(2, 500, int(rng.integers(3, 20))), max_tokens=int(rng.integers(5, 30)),
                  arrival=int(rng.integers(0, 6))) for i in range(int(rng.integers(2, 6)))]
    need = max(-(-(len(s.prompt) + s.max_tokens) // bs) for s in specs)
    cfg = SchedulerConfig(num_blocks=need + int(rng.integers(0, 5)), block_size=bs, max_num_seqs=int(rng.integers(2, 5)),
                          max_num_batched_tokens=64, watermark=0.0)
    plain, private = drive(cfg, specs, use_advance=adv), drive(cfg, mark_private(cfg, specs), use_advance=adv)
    check_outcome(private, specs, cfg)
    same_schedule(private, plain, specs)
    same_cache(private.core.pool, plain.core.pool)


def test_a_preempted_private_request_finds_its_own_blocks(monkeypatch):
    cfg = SchedulerConfig(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    rng = np.random.default_rng(11)
    specs = [Spec(rid=i, prompt=rng.integers(2, 500, 14), max_tokens=14, arrival=i, private=True) for i in range(3)]
    found = []
    match = BlockPool.match_prefix
    monkeypatch.setattr(BlockPool, "match_prefix", lambda self, *a: found.append(len(r := match(self, *a))) or r)
    plain = drive(cfg, [attrs.evolve(s, private=False) for s in specs])
    hits, found[:] = list(found), []
    private = drive(cfg, specs)
    assert private.core.num_preemptions > 0 and max(found) > 0  # readmitted onto its own blocks
    assert found == hits
    same_schedule(private, plain, specs)
    same_cache(private.core.pool, plain.core.pool)


# --- the simulator ----------------------------------------------------------------------------


@pytest.mark.parametrize("example,trace,n", [
    ("h200-v2lite.toml", "azure_code_300.csv", 300),
    ("h200-dep8.toml", "azure_code_300.csv", 120),
    ("h200-v2lite.toml", "mooncake_conversation_300.jsonl", 80),
])
def test_private_prefixes_simulate_to_the_bit(example, trace, n):
    d = load_deployment(ROOT / "examples" / example)
    workload = read_trace(DATA / trace).requests[:n]
    sims = [Simulator(d, workload, seed=0, private_prefixes=p) for p in (True, False)]
    reps = [s.run() for s in sims]
    assert reps[0] == reps[1]
    for key in ("first", "last", "finish"):
        assert np.array_equal(getattr(sims[0].metrics, key), getattr(sims[1].metrics, key), equal_nan=True)
    if trace.startswith("azure"):
        assert any(sims[0].prompts.private)  # the fast path ran
    if trace.startswith("mooncake"):
        assert not all(sims[0].prompts.private[:n])  # shared prefixes were found


def test_prompts_hashed_ahead_but_not_kept_simulate_alike(monkeypatch):
    """A workload too large to keep its prompts materializes them again on arrival."""
    d = load_deployment(ROOT / "examples" / "h200-v2lite.toml")
    workload = read_trace(DATA / "azure_code_300.csv").requests[:150]
    kept = Simulator(d, workload, seed=0).run()
    monkeypatch.setattr(prompts_module, "KEEP_PROMPT_TOKENS", 0)
    assert Simulator(d, workload, seed=0).run() == kept == Simulator(d, workload, seed=0, private_prefixes=False).run()


def _request(t: float, segs: list[tuple[int, int]], output_len: int, output_seg: int = -1) -> TraceRequest:
    ids, lens = zip(*segs)
    return TraceRequest(arrival_s=t, input_len=sum(lens), output_len=output_len,
                        seg_ids=np.array(ids, dtype=np.int64), seg_lens=np.array(lens, dtype=np.int32),
                        output_seg=output_seg)


# (requests, which are private): blocks of 16 tokens, a 32,768-token context
SHARING = ([
    _request(0.0, [(100, 40), (101, 20)], 4),  # 0, 1: their first two blocks are equal
    _request(0.1, [(100, 40), (102, 20)], 4),
    _request(0.2, [(200, 5)], 3),  # 2: no full block, prompt and output together
    _request(0.3, [(300, 10)], 10),  # 3: one block, the prompt's and its own output's tokens
    _request(0.4, [(400, 32768)], 1),  # 4: too long for the model: rejected, never hashed
    _request(0.5, [(500, 64)], 8),  # 5: alone
    _request(0.6, [(600, 8), (601, 40)], 4),  # 6, 7: 8 equal tokens, no equal block
    _request(0.7, [(600, 8), (602, 40)], 4),
    _request(0.8, [(900, 32)], 16, output_seg=901),  # 8, 9: the next turn resends 8's output
    _request(0.9, [(900, 32), (901, 16), (902, 10)], 4),
], [False, False, True, True, False, True, True, True, False, False])


@pytest.mark.parametrize("trace", ["sharing", "mooncake_conversation_300.jsonl", "azure_code_300.csv"])
def test_private_requests_are_those_sharing_no_block_at_all(trace):
    """``find_private`` counts first blocks only (a block's hash chains all before it): the
    same requests as counting every block of every prompt and output. The excerpts are all
    shared (Mooncake) or all private (Azure); the made-up workload mixes the cases."""
    d = load_deployment(ROOT / "examples" / "h200-v2lite.toml")
    workload = SHARING[0] if trace == "sharing" else read_trace(DATA / trace).requests[:200]
    sim = Simulator(d, workload, seed=0)
    owners: dict[int, set[int]] = {}
    hashed = [r for r in range(len(workload)) if r in sim.prompts._ready]  # not too long for the model
    for r in hashed:
        seq = np.concatenate([sim.prompts._ready[r][0],
                              sim.out_tokens[sim.out_base.item(r) : sim.out_base.item(r + 1)]])
        for key in sim.hasher.hash_prompt(seq)[0][:, 0].tolist():
            owners.setdefault(key, set()).add(r)
    shared = set().union(*(o for o in owners.values() if len(o) > 1))
    assert sim.prompts.private == [r in hashed and r not in shared for r in range(len(workload))]
    if trace == "sharing":
        assert sim.prompts.private == SHARING[1]
