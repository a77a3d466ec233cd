"""A stand-in prefill process for tests and benchmarks: fills its pool with a known pattern,
exports it over a Unix socket and keeps polling its transport (NIXL needs the passive side to
keep calling in) until told to stop with one byte on the socket.
"""

from __future__ import annotations

import select
import socket

import numpy as np

from lockstep.transports.kv.base import send_peer_info


_MOD251 = ((np.arange(251)[:, None] * np.arange(251)[None, :]) % 251).astype(np.uint8)
_MOD251.setflags(write=False)  # a constant table


def pattern(num_blocks: int, block_bytes: int, first: int = 0) -> np.ndarray:
    """Bytes that differ between blocks and within a block, so a misplaced run shows: byte i of
    block b is ``(b * 131 + i * 7 + (b * i) % 251) & 0xFF``, for blocks ``first`` onwards.

    Built from a 251 x 251 table (``(b * i) % 251`` repeats every 251 bytes) with uint8
    arithmetic that wraps mod 256, so a benchmark's gigabyte pool fills in about a second.
    """
    b = np.arange(first, first + num_blocks, dtype=np.int64)
    i = np.arange(block_bytes, dtype=np.int64)
    out = np.empty((num_blocks, -(-block_bytes // 251), 251), np.uint8)
    out[:] = _MOD251[b % 251][:, None, :]
    out = out.reshape(num_blocks, -1)[:, :block_bytes]
    out += ((i * 7) & 0xFF).astype(np.uint8)[None, :]
    out += ((b * 131) & 0xFF).astype(np.uint8)[:, None]
    return out


def fill(pool: np.ndarray, chunk_bytes: int = 16 << 20) -> None:
    """Write ``pattern`` into a (num_blocks, block_bytes) uint8 pool, a few MiB at a time."""
    n, bb = pool.shape
    step = max(1, chunk_bytes // bb)
    for b0 in range(0, n, step):
        pool[b0 : b0 + step] = pattern(min(step, n - b0), bb, b0)


def make_transport(kind: str, name: str, num_blocks: int, block_bytes: int):
    """A transport of ``kind`` ("shm" or "nixl") with a registered, zeroed pool."""
    if kind == "shm":
        from lockstep.transports.kv.shm import ShmKVTransport

        t = ShmKVTransport(name)
        pool = t.alloc_pool(num_blocks, block_bytes)
    elif kind == "nixl":
        from lockstep.transports.kv.nixl_transport import NixlKVTransport

        t = NixlKVTransport(name)
        pool = np.zeros((num_blocks, block_bytes), np.uint8)
    else:
        raise ValueError(f"unknown KV transport kind {kind!r}; use 'shm' or 'nixl'")
    t.register_pool(pool)
    return t, pool


def serve(sock: socket.socket, kind: str, num_blocks: int, block_bytes: int) -> None:
    t, pool = make_transport(kind, f"prefill-{kind}", num_blocks, block_bytes)
    fill(pool)
    send_peer_info(sock, t.export())
    try:
        while not select.select([sock], [], [], 0.001)[0]:
            t.poll()
        sock.recv(1)
    finally:
        del pool
        t.close()
        sock.close()
