"""The Triton kernels against their plain-torch references, on fresh random inputs with fixed
seeds. On a CUDA machine the kernels run compiled at model-like shapes; without one they run
under TRITON_INTERPRET=1 at tiny shapes (the interpreter executes every program in numpy), so
`make test` covers their logic on any x86 machine. Only the long-row and full-size cases,
which take minutes in the interpreter, need CUDA.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # Must precede the kernels' import: triton.jit decides compiled vs interpreted there.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is installed on x86_64 only (see pyproject's test extra)")

from lockstep.kernels import _util  # noqa: E402
from lockstep.kernels.fused_moe import (  # noqa: E402
    fused_moe, fused_moe_reference, moe_sum_reference, quantize_fp8_blockwise)
from lockstep.kernels.moe_align import ALIGN_KERNEL_MAX_PAIRS, moe_align, moe_align_reference  # noqa: E402
from lockstep.kernels.kv_store import kv_store, kv_store_reference, mla_prep_store, quantize_per_token  # noqa: E402
from lockstep.kernels.mla_decode import (  # noqa: E402
    LAZY_MARGIN, LOG2E, merge_reference, mla_decode, mla_decode_partials, mla_decode_reference)
from lockstep.kernels.mla_prefill import mla_attention, mla_prefill, mla_prefill_reference  # noqa: E402
from lockstep.kernels.topk import topk, topk_config, topk_reference  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
BF16 = torch.bfloat16
NEEDS_CUDA = pytest.mark.skipif(not CUDA, reason="full-size shapes take minutes in the CPU interpreter")

if not CUDA and not _util.INTERPRET:
    raise RuntimeError("lockstep.kernels was imported before TRITON_INTERPRET=1 was set; run "
                       "this file in its own process or export TRITON_INTERPRET=1")


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def randn(*shape, g, dtype=BF16, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


def close(out: torch.Tensor, ref: torch.Tensor, tol: float = 2e-2) -> None:
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def same_fp8(a: torch.Tensor, b: torch.Tensor) -> None:
    """FP8 codes equal, up to one code in a rare element (different hardware conversions)."""
    d = (a.view(torch.uint8).int() - b.view(torch.uint8).int()).abs()
    assert int(d.max()) <= 1 and float((d > 0).float().mean()) < 1e-3


# -- KV store ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8", [False, True])
def test_kv_store_matches_reference(fp8):
    g = gen(1)
    dl, dr, bs, blocks = (512, 64, 64, 16) if CUDA else (32, 16, 4, 6)
    t = 40 if CUDA else 7
    latent, k_pe = randn(t, dl, g=g), randn(t, dr, g=g, scale=3.0)
    slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(1))[:t].to(DEV)
    slots[2] = -1  # a padding token stores nothing
    dtype = _util.FP8 if fp8 else BF16
    cache, ref = (torch.zeros(blocks, bs, dl + dr, device=DEV).to(dtype) for _ in range(2))
    scale, ref_scale = (torch.zeros(blocks, bs, device=DEV) if fp8 else None for _ in range(2))
    kv_store(cache, latent, k_pe, slots, scale)
    kv_store_reference(ref, latent, k_pe, slots, ref_scale)
    if fp8:
        same_fp8(cache, ref)
        torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    else:
        assert torch.equal(cache, ref)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("interleaved", [True, False])
def test_mla_prep_store_is_norm_rope_and_kv_store(fp8, interleaved):
    """One launch: the latent's RMS norm, rope of k_pe and of every head's q_pe, and the cache
    entry, against the model's rms_norm / apply_rope and kv_store_reference on strided views
    (q_pe a slice of q's heads, the tail a slice of the fused projection's rows)."""
    from lockstep.runtime.models.deepseek_v3 import rms_norm
    from lockstep.runtime.models.rope import apply_rope

    g = gen(3)
    heads, dn, dl, dr, bs, blocks = (16, 128, 512, 64, 16, 16) if CUDA else (3, 8, 32, 16, 4, 6)
    t = 40 if CUDA else 7
    q = randn(t, heads, dn + dr, g=g)
    f = randn(t, 24 + dl + dr, g=g, scale=2.0)
    q_pe, tail = q[..., dn:], f[:, 24:]
    pos = torch.arange(t, device=DEV).float()[:, None] * torch.linspace(0.01, 1.0, dr // 2, device=DEV)
    cos, sin = pos.cos(), pos.sin()
    w = randn(dl, g=g, scale=0.5) + 1
    slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(3))[:t].to(DEV)
    slots[1] = -1  # padding: nothing stored
    dtype = _util.FP8 if fp8 else BF16
    cache, ref = (torch.zeros(blocks, bs, dl + dr, device=DEV).to(dtype) for _ in range(2))
    scale, ref_scale = (torch.zeros(blocks, bs, device=DEV) if fp8 else None for _ in range(2))
    qo, lat, kpe = mla_prep_store(q_pe, tail, cos, sin, w, 1e-6, cache, slots, scale, interleaved=interleaved)
    want_lat = rms_norm(tail[:, :dl], w, 1e-6)
    pe = apply_rope(torch.cat([q_pe, tail[:, None, dl:]], dim=1), cos[:, None], sin[:, None], interleaved)
    close(lat, want_lat)
    close(qo, pe[:, :-1])
    close(kpe, pe[:, -1])
    if not CUDA:  # the interpreter rounds to bf16 as the GPU does (_util.to_dtype): bit for bit
        assert torch.equal(lat, want_lat) and torch.equal(qo, pe[:, :-1]) and torch.equal(kpe, pe[:, -1])
    kv_store_reference(ref, lat, kpe, slots, ref_scale)  # what it stored is what it returned
    if fp8:
        same_fp8(cache, ref)
        torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    else:
        assert torch.equal(cache, ref)
    with pytest.raises(ValueError, match="cos"):
        mla_prep_store(q_pe, tail, cos[:, :2], sin, w, 1e-6, cache, slots, scale, interleaved=interleaved)


def test_kv_store_rejects_bad_arguments():
    cache = torch.zeros(2, 4, 48, dtype=_util.FP8, device=DEV)
    lat, pe = torch.zeros(3, 32, dtype=BF16, device=DEV), torch.zeros(3, 16, dtype=BF16, device=DEV)
    slots = torch.zeros(3, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="scale"):
        kv_store(cache, lat, pe, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_store(cache.to(BF16), lat, pe, slots[:2])
    with pytest.raises(ValueError, match="cache entries"):
        kv_store(cache.to(BF16), lat, pe[:, :8], slots)


# -- MLA decode ---------------------------------------------------------------------------------

def _decode_case(g, fp8: bool):
    b, h, dl, dr, bs = (9, 16, 512, 64, 16) if CUDA else (3, 4, 32, 16, 4)  # CUDA: the runtime's pages
    lens = [1000, 0, 1, 64, 577, 4096, 130, 2049, 63] if CUDA else [13, 0, 5]
    blocks_per = max(-(-n // bs) for n in lens)
    perm = torch.randperm(b * blocks_per, generator=torch.Generator().manual_seed(2))
    tables = perm.view(b, blocks_per).to(torch.int32).to(DEV)
    cache = randn(b * blocks_per, bs, dl + dr, g=g)
    scale = None
    if fp8:
        cache, scale = quantize_per_token(cache)
    q_lat, q_pe = randn(b, h, dl, g=g, scale=0.2), randn(b, h, dr, g=g, scale=0.2)
    return q_lat, q_pe, cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEV), scale


# Tiles within a page and tiles of whole pages (block ids loaded a group of pages at a time:
# whole splits, or two pages to cross groups), a block-table entry per token, and the latent
# as two halves. (PAGED is set wherever a path is paged: a bound under 1K takes the 1K
# bucket's config, which is unpaged for some batches and dtypes.)
DECODE_PATHS = {"page": {"BLOCK_N": 4}, "page-groups": {"BLOCK_N": 4, "MAX_GROUP": 2},
                "pages": {"BLOCK_N": 8}, "pages-groups": {"BLOCK_N": 8, "MAX_GROUP": 2},
                "per-token": {"BLOCK_N": 16, "PAGED": False},
                "halves": {"BLOCK_N": 8, "HALVES": 2}, "halves-per-token": {"BLOCK_N": 16, "PAGED": False, "HALVES": 2},
                "early-dequant": {"BLOCK_N": 8, "HALVES": 2, "EARLY_DEQUANT": True},
                "early-dequant-per-token": {"BLOCK_N": 16, "PAGED": False, "EARLY_DEQUANT": True},
                "prefetch": {"BLOCK_N": 4, "PREFETCH": True}, "prefetch-groups": {"BLOCK_N": 8, "MAX_GROUP": 2, "PREFETCH": True},
                "prefetch-pages": {"BLOCK_N": 8, "MAX_GROUP": 4, "PREFETCH": True},  # two-page tiles, two a group
                "prefetch-early-halves": {"BLOCK_N": 4, "MAX_GROUP": 2, "HALVES": 2, "EARLY_DEQUANT": True, "PREFETCH": True},
                "reload-halves": {"BLOCK_N": 8, "HALVES": 2, "RELOAD": True},
                "reload-page": {"BLOCK_N": 4, "MAX_GROUP": 2, "RELOAD": True},
                "reload-per-token": {"BLOCK_N": 16, "PAGED": False, "RELOAD": True, "HALVES": 2},
                "reload-prefetch": {"BLOCK_N": 4, "RELOAD": True, "PREFETCH": True},  # RELOAD: no prefetch
                "lazy": {"BLOCK_N": 4, "LAZY_RESCALE": True},
                "lazy-halves-reload": {"BLOCK_N": 8, "HALVES": 2, "RELOAD": True, "LAZY_RESCALE": True},
                "lazy-per-token-early": {"BLOCK_N": 16, "PAGED": False, "EARLY_DEQUANT": True, "LAZY_RESCALE": True},
                "lazy-prefetch": {"BLOCK_N": 4, "MAX_GROUP": 2, "PREFETCH": True, "LAZY_RESCALE": True}}
if CUDA:
    DECODE_PATHS = {"default": None, "page": {"BLOCK_N": 16}, "page-groups": {"BLOCK_N": 16, "MAX_GROUP": 2},
                    "pages": {"BLOCK_N": 64, "num_warps": 8, "num_stages": 3}, "pages-groups": {"BLOCK_N": 32, "MAX_GROUP": 2},
                    "per-token": {"PAGED": False}, "halves": {"BLOCK_N": 32, "HALVES": 2},
                    "halves-page": {"BLOCK_N": 16, "HALVES": 2},
                    "early-dequant": {"BLOCK_N": 32, "HALVES": 2, "EARLY_DEQUANT": True},
                    "early-dequant-per-token": {"PAGED": False, "EARLY_DEQUANT": True},
                    "prefetch": {"BLOCK_N": 16, "PREFETCH": True}, "prefetch-groups": {"BLOCK_N": 32, "MAX_GROUP": 2, "PREFETCH": True},
                    "prefetch-pages": {"BLOCK_N": 32, "MAX_GROUP": 4, "PREFETCH": True},
                    "prefetch-early-halves": {"BLOCK_N": 32, "HALVES": 2, "EARLY_DEQUANT": True, "PREFETCH": True},
                    "reload-halves": {"BLOCK_N": 32, "HALVES": 2, "RELOAD": True},
                    "reload-pages": {"BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "RELOAD": True},
                    "reload-per-token": {"PAGED": False, "RELOAD": True},
                    "lazy": {"BLOCK_N": 32, "HALVES": 2, "LAZY_RESCALE": True},
                    "lazy-reload": {"BLOCK_N": 32, "HALVES": 2, "RELOAD": True, "LAZY_RESCALE": True},
                    "lazy-per-token": {"PAGED": False, "LAZY_RESCALE": True}}
for _cfg in DECODE_PATHS.values():
    if _cfg is not None and "PAGED" not in _cfg:
        _cfg["PAGED"] = True


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("path", list(DECODE_PATHS))
def test_mla_decode_matches_reference(fp8, splits, path):
    q_lat, q_pe, cache, tables, lens, scale = _decode_case(gen(2), fp8)
    sm = 0.1
    out = mla_decode(q_lat, q_pe, cache, tables, lens, sm, scale, num_splits=splits,
                     config=DECODE_PATHS[path])
    ref = mla_decode_reference(q_lat, q_pe, cache, tables, lens, sm, scale)
    close(out, ref)
    assert not out[1].any()  # seq_len 0 gives zeros


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("halves", [1, 2])
def test_mla_decode_lazy_rescale_where_the_max_keeps_growing(fp8, halves):
    """LAZY_RESCALE keeps a running max until some head's grows past LAZY_MARGIN: keys
    aligned with head 0's query, scaled up token by token (~3.5 log2 units a tile), move
    the max every tile, so the kernel keeps a stale max for two tiles (weights up to ~2^7)
    and rescales on the third, while head 1's scores fall."""
    b, h, dl, dr, bs = (1, 16, 512, 64, 16) if CUDA else (1, 4, 32, 16, 4)
    n, bn, sm = (256, 16, 0.1) if CUDA else (40, 4, 0.1)
    g = gen(11)
    q_lat, q_pe = randn(b, h, dl, g=g, scale=0.2), randn(b, h, dr, g=g, scale=0.2)
    q_lat[0, 1] = -q_lat[0, 0]
    q_pe[0, 1] = -q_pe[0, 0]
    q0 = torch.cat([q_lat[0, 0], q_pe[0, 0]]).float()
    top = 3.5 * (n / bn) / (float(q0.norm()) * sm * LOG2E)  # head 0's score at the last token
    ramp = torch.linspace(0, top, n, device=DEV)[:, None] * (q0 / q0.norm())[None, :]
    entries = (ramp + randn(n, dl + dr, g=g, scale=0.3).float()).to(BF16)
    # the data does what the docstring says: with one split, stale-max tiles and rescales both
    s = (torch.cat([q_lat[0], q_pe[0]], 1).float() @ entries.float().T * sm * LOG2E).cpu()  # (h, n)
    m, stale, rescaled = torch.full((h,), float("-inf")), 0, 0
    for t in range(0, n, bn):
        grow = float((s[:, t : t + bn].max(1).values - m).max())
        if grow > float(LAZY_MARGIN.value):
            m, rescaled = torch.maximum(m, s[:, t : t + bn].max(1).values), rescaled + 1
        elif grow > 0:
            stale += 1
    assert stale >= 2 and rescaled >= 3
    pages = -(-n // bs)
    cache = torch.zeros(pages, bs, dl + dr, dtype=BF16, device=DEV)
    cache.view(-1, dl + dr)[:n] = entries
    scale = None
    if fp8:
        cache, scale = quantize_per_token(cache)
    tables = torch.arange(pages, dtype=torch.int32, device=DEV)[None]
    lens = torch.tensor([n], dtype=torch.int32, device=DEV)
    ref = mla_decode_reference(q_lat, q_pe, cache, tables, lens, sm, scale)
    for splits in (1, 2):
        cfg = {"BLOCK_N": bn, "HALVES": halves, "LAZY_RESCALE": True, "PAGED": True}
        out = mla_decode(q_lat, q_pe, cache, tables, lens, sm, scale, num_splits=splits, config=cfg)
        close(out, ref)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("paged", [False, True])
def test_mla_decode_halves_with_a_latent_not_a_power_of_two(fp8, splits, paged):
    """HALVES = 2 where the second half is partly masked (latent 48: halves of 32 columns)."""
    g = gen(4)
    b, h, dl, dr, bs = 2, 4, 48, 16, 4
    lens = torch.tensor([11, 6], dtype=torch.int32, device=DEV)
    tables = torch.randperm(8, generator=torch.Generator().manual_seed(5)).view(b, 4).to(torch.int32).to(DEV)
    cache, scale = randn(8, bs, dl + dr, g=g), None
    if fp8:
        cache, scale = quantize_per_token(cache)
    q_lat, q_pe = randn(b, h, dl, g=g, scale=0.2), randn(b, h, dr, g=g, scale=0.2)
    out = mla_decode(q_lat, q_pe, cache, tables, lens, 0.1, scale, num_splits=splits,
                     config={"BLOCK_N": 16 if CUDA else 4, "HALVES": 2, "PAGED": paged})  # (tensor cores: K >= 16)
    close(out, mla_decode_reference(q_lat, q_pe, cache, tables, lens, 0.1, scale))


def test_mla_decode_rejects_bad_arguments():
    q_lat, q_pe, cache, tables, lens, _ = _decode_case(gen(3), False)
    with pytest.raises(ValueError, match="q_pe"):
        mla_decode(q_lat, q_pe[:, :1], cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="block_tables"):
        mla_decode(q_lat, q_pe, cache, tables.float(), lens, 0.1)
    with pytest.raises(ValueError, match="FP8"):
        mla_decode(q_lat, q_pe, cache, tables, lens, 0.1, torch.ones(cache.shape[:2], device=DEV))


# -- fused MoE ----------------------------------------------------------------------------------

def _moe_case(g, t, e, h, inter, k):
    x = randn(t, h, g=g)
    w13 = randn(e, 2 * inter, h, g=g, scale=h ** -0.5)
    w2 = randn(e, h, inter, g=g, scale=inter ** -0.5)
    ids = torch.rand(t, e, generator=g, device=DEV).topk(k, dim=-1).indices
    weights = torch.rand(t, k, generator=g, device=DEV)
    return x, w13, w2, weights, ids


TINY_MOE = {"BLOCK_M": 16, "up": {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2},
            "down": {"BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}}


ALIGN_CASES = ([(300, 64, 6), (1, 64, 6), (700, 128, 8)] if CUDA
               else [(9, 8, 3), (70, 8, 3), (24, 64, 3)])


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("t,e,k", ALIGN_CASES)
def test_moe_align_matches_torch(block_m, t, e, k):
    # The larger cases span several programs (64 pairs each up to 64 experts): experts' runs
    # cross chunk boundaries, and the block table is split between programs, with 64 experts
    # in more than one sweep.
    g = gen(4)
    ids = torch.rand(t, e, generator=g, device=DEV).topk(k, dim=-1).indices
    ids[0, 1] = -1  # an expert on another rank
    ids[-1, 0] = e  # the padding id
    ids[ids == 2] = e + 3  # expert 2 gets no pairs
    got, want = moe_align(ids, e, block_m), moe_align_reference(ids, e, block_m)
    total = int(want[2])
    assert int(got[2]) == total
    assert torch.equal(got[0][:total], want[0][:total])
    assert torch.equal(got[1], want[1])


@pytest.mark.skipif(not CUDA, reason="host-device syncs exist on CUDA only")
def test_moe_align_for_large_prefills_makes_the_host_wait_for_nothing():
    """Beyond ALIGN_KERNEL_MAX_PAIRS pairs the alignment runs as torch ops: none may read a
    device value back (torch.bincount does), or every MoE layer of a large prefill would
    stall the host."""
    ids = torch.rand(2048, 64, generator=gen(6), device=DEV).topk(6, dim=-1).indices
    assert ids.numel() > ALIGN_KERNEL_MAX_PAIRS
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = moe_align(ids, 64, 32)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = moe_align_reference(ids.cpu(), 64, 32)
    total = int(want[2])
    assert int(got[2]) == total and torch.equal(got[0][:total].cpu(), want[0][:total])
    assert torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize("fp8", [False, True])
def test_fused_moe_matches_reference(fp8):
    g = gen(5)
    t, e, h, inter, k = (70, 16, 512, 384, 6) if CUDA else (5, 4, 256, 160, 2)
    x, w13, w2, weights, ids = _moe_case(g, t, e, h, inter, k)
    ids[1, 0] = -1  # skipped: contributes nothing
    scales = {}
    if fp8:
        (w13, s13), (w2, s2) = quantize_fp8_blockwise(w13), quantize_fp8_blockwise(w2)
        scales = {"w_gate_up_scale": s13, "w_down_scale": s2}
    cfg = None if CUDA else TINY_MOE
    out = fused_moe(x, w13, w2, weights, ids, config=cfg, **scales)
    close(out, fused_moe_reference(x, w13, w2, weights, ids, **scales))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("t", [1, 5])
def test_fused_moe_weight_tiles_as_tensor_descriptors(fp8, t):
    """TMA: the weight tiles as bulk copies (interpreter, or Hopper), pair blocks and aligned
    blocks; tiles that run past an expert's rows read the next rows (their columns are
    masked) and past its columns zeros: the same output as the reference."""
    g = gen(12)
    e, h, inter, k = (16, 512, 384, 6) if CUDA else (4, 256, 160, 2)
    x, w13, w2, weights, ids = _moe_case(g, t, e, h, inter, k)
    scales = {}
    if fp8:
        (w13, s13), (w2, s2) = quantize_fp8_blockwise(w13), quantize_fp8_blockwise(w2)
        scales = {"w_gate_up_scale": s13, "w_down_scale": s2}
    # up: 160 / 384 rows in tiles of 64 / 256 spill into the up part; down: K = 160 in tiles
    # of 64 runs past the rows' end (zeros)
    up = {"BLOCK_N": 64 if not CUDA else 256, "BLOCK_K": 64 if not CUDA else 128, "num_warps": 4,
          "num_stages": 3 if not CUDA else 2}  # 3 stages of 256 x 128 would not fit an H200's shared memory
    down = {"BLOCK_N": 64 if not CUDA else 128, "BLOCK_K": 64 if not CUDA else 128, "num_warps": 4, "num_stages": 3}
    cfg = {"BLOCK_M": 16, "up": up, "down": down, "TMA": True}
    from lockstep.kernels import fused_moe as fm
    assert fm._tma_ok(w13) == (not CUDA or _util.hopper_or_later(w13.device))  # else the pointer path
    out = fused_moe(x, w13, w2, weights, ids, config=cfg, **scales)
    close(out, fused_moe_reference(x, w13, w2, weights, ids, **scales))


@pytest.mark.parametrize("fp8", [False, True])
def test_fused_moe_one_token_runs_a_block_per_pair(fp8, monkeypatch):
    """T = 1 takes no alignment: each pair's block in pair order, ids outside [0, E) skipped;
    with reduce=False the unsummed terms, which moe_sum_reference sums as the kernel does."""
    g = gen(8)
    e, h, inter, k = (16, 512, 384, 8) if CUDA else (6, 256, 160, 3)
    x, w13, w2, weights, ids = _moe_case(g, 1, e, h, inter, k)
    ids[0, 1] = e  # a padding id: contributes nothing
    ids[0, 2] = -1  # nor does a foreign expert's
    scales = {}
    if fp8:
        (w13, s13), (w2, s2) = quantize_fp8_blockwise(w13), quantize_fp8_blockwise(w2)
        scales = {"w_gate_up_scale": s13, "w_down_scale": s2}
    cfg = None if CUDA else TINY_MOE
    from lockstep.kernels import fused_moe as fm

    def no_align(*a, **kw):
        raise AssertionError("one token must not align")

    monkeypatch.setattr(fm, "moe_align", no_align)
    want = fused_moe_reference(x, w13, w2, weights, ids, **scales)
    out = fused_moe(x, w13, w2, weights, ids, config=cfg, **scales)
    close(out, want)
    terms = fused_moe(x, w13, w2, weights, ids, config=cfg, reduce=False, **scales)
    assert terms.shape == (1, k, h)
    assert torch.equal(moe_sum_reference(terms, ids, e), out)  # the sum launch's own order


def test_fused_moe_unsummed_terms_sum_to_the_output():
    x, w13, w2, weights, ids = _moe_case(gen(9), 5 if not CUDA else 70, 4 if not CUDA else 16,
                                         256 if not CUDA else 512, 160 if not CUDA else 384, 2 if not CUDA else 6)
    ids[2, 0] = -1
    cfg = None if CUDA else TINY_MOE
    out = fused_moe(x, w13, w2, weights, ids, config=cfg)
    terms = fused_moe(x, w13, w2, weights, ids, config=cfg, reduce=False)
    assert torch.equal(moe_sum_reference(terms, ids, w13.shape[0]), out)


def test_fused_moe_writes_one_term_rows_into_a_strided_out():
    """k = 1 (an expert-parallel rank's received rows): the terms go straight into ``out``
    (rows of a wider area), the rows of ids outside [0, E) untouched; as the reference does."""
    t, e, h, inter = (70, 16, 512, 384) if CUDA else (6, 4, 256, 160)
    x, w13, w2, _, ids = _moe_case(gen(10), t, e, h, inter, 1)
    ids[1, 0] = e  # a receive row no pair took
    ones = torch.ones(t, 1, dtype=torch.float32, device=DEV)
    cfg = None if CUDA else TINY_MOE
    for fn in (fused_moe, fused_moe_reference):
        area = torch.full((t, h + 64), 7.0, dtype=x.dtype, device=DEV)  # rows wider than h
        got = fn(x, w13, w2, ones, ids, reduce=False, out=area[:, :h], **({"config": cfg} if fn is fused_moe else {}))
        assert got.data_ptr() == area.data_ptr()
        assert (area[:, h:] == 7).all() and (area[1, :h] == 7).all()
        live = ids[:, 0] < e
        close(area[:, :h][live], fused_moe_reference(x, w13, w2, ones, ids)[live])
    with pytest.raises(ValueError, match="pass reduce=False"):
        fused_moe(x, w13, w2, ones, ids, out=area[:, :h])
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe(x, w13, w2, ones, ids, reduce=False, out=area[:, None, :h])


@NEEDS_CUDA
@pytest.mark.parametrize("t", [1, 64, 256])
def test_fused_moe_v2_lite_layer(t):
    x, w13, w2, weights, ids = _moe_case(gen(6), t, 64, 2048, 1408, 6)
    close(fused_moe(x, w13, w2, weights, ids), fused_moe_reference(x, w13, w2, weights, ids))


def test_moe_config_falls_back_only_to_a_near_expert_count(monkeypatch):
    """A table entry serves other expert counts within a quarter of its own (shared experts
    fused as extra slots), not a DEP rank's half of the experts, nor the reverse."""
    from lockstep.kernels import fused_moe as fm

    mine = {"BLOCK_M": 64, "up": {}, "down": {}}
    monkeypatch.setattr(fm, "MOE_CONFIGS", {(64, 2048, 1408, "bf16", 256): mine})
    assert fm.moe_config(64, 2048, 1408, False, 300, 6) is mine
    assert fm.moe_config(66, 2048, 1408, False, 300, 6) is mine
    assert fm.moe_config(32, 2048, 1408, False, 300, 1) == fm.default_moe_config(300, 1, 32)
    assert fm.moe_config(64, 2048, 1408, True, 300, 6) == fm.default_moe_config(300, 6, 64)  # fp8: no entry
    monkeypatch.undo()  # the committed table: one GPU's 64 experts (+2 shared slots) and a DEP2 rank's 32
    for rows in (600, 3000):
        got = fm.moe_config(66, 2048, 1408, False, rows, 6)
        assert got not in [v for key, v in fm.MOE_CONFIGS.items() if key[0] == 32]


def test_fused_moe_rejects_bad_arguments():
    x, w13, w2, weights, ids = _moe_case(gen(7), 3, 4, 64, 32, 2)
    with pytest.raises(ValueError, match="w_down"):
        fused_moe(x, w13, w2.transpose(1, 2).contiguous(), weights, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(x, w13, w2, weights.to(BF16), ids)
    with pytest.raises(ValueError, match="w_gate_up_scale"):
        fused_moe(x, w13.to(_util.FP8), w2.to(_util.FP8), weights, ids)


# -- top-k ----------------------------------------------------------------------------------------

# Interpreter-sized configs: the two-launch select path (CAND: its register tile; a row with
# more candidates, or fewer than k, takes the tiled path) and the four-launch threshold path.
TINY_TOPK = {"CHUNK": 128, "TILE": 64, "SAMPLE": 64, "PIECES": 8, "BINS": 256, "CAND": 512,
             "select_warps": 4, "FINISH_TILE": 256}
TINY_THRESHOLD = {"ALGO": "threshold", "CHUNK": 256, "TILE": 128, "SAMPLE": 64, "FINISH_TILE": 256}


def _assert_topk(x, k, config=None):
    vals, idx = topk(x, k, config=config)
    ref_vals, ref_idx = topk_reference(x, k)
    assert torch.equal(idx, ref_idx)
    assert torch.equal(vals.view(torch.uint8), ref_vals.view(torch.uint8))  # bits: NaN == NaN
    return vals, idx


def _hard_rows(g, n: int, sample: int, pieces: int) -> torch.Tensor:
    """Rows that defeat a sampled threshold or stress ties, one per case."""
    rows = torch.randn(9, n, generator=g, device=DEV)
    rows[0] = 0.0  # every element ties
    rows[1, n // 3:] = 1.0  # ties straddle the k-th value
    rows[2] = rows[2].sort().values  # ascending: the top k sit in the last chunks
    rows[3] = rows[3].sort(descending=True).values
    piece = sample // pieces
    hot = torch.arange(sample, device=DEV)
    hot = (hot // piece) * max(n // pieces, piece) + hot % piece
    rows[4] *= 1e-3
    rows[4, hot] = 100.0 + 100.0 * torch.rand(sample, generator=g, device=DEV)  # sampled: outliers
    rows[5, ::7] = float("nan")
    rows[6, n // 40:] = float("-inf")  # padding: fewer finite values than k
    rows[7] = torch.randint(0, 40, (n,), generator=g, device=DEV).float()  # few distinct values
    rows[8] = torch.where(rows[8] > 0, rows[8] * 1e30, rows[8])  # one sign spans 30 decades
    return rows


def test_topk_random_rows_match_torch():
    g = gen(8)
    r, n, k = (6, 20000, 700) if CUDA else (3, 1000, 50)
    x = torch.randn(r, n, generator=g, device=DEV)
    vals, idx = _assert_topk(x, k, None if CUDA else TINY_TOPK)
    want = torch.topk(x, k, dim=1).indices.sort(dim=1).values
    assert torch.equal(idx.long(), want)


@pytest.mark.parametrize("cand, rows, walk, stages", [(512, 9, None, 0), (1024, 2, None, 0), (512, 9, 0, 0),
                                                      (512, 9, None, 3), (512, 9, None, "asm")])
def test_topk_select_hard_rows(cand, rows, walk, stages):
    """Every way through the select program: candidates in registers as a chunk tile or by
    search (sorted rows), the k-th key's bin walked or bisected (ties, clusters), and the
    tiled path for too many candidates (ties) or too few (a misleading sample); with the
    larger tile the tied rows' candidates fit in registers. ``walk`` 0: every bin bisected;
    ``stages``: the scan's loop pipelined by the compiler instead of its written prefetch;
    "asm": the scan's stores and counts as inline PTX (on CUDA; the interpreter ignores it)."""
    if CUDA and rows < 9:
        pytest.skip("the interpreter-sized tile: on CUDA the default config takes every path")
    n, k = (30000, 2048) if CUDA else (1000, 64)
    cfg = {} if CUDA else {**TINY_TOPK, "CAND": cand}
    if walk is not None:
        cfg = {**cfg, "WALK": walk, "WAYS": 16}
    if stages == "asm":
        cfg = {**cfg, "ASM_STORES": True}
    elif stages:  # the scan's loads pipelined by the compiler
        cfg = {**cfg, "SCAN_STAGES": stages}
    full = {**topk_config(9), **cfg}
    x = _hard_rows(gen(9), n, min(full["SAMPLE"], n), full["PIECES"])
    _assert_topk(x[:rows], k, cfg or None)


def test_topk_config_takes_the_row_bucket_then_the_nearest_row_length(monkeypatch):
    import lockstep.kernels.topk as topk_mod
    monkeypatch.setattr(topk_mod, "TOPK_CONFIGS", {(1, 131072): {"TILE": 1}, (64, 32768): {"TILE": 2},
                                                   (64, 131072): {"TILE": 3}})
    assert topk_config(64, 32768)["TILE"] == 2 and topk_config(200, 131072)["TILE"] == 3
    assert topk_config(64, 50000)["TILE"] == 2  # nearer 32K than 128K on a log scale
    assert topk_config(64, 100000)["TILE"] == 3 and topk_config(64, 65536)["TILE"] == 3  # a tie: the longer
    assert topk_config(1, 1000)["TILE"] == 1  # the row bucket's entry at another length
    assert topk_config(8, 32768) == topk_mod.DEFAULT_CONFIG  # no entry for 8 rows


def test_topk_threshold_path_hard_rows():
    n, k = (30000, 2048) if CUDA else (1000, 64)
    cfg = {"ALGO": "threshold"} if CUDA else TINY_THRESHOLD
    sample = 2048 if CUDA else cfg["SAMPLE"]
    _assert_topk(_hard_rows(gen(9), n, sample, 16)[:6], k, cfg)


def test_topk_bf16_whole_row_and_single():
    g = gen(10)
    cfg = None if CUDA else TINY_TOPK
    _assert_topk(randn(2, 777, g=g), 777, cfg)  # (interpreter: k > CAND / 2, the threshold path)
    _assert_topk(randn(2, 777, g=g), 200, cfg)
    _assert_topk(torch.randn(1, 300, generator=g, device=DEV), 1, cfg)


@NEEDS_CUDA
@pytest.mark.parametrize("algo", ["select", "threshold"])
@pytest.mark.parametrize("rows", [1, 64])
def test_topk_indexer_shape(rows, algo):
    x = torch.randn(rows, 131072, generator=gen(11), device=DEV)
    _, idx = _assert_topk(x, 2048, {"ALGO": algo})
    assert torch.equal(idx.long(), torch.topk(x, 2048, dim=1).indices.sort(dim=1).values)


def test_topk_rejects_bad_arguments():
    x = torch.zeros(2, 10, device=DEV)
    with pytest.raises(ValueError, match="k must be"):
        topk(x, 11)
    with pytest.raises(ValueError, match="x must be"):
        topk(x.int(), 3)
    with pytest.raises(ValueError, match="unit-stride"):
        topk(x.t(), 1)


# -- MLA prefill ---------------------------------------------------------------------------------

@pytest.mark.parametrize("split", [False, True], ids=["masked", "split"])
@pytest.mark.parametrize("fp8", [False, True])
def test_mla_prefill_matches_reference(fp8, split):
    """split: key blocks every row sees whole are walked without masks, the rest masked."""
    g = gen(12)
    if CUDA:
        h, dn, dr, dv, dl, bs, chunk = 16, 128, 64, 128, 512, 64, 1024
        cfg = {"SPLIT": int(split)}
        new, prefix = [77, 300, 1], [1500, 0, 700]
    else:  # key blocks of 4: whole blocks in both the causal pass and the prefix chunks
        h, dn, dr, dv, dl, bs, chunk = 2, 16, 16, 16, 32, 4, 16
        cfg = {"BLOCK_M": 16, "BLOCK_N": 4 if split else 16, "SPLIT": int(split)}
        new, prefix = [5, 19], [10, 0]
    t = sum(new)
    cu = torch.tensor([0] + new, device=DEV).cumsum(0).to(torch.int32)
    q = randn(t, h, dn + dr, g=g, scale=0.3)
    k_nope, k_pe, v = randn(t, h, dn, g=g), randn(t, dr, g=g), randn(t, h, dv, g=g)
    per = max(-(-p // bs) for p in prefix)
    tables = torch.randperm(len(new) * per, generator=torch.Generator().manual_seed(3))
    tables = tables.view(len(new), per).to(torch.int32).to(DEV)
    cache = randn(len(new) * per, bs, dl + dr, g=g)
    scale = None
    if fp8:
        cache, scale = quantize_per_token(cache)
    w_kv_b = randn(h * (dn + dv), dl, g=g, scale=dl ** -0.5)
    sm = (dn + dr) ** -0.5
    out = mla_prefill(q, k_nope, k_pe, v, cu, max(new), prefix, cache, tables, w_kv_b, sm,
                      scale, chunk_tokens=chunk, config=cfg)
    close(out, mla_prefill_reference(q, k_nope, k_pe, v, cu, prefix, cache, tables, w_kv_b,
                                     sm, scale))


def test_mla_attention_split_equals_masked_where_rows_see_no_keys():
    """Causal sequences with fewer keys than queries (a row at a negative position sees no
    key) and more: the unmasked walk (SPLIT) gives what masking every block gives."""
    g = gen(13)
    h, dn, dr, dv = 2, 16, 16, 16
    q_lens, k_lens = [2, 40, 9], [30, 10, 9]
    cu_q = torch.tensor([0] + q_lens, device=DEV).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens, device=DEV).cumsum(0).to(torch.int32)
    q = randn(sum(q_lens), h, dn + dr, g=g, scale=0.3)
    kn, kp, v = randn(sum(k_lens), h, dn, g=g), randn(sum(k_lens), dr, g=g), randn(sum(k_lens), h, dv, g=g)
    outs = []
    for split in (0, 1):
        cfg = {"BLOCK_M": 16, "BLOCK_N": 4, "SPLIT": split} if not CUDA else {"SPLIT": split}
        out, lse = mla_attention(q, kn, kp, v, cu_q, cu_k, max(q_lens), 0.2, causal=True, config=cfg)
        outs.append((out.float(), lse))
    assert torch.equal(outs[0][1], outs[1][1]) or torch.allclose(outs[0][1], outs[1][1], atol=1e-5)
    close(outs[1][0], outs[0][0])
    assert torch.isinf(outs[1][1][q_lens[0]:q_lens[0] + 30]).all()  # the second's first 30 rows see nothing


# -- MoE router ----------------------------------------------------------------------------------

from lockstep.kernels.router import moe_route, moe_route_reference, router_logits  # noqa: E402
from lockstep.runtime.models.deepseek_v3 import route  # noqa: E402

# (experts, top_k, n_group, topk_group, norm_topk_prob, scaling): v2-lite's router, tiny's
# (group-limited), DeepSeek-V3's, and groups of a size that is no power of two.
ROUTE_CASES = [(64, 6, 1, 1, False, 1.0), (8, 2, 2, 1, True, 2.5), (256, 8, 8, 4, True, 2.5),
               (30, 4, 3, 2, False, 1.5)]


@pytest.mark.parametrize("case", ROUTE_CASES, ids=lambda c: f"e{c[0]}-k{c[1]}-g{c[2]}of{c[3]}")
def test_moe_route_matches_model_route(case):
    e, k, n_group, topk_group, norm, scaling = case
    g = gen(13)
    t, h = (300, 256) if CUDA else (9, 16)  # the interpreter: several tokens a program
    x, w = randn(t, h, g=g), randn(e, h, g=g, dtype=torch.float32)
    bias = randn(e, g=g, dtype=torch.float32, scale=0.1)
    args = (k, n_group, topk_group, norm, scaling)
    # A strided view, as a slice of a wider GEMM output would be.
    logits = torch.nn.functional.pad(torch.nn.functional.linear(x.float(), w), (0, 3))[:, :e]
    weights, ids = moe_route(logits, bias, *args)
    ref_weights, ref_ids = route(x, w, bias, *args)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)
    ref_weights, ref_ids = moe_route_reference(logits, bias, *args)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", ROUTE_CASES[:2], ids=lambda c: f"e{c[0]}-k{c[1]}-g{c[2]}of{c[3]}")
def test_moe_route_appends_the_shared_experts_columns(case):
    """shared=(first, count): the routed columns unchanged, then ids first.. with weight 1,
    what models.fast used to concatenate after the router."""
    e, k, n_group, topk_group, norm, scaling = case
    g = gen(14)
    logits, bias = randn(7, e, g=g, dtype=torch.float32), randn(e, g=g, dtype=torch.float32, scale=0.1)
    args = (k, n_group, topk_group, norm, scaling)
    weights, ids = moe_route(logits, bias, *args)
    w2, i2 = moe_route(logits, bias, *args, (e, 2))
    assert i2.shape == (7, k + 2) and w2.is_contiguous() and i2.is_contiguous()
    assert torch.equal(i2[:, :k], ids) and torch.equal(w2[:, :k], weights)
    assert torch.equal(i2[:, k:], torch.tensor([[e, e + 1]] * 7, device=DEV))
    assert torch.equal(w2[:, k:], torch.ones(7, 2, device=DEV))
    with pytest.raises(ValueError, match="shared"):
        moe_route(logits, bias, *args, (e - 1, 2))


@pytest.mark.parametrize("t, e, h", [(1, 64, 2048), (5, 30, 100), (37, 64, 256)] if CUDA else
                         [(1, 64, 64), (5, 30, 40), (13, 20, 48)])
def test_router_logits_are_the_float32_gemm(t, e, h):
    """bf16 activations times the float32 gate, in float32: cuBLAS's result up to rounding."""
    g = gen(21)
    x, w = randn(t, h, g=g), randn(e, h, g=g, dtype=torch.float32)
    got = router_logits(x, w)
    want = x.double() @ w.double().T
    assert got.dtype == torch.float32 and got.shape == (t, e)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="w must be"):
        router_logits(x, w.to(BF16))
    with pytest.raises(ValueError, match="w must have shape"):
        router_logits(x, w[:, 1:])
    assert router_logits(x[:0], w).shape == (0, e)


@pytest.mark.parametrize("t, e, h", [(1, 64, 2048), (37, 64, 2048), (256, 64, 2048), (300, 30, 100)] if CUDA else
                         [(1, 64, 64), (5, 30, 40), (19, 20, 48)])
def test_router_logits_split_is_the_float32_gemm(t, e, h):
    """The gate as three bf16 pieces sums to it exactly; the split GEMM is the float32 GEMM
    up to rounding (tensor cores add float32 products in their own way: within 1e-5 of the
    largest logit), hundreds of times closer to the exact product than the bf16 gate alone."""
    from lockstep.kernels.router import router_logits_split, split_gate

    g = gen(22)
    x, w = randn(t, h, g=g), randn(e, h, g=g, dtype=torch.float32) * 0.05
    w3 = split_gate(w)
    assert w3.shape == (3, e, h) and w3.dtype == BF16 and torch.equal(w3.float().sum(0), w)
    got = router_logits_split(x, w3)
    want = x.double() @ w.double().T
    assert got.dtype == torch.float32 and got.shape == (t, e)
    err = (got.double() - want).abs().max().item()
    ref_err = ((x.float() @ w.T).double() - want).abs().max().item()
    hi_err = ((x.float() @ w3[0].float().T).double() - want).abs().max().item()  # the bf16 gate
    tol = 4 * ref_err + 1e-5 * want.abs().max().item()
    assert err <= tol and err * 100 < hi_err, (err, ref_err, hi_err)
    other = router_logits_split(x, w3, config={"BLOCK_T": 32, "BLOCK_K": 16})  # other tiles, other sums
    assert (other.double() - want).abs().max().item() <= tol
    with pytest.raises(ValueError, match="x must be"):
        router_logits_split(x.float(), w3)
    with pytest.raises(ValueError, match="w3 must have shape"):
        router_logits_split(x, w3[:, :, 1:])
    assert router_logits_split(x[:0], w3).shape == (0, e)
    big = w.clone()
    big[0, 0] = 3.4e38  # rounds to bf16 infinity: no split
    assert split_gate(big) is None


def test_moe_route_ties_and_nan():
    """Ties go to the lowest expert and group; a NaN ranks first, as in torch.topk."""
    logits, bias = torch.zeros(3, 16, device=DEV), torch.zeros(16, device=DEV)
    logits[1, 9] = float("nan")
    logits[2, 12:] = 1.0  # group 3 wins; the other groups tie, the lowest is kept
    weights, ids = moe_route(logits, bias, 5, 4, 2, False, 1.0)
    assert ids.tolist() == [[0, 1, 2, 3, 4], [9, 0, 1, 2, 3], [12, 13, 14, 15, 0]]
    assert torch.isnan(weights[1, 0]) and torch.all(weights[0] == 0.5)
    weights, ids = moe_route(logits[:0], bias, 2, 1, 1, True, 1.0)
    assert ids.shape == (0, 2) and weights.shape == (0, 2)


def test_moe_route_rejects_bad_arguments():
    logits, bias = torch.zeros(2, 16, device=DEV), torch.zeros(16, device=DEV)
    with pytest.raises(ValueError, match="logits must be"):
        moe_route(logits.to(BF16), bias, 2, 1, 1, True, 1.0)
    with pytest.raises(ValueError, match="bias must have shape"):
        moe_route(logits, bias[:8], 2, 1, 1, True, 1.0)
    with pytest.raises(ValueError, match="top_k must be"):
        moe_route(logits, bias, 17, 1, 1, True, 1.0)
    with pytest.raises(ValueError, match="equal groups"):
        moe_route(logits, bias, 2, 3, 1, True, 1.0)
    with pytest.raises(ValueError, match="exceeds"):
        moe_route(logits, bias, 5, 4, 1, True, 1.0)
    with pytest.raises(ValueError, match="unit-stride"):
        moe_route(torch.zeros(16, 2, device=DEV).t(), bias, 2, 1, 1, True, 1.0)


# -- dense decode projections ---------------------------------------------------------------------

from lockstep.kernels import dense  # noqa: E402
from lockstep.kernels.dense import bmm_row, dense_config, gemv, linear, merge_bmm_row  # noqa: E402

DENSE_TILES = [{"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2},
               {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}]


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("tile", range(len(DENSE_TILES)))
def test_dense_linear_matches_torch(rows, tile):
    g = gen(17)
    n, k = (300, 200) if not CUDA else (3648, 2048)  # N, K off the tiles' multiples on the CPU
    x, w = randn(rows, k, g=g), randn(n, k, g=g, scale=0.05)
    out = linear(x, w, config=DENSE_TILES[tile])
    assert out.shape == (rows, n) and out.dtype == x.dtype
    close(out, x.float() @ w.float().T)


def test_dense_linear_falls_back_to_cublas():
    x, w = randn(3, 64, g=gen(18)), randn(40, 64, g=gen(19))
    assert dense_config(40, 64, 3) is None  # not in the table: F.linear
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))
    assert torch.equal(linear(x, w, config={"BACKEND": "cublas"}), torch.nn.functional.linear(x, w))
    assert dense_config(40, 64, 300) is None  # past the decode sizes


GEMV_TILES = [{"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2},
              {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}]


@pytest.mark.parametrize("tile", range(len(GEMV_TILES)))
def test_gemv_one_row_projection_and_per_head_products(tile):
    """gemv through a projection's transpose (k unit-stride) and per-head [K, N] matrices
    (n unit-stride), sizes off the tiles' multiples, against float32 torch."""
    g, cfg = gen(20), GEMV_TILES[tile]
    n, k = (300, 200) if not CUDA else (3648, 2048)
    x, w = randn(1, k, g=g), randn(n, k, g=g, scale=0.05)
    out = linear(x, w, config={"BACKEND": "gemv", **cfg})
    assert out.shape == (1, n) and out.dtype == x.dtype
    close(out, x.float() @ w.float().T)
    x2, w2 = randn(1, 256, g=g), randn(64, 256, g=g, scale=0.05)  # multiples of every tile
    close(linear(x2, w2, config={"BACKEND": "gemv", **cfg}), x2.float() @ w2.float().T)
    heads, kk, nn = (3, 40, 72) if not CUDA else (16, 128, 512)
    q = randn(heads, 1, kk + 8, g=g)[:, 0, :kk]  # strided rows, as a head's slice of q
    m = randn(heads, kk, nn, g=g, scale=0.1)
    close(gemv(q, m, cfg), torch.bmm(q.float()[:, None], m.float())[:, 0])


def test_bmm_row_uses_the_table_or_torch(monkeypatch):
    g = gen(21)
    q, m = randn(3, 40, g=g), randn(3, 40, 72, g=g, scale=0.1)
    want = torch.bmm(q[:, None], m)[:, 0]
    assert torch.equal(bmm_row(q, m), want)  # not in the table
    monkeypatch.setitem(dense.BMM_ROW_CONFIGS, (3, 40, 72), GEMV_TILES[0])
    close(bmm_row(q, m), q.float()[:, None].bmm(m.float())[:, 0])
    # a gemv entry serves one row only: more rows go to F.linear
    x, w = randn(3, 64, g=g), randn(40, 64, g=g)
    assert torch.equal(linear(x, w, config={"BACKEND": "gemv", **GEMV_TILES[0]}), torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("splits", [1, 3, 300])
@pytest.mark.parametrize("tile", range(len(GEMV_TILES)))
@pytest.mark.parametrize("shape", ["off-tiles", "on-tiles"])
def test_merge_bmm_row_merges_the_splits_then_multiplies(monkeypatch, splits, tile, shape):
    """The attention splits' merge fused into the heads' W_UV product: equal to merging in
    torch, rounding to bf16 (as a merge launch stores it) and multiplying; an empty split
    (lse -inf) weighs nothing and a head whose splits are all empty gives zeros; lse may be
    strided. 300 splits shrink the K tile (the partials' tile stays in registers); K and N
    off the tiles' multiples take the masked loads, on them the unmasked ones."""
    g = gen(22)
    if shape == "off-tiles":
        heads, k, n = (3, 40, 72) if not CUDA else (16, 500, 120)
    else:
        heads, k, n = (3, 128, 32) if not CUDA else (16, 512, 128)
    part = randn(heads, splits, k, g=g, dtype=torch.float32)
    lse = randn(heads, splits, g=g, dtype=torch.float32) * 3
    lse[0, 0] = float("-inf")
    lse[2] = float("-inf")
    w = randn(heads, k, n, g=g, scale=0.1)
    monkeypatch.setitem(dense.BMM_ROW_CONFIGS, (heads, k, n), GEMV_TILES[tile])
    assert dense.merge_fuses(w) and not dense.merge_fuses(w.half())
    out = merge_bmm_row(part, lse, w)
    merged = merge_reference(part, lse).to(BF16)
    assert out.shape == (heads, n) and out.dtype == BF16 and not out[2].any()
    close(out, torch.bmm(merged.float()[:, None], w.float())[:, 0])
    strided = lse.t().contiguous().t()  # the same values, split stride = heads
    assert (splits == 1 or strided.stride(1) == heads) and torch.equal(merge_bmm_row(part, strided, w), out)
    monkeypatch.delitem(dense.BMM_ROW_CONFIGS, (heads, k, n))  # not in the table: torch ops
    assert not dense.merge_fuses(w)
    assert torch.equal(merge_bmm_row(part, lse, w), torch.bmm(merged[:, None], w)[:, 0])


def test_decode_config_takes_the_largest_context_bucket_with_an_entry():
    """A context bound picks the largest bucket at or below it that has an entry for its
    dtype and batch (a long bound without a 128K entry keeps the 4K one), and a bound under
    the smallest bucket takes the smallest."""
    from lockstep.kernels.mla_decode import DECODE_CONFIGS, LEN_BUCKETS, decode_config

    for name, dt in (("bf16", BF16), ("fp8", torch.float8_e4m3fn)):
        for batch in (1, 8, 32, 64, 128, 256):
            for bound in (100, 1024, 3000, 4096, 100_000, 131_072, 855_000):
                have = [b for b in LEN_BUCKETS if (name, batch, b) in DECODE_CONFIGS and b <= max(bound, LEN_BUCKETS[0])]
                cfg = decode_config(dt, batch, bound)
                if have:
                    assert all(cfg[k] == v for k, v in DECODE_CONFIGS[(name, batch, max(have))].items())
    assert decode_config(BF16, 256, 855_000)["MIN_SPLIT"] == DECODE_CONFIGS[("bf16", 256, 4096)]["MIN_SPLIT"]


@pytest.mark.parametrize("splits", [5, 300, 2048])
def test_merge_of_many_splits_matches_the_reference(splits):
    """Hundreds of splits (long contexts at small batch): the merge narrows its column slice
    to keep its tile in registers; empty splits (lse -inf) weigh nothing."""
    from lockstep.kernels.mla_decode import _merge

    g = gen(7)
    b, h, dl = 2, 3, 40
    part = randn(b, h, splits, dl, g=g, dtype=torch.float32)
    lse = randn(b, h, splits, g=g, dtype=torch.float32, scale=3.0)
    lse[0, 1, splits // 2:] = float("-inf")
    out = torch.empty(b, h, dl, dtype=BF16, device=DEV)
    _merge(part, lse, out)
    close(out, merge_reference(part, lse).to(BF16))


def test_mla_decode_partials_merge_to_mla_decode():
    q_lat, q_pe, cache, tables, lens, scale = _decode_case(gen(2), False)
    part, lse = mla_decode_partials(q_lat, q_pe, cache, tables, lens, 0.1, num_splits=3)
    assert part.shape[:3] == lse.shape == (*q_lat.shape[:2], 3)
    out = mla_decode(q_lat, q_pe, cache, tables, lens, 0.1, num_splits=3)
    close(merge_reference(part, lse), out, tol=1e-2)
    direct, none = mla_decode_partials(q_lat, q_pe, cache, tables, lens, 0.1, num_splits=1)
    assert none is None and torch.equal(direct, mla_decode(q_lat, q_pe, cache, tables, lens, 0.1, num_splits=1))
    merged, none = mla_decode_partials(q_lat, q_pe, cache, tables, lens, 0.1, num_splits=3, merge_above=2)
    assert none is None and torch.equal(merged, out)  # more splits than merge_above: merged here
    empty, none = mla_decode_partials(q_lat[:0], q_pe[:0], cache, tables[:0], lens[:0], 0.1, num_splits=3)
    assert none is None and empty.shape == (0, *q_lat.shape[1:])


def test_merge_bmm_row_rejects_bad_arguments():
    part, lse = torch.zeros(2, 3, 8, device=DEV), torch.zeros(2, 3, device=DEV)
    w = torch.zeros(2, 8, 4, dtype=BF16, device=DEV)
    with pytest.raises(ValueError, match="lse"):
        merge_bmm_row(part, lse[:, :2], w)
    with pytest.raises(ValueError, match="part"):
        merge_bmm_row(part.to(BF16), lse, w)
    with pytest.raises(ValueError, match="w"):
        merge_bmm_row(part, lse, w[:, :4])


def test_dense_linear_rejects_bad_arguments():
    x, w = randn(3, 64, g=gen(18)), randn(40, 64, g=gen(19))
    with pytest.raises(ValueError, match="w"):
        linear(x, w[:, :32], config=DENSE_TILES[0])
    with pytest.raises(ValueError, match="w"):
        linear(x, w.float(), config=DENSE_TILES[0])


# -- sampling ---------------------------------------------------------------------------------------

from lockstep.kernels.sampling import sample_reference, sample_rows  # noqa: E402


def _sampling_case(g, s: int, v: int, dtype=torch.float32):
    logits = (torch.randn(s, v, generator=g, device=DEV) * 3).to(dtype)
    temp = torch.tensor([0.0, 1.0, 0.5, 2.0, 1.0, 0.7, 1.3][:s], device=DEV)
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 0.05, 0.999, 0.3][:s], device=DEV)
    top_k = torch.tensor([5, 0, 40, 0, 3, v + 1, 1][:s], device=DEV, dtype=torch.int32)  # 0, >= V: off
    noise = torch.empty(s, v, device=DEV).exponential_(generator=g)
    rows = torch.tensor([-1, 4, 0, 2, 3, 1, 5][:s], device=DEV)  # any noise row per sampled row
    return logits, temp, top_p, top_k, noise, rows


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_sample_rows_draws_what_a_sorted_nucleus_draws(dtype):
    """Greedy rows take the first max; sampled rows the race over the top-k tokens' top-p
    nucleus, equal to sorting the row, over rows longer than the kernel's step (several
    steps and a ragged end on CUDA), with a nucleus of one token (top_p 0.05, top_k 1) and,
    in bf16, many tied values (a boundary value's tokens are all kept or all dropped)."""
    g = gen(30)
    v = 300 if not CUDA else 102400 + 77
    for trial in range(3 if not CUDA else 20):
        case = _sampling_case(g, 7, v, dtype)
        want = sample_reference(*case)
        assert torch.equal(sample_rows(*case), want), trial
        logits, top_k = case[0], case[3]
        for i in (2, 4, 6):  # the pick is among the top-k values
            assert logits[i, want[i]] >= logits[i].float().sort(descending=True).values[top_k[i] - 1]
    assert want[0] == case[0][0].float().argmax()


def test_sample_rows_follows_the_nucleus_distribution():
    """Top-p 0.7 over [0.5, 0.3, 0.15, 0.05]: the first two tokens (0.8 >= 0.7; 0.5 alone
    is not), drawn as 5/8 and 3/8; a tie at the boundary keeps every tied token. On CUDA the
    kernel's draws are counted; under Triton's interpreter (one program a row, slow) the
    kernel picks what ``sample_reference`` picks on the same noise for 64 rows, and the
    reference's draws are counted."""
    n, tol = (4000, 0.03) if not CUDA else (40000, 0.01)
    g = gen(31)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], device=DEV)
    logits = probs.log().expand(n, 4).contiguous()
    tied = torch.tensor([0.4, 0.2, 0.2, 0.2], device=DEV).log().expand(n, 4).contiguous()
    ones, no_k = torch.ones(n, device=DEV), torch.zeros(n, device=DEV, dtype=torch.int32)
    noise = torch.empty(n, 4, device=DEV).exponential_(generator=g)
    rows = torch.arange(n, device=DEV)
    cases = (  # (logits, top_p, top_k, the frequencies)
        (logits, ones * 0.7, no_k, [5 / 8, 3 / 8, 0, 0]),
        (tied, ones * 0.5, no_k, [0.4, 0.2, 0.2, 0.2]),
        (tied, ones, no_k + 2, [0.4, 0.2, 0.2, 0.2]),  # top-k 2 keeps the values tied with the 2nd
        (logits, ones, no_k + 2, [5 / 8, 3 / 8, 0, 0]),  # top-k 2: the first two, at 5/8 and 3/8
    )
    for x, top_p, top_k, want in cases:
        if CUDA:
            picks = sample_rows(x, ones, top_p, top_k, noise, rows)
        else:
            m = 64
            picks = sample_reference(x, ones, top_p, top_k, noise, rows)
            got = sample_rows(x[:m].contiguous(), ones[:m], top_p[:m], top_k[:m], noise, rows[:m])
            assert torch.equal(got, picks[:m]), (want, got, picks[:m])
        freq = torch.bincount(picks, minlength=4).double() / n
        torch.testing.assert_close(freq.cpu(), torch.tensor(want, dtype=torch.float64), atol=tol, rtol=0)


def test_sample_rows_reruns_the_race_above_a_losing_winner_and_takes_first_maxima():
    """A first winner outside the nucleus (token 0, its noise tiny) sends the race above it:
    the answer is the nucleus' winner, token 1, in a row shorter than the kernel's step (its
    idle lanes must not stand for the winner's value). -inf logits never win; greedy rows
    take the first of equal maxima."""
    logits = torch.tensor([[-1.0, 0.5, -0.5, -0.5, -0.5], [-1.0, 0.5, -0.5, float("-inf"), -0.5],
                           [0.0, 2.0, 1.0, 2.0, -3.0]], device=DEV)
    temp, top_p = torch.tensor([1.0, 1.0, 0.0], device=DEV), torch.tensor([0.5, 0.5, 1.0], device=DEV)
    noise = torch.ones(2, 5, device=DEV)
    noise[:, 0] = 1e-3
    rows = torch.tensor([0, 1, -1], device=DEV)
    want = torch.tensor([1, 1, 1], device=DEV)
    no_k = torch.zeros(3, dtype=torch.int32, device=DEV)
    assert torch.equal(sample_reference(logits, temp, top_p, no_k, noise, rows), want)
    assert torch.equal(sample_rows(logits, temp, top_p, no_k, noise, rows), want)


def test_sample_rows_takes_any_positive_temperature():
    """A tiny temperature tends to greedy, not to NaN: the logits are shifted by their max
    before the division (x / 1e-40 alone overflows float32). Every sampled row, with top-k,
    top-p or neither, picks the argmax, as the reference and the torch sampler do; of tied
    maxima the race picks one of them."""
    g = gen(32)
    v = 300 if not CUDA else 102400 + 77
    logits = torch.randn(4, v, generator=g, device=DEV) * 3
    logits[3, 7] = logits[3, 11] = logits[3].max() + 1  # two tied maxima
    temp = torch.full((4,), 1e-40, device=DEV)
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5], device=DEV)
    top_k = torch.tensor([0, 0, 5, 0], device=DEV, dtype=torch.int32)
    noise = torch.empty(4, v, device=DEV).exponential_(generator=gen(33))
    rows = torch.arange(4, device=DEV)
    got = sample_rows(logits, temp, top_p, top_k, noise, rows)
    assert torch.equal(got[:3], logits[:3].argmax(-1)) and int(got[3]) in (7, 11)
    assert torch.equal(sample_reference(logits, temp, top_p, top_k, noise, rows), got)
    from lockstep.runtime.sampling import _probs
    probs = _probs(logits, temp.cpu().numpy(), top_p.cpu().numpy(), top_k.cpu().numpy())
    assert not probs.isnan().any() and torch.equal(probs[:3].argmax(-1), got[:3])


def test_runtime_samplers_keep_extreme_parameters_finite():
    """The runtime's samplers (torch ops and the kernel's launcher) get float64 parameters: a
    temperature of 1e-50 or a top_p of 1e-50 rounds to 0 in float32 and 1e39 to inf. The
    first two must still give the argmax, the last a real token, never NaN (a -inf logit /
    inf was NaN; 0 / 0 at the row's max too)."""
    import numpy as np

    from lockstep.runtime.sampling import _probs, sample_on_device
    logits = torch.tensor([[0.0, float("-inf"), 1.0, 0.5], [2.0, 1.0, float("-inf"), 0.0],
                           [0.0, 3.0, 1.0, float("-inf")], [1.0, float("-inf"), 0.0, 2.0]], device=DEV)
    temp, top_p = np.array([1e-50, 1.0, 1e39, 1e39]), np.array([1.0, 1e-50, 1.0, 0.5])
    no_k = np.zeros(4, np.int64)
    probs = _probs(logits, temp, top_p, no_k)
    assert not probs.isnan().any() and torch.equal(probs[:2].argmax(-1), logits[:2].argmax(-1))
    assert (probs[2:, :].sum(-1) - 1).abs().max() < 1e-5 and probs[2, 3] == 0 and probs[3, 1] == 0
    seeds, pos = np.arange(4), np.zeros(4, np.int64)
    for k in (no_k, no_k + 3):  # the kernel; with top-k on 4 rows, the torch ops
        got = sample_on_device(logits, temp, top_p, k, seeds, pos, gen(34)).cpu()
        assert torch.equal(got[:2], logits[:2].argmax(-1).cpu()) and logits[2:][torch.arange(2), got[2:]].isfinite().all()


def test_sample_rows_rejects_bad_arguments():
    logits, temp, top_p, top_k, noise, rows = _sampling_case(gen(32), 3, 40)
    with pytest.raises(ValueError, match="temperature"):
        sample_rows(logits, temp[:2], top_p, top_k, noise, rows)
    with pytest.raises(ValueError, match="top_k"):
        sample_rows(logits, temp, top_p, top_k.long(), noise, rows)
    with pytest.raises(ValueError, match="noise"):
        sample_rows(logits, temp, top_p, top_k, noise[:, :30], rows)
    with pytest.raises(ValueError, match="noise_rows"):
        sample_rows(logits, temp, top_p, top_k, noise, rows.float())
    assert sample_rows(logits[:0], temp[:0], top_p[:0], top_k[:0], noise, rows[:0]).shape == (0,)


@pytest.mark.parametrize("vocab", [100, 5000])
def test_penalize_kernel_equals_the_torch_penalties(vocab):
    """In place, one pass a row, the same numbers as the CPU's torch ops (bit for bit: the
    same operations in the same order, with a correctly rounded division)."""
    from lockstep.kernels.penalties import penalize
    from lockstep.runtime.logits import penalize_torch

    g = torch.Generator().manual_seed(7)  # (the data is made on the CPU, the reference's device)
    x = torch.randn(6, vocab, generator=g) * 4
    counts = torch.randint(0, 3, (9, vocab), generator=g, dtype=torch.int32) * (torch.rand(9, vocab, generator=g) < 0.1)
    seen = torch.rand(9, vocab, generator=g) < 0.05
    rows, slots = torch.tensor([0, 2, 3, 5]), torch.tensor([8, 0, 4, 4])
    params = torch.tensor([[1.3, 0.5, 0.2], [0.7, -1.0, 1.5], [1.0, 0.0, 0.0], [2.0, 2.0, -2.0]])
    want = x.clone()
    penalize_torch(want, rows, slots, counts, seen, params)
    got = x.clone().to(DEV)  # (a copy: on the CPU .to() would hand back x itself)
    penalize(got, rows.to(DEV), slots.to(DEV), counts.int().to(DEV), seen.to(DEV), params.to(DEV))
    assert torch.equal(got.cpu(), want)
    assert not torch.equal(want[rows], x[rows]) and torch.equal(want[[1, 4]], x[[1, 4]])  # only its rows


@pytest.mark.parametrize("vocab", [100, 5000])
def test_min_p_kernel_equals_the_torch_ops(vocab):
    """In place, one program a row, the same numbers as the CPU's torch ops (a float32
    subtraction and comparison), only the rows given."""
    from lockstep.kernels.min_p import min_p_
    from lockstep.runtime.logits import LogitsProcessors

    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, vocab, generator=g) * 3
    x[2, 7] = float("-inf")  # (a token masked before: stays so)
    narrow, temperature = [(0, 0.05), (2, 0.3), (3, 1.0)], np.array([1.0, 0.0, 0.7, 2.0, 1.0])
    want = x.clone()
    LogitsProcessors._min_p(want, narrow, temperature)  # (on the CPU: the torch ops)
    rows = torch.tensor([j for j, _ in narrow])
    floor = torch.tensor([float(temperature[j]) * math.log(p) for j, p in narrow], dtype=torch.float64).float()
    got = x.clone().to(DEV)
    min_p_(got, rows.to(DEV), floor.to(DEV))
    assert torch.equal(got.cpu(), want)
    assert torch.equal(want[[1, 4]], x[[1, 4]]) and (want[0] == float("-inf")).sum() > (x[0] == float("-inf")).sum()
