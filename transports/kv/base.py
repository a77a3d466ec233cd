"""The ``KVTransport`` protocol: how a decode rank pulls a request's KV blocks from a prefill rank.

A transport owns one KV pool: one contiguous region of ``num_blocks`` blocks of a fixed
``block_bytes`` (all layers of a block side by side, so one block is one span of bytes). The
prefill side registers its pool and exports a ``PeerInfo``; the decode side connects to it and
starts pulls. Pulls never block: the caller (the runtime loop) calls ``poll`` for completions,
and keeps calling it while anything is pending, on both sides, because some transports only
make progress inside ``poll`` (there is no progress thread).

P/D allocates runs of contiguous blocks on both sides, so ``block_runs`` merges them: one
descriptor per run instead of one per block (per-descriptor cost dominates small blocks).
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import attrs
import numpy as np


class KVTransferError(RuntimeError):
    pass


@attrs.frozen
class PeerInfo:
    """What a peer needs to read our pool: opaque ``metadata`` and, for transports that share
    memory by fd, the fds themselves (they travel over a Unix socket, never by name)."""

    metadata: bytes
    fds: tuple[int, ...] = ()


class Region(NamedTuple):
    addr: int
    num_blocks: int
    block_bytes: int


class KVTransport(Protocol):
    def register_pool(self, pool: Any) -> None:
        """Register this side's pool: a C-contiguous CPU numpy array or torch tensor whose
        first dimension is the block index. One pool per transport."""
        ...

    def export(self) -> PeerInfo:
        """What ``connect`` on the peer needs. Fds in it stay ours; send them, then forget."""
        ...

    def connect(self, peer: PeerInfo) -> str:
        """Connect to a peer from its ``export``; takes ownership of ``peer.fds``. Returns
        the peer's name, to pass to ``pull``."""
        ...

    def pull(self, req_id: int, peer: str, remote_blocks: Sequence[int], local_blocks: Sequence[int]) -> None:
        """Start reading ``remote_blocks`` of ``peer`` into our ``local_blocks`` (same
        length, paired in order). Returns at once; the outcome comes from ``poll``."""
        ...

    def poll(self) -> tuple[list[int], list[int]]:
        """Make progress; return (req_ids done, req_ids failed) since the last poll. Each
        pulled req_id is reported exactly once, unless cancelled."""
        ...

    def cancel(self, req_id: int) -> None:
        """Stop a pull; it is never reported. Its local blocks may hold partial data."""
        ...

    def close(self) -> None: ...


def block_runs(remote: Sequence[int], local: Sequence[int]) -> list[tuple[int, int, int]]:
    """Pair blocks into runs (remote_start, local_start, count) that are contiguous on both
    sides, so each run is one descriptor."""
    if len(remote) != len(local):
        raise ValueError(f"pull pairs remote and local blocks: got {len(remote)} remote and {len(local)} local")
    runs: list[tuple[int, int, int]] = []
    for r, l in zip(remote, local):
        if runs and runs[-1][0] + runs[-1][2] == r and runs[-1][1] + runs[-1][2] == l:
            r0, l0, n = runs[-1]
            runs[-1] = (r0, l0, n + 1)
        else:
            runs.append((int(r), int(l), 1))
    return runs


def check_blocks(blocks: Sequence[int], num_blocks: int, side: str) -> None:
    bad = [b for b in blocks if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{side} block ids {bad[:8]} out of range for a pool of {num_blocks} blocks")


def pool_region(pool: Any) -> Region:
    """Address and geometry of a CPU pool given as a numpy array or torch tensor."""
    if isinstance(pool, np.ndarray):
        ok, addr, nbytes, shape = pool.flags.c_contiguous, pool.ctypes.data, pool.nbytes, pool.shape
    else:
        import torch  # only when a tensor is passed: the shm path stays torch-free

        if not isinstance(pool, torch.Tensor):
            raise TypeError(f"a KV pool is a numpy array or torch tensor, got {type(pool).__name__}")
        if pool.device.type != "cpu":
            raise ValueError(f"this transport registers CPU memory only; the pool is on {pool.device}")
        ok, addr, shape = pool.is_contiguous(), pool.data_ptr(), tuple(pool.shape)
        nbytes = pool.numel() * pool.element_size()
    if not ok or len(shape) < 2 or shape[0] == 0 or nbytes == 0:
        raise ValueError(f"a KV pool must be C-contiguous with shape (num_blocks, ...), got shape {shape}")
    return Region(addr, shape[0], nbytes // shape[0])


_FDS_HDR = struct.Struct("<II")  # metadata length, fd count


def send_peer_info(sock: socket.socket, info: PeerInfo) -> None:
    """Send ``info`` over a Unix socket (its fds by SCM_RIGHTS); the fds stay ours."""
    socket.send_fds(sock, [_FDS_HDR.pack(len(info.metadata), len(info.fds)) + info.metadata], list(info.fds))


def recv_peer_info(sock: socket.socket, max_bytes: int = 1 << 20, max_fds: int = 8) -> PeerInfo:
    msg, fds, _, _ = socket.recv_fds(sock, max_bytes, max_fds)
    size, nfds = _FDS_HDR.unpack_from(msg) if len(msg) >= _FDS_HDR.size else (-1, -1)
    if size != len(msg) - _FDS_HDR.size or nfds != len(fds):
        for fd in fds:
            os.close(fd)
        raise KVTransferError(
            f"bad peer info: {len(msg)} bytes and {len(fds)} fds (header says {size} bytes, {nfds} fds); "
            f"was it sent with send_peer_info and is it under {max_bytes} bytes?"
        )
    return PeerInfo(bytes(msg[_FDS_HDR.size :]), tuple(fds))

