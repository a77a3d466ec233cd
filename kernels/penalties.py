"""vLLM's repetition, frequency and presence penalties applied in place, in one pass over each
penalized row: read its logits, its slot's output counts and prompt marks, write the logits.

The torch version (``lockstep.runtime.logits.penalize_torch``, which the CPU runs, and this
kernel's reference) gathers the rows and the count table and builds a dozen (rows, vocab) temporaries: at 256 rows of v2-lite's 102,400
ids about 1.2 GB of traffic a decode step, against 13 bytes an element here. The arithmetic
is the same, in the same order, with a correctly rounded division: the results are equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _penalize_kernel(x_ptr, s_x, rows_ptr, slots_ptr, counts_ptr, s_c, seen_ptr, s_s, par_ptr, vocab,
                     BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < vocab
    row = tl.load(rows_ptr + r).to(tl.int64)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    rep, freq, pres = tl.load(par_ptr + r * 3), tl.load(par_ptr + r * 3 + 1), tl.load(par_ptr + r * 3 + 2)
    x = tl.load(x_ptr + row * s_x + offs, mask=m, other=0.0)
    n = tl.load(counts_ptr + slot * s_c + offs, mask=m, other=0)
    seen = tl.load(seen_ptr + slot * s_s + offs, mask=m, other=0)
    used = n > 0
    # (tl.div_rn: plain `/` is approximate on the GPU; torch's division is correctly rounded)
    y = tl.where(used | (seen != 0), tl.where(x > 0, tl.div_rn(x, rep), x * rep), x)
    y = y - freq * n.to(tl.float32) - pres * used.to(tl.float32)
    tl.store(x_ptr + row * s_x + offs, y, mask=m)


def penalize(x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
             params: torch.Tensor) -> None:
    """Penalize ``x`` (float32 [R, V]) in place: row ``rows[i]`` by the counts and prompt
    marks of slot ``slots[i]`` (``counts`` int32 [S, V], ``seen`` bool [S, V]) with
    ``params[i]`` = (repetition, frequency, presence) (float32 [n, 3])."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"penalize: x must be contiguous float32, got {x.dtype} (contiguous {x.is_contiguous()})")
    n, vocab = len(rows), x.shape[1]
    if n == 0:
        return
    grid = (n, triton.cdiv(vocab, BLOCK))
    _penalize_kernel[grid](x, x.stride(0), rows, slots, counts, counts.stride(0), seen.view(torch.uint8),
                           seen.stride(0), params.contiguous(), vocab, BLOCK=BLOCK, num_warps=4,
                           enable_fp_fusion=False)  # (no fused multiply-add: the torch ops round each step)
