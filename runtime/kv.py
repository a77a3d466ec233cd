"""A runtime's end of P/D KV transfer: its KV pool registered with a ``KVTransport``.

The runtime owns the transport because GPU memory registers only in-process. The engine
decides which pulls start (at most ``max_kv_loads_per_step`` new ones per step) and sends
each as a ``KVPull`` before the plan that first shows the request waiting; completions go
back in ``StepResult.kv_loads_done`` / ``kv_loads_failed``. Peers are announced with
``KVConnect`` carrying the peer's ``Ready.kv_peer``.

A pull the engine gives up on (the request was aborted) is drained, not abandoned: its
local blocks go back to the pool and must not be written by a late transfer, so ``cancel``
waits for the transfer to end (a CPU read takes milliseconds).

Shared memory needs the peer's fds. They never travel over the engine: the peer names its
pid and fd numbers, and this side opens ``/proc/<pid>/fd/<n>`` (same user, as UCX's
process_vm_readv requires too).
"""

from __future__ import annotations

import logging
import os
import time

import msgspec
import numpy as np

from lockstep.transports.kv.base import KVTransferError, PeerInfo

log = logging.getLogger(__name__)

KINDS = ("nixl", "shm")


class KVPeer(msgspec.Struct, frozen=True):
    """What ``Ready.kv_peer`` holds: a transport's export, plus where its fds live."""

    name: str
    kind: str
    metadata: bytes
    pid: int
    fds: list[int] = []


class KVEndpoint:
    """One runtime's KV pool and transport. ``pool`` is the uint8 (num_blocks, block_bytes)
    view of the runtime's KV pool, one contiguous block per row: a numpy array, or on a GPU
    (``device`` a CUDA torch.device; NIXL only) a CUDA tensor."""

    def __init__(self, kind: str, name: str, num_blocks: int, block_bytes: int, device=None):
        if kind not in KINDS:
            raise ValueError(f"kv_transport must be one of {KINDS}, got {kind!r}")
        self.kind, self.name = kind, name
        gpu = device is not None and getattr(device, "type", "cpu") == "cuda"
        if gpu and kind != "nixl":
            raise ValueError(f"kv_transport {kind!r} moves CPU pools only; a pool on {device} needs 'nixl'")
        if gpu:
            import torch

            from lockstep.transports.kv.nixl_transport import NixlKVTransport

            self.transport = NixlKVTransport(name)
            self.pool = torch.zeros((num_blocks, block_bytes), dtype=torch.uint8, device=device)
        elif kind == "shm":
            from lockstep.transports.kv.shm import ShmKVTransport

            self.transport = ShmKVTransport(name)
            self.pool = self.transport.alloc_pool(num_blocks, block_bytes)
        else:
            from lockstep.transports.kv.nixl_transport import NixlKVTransport

            self.transport = NixlKVTransport(name)
            self.pool = np.zeros((num_blocks, block_bytes), np.uint8)
        self.transport.register_pool(self.pool)
        self._peers: dict[str, str] = {}  # engine's peer name -> the transport's
        self._inflight: set[int] = set()
        self._done: list[int] = []  # completions not yet reported
        self._failed: list[int] = []

    def export(self) -> bytes:
        info = self.transport.export()
        return msgspec.msgpack.encode(KVPeer(self.name, self.kind, info.metadata, os.getpid(), list(info.fds)))

    def connect(self, peer_bytes: bytes) -> None:
        """Connect to a peer the engine announced. A peer that is gone by now (killed between
        the announcement and this call: its fds or its listening socket refuse) stays
        unknown, and pulls from it report failed (the decode side then prefills those
        requests itself); this runtime carries on."""
        peer = msgspec.msgpack.decode(peer_bytes, type=KVPeer)
        if peer.name in self._peers:
            return  # announced twice (a peer that started while this runtime did)
        if peer.kind != self.kind:
            raise KVTransferError(f"peer {peer.name!r} uses KV transport {peer.kind!r}, this runtime {self.kind!r}")
        fds: list[int] = []
        try:
            for fd in peer.fds:
                fds.append(os.open(f"/proc/{peer.pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC))
            self._peers[peer.name] = self.transport.connect(PeerInfo(peer.metadata, tuple(fds)))
        except Exception as e:  # noqa: BLE001 - the transport's own errors (NIXL's backend errors) too
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            log.warning("KV peer %r (pid %d) unreachable, its pulls will fail: %r", peer.name, peer.pid, e)

    def pull(self, req_id: int, peer: str, remote: list[int], local: list[int]) -> None:
        """Start a pull; anything wrong with it reports it failed (the decode side then
        prefills the request itself) rather than stopping the runtime."""
        name = self._peers.get(peer)
        if name is None or not remote or len(remote) != len(local):
            self._failed.append(req_id)
            return
        try:
            self.transport.pull(req_id, name, remote, local)
        except (KVTransferError, ValueError):
            self._failed.append(req_id)
            return
        self._inflight.add(req_id)

    def progress(self) -> None:
        """Call into the transport (the passive side too: handshakes progress only there);
        completions wait for ``poll``."""
        done, failed = self.transport.poll()
        if done or failed:
            self._inflight.difference_update(done)
            self._inflight.difference_update(failed)
            self._done.extend(done)
            self._failed.extend(failed)

    def poll(self) -> tuple[list[int], list[int]]:
        self.progress()
        done, failed, self._done, self._failed = self._done, self._failed, [], []
        return done, failed

    def cancel(self, req_ids: list[int], timeout: float = 5.0) -> None:
        """Forget these pulls; wait for any still moving data into our blocks."""
        ids = set(req_ids)
        busy = ids & self._inflight
        deadline = time.monotonic() + timeout
        while busy and time.monotonic() < deadline:
            self.progress()
            busy &= self._inflight
        for r in busy:  # still stuck: the transport stops it as best it can
            self.transport.cancel(r)
            self._inflight.discard(r)
        self._done = [r for r in self._done if r not in ids]
        self._failed = [r for r in self._failed if r not in ids]

    def pending(self) -> bool:
        return bool(self._inflight or self._failed or self._done)

    def close(self) -> None:
        self.transport.close()
