"""A stand-in prefill process for tests: fills its pool with a known pattern, exports it over
a Unix socket and keeps polling its transport (NIXL needs the passive side to keep calling
in) until told to stop with one byte on the socket.
"""

from __future__ import annotations

import select
import socket

import numpy as np

from lockstep.transports.kv.base import send_peer_info


def pattern(num_blocks: int, block_bytes: int) -> np.ndarray:
    """Bytes that differ between blocks and within a block, so a misplaced run shows."""
    b = np.arange(num_blocks, dtype=np.uint64)[:, None]
    i = np.arange(block_bytes, dtype=np.uint64)[None, :]
    return ((b * 131 + i * 7 + (b * i) % 251) & 0xFF).astype(np.uint8)


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
    pool[:] = pattern(num_blocks, block_bytes)
    send_peer_info(sock, t.export())
    try:
        while not select.select([sock], [], [], 0.001)[0]:
            t.poll()
        sock.recv(1)
    finally:
        del pool
        t.close()
        sock.close()
