"""KV transfer between processes of one host through shared memory.

The prefill side's pool lives in a memfd (no name, so nothing leaks when a process is
killed); ``export`` hands out the memfd and the read end of a pipe whose write end only the
owner holds. The decode side maps the pool read-only and a pull is a memcpy per run of
blocks, done inside ``pull`` and reported by the next ``poll``. The pipe is how a pull learns
that the owner is gone: its read end turns readable (EOF) when the owner closes or dies, and
then the owner's blocks may already have been reused, so the pull fails instead.
"""

from __future__ import annotations

import mmap
import os
import select
import struct
from collections.abc import Sequence

import numpy as np

from lockstep.transports.kv.base import KVTransferError, PeerInfo, check_blocks, pool_region, run_array, runs_in_range

_META = struct.Struct("<QQ")  # num_blocks, block_bytes; the owner's name follows


class _Peer:
    def __init__(self, name: str, blocks: np.ndarray, mem: mmap.mmap, live_fd: int):
        self.name, self.blocks, self.mem, self.live_fd = name, blocks, mem, live_fd

    def alive(self) -> bool:
        return not select.select([self.live_fd], [], [], 0)[0]


class ShmKVTransport:
    """``KVTransport`` over a shared memfd. Its pool must come from ``alloc_pool``."""

    def __init__(self, name: str):
        self.name = name
        self._pool: np.ndarray | None = None
        self._map: mmap.mmap | None = None
        self._fd = -1
        self._live: tuple[int, int] | None = None  # the pipe (read end, write end)
        self._registered = False
        self._peers: dict[str, _Peer] = {}
        self._done: list[int] = []
        self._failed: list[int] = []

    def alloc_pool(self, num_blocks: int, block_bytes: int) -> np.ndarray:
        """A (num_blocks, block_bytes) uint8 pool in a fresh memfd, zero-filled."""
        if self._fd >= 0:
            raise KVTransferError(f"transport {self.name!r} already has a pool: one pool per transport")
        if num_blocks <= 0 or block_bytes <= 0:
            raise ValueError(f"pool needs positive num_blocks and block_bytes, got {num_blocks} x {block_bytes}")
        self._fd = os.memfd_create("lockstep-kv", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, num_blocks * block_bytes)
        self._map = mmap.mmap(self._fd, num_blocks * block_bytes)
        self._pool = np.frombuffer(self._map, np.uint8).reshape(num_blocks, block_bytes)
        return self._pool

    def register_pool(self, pool: np.ndarray) -> None:
        if self._pool is None or pool_region(pool) != pool_region(self._pool):
            raise KVTransferError("ShmKVTransport shares only the pool made by its alloc_pool(); allocate it there")
        self._registered = True

    def export(self) -> PeerInfo:
        if not self._registered:
            raise KVTransferError(f"transport {self.name!r}: register_pool before export")
        if self._live is None:
            r, w = os.pipe2(os.O_CLOEXEC)
            self._live = (r, w)
        n, bb = self._pool.shape
        return PeerInfo(_META.pack(n, bb) + self.name.encode(), (self._fd, self._live[0]))

    def connect(self, peer: PeerInfo) -> str:
        try:
            if len(peer.fds) != 2 or len(peer.metadata) < _META.size:
                raise KVTransferError(f"shm peer info needs metadata and 2 fds, got {len(peer.fds)} fds")
            n, bb = _META.unpack_from(peer.metadata)
            name = peer.metadata[_META.size :].decode()
            if name in self._peers:
                raise KVTransferError(f"already connected to a peer named {name!r}")
            # A read-only mapping: a bug on this side cannot scribble on the peer's KV.
            mem = mmap.mmap(peer.fds[0], n * bb, prot=mmap.PROT_READ)
        except BaseException:
            for fd in peer.fds:
                os.close(fd)
            raise
        os.close(peer.fds[0])  # the mapping keeps the memory; one fd less per peer
        blocks = np.frombuffer(mem, np.uint8).reshape(n, bb)
        self._peers[name] = _Peer(name, blocks, mem, peer.fds[1])
        return name

    def pull(self, req_id: int, peer: str, remote_blocks: Sequence[int], local_blocks: Sequence[int]) -> None:
        p = self._peers.get(peer)
        if p is None:
            raise KVTransferError(f"pull {req_id}: not connected to {peer!r} (connected: {sorted(self._peers)})")
        if self._pool is None:
            raise KVTransferError(f"pull {req_id}: transport {self.name!r} has no pool")
        if req_id in self._done or req_id in self._failed:
            raise ValueError(f"pull {req_id}: a pull with this req_id is still unreported")
        if p.blocks.shape[1] != self._pool.shape[1]:
            raise KVTransferError(f"block sizes differ: peer {p.blocks.shape[1]} B, ours {self._pool.shape[1]} B")
        runs = run_array(remote_blocks, local_blocks)
        if not runs_in_range(runs, p.blocks.shape[0], self._pool.shape[0]):
            check_blocks(remote_blocks, p.blocks.shape[0], "remote")
            check_blocks(local_blocks, self._pool.shape[0], "local")
        if not p.alive():
            self._failed.append(req_id)
            return
        for r0, l0, n in runs.tolist():
            self._pool[l0 : l0 + n] = p.blocks[r0 : r0 + n]
        # The owner may have died (and reused the blocks) while we copied.
        (self._done if p.alive() else self._failed).append(req_id)

    def poll(self) -> tuple[list[int], list[int]]:
        done, failed = self._done, self._failed
        self._done, self._failed = [], []
        return done, failed

    def cancel(self, req_id: int) -> None:
        # The copy already happened; cancelling only means it is never reported.
        self._done = [r for r in self._done if r != req_id]
        self._failed = [r for r in self._failed if r != req_id]

    def close(self) -> None:
        for p in self._peers.values():
            os.close(p.live_fd)
            p.blocks = None
            _unmap(p.mem)
        self._peers.clear()
        if self._live is not None:
            os.close(self._live[0])
            os.close(self._live[1])  # peers' pulls fail from here on
            self._live = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._pool, mem, self._map = None, self._map, None
        if mem is not None:
            _unmap(mem)


def _unmap(mem: mmap.mmap) -> None:
    try:
        mem.close()
    except BufferError:
        pass  # the caller still holds a view of the pool; it unmaps when that view dies
