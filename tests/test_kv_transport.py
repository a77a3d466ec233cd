"""KV transports between a real prefill process and this (decode) process: every byte of
merged and non-contiguous runs, cancel, a dead peer reported as failed, no leaked fds."""

import multiprocessing as mp
import os
import socket
import time

import numpy as np
import pytest

from lockstep.runtime.models.config import preset
from lockstep.transports.kv import KVTransferError, PeerInfo, block_runs, recv_peer_info
from lockstep.transports.kv import nixl_transport, prefill_worker
from lockstep.transports.kv.base import kv_bytes_per_token, run_array, runs_in_range
from lockstep.transports.kv.prefill_worker import fill, make_transport, pattern
from leaks import leaked_shm, open_fds

NUM_BLOCKS, BLOCK_BYTES = 64, 1024
KINDS = [
    "shm",
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_transport.available(), reason="nixl not installed")),
]


class Prefill:
    """A prefill process and the socket to it."""

    def __init__(self, kind: str):
        ctx = mp.get_context("spawn")
        self.sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = ctx.Process(target=prefill_worker.serve, args=(child, kind, NUM_BLOCKS, BLOCK_BYTES), daemon=True)
        self.proc.start()
        child.close()
        self.sock.settimeout(60)  # a hang guard only
        self.info = recv_peer_info(self.sock)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.sock.send(b"q")
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.sock.close()
        self.proc.close()  # its sentinel fd

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)


def wait_for(t, wanted: set[int]) -> tuple[set[int], set[int]]:
    """Poll until every req_id in ``wanted`` was reported; the deadline only guards a hang."""
    done, failed = set(), set()
    deadline = time.monotonic() + 20
    while not wanted <= done | failed:
        d, f = t.poll()
        assert not (set(d) | set(f)) & (done | failed), "a req_id was reported twice"
        done |= set(d)
        failed |= set(f)
        assert time.monotonic() < deadline, f"still waiting for {wanted - done - failed}"
    return done, failed




@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


def test_block_runs_merge_only_what_is_contiguous_on_both_sides():
    assert block_runs([3, 4, 5, 10, 11, 20], [0, 1, 2, 7, 8, 30]) == [(3, 0, 3), (10, 7, 2), (20, 30, 1)]
    assert block_runs([1, 2, 3], [5, 9, 10]) == [(1, 5, 1), (2, 9, 2)]
    assert block_runs([], []) == []
    with pytest.raises(ValueError, match="2 remote and 1 local"):
        block_runs([1, 2], [1])


def reference_runs(remote, local):
    """The plain loop block_runs replaced."""
    runs = []
    for r, l in zip(remote, local):
        if runs and runs[-1][0] + runs[-1][2] == r and runs[-1][1] + runs[-1][2] == l:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((int(r), int(l), 1))
    return runs


def test_block_runs_match_a_plain_loop_on_random_tables():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 40))
        # mostly ascending with gaps and repeats, sometimes shuffled, like real block tables
        remote = np.cumsum(rng.integers(0, 3, n)) + int(rng.integers(0, 5))
        local = np.cumsum(rng.integers(0, 3, n))
        if rng.random() < 0.3:
            local = rng.permutation(local)
        want = reference_runs(remote.tolist(), local.tolist())
        for dtype in (np.int32, np.int64):
            assert block_runs(remote.astype(dtype), local.astype(dtype)) == want
        assert run_array(remote.tolist(), local.tolist()).tolist() == [list(r) for r in want]
    assert run_array(np.arange(5, 9, dtype=np.int32), np.arange(2, 6)).tolist() == [[5, 2, 4]]
    with pytest.raises(TypeError, match="remote block ids must be a flat sequence of integers"):
        block_runs([1.0, 2.0], [1, 2])
    with pytest.raises(TypeError, match="local block ids"):
        block_runs([1], [[1]])


def test_runs_in_range_bounds_every_run():
    assert runs_in_range(run_array([0, 1, 2], [5, 6, 7]), 3, 8)
    assert not runs_in_range(run_array([0, 1, 2], [5, 6, 7]), 2, 8)
    assert not runs_in_range(run_array([0, 1, 2], [5, 6, 7]), 3, 7)
    assert runs_in_range(run_array([4, 0, 9], [1, 0, 3]), 10, 4)
    assert not runs_in_range(run_array([4, 0, 10], [1, 0, 3]), 10, 4)
    assert not runs_in_range(run_array([4, -1, 9], [1, 0, 3]), 10, 4)
    assert runs_in_range(run_array([], []), 0, 0)


