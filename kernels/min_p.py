"""vLLM's min_p in place, one program a row: the row's largest logit, then every logit whose
probability (after temperature) is below min_p times the largest one's set to -inf, that is
``(x - max) < t * log(min_p)``.

The torch version (``lockstep.runtime.logits.LogitsProcessors._min_p``, which the CPU runs)
gathers the rows, takes their max, subtracts, compares, fills and scatters them back: about
eight passes over (rows, vocab) against three here (read for the max, read and write). The
arithmetic is the same (a float32 subtraction and comparison): the results are equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _min_p_kernel(x_ptr, s_x, rows_ptr, floor_ptr, vocab, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r).to(tl.int64)
    floor = tl.load(floor_ptr + r)
    base = x_ptr + row * s_x
    top = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        top = tl.maximum(top, tl.load(base + offs, mask=offs < vocab, other=float("-inf")))
    m = tl.max(top, 0)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        keep = offs < vocab
        x = tl.load(base + offs, mask=keep, other=0.0)
        tl.store(base + offs, tl.where(x - m < floor, float("-inf"), x), mask=keep)


def min_p_(x: torch.Tensor, rows: torch.Tensor, floor: torch.Tensor) -> None:
    """Set ``x[rows[i], v]`` (float32 [R, V], in place) to -inf where it is more than
    ``-floor[i]`` below its row's largest logit (``floor``: t * log(min_p), float32 [n])."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"min_p_: x must be contiguous float32, got {x.dtype} (contiguous {x.is_contiguous()})")
    if len(rows):
        _min_p_kernel[(len(rows),)](x, x.stride(0), rows, floor.contiguous(), x.shape[1], BLOCK=BLOCK, num_warps=8)
