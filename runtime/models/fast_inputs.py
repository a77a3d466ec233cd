"""What one fast-path forward is fed: how its tokens attend (``AttnPlan``, decided on the
host before any launch) and its device inputs (``FastInputs``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .batch import to_device

DECODE_MAX_NEW = 16  # a sequence feeding at most this many tokens attends per token
MIN_LEN_BUCKET = 1024  # shortest context bound decode launches are shaped for


def len_bucket(max_len: int, cap: int) -> int:
    """The context bound a decode launch is shaped for (its split count): a power of two, so
    a CUDA graph serves a range of lengths."""
    b = MIN_LEN_BUCKET
    while b < max_len:
        b *= 2
    return max(min(b, cap), max_len)


@dataclass(frozen=True)
class AttnPlan:
    """How this forward's tokens attend, decided on the host before any launch."""

    n_dec: int  # tokens that attend per token (absorbed decode)
    dec: torch.Tensor | None  # their indices; None when every token does
    dec_len_bound: int  # a bound on their context lengths (shapes the decode split)
    n_pf: int  # tokens of prefilling sequences
    pf: torch.Tensor | None  # their indices; None when every token prefills
    pf_rows: torch.Tensor | None  # (P,) table rows of the prefilling sequences
    pf_cu: torch.Tensor | None  # (P+1,) int32 offsets of their new tokens (in pf order)
    pf_max_new: int
    pf_prefix: list[int]  # cached tokens before each one's new tokens

    @classmethod
    def decode_only(cls, n: int, len_bound: int) -> AttnPlan:
        return cls(n, None, len_bound, 0, None, None, None, 0, [])

    @classmethod
    def build(cls, num_new: np.ndarray, seq_lens: np.ndarray, rows: np.ndarray, len_cap: int,
              device) -> AttnPlan:
        dec_seq = num_new <= DECODE_MAX_NEW
        t = int(num_new.sum())
        bound = len_bucket(int(seq_lens[dec_seq].max()), len_cap) if dec_seq.any() else 0
        if dec_seq.all():
            return cls.decode_only(t, bound)
        pf_seq = ~dec_seq
        tok_dec = np.repeat(dec_seq, num_new)
        mixed = bool(dec_seq.any())

        def idx(mask: np.ndarray) -> torch.Tensor:
            return to_device(np.flatnonzero(mask), device)

        new = num_new[pf_seq]
        cu = np.zeros(len(new) + 1, np.int32)
        np.cumsum(new, out=cu[1:])
        return cls(int(tok_dec.sum()), idx(tok_dec) if mixed else None, bound,
                   int((~tok_dec).sum()), idx(~tok_dec) if mixed else None,
                   to_device(rows[pf_seq].astype(np.int64), device), to_device(cu, device),
                   int(new.max()), (seq_lens[pf_seq] - new).tolist())


@dataclass(frozen=True)
class FastInputs:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    slot_mapping: torch.Tensor  # (T,) int64; -1 marks a padding token (nothing stored)
    tables: torch.Tensor  # (R, W) int32 block tables
    tok_rows: torch.Tensor  # (T,) int64: the table row of each token's sequence
    plan: AttnPlan
    sample_index: torch.Tensor | None = None  # rows whose logits are returned; None: all
    padded: bool = False  # some tokens are padding (a CUDA-graph batch)
    # Each row's last sampled token (int64 by table row): an input id of -1 (PLACEHOLDER)
    # is read from it inside the forward, so a captured graph reads it at replay.
    last: torch.Tensor | None = None
