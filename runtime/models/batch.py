"""One forward pass's inputs: a flat batch of new tokens from several sequences, with the
paged-KV addressing each sequence needs.

Sequences may be prefilling a chunk, decoding one token, or resuming after a prefix-cache
hit; the model does not care which. Every new token's latent KV is written to its slot
first, then sequence i attends over cache positions [0, seq_lens[i]) read through its block
table, so cached prefixes (shared blocks included) and new tokens are treated alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch



def to_device(a, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host data (a numpy array or sequence) on ``device`` without making the host wait for
    the GPU. A copy from pageable memory ends in a stream synchronize: the host would wait for
    every step already launched (and a step launched ahead would gain nothing). On CUDA the
    data goes through pinned memory from torch's caching host allocator, which keeps the
    block until the copy is done, and a non-blocking copy."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)

@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    query_start: torch.Tensor  # (B+1,) int64: sequence i's new tokens are [qs[i], qs[i+1])
    seq_lens: torch.Tensor  # (B,) int64: context length after this step (cached + new)
    block_tables: torch.Tensor  # (B, max_blocks) int32; padding past the used blocks
    slot_mapping: torch.Tensor  # (T,) int64: block_id * block_size + offset
    sample_index: torch.Tensor  # (S,) int64: rows of T whose logits are returned

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @classmethod
    def build(cls, new_tokens: Sequence[Sequence[int]], num_cached: Sequence[int],
              block_tables: Sequence[Sequence[int]], block_size: int,
              device: torch.device | str = "cpu") -> ForwardBatch:
        """Lay out a batch from per-sequence lists: new token ids, how many tokens of the
        sequence are already in the cache, and its block ids. Samples each last new token."""
        if not (len(new_tokens) == len(num_cached) == len(block_tables)):
            raise ValueError("new_tokens, num_cached and block_tables need one entry per sequence")
        lens = [len(t) for t in new_tokens]
        if min(lens, default=1) < 1:
            raise ValueError("every sequence in a batch needs at least one new token")
        ids = np.concatenate([np.asarray(t, dtype=np.int64) for t in new_tokens])
        pos = np.concatenate([np.arange(c, c + n) for c, n in zip(num_cached, lens)])
        qs = np.concatenate([[0], np.cumsum(lens)])
        width = max(len(b) for b in block_tables)
        table = np.zeros((len(lens), width), dtype=np.int32)
        for i, row in enumerate(block_tables):
            if len(row) * block_size < num_cached[i] + lens[i]:
                raise ValueError(f"sequence {i}: {len(row)} blocks of {block_size} cannot hold "
                                 f"{num_cached[i] + lens[i]} tokens")
            table[i, :len(row)] = row
        seq_of_token = np.repeat(np.arange(len(lens)), lens)
        slots = table[seq_of_token, pos // block_size].astype(np.int64) * block_size + pos % block_size

        def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(a, dtype=dtype, device=device)

        return cls(t(ids, torch.int64), t(pos, torch.int64), t(qs, torch.int64),
                   t(np.asarray(num_cached) + lens, torch.int64), t(table, torch.int32),
                   t(slots, torch.int64), t(qs[1:] - 1, torch.int64))

    def host_meta(self) -> tuple[np.ndarray, np.ndarray]:
        """(query_start, seq_lens) on the host: what a forward needs to plan its launches
        (one sync; the runtime's own steps get them from HostBatch without one)."""
        return self.query_start.cpu().numpy(), self.seq_lens.cpu().numpy()

    def check_integrity(self, block_size: int, num_blocks: int) -> None:
        """Raise ValueError if the fields disagree (called in tests, not per step)."""
        qs, lens = self.query_start.tolist(), self.seq_lens.tolist()
        n_tok = int(self.input_ids.shape[0])

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"ForwardBatch: {msg}")

        need(len(qs) == len(lens) + 1 and qs[0] == 0 and qs[-1] == n_tok,
             f"query_start {qs} must run from 0 to the {n_tok} tokens, one more entry than seq_lens")
        need(self.positions.shape == self.slot_mapping.shape == (n_tok,),
             "positions and slot_mapping need one entry per token")
        need(self.block_tables.shape[0] == len(lens), "block_tables needs one row per sequence")
        for i, (a, b) in enumerate(zip(qs, qs[1:])):
            need(b > a, f"sequence {i} has no new tokens")
            want = torch.arange(lens[i] - (b - a), lens[i])
            need(torch.equal(self.positions[a:b].cpu(), want),
                 f"sequence {i}: positions must be {lens[i] - (b - a)}..{lens[i] - 1}")
            blocks = self.block_tables[i, :-(-lens[i] // block_size)].cpu().long()
            need(blocks.shape[0] * block_size >= lens[i], f"sequence {i}: block table too short")
            need(bool(((blocks >= 0) & (blocks < num_blocks)).all()),
                 f"sequence {i}: block ids must be in [0, {num_blocks})")
            pos = want
            slots = blocks[pos // block_size] * block_size + pos % block_size
            need(torch.equal(self.slot_mapping[a:b].cpu(), slots),
                 f"sequence {i}: slot_mapping disagrees with its block table")
        need(torch.unique(self.slot_mapping).numel() == n_tok, "two tokens write the same slot")
        s = self.sample_index
        need(bool(((s >= 0) & (s < n_tok)).all()), "sample_index must index the batch's tokens")


@dataclass(frozen=True)
class HostBatch:
    """A forward batch while it is still numpy on the host, built from a StepPlan: the
    reference path copies it into a ForwardBatch, the CUDA fast path into its persistent
    buffers. Only sequences with new tokens appear; ``rows`` are their block-table rows
    (batch slots) in the runtime's table."""

    input_ids: np.ndarray  # (T,) int64
    positions: np.ndarray  # (T,) int64
    query_start: np.ndarray  # (B+1,) int64
    seq_lens: np.ndarray  # (B,) int64
    rows: np.ndarray  # (B,) int64
    width: int  # block-table columns the batch reads
    slot_mapping: np.ndarray  # (T,) int64
    sample_index: np.ndarray  # (S,) int64

    @property
    def num_new(self) -> np.ndarray:
        return np.diff(self.query_start)

    def is_decode(self) -> bool:
        """One new token per sequence."""
        return len(self.input_ids) == len(self.seq_lens)

    def forward_batch(self, tables: np.ndarray, device: torch.device | str) -> ForwardBatch:
        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        table = np.ascontiguousarray(tables[self.rows, :self.width])
        return ForwardBatch(input_ids=t(self.input_ids), positions=t(self.positions),
                            query_start=t(self.query_start), seq_lens=t(self.seq_lens),
                            block_tables=t(table), slot_mapping=t(self.slot_mapping),
                            sample_index=t(self.sample_index))
