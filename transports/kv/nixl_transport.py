"""KV transfer with a NIXL agent over UCX (the optional ``nixl`` extra).

The agent lives in the process that owns the pool (GPU memory registers only in-process).
It runs without a progress thread: UCX moves data and completes handshakes only inside calls
into the agent, so ``poll`` must be called on both sides while anything is pending — the
passive (prefill) side included, or connection setup hangs. On CPU this registers DRAM; UCX
then reads with process_vm_readv (both processes under one user).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from lockstep.transports.kv.base import KVTransferError, PeerInfo, Region, block_runs, check_blocks, pool_region

try:  # the CUDA 12 build alone (the `nixl` meta package would pull both CUDA variants)
    from nixl_cu12._api import nixl_agent, nixl_agent_config
except ImportError:
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:  # raised when a transport is made, so importing this module stays safe
        nixl_agent = None
        _IMPORT_ERROR: ImportError | None = e
    else:
        _IMPORT_ERROR = None
else:
    _IMPORT_ERROR = None


class _Meta(msgspec.Struct, frozen=True):
    agent: bytes  # the agent's own metadata, for add_remote_agent
    addr: int
    num_blocks: int
    block_bytes: int


def available() -> bool:
    return _IMPORT_ERROR is None


class NixlKVTransport:
    """``KVTransport`` over a NIXL agent; ``name`` must be unique among connected agents."""

    def __init__(self, name: str, backends: Sequence[str] = ("UCX",)):
        if _IMPORT_ERROR is not None:
            raise KVTransferError(f"NixlKVTransport needs nixl (pip install 'lockstep[nixl]'): {_IMPORT_ERROR}")
        self.name = name
        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=list(backends)))
        self._pool: Any = None  # kept alive: the agent holds its address
        self._region: Region | None = None
        self._reg = None
        self._peers: dict[str, Region] = {}
        self._xfers: dict[int, Any] = {}  # req_id -> handle of a pull in flight
        self._doomed: list[Any] = []  # cancelled handles NIXL would not release yet
        self._done: list[int] = []
        self._failed: list[int] = []

    def register_pool(self, pool: Any) -> None:
        if self._region is not None:
            raise KVTransferError(f"transport {self.name!r} already has a pool: one pool per transport")
        region = pool_region(pool)
        self._reg = self._agent.register_memory([(region.addr, region.num_blocks * region.block_bytes, 0, "")], "DRAM")
        self._pool, self._region = pool, region

    def export(self) -> PeerInfo:
        if self._region is None:
            raise KVTransferError(f"transport {self.name!r}: register_pool before export")
        r = self._region
        return PeerInfo(msgspec.msgpack.encode(_Meta(self._agent.get_agent_metadata(), r.addr, r.num_blocks, r.block_bytes)))

    def connect(self, peer: PeerInfo) -> str:
        if peer.fds:
            raise KVTransferError(f"NIXL peer info carries no fds, got {len(peer.fds)}")
        meta = msgspec.msgpack.decode(peer.metadata, type=_Meta)
        name = self._agent.add_remote_agent(meta.agent)
        name = name.decode() if isinstance(name, bytes) else name
        self._peers[name] = Region(meta.addr, meta.num_blocks, meta.block_bytes)
        return name

    def pull(self, req_id: int, peer: str, remote_blocks: Sequence[int], local_blocks: Sequence[int]) -> None:
        remote, local = self._peers.get(peer), self._region
        if remote is None:
            raise KVTransferError(f"pull {req_id}: not connected to {peer!r} (connected: {sorted(self._peers)})")
        if local is None:
            raise KVTransferError(f"pull {req_id}: transport {self.name!r} has no pool")
        if req_id in self._xfers or req_id in self._done or req_id in self._failed:
            raise ValueError(f"pull {req_id}: a pull with this req_id is still unreported")
        if remote.block_bytes != local.block_bytes:
            raise KVTransferError(f"block sizes differ: peer {remote.block_bytes} B, ours {local.block_bytes} B")
        runs = block_runs(remote_blocks, local_blocks)
        check_blocks(remote_blocks, remote.num_blocks, "remote")
        check_blocks(local_blocks, local.num_blocks, "local")
        bb = local.block_bytes
        ldescs = self._agent.get_xfer_descs([(local.addr + l0 * bb, n * bb, 0) for _, l0, n in runs], "DRAM")
        rdescs = self._agent.get_xfer_descs([(remote.addr + r0 * bb, n * bb, 0) for r0, _, n in runs], "DRAM")
        try:
            handle = self._agent.initialize_xfer("READ", ldescs, rdescs, peer)
        except Exception:  # nixl raises its own error types per status code
            self._failed.append(req_id)
            return
        self._xfers[req_id] = handle
        try:
            state = self._agent.transfer(handle)
        except Exception:  # e.g. NIXL_ERR_REMOTE_DISCONNECT when the peer is gone
            state = "ERR"
        self._settle(req_id, state)

    def poll(self) -> tuple[list[int], list[int]]:
        # Always call into the agent, even with nothing of ours in flight: a peer's handshake
        # or read of our memory may need this side to make progress.
        self._agent.get_new_notifs()
        for req_id, handle in list(self._xfers.items()):
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception:
                state = "ERR"
            self._settle(req_id, state)
        self._doomed = [h for h in self._doomed if not self._release(h)]
        done, failed = self._done, self._failed
        self._done, self._failed = [], []
        return done, failed

    def _settle(self, req_id: int, state: str) -> None:
        if state == "PROC":
            return
        handle = self._xfers.pop(req_id)
        if not self._release(handle):
            self._doomed.append(handle)
        (self._done if state == "DONE" else self._failed).append(req_id)

    def _release(self, handle: Any) -> bool:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:  # still posted: NIXL refuses to free it until it can abort it
            return False
        return True

    def cancel(self, req_id: int) -> None:
        handle = self._xfers.pop(req_id, None)
        if handle is not None and not self._release(handle):
            self._doomed.append(handle)  # retried on every poll
        self._done = [r for r in self._done if r != req_id]
        self._failed = [r for r in self._failed if r != req_id]

    def close(self) -> None:
        for handle in [*self._xfers.values(), *self._doomed]:
            self._release(handle)
        self._xfers.clear()
        self._doomed.clear()
        for name in self._peers:
            try:
                self._agent.remove_remote_agent(name)
            except Exception:
                pass  # already disconnected
        self._peers.clear()
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None
        self._pool = self._region = None