def test_kv_bytes_per_token_of_the_compact_mla_layout():
    tiny, lite = preset("tiny"), preset("v2-lite")
    assert kv_bytes_per_token(tiny) == 4 * (32 + 16) * 2 == 384
    assert kv_bytes_per_token(lite) == 27 * (512 + 64) * 2 == 31_104
    assert kv_bytes_per_token(lite, "float32") == kv_bytes_per_token(lite, np.dtype(np.float32)) == 62_208
    assert kv_bytes_per_token(lite, "float8_e4m3fn", scale_bytes=4) == 27 * (576 + 4)
    assert kv_bytes_per_token(tiny, 2) == 384
    with pytest.raises(ValueError, match="unknown KV dtype 'int3'"):
        kv_bytes_per_token(tiny, "int3")


def test_pattern_is_the_documented_formula_and_fill_writes_it():
    for n, bb, first in [(7, 1000, 0), (3, 251, 5), (5, 17, 300), (2, 600, 250)]:
        b = np.arange(first, first + n, dtype=np.uint64)[:, None]
        i = np.arange(bb, dtype=np.uint64)[None, :]
        want = ((b * 131 + i * 7 + (b * i) % 251) & 0xFF).astype(np.uint8)
        np.testing.assert_array_equal(pattern(n, bb, first), want)
    pool = np.zeros((37, 300), np.uint8)
    fill(pool, chunk_bytes=2000)  # several chunks, the last one short
    np.testing.assert_array_equal(pool, pattern(37, 300))


def test_pull_moves_every_byte_of_merged_and_scattered_runs(kind):
    pre = Prefill(kind)
    dec, pool = make_transport(kind, "decode", NUM_BLOCKS, BLOCK_BYTES)
    try:
        peer = dec.connect(pre.info)
        want = pattern(NUM_BLOCKS, BLOCK_BYTES)
        pulls = {
            1: ([3, 4, 5, 10, 11, 20], [0, 1, 2, 7, 8, 30]),  # three runs
            2: ([0, 1], [40, 41]),
            3: ([63, 62, 61], [50, 51, 52]),  # reversed: nothing merges
            4: (np.arange(12, 20, dtype=np.int32), np.arange(54, 62, dtype=np.int32)),  # a plan's int32 table
            5: (np.array([30, 31, 33]), np.array([20, 21, 22])),  # int64, two runs
            6: ([], []),  # nothing to move, still reported
        }
        for req_id, (remote, local) in pulls.items():
            dec.pull(req_id, peer, remote, local)
        done, failed = wait_for(dec, set(pulls))
        assert (done, failed) == (set(pulls), set())
        written = set()
        for remote, local in pulls.values():
            np.testing.assert_array_equal(pool[local], want[remote])
            written |= set(local)
        untouched = [b for b in range(NUM_BLOCKS) if b not in written]
        assert not pool[untouched].any()
        assert dec.poll() == ([], [])
        with pytest.raises(ValueError, match="out of range"):
            dec.pull(9, peer, [NUM_BLOCKS], [0])
        with pytest.raises(ValueError, match="out of range"):
            dec.pull(9, peer, [0], [-1])
        with pytest.raises(ValueError, match="2 remote and 1 local"):
            dec.pull(9, peer, [1, 2], [3])
        with pytest.raises(KVTransferError, match="not connected"):
            dec.pull(9, "nobody", [0], [0])
    finally:
        del pool
        dec.close()
        pre.stop()


def test_a_cancelled_pull_is_never_reported(kind):
    pre = Prefill(kind)
    dec, pool = make_transport(kind, "decode", NUM_BLOCKS, BLOCK_BYTES)
    try:
        peer = dec.connect(pre.info)
        dec.pull(5, peer, list(range(8)), list(range(8)))
        dec.cancel(5)
        dec.pull(6, peer, [9], [9])
        done, failed = wait_for(dec, {6})
        for _ in range(20):
            d, f = dec.poll()
            done |= set(d)
            failed |= set(f)
        assert (done, failed) == ({6}, set())
        np.testing.assert_array_equal(pool[9], pattern(NUM_BLOCKS, BLOCK_BYTES)[9])
    finally:
        del pool
        dec.close()
        pre.stop()


