"""All-to-all by writing into the peers' memory: padded expert dispatch without NCCL calls.

A padded exchange moves a fixed-size block from every rank to every rank. Here each rank
copies its block for rank d straight into rank d's receive area (the block of this rank
there), then all ranks meet at a barrier, after which every receive area is complete: world
copies and one barrier, all capturable in a CUDA graph. On two H200s a layer's two such
exchanges took 43 us at 64 tokens a rank and 74 at 256, against NCCL's 44 and 102 inside a
CUDA graph (``benchmarks/results/2026-11-30-h200x2-session13.md``). The larger gain is the
direct mode (``direct``: areas for rows, tags and outputs, written and read by the kernels
of ``kernels.ep_dispatch``), which also drops the send buffer and the ops around it.

Each channel has its own receive area per rank: ``world`` blocks of up to ``rows`` rows of
``row_bytes[c]`` bytes. A step's block size (``n`` rows, the same on every rank) sets the
layout, so a channel's received rows are contiguous, block s from rank s, as NCCL's
``all_to_all_single`` lays them out.

Reuse is safe with one barrier per exchange as long as a rank reads channel c's area
before it enters the barrier of the next exchange on another channel, and the channels
alternate (dispatch on 0, combine on 1, dispatch on 0...): a peer writes channel 0 again
only after passing the combine barrier, which this rank enters after reading channel 0.
In the direct mode a layer has two barriers: a rank reads its rows and tags (and resets the
tags) before the second, and its peers read its outputs before the first barrier of the next
layer, so no area is rewritten before it has been read.

On CUDA the areas are PyTorch symmetric memory (``torch.distributed._symmetric_memory``:
peer mappings over NVLink, a barrier kernel with release / acquire semantics across the
GPUs); multicast is never used. On CPU (tests, with Gloo) they are one shared-memory file
mapped by every rank, and the barrier is the process group's.
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import leftovers


def host_id() -> str:
    """This machine, as the ranks of a group compare it: the host name and the kernel's boot
    id (two containers may share a name, not a boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class PeerExchange:
    def __init__(self, rows: int, row_bytes: Sequence[int], world: int, rank: int, group, device: torch.device):
        if rows < 1 or not row_bytes or min(row_bytes) < 1:
            raise ValueError(f"peer exchange needs rows >= 1 and row sizes >= 1 byte, got {rows} rows of "
                             f"{list(row_bytes)} bytes")
        self.rows, self.row_bytes, self.world, self.rank = rows, tuple(int(b) for b in row_bytes), world, rank
        self._offsets, total = [], 0
        for b in self.row_bytes:
            self._offsets.append(total)
            total += -(-world * rows * b // 16) * 16  # each channel's area 16-byte aligned
        self.nbytes = total
        self.direct = False  # laid out for kernels that address the peers' areas (attach_peer_exchange)
        self.bases: list[torch.Tensor] = []
        self._map = None
        self._handle = self._buf = None
        self._group = group
        device = torch.device(device)
        if device.type == "cuda":
            from torch.distributed import _symmetric_memory as symm

            name = (group if group is not None else dist.group.WORLD).group_name
            self._buf = symm.empty(total, dtype=torch.uint8, device=device)
            self._handle = symm.rendezvous(self._buf, name)
            self._peers = [self._handle.get_buffer(r, (total,), torch.uint8) for r in range(world)]
            self._barrier = lambda: self._handle.barrier(channel=0)
        else:
            self._peers = self._shared_file(total, group)
            self._barrier = lambda: dist.barrier(group=group)

    def _shared_file(self, total: int, group) -> list[torch.Tensor]:
        """Every rank's area in one file under /dev/shm, mapped by all ranks; the file is
        unlinked as soon as every rank has mapped it (or failed to), so nothing outlives the
        set-up."""
        name = [f"/dev/shm/lockstep-ep-{os.getpid()}-{secrets.token_hex(6)}" if self.rank == 0 else None]
        dist.broadcast_object_list(name, src=0, group=group)
        path = name[0]
        # Every rank makes the same two all-reduces whatever fails, so no rank waits on a
        # collective that another skipped; the file is gone after the second.
        error = None
        try:
            if self.rank == 0:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                leftovers.track(path)  # removed even if this process is ended mid-set-up
                try:
                    os.ftruncate(fd, total * self.world)
                finally:
                    os.close(fd)
        except OSError as e:
            error = e
        if self._failed(error, group) and error is None:
            error = RuntimeError(f"peer exchange: rank 0 could not create {path}")
        if error is None:
            try:
                fd = os.open(path, os.O_RDWR)
                try:
                    self._map = mmap.mmap(fd, total * self.world)
                finally:
                    os.close(fd)
            except OSError as e:
                error = e
        failed = self._failed(error, group)
        if self.rank == 0:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            leftovers.untrack(path)
        if failed:
            if self._map is not None:
                self._map.close()
                self._map = None
            raise error or RuntimeError(f"peer exchange: another rank could not map {path}")
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        return [whole[r * total:(r + 1) * total] for r in range(self.world)]

    @staticmethod
    def _failed(error, group) -> bool:
        """Whether any rank of ``group`` failed (``error`` is this rank's), as every rank learns
        it from one all-reduce."""
        flag = torch.tensor([int(error is not None)])
        dist.all_reduce(flag, group=group)
        return bool(flag.item())

    def addresses(self, channel: int) -> torch.Tensor:
        """int64 [world]: where each rank's area of ``channel`` starts, as this process sees
        it (for kernels that read or write the peers' areas themselves)."""
        o = self._offsets[channel]
        dev = self._peers[self.rank].device
        return torch.tensor([p.data_ptr() + o for p in self._peers], dtype=torch.int64, device=dev)

    def local(self, channel: int, n: int) -> torch.Tensor:
        """This rank's area of ``channel`` laid out for blocks of ``n`` rows, as bytes."""
        return self._area(self.rank, channel, n)

    def fill(self, channel: int, value: int) -> None:
        """Every byte of this rank's whole area of ``channel`` set to ``value``, then a
        barrier of the process group (set-up: no rank writes another's area before)."""
        self._area(self.rank, channel, self.rows).fill_(value)
        if self._peers[self.rank].is_cuda:
            torch.cuda.current_stream().synchronize()
        dist.barrier(group=self._group)

    def barrier(self) -> None:
        """Every rank's writes into the areas so far are visible to every rank after it."""
        self._barrier()

    def _area(self, rank: int, channel: int, n: int) -> torch.Tensor:
        """(world * n, row_bytes) uint8: ``rank``'s receive area of ``channel`` laid out for
        blocks of ``n`` rows."""
        b, o = self.row_bytes[channel], self._offsets[channel]
        return self._peers[rank][o:o + self.world * n * b].view(self.world * n, b)

    def exchange(self, channel: int, send: torch.Tensor) -> torch.Tensor:
        """``send`` (world * n rows of row_bytes[channel] bytes, uint8): block d goes to rank d.
        Returns this rank's received rows, block s from rank s, as ``all_to_all_single``
        would; a view of the receive area, valid until the next exchange on this channel."""
        b = self.row_bytes[channel]
        if send.dtype != torch.uint8 or send.dim() != 2 or send.shape[1] != b or send.shape[0] % self.world:
            raise ValueError(f"peer exchange channel {channel}: send must be uint8 (world * n, {b}), "
                             f"got {send.dtype} {tuple(send.shape)}")
        n = send.shape[0] // self.world
        if n > self.rows:
            raise ValueError(f"peer exchange channel {channel}: {n} rows a block, room for {self.rows}")
        for d in range(self.world):
            self._area(d, channel, n)[self.rank * n:(self.rank + 1) * n].copy_(send[d * n:(d + 1) * n])
        self._barrier()
        return self._area(self.rank, channel, n)

    def received(self, channel: int, rows: int) -> torch.Tensor:
        """This rank's receive area of ``channel``, its first ``rows`` rows, as bytes."""
        return self._area(self.rank, channel, rows // self.world)

    def close(self) -> None:
        """Drop every view of the areas (call before the process group goes; graphs that
        hold their addresses must not replay after)."""
        self._peers, self.bases = [], []
        self._handle = self._buf = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still held somewhere: the mapping goes with it
                pass
            self._map = None
