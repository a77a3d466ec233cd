"""The ``KVTransport`` protocol: how a decode rank pulls a request's KV blocks from a prefill rank.

A transport owns one KV pool: one contiguous region of ``num_blocks`` blocks of a fixed
``block_bytes`` (all layers of a block side by side, so one block is one span of bytes). The
prefill side registers its pool and exports a ``PeerInfo``; the decode side connects to it and
starts pulls. Pulls never wait for the peer: the caller (the runtime loop) calls ``poll`` for
completions, and keeps calling it while anything is pending, on both sides, because some
transports only make progress inside ``poll`` (there is no progress thread). On CPU both
transports copy inside ``pull`` (about 5 GB/s on the development VM), so a pull returns when
its bytes are in place and is reported by the next ``poll``.

P/D allocates runs of contiguous blocks on both sides, so ``block_runs`` (``run_array``, its
numpy form) merges them: one descriptor per run instead of one per block (per-descriptor cost
dominates small blocks). ``kv_bytes_per_token`` gives the compact layout's size of a token.
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
        first dimension is the block index (NIXL takes a CUDA tensor too). One pool per
        transport."""
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
    return [(r, l, n) for r, l, n in run_array(remote, local).tolist()]


def run_array(remote: Sequence[int] | np.ndarray, local: Sequence[int] | np.ndarray) -> np.ndarray:
    """``block_runs`` as a (runs, 3) int64 array, computed with numpy: a request's table is
    hundreds of block ids (often an int32 array straight from a StepPlan), and a Python loop
    over numpy scalars costs more than moving a small request's bytes."""
    r, l = as_block_ids(remote, "remote"), as_block_ids(local, "local")
    n = len(r)
    if n != len(l):
        raise ValueError(f"pull pairs remote and local blocks: got {n} remote and {len(l)} local")
    if n <= 1:
        return np.array([[r[0], l[0], 1]], np.int64) if n else np.zeros((0, 3), np.int64)
    breaks = ((r[1:] - r[:-1] != 1) | (l[1:] - l[:-1] != 1)).nonzero()[0]
    if len(breaks) == 0:  # the common case: P/D allocated the request one run on each side
        return np.array([[r[0], l[0], n]], np.int64)
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((starts[1:], [n]))
    return np.stack((r[starts], l[starts], ends - starts), axis=1)


def as_block_ids(blocks: Sequence[int] | np.ndarray, side: str) -> np.ndarray:
    """Block ids as a flat int64 array (a view when they already are one)."""
    a = blocks if isinstance(blocks, np.ndarray) else np.asarray(blocks)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise TypeError(f"{side} block ids must be a flat sequence of integers, got {a.dtype} of shape {a.shape}")
    return a.astype(np.int64, copy=False)


def check_blocks(blocks: Sequence[int] | np.ndarray, num_blocks: int, side: str) -> None:
    a = as_block_ids(blocks, side)
    if a.size and (a.min() < 0 or a.max() >= num_blocks):
        bad = a[(a < 0) | (a >= num_blocks)]
        raise ValueError(f"{side} block ids {bad[:8].tolist()} out of range for a pool of {num_blocks} blocks")


def runs_in_range(runs: np.ndarray, num_remote: int, num_local: int) -> bool:
    """Whether every run of ``run_array`` lies inside pools of these sizes (a run ascends, so
    its first and last block bound it)."""
    if len(runs) == 1:
        r0, l0, n = runs[0].tolist()
        return r0 >= 0 and l0 >= 0 and r0 + n <= num_remote and l0 + n <= num_local
    if len(runs) == 0:
        return True
    return bool(runs[:, :2].min() >= 0 and (runs[:, 0] + runs[:, 2]).max() <= num_remote
                and (runs[:, 1] + runs[:, 2]).max() <= num_local)


def pool_region(pool: Any, *, gpu: bool = False) -> Region:
    """Address and geometry of a pool given as a numpy array or torch tensor: CPU memory,
    or with ``gpu`` a CUDA tensor too (see ``pool_device``)."""
    if isinstance(pool, np.ndarray):
        ok, addr, nbytes, shape = pool.flags.c_contiguous, pool.ctypes.data, pool.nbytes, pool.shape
    else:
        import torch  # only when a tensor is passed: the shm path stays torch-free

        if not isinstance(pool, torch.Tensor):
            raise TypeError(f"a KV pool is a numpy array or torch tensor, got {type(pool).__name__}")
        if pool.device.type != "cpu" and not (gpu and pool.device.type == "cuda"):
            raise ValueError(f"this transport registers CPU memory only; the pool is on {pool.device}")
        ok, addr, shape = pool.is_contiguous(), pool.data_ptr(), tuple(pool.shape)
        nbytes = pool.numel() * pool.element_size()
    if not ok or len(shape) < 2 or shape[0] == 0 or nbytes == 0:
        raise ValueError(f"a KV pool must be C-contiguous with shape (num_blocks, ...), got shape {shape}")
    return Region(addr, shape[0], nbytes // shape[0])


def pool_device(pool: Any) -> tuple[str, int]:
    """NIXL's memory type and device id for a pool: ("DRAM", 0) or ("VRAM", cuda index)."""
    dev = getattr(pool, "device", None)
    if dev is not None and getattr(dev, "type", "cpu") == "cuda":
        return "VRAM", dev.index or 0
    return "DRAM", 0


_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1}


def kv_bytes_per_token(cfg: Any, dtype: Any = "bfloat16", *, scale_bytes: int = 0) -> int:
    """Bytes one token's KV takes in the compact MLA layout (one tensor
    [num_blocks, num_layers, block_size, kv_lora_rank + qk_rope_head_dim]): every layer's
    latent plus rope key, and ``scale_bytes`` per token and layer for FP8 with per-token
    scales. ``cfg`` is a ``ModelConfig`` (anything with ``num_hidden_layers``,
    ``kv_lora_rank`` and ``qk_rope_head_dim``); ``dtype`` a name, a numpy or torch dtype, or
    a size in bytes. A block of ``block_size`` tokens is one contiguous span of
    ``block_size * kv_bytes_per_token(...)`` bytes."""
    if isinstance(dtype, int):
        itemsize = dtype
    elif isinstance(dtype, str):
        if dtype not in _ITEMSIZE:
            raise ValueError(f"unknown KV dtype {dtype!r}; use one of {sorted(_ITEMSIZE)} or a size in bytes")
        itemsize = _ITEMSIZE[dtype]
    else:
        itemsize = dtype.itemsize  # numpy and torch dtypes both have it
    return cfg.num_hidden_layers * ((cfg.kv_lora_rank + cfg.qk_rope_head_dim) * itemsize + scale_bytes)


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