def test_a_pull_from_a_dead_peer_fails_instead_of_hanging(kind):
    pre = Prefill(kind)
    dec, pool = make_transport(kind, "decode", NUM_BLOCKS, BLOCK_BYTES)
    try:
        peer = dec.connect(pre.info)
        dec.pull(1, peer, [0, 1], [0, 1])
        assert wait_for(dec, {1}) == ({1}, set())  # connected and working first
        pre.kill()
        dec.pull(2, peer, [2, 3], [2, 3])
        assert wait_for(dec, {2}) == (set(), {2})
    finally:
        del pool
        dec.close()
        pre.stop()


def test_shm_leaks_no_fds_and_names_nothing():
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # multiprocessing's own helper keeps a pipe open
    before = open_fds()
    for _ in range(2):
        pre = Prefill("shm")
        dec, pool = make_transport("shm", "decode", NUM_BLOCKS, BLOCK_BYTES)
        peer = dec.connect(pre.info)
        dec.pull(1, peer, [1, 2], [3, 4])
        assert wait_for(dec, {1}) == ({1}, set())
        assert not leaked_shm(set())
        del pool
        dec.close()
        pre.stop()
    leaked = open_fds() - before
    assert not leaked, leaked


def test_shm_rejects_bad_peer_info_and_closes_its_fds():
    dec, pool = make_transport("shm", "decode", 4, 64)
    r, w = os.pipe()
    try:
        with pytest.raises(KVTransferError, match="2 fds"):
            dec.connect(PeerInfo(b"", (r,)))
        with pytest.raises(OSError):
            os.fstat(r)  # connect owned it and closed it
        with pytest.raises(KVTransferError, match="alloc_pool"):
            dec.register_pool(np.zeros((4, 64), np.uint8))
    finally:
        os.close(w)
        del pool
        dec.close()


@pytest.mark.skipif(not nixl_transport.available(), reason="nixl not installed")
def test_nixl_registers_a_torch_tensor_pool():
    torch = pytest.importorskip("torch")
    pre = Prefill("nixl")
    dec = nixl_transport.NixlKVTransport("decode-torch")
    pool = torch.zeros((NUM_BLOCKS, BLOCK_BYTES // 4), dtype=torch.int32)  # 1024 bytes a block
    try:
        dec.register_pool(pool)
        peer = dec.connect(pre.info)
        dec.pull(1, peer, [7, 8, 9], [0, 1, 2])
        assert wait_for(dec, {1}) == ({1}, set())
        got = pool[:3].numpy().view(np.uint8)
        np.testing.assert_array_equal(got, pattern(NUM_BLOCKS, BLOCK_BYTES)[7:10])
    finally:
        dec.close()
        pre.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_endpoint_connect_to_a_peer_gone_since_its_announcement_fails_only_its_pulls(kind, monkeypatch):
    """A peer killed between its announcement and the connect: the runtime carries on, the
    peer stays unknown and pulls from it report failed (the decode side then prefills
    itself). Gone two ways: its process (its fds cannot be opened), and its transport
    refusing the connection (as NIXL's UCX did in CI: NIXL_ERR_BACKEND, 'Connection
    refused'; raised here by the transport's connect, as the race is not reproducible)."""
    import msgspec
    from lockstep.runtime.kv import KVEndpoint, KVPeer

    gone = mp.get_context("fork").Process(target=int)
    gone.start()
    gone.join()  # its pid now names no process
    dead_pid = gone.pid
    gone.close()
    src, dec = KVEndpoint(kind, "src", 4, 64), KVEndpoint(kind, "dec", 4, 64)
    try:
        info = msgspec.msgpack.decode(src.export(), type=KVPeer)
        if info.fds:  # the peer's fds (shm): none can be opened, none stays open
            fds = open_fds()
            dec.connect(msgspec.msgpack.encode(KVPeer("src", kind, info.metadata, dead_pid, info.fds)))
            assert open_fds() == fds
        else:  # NIXL needs no fds: its connect is what fails
            def refuse(peer):
                raise RuntimeError("NIXL_ERR_BACKEND: Connection refused")
            monkeypatch.setattr(dec.transport, "connect", refuse)
            dec.connect(src.export())
        dec.pull(7, "src", [0], [1])
        assert dec.poll() == ([], [7])
    finally:
        dec.close()
        src.close()
