"""KV transfer with a NIXL agent over UCX (the optional ``nixl`` extra).

The agent lives in the process that owns the pool (GPU memory registers only in-process).
It runs without a progress thread: UCX moves data and completes handshakes only inside calls
into the agent, so ``poll`` must be called on both sides while anything is pending — the
passive (prefill) side included, or connection setup hangs. On CPU this registers DRAM; UCX
then reads with process_vm_readv (both processes under one user), inside ``transfer``: a pull
returns only once its bytes are copied (about 1 ms for 8 MB on the development VM), as the
shared-memory transport's does. A pool that is a CUDA tensor registers as VRAM on its device;
between GPUs of one host UCX then copies over NVLink (its cuda_ipc transport), and a pull
returns at once and completes in ``poll``.

Descriptor lists are prepared once: one descriptor per block of our pool at
``register_pool``, one per block of a peer's pool at ``connect``. A pull then names blocks
by index (``make_prepped_xfer``), and NIXL merges indices that are contiguous on both sides
into one descriptor in C++, so a request allocated as one run costs one descriptor and a few
microseconds of host time whatever its length (building descriptor lists per request through
``initialize_xfer`` cost 60-80 us per request on the development VM). Block ids are checked
by NIXL; only when it refuses a pull do we look at them again, to say what was wrong.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np

from lockstep.transports.kv.base import (KVTransferError, PeerInfo, Region, as_block_ids, check_blocks, pool_device,
                                          pool_region)

# NIXL logs each agent's start at INFO to stdout, which is where `lockstep generate` streams
# its answer: warnings and errors only, unless the user asks for more.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

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
    mem: str = "DRAM"  # NIXL memory type of the pool: DRAM or VRAM
    device: int = 0  # the CUDA device of a VRAM pool


def available() -> bool:
    return _IMPORT_ERROR is None


class _Peer(NamedTuple):
    region: Region
    dlist: Any  # prepared descriptors, one per block of the peer's pool


def _block_dlist(region: Region, device: int = 0) -> np.ndarray:
    """(num_blocks, 3) rows of (address, length, device) for ``prep_xfer_dlist``."""
    d = np.zeros((region.num_blocks, 3), np.uint64)
    d[:, 0] = region.addr + np.arange(region.num_blocks, dtype=np.uint64) * np.uint64(region.block_bytes)
    d[:, 1] = region.block_bytes
    d[:, 2] = device
    return d


class NixlKVTransport:
    """``KVTransport`` over a NIXL agent; ``name`` must be unique among connected agents."""

    def __init__(self, name: str, backends: Sequence[str] = ("UCX",)):
        if _IMPORT_ERROR is not None:
            raise KVTransferError(f"NixlKVTransport needs nixl (pip install 'lockstep[nixl]'): {_IMPORT_ERROR}")
        self.name = name
        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=list(backends)))
        self._pool: Any = None  # kept alive: the agent holds its address
        self._region: Region | None = None
        self._mem = ("DRAM", 0)
        self._reg = None
        self._dlist: Any = None  # prepared descriptors, one per block of our pool
        self._peers: dict[str, _Peer] = {}
        self._xfers: dict[int, Any] = {}  # req_id -> handle of a pull in flight
        self._doomed: list[Any] = []  # cancelled handles NIXL would not release yet
        self._done: list[int] = []
        self._failed: list[int] = []

    def register_pool(self, pool: Any) -> None:
        if self._region is not None:
            raise KVTransferError(f"transport {self.name!r} already has a pool: one pool per transport")
        region = pool_region(pool, gpu=True)
        mem, dev = pool_device(pool)
        try:
            self._reg = self._agent.register_memory([(region.addr, region.num_blocks * region.block_bytes, dev, "")],
                                                    mem)
        except Exception as e:
            if mem != "VRAM":
                raise
            # Seen on a host whose torch is built for CUDA 13: UCX's CUDA memory hooks
            # (libucm_cuda) need libcudart.so.12, so UCX takes GPU memory for host memory.
            raise KVTransferError(f"transport {self.name!r}: NIXL could not register the KV pool on cuda:{dev} "
                                  f"({e}). UCX needs its CUDA modules: libcudart.so.12 must be on the library "
                                  "path (LD_LIBRARY_PATH), e.g. from the nvidia-cuda-runtime-cu12 wheel") from e
        self._dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", _block_dlist(region, dev), mem)
        self._pool, self._region, self._mem = pool, region, (mem, dev)

    def export(self) -> PeerInfo:
        if self._region is None:
            raise KVTransferError(f"transport {self.name!r}: register_pool before export")
        r = self._region
        return PeerInfo(msgspec.msgpack.encode(_Meta(self._agent.get_agent_metadata(), r.addr, r.num_blocks,
                                                     r.block_bytes, *self._mem)))

    def connect(self, peer: PeerInfo) -> str:
        if peer.fds:
            raise KVTransferError(f"NIXL peer info carries no fds, got {len(peer.fds)}")
        meta = msgspec.msgpack.decode(peer.metadata, type=_Meta)
        name = self._agent.add_remote_agent(meta.agent)
        name = name.decode() if isinstance(name, bytes) else name
        region = Region(meta.addr, meta.num_blocks, meta.block_bytes)
        try:
            dlist = self._agent.prep_xfer_dlist(name, _block_dlist(region, meta.device), meta.mem)
        except Exception:
            self._agent.remove_remote_agent(name)
            raise
        self._peers[name] = _Peer(region, dlist)
        return name

    def pull(self, req_id: int, peer: str, remote_blocks: Sequence[int], local_blocks: Sequence[int]) -> None:
        p, local = self._peers.get(peer), self._region
        if p is None:
            raise KVTransferError(f"pull {req_id}: not connected to {peer!r} (connected: {sorted(self._peers)})")
        if local is None:
            raise KVTransferError(f"pull {req_id}: transport {self.name!r} has no pool")
        if req_id in self._xfers or req_id in self._done or req_id in self._failed:
            raise ValueError(f"pull {req_id}: a pull with this req_id is still unreported")
        if p.region.block_bytes != local.block_bytes:
            raise KVTransferError(f"block sizes differ: peer {p.region.block_bytes} B, ours {local.block_bytes} B")
        if len(remote_blocks) == 0 and len(local_blocks) == 0:
            self._done.append(req_id)  # nothing to move (NIXL refuses an empty transfer)
            return
        try:
            handle = self._agent.make_prepped_xfer("READ", self._dlist, local_blocks, p.dlist, remote_blocks)
        except Exception:  # nixl raises its own error types per status code
            self._check(remote_blocks, local_blocks, p.region, local)  # a bad argument: say which
            self._failed.append(req_id)
            return
        self._xfers[req_id] = handle
        try:
            state = self._agent.transfer(handle)
        except Exception:  # e.g. NIXL_ERR_REMOTE_DISCONNECT when the peer is gone
            state = "ERR"
        self._settle(req_id, state)

    @staticmethod
    def _check(remote_blocks: Sequence[int], local_blocks: Sequence[int], remote: Region, local: Region) -> None:
        r, l = as_block_ids(remote_blocks, "remote"), as_block_ids(local_blocks, "local")
        if len(r) != len(l):
            raise ValueError(f"pull pairs remote and local blocks: got {len(r)} remote and {len(l)} local")
        check_blocks(r, remote.num_blocks, "remote")
        check_blocks(l, local.num_blocks, "local")

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
        for name, p in self._peers.items():
            self._agent.release_dlist_handle(p.dlist)
            try:
                self._agent.remove_remote_agent(name)
            except Exception:
                pass  # already disconnected
        self._peers.clear()
        if self._dlist is not None:
            self._agent.release_dlist_handle(self._dlist)
            self._dlist = None
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None
        self._pool = self._region = None
