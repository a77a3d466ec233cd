"""MLA attention: decode (short and long contexts), KV store, prefill."""

from __future__ import annotations

import traceback

import torch

from lockstep.kernels import fused_moe as moe_mod
from lockstep.kernels import mla_decode as dec_mod
from lockstep.kernels.kv_store import kv_store, kv_store_reference, quantize_per_token
from lockstep.kernels.mla_prefill import PREFILL_CONFIG, mla_attention, mla_prefill, mla_prefill_reference
from lockstep.runtime.models.fast_inputs import len_bucket

from .core import Bench

# -- 4. MLA decode ------------------------------------------------------------------------------

def lazy_variant(cfg: dict) -> dict:
    """``cfg`` with the accumulators rescaled only where the running max grows past
    LAZY_MARGIN (session 17, untimed: offline for sm_90, 467 instructions a 32-token tile
    instead of 528 at batch 256). The bench's random scores do not move the max after the
    first tiles, so it times the skipping path, as one decode query mostly takes."""
    return {**cfg, "LAZY_RESCALE": not cfg.get("LAZY_RESCALE", False)}


def fp8_variants(committed: dict, bf16_twin: dict) -> list[dict]:
    """The FP8 kernel's other forms: RELOAD (session 17: each latent tile loaded once per
    product, so that the compiler pipelines both loads; first, as the one untimed), then
    session 16's EARLY_DEQUANT and PREFETCH (paged tiles), alone and together, on the
    committed tile and the bf16 cache's."""
    plain = {a: v for a, v in committed.items() if a != "RELOAD"}
    out = [] if plain == committed else [plain]  # a committed RELOAD against the tile without it
    for base in (plain, {**bf16_twin, "PAGED": True}):
        out.append({**base, "RELOAD": True})
    out.append({**plain, "RELOAD": True, "num_stages": 2})
    for base in (plain, {**bf16_twin, "PAGED": True}):
        for extra in ({"PREFETCH": True, "PAGED": True}, {"EARLY_DEQUANT": True},
                      {"EARLY_DEQUANT": True, "PREFETCH": True, "PAGED": True}):
            out.append({**base, **extra})
    return out


def decode_candidates(committed: dict, fp8: bool, smoke: bool, bf16_twin: dict | None = None) -> list[dict]:
    """(The page-group tile loop prefetches only with num_stages >= 3.) HALVES 2: the latent
    as two halves, two tensor-core chains a tile instead of one. ``bf16_twin``: the bf16
    cache's config for the same case (FP8 candidates try it with EARLY_DEQUANT)."""
    bf16_twin = bf16_twin or committed
    if smoke:
        return [{"BLOCK_N": 4, "num_warps": 4, "num_stages": 3, "MIN_SPLIT": 64},
                {"BLOCK_N": 4, "num_warps": 4, "num_stages": 3, "MIN_SPLIT": 64, "HALVES": 2}]
    if fp8:
        tiles = [(64, 8, 3), (32, 8, 3), (16, 4, 3), (32, 4, 3), (64, 8, 4)]
    else:
        tiles = [(16, 4, 3), (32, 8, 3), (64, 8, 3), (32, 4, 3), (16, 4, 4), (64, 4, 3), (32, 4, 4)]
    out = [committed, lazy_variant(committed)]  # the untimed lazy rescale first, on the committed tile
    if fp8:  # each tile dequantized to bf16 where loaded, and each tile's load written out one
        # tile ahead, on the committed tile and bf16's (first: tuning stops at the deadline)
        out += fp8_variants(committed, bf16_twin)
    for bn, w, s in tiles:
        for halves in (1, 2):
            for split in (64, 256, 512, 1024):
                for waves in (1, 2, 4):
                    cfg = {"BLOCK_N": bn, "num_warps": w, "num_stages": s, "MIN_SPLIT": split,
                           "WAVES": waves, "HALVES": halves}
                    if cfg != committed:
                        out.append(cfg)
    # the loop as it was before page groups (a block-table entry per token), for comparison
    out.append({**committed, "num_stages": 2, "PAGED": False})
    return [c for i, c in enumerate(out) if c not in out[:i]]


def decode_case(b: Bench, bw: float, name: str, key: tuple, cands: list[dict], ql, qp, cache, scale, tables,
                lens, ctx: int, sm_scale: float, baseline: bool = True, bound: int | None = None,
                bucket: int | None = None) -> None:
    """Tune mla_decode over cands (keyed DECODE_CONFIGS[key]), check it where the float32
    reference fits, and time it against its KV bytes (and the torch baseline for bf16).
    ``ctx``: the sequences' length; ``bound``: the launch's context bound (default ``ctx``);
    ``bucket``: the context the case stands for (default ``ctx``), which decides whether the
    float32 reference (it gathers everything) is affordable."""
    fp8 = scale is not None
    batch, h, dl = ql.shape
    dr = qp.shape[2]
    bound = bound or ctx
    cfg, _ = b.autotune(f"mla_decode.DECODE_CONFIGS[{key}]", cands,
                        lambda c: dec_mod.mla_decode(ql, qp, cache, tables, lens, sm_scale,
                                                     scale, max_seq_len=bound, config=c))
    run = lambda: dec_mod.mla_decode(ql, qp, cache, tables, lens, sm_scale, scale,  # noqa: E731
                                     max_seq_len=bound, config=cfg)
    check = ""
    bucket = bucket or ctx
    if batch * bucket <= 256 * 1024 or (batch == 1 and bucket <= 1 << 17):  # the reference gathers everything
        ref = dec_mod.mla_decode_reference(ql, qp, cache, tables, lens, sm_scale, scale)
        check = b.check(name, run(), ref)
    per_token = (dl + dr) * (1 if fp8 else 2) + (4 if fp8 else 0)
    nbytes = batch * ctx * per_token + 2 * batch * h * (2 * dl + dr)  # KV + q + out
    us, us_eager = b.graph_us(run), b.eager_us(run)
    roof_us = 1e6 * nbytes / bw
    kw = {}
    if not fp8 and baseline:
        base = lambda: dec_mod.mla_decode_reference(  # noqa: E731
            ql, qp, cache, tables, lens, sm_scale, None, torch.bfloat16, max_len=ctx)
        base_us = b.graph_us(base)
        kw = dict(baseline="torch reference (gather + bf16 matmuls)", baseline_us=base_us,
                  baseline_us_eager=b.eager_us(base), speedup=base_us / us,
                  baseline_frac=roof_us / base_us)
    b.row("mla_decode", name, us=us, us_eager=us_eager, bytes_mb=nbytes / 1e6,
          frac_roofline=roof_us / us, check=check, note=f"config {cfg}", **kw)


def decode_inputs(b: Bench, g: torch.Generator, batch: int, ctx: int, most: int, bs: int, h: int, dl: int,
                  dr: int) -> tuple:
    """(block tables, lengths, q_latent, q_pe) of `batch` sequences of `ctx` tokens, their
    pages drawn at random from `most` pages of `bs` tokens."""
    per = -(-ctx // bs)
    tables = torch.randperm(most, generator=g, device=b.dev)[:batch * per].view(batch, per).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=b.dev)
    ql = (torch.randn(batch, h, dl, generator=g, device=b.dev) * 0.1).to(torch.bfloat16)
    qp = (torch.randn(batch, h, dr, generator=g, device=b.dev) * 0.1).to(torch.bfloat16)
    return tables, lens, ql, qp


# Decode cases are timed this many tokens past their context (a decode step of a request whose
# prompt was that long), with the launch bound the runtime would give them: session 17's
# re-tune at exactly 1,024 tokens (bound 1,024) picked configs that made the whole model 3%
# slower at batch 256, where the runtime launches with bound 2,048.
DECODE_PAST = 16


def bench_decode(b: Bench, bw: float, cases: set[tuple[str, int, int]] | None = None) -> None:
    h, dl, dr, bs = (16, 512, 64, 16) if not b.smoke else (4, 32, 16, 4)  # bs: the runtime's pages
    # the batches the decode targets name first: tuning stops at the budget
    batches = (256, 64, 128, 1, 8, 32) if not b.smoke else (1, 3)
    ctxs = (1024, 4096) if not b.smoke else (40,)
    sm_scale = 192 ** -0.5
    g = torch.Generator(device=b.dev).manual_seed(1)
    most = max(batches) * -(-(max(ctxs) + DECODE_PAST) // bs)
    cache16 = torch.randn(most, bs, dl + dr, generator=g, device=b.dev).to(torch.bfloat16)
    cache8, scale8 = quantize_per_token(cache16)
    if cases:
        missing = sorted(c for c in cases if c[1] not in batches or c[2] not in ctxs)
        if missing:
            print(f"--decode-cases: not cases of this section (batches {batches}, contexts {ctxs}): "
                  f"{missing}", flush=True)
        batches = tuple(x for x in batches if any(c[1] == x for c in cases))
        ctxs = tuple(x for x in ctxs if any(c[2] == x for c in cases))
    for batch in batches:
        for ctx in ctxs:
            # As the runtime launches decode after a ctx-token prompt: the sequences a few
            # tokens past it, the launch bound the power of two above (``len_bucket``), and
            # the config the bucket at or below that bound (ctx's).
            seq = ctx + DECODE_PAST if not b.smoke else ctx
            bound = len_bucket(seq, 1 << 30) if not b.smoke else ctx
            gc = torch.Generator(device=b.dev).manual_seed(batch * 100_000 + ctx)  # whichever cases run
            tables, lens, ql, qp = decode_inputs(b, gc, batch, seq, most, bs, h, dl, dr)
            for fp8 in (False, True):
                if cases and ("fp8" if fp8 else "bf16", batch, ctx) not in cases:
                    continue
                name = f"decode {'fp8' if fp8 else 'bf16'} batch {batch} ctx {ctx}"
                try:
                    cache, scale = (cache8, scale8) if fp8 else (cache16, None)
                    # keyed by batch and context bucket (the split that fills the GPU depends on both)
                    key = ("fp8" if fp8 else "bf16", batch, ctx)
                    cands = decode_candidates(dec_mod.decode_config(cache.dtype, batch, ctx), fp8, b.smoke,
                                              dec_mod.decode_config(cache16.dtype, batch, ctx))
                    decode_case(b, bw, name, key, cands, ql, qp, cache, scale, tables, lens, seq, sm_scale,
                                bound=bound, bucket=ctx)
                except Exception:  # noqa: BLE001
                    b.errors[name] = traceback.format_exc()[-1500:]
                    print(b.errors[name], flush=True)
        torch.cuda.empty_cache() if not b.smoke else None


def long_candidates(committed: dict, short: dict, fp8: bool, batch: int, sms: int,
                    bf16_twin: dict | None = None) -> list[dict]:
    """Long contexts at small batch: more splits than the 128 the short buckets allow (several
    programs per SM), on the tiles that won at 4K. A cap no launch reaches (WAVES * sms /
    batch splits wanted) is left out: it would time the same launch again. ``short``: the 4K
    bucket's config, which such launches took before the 128K bucket; ``bf16_twin``: the bf16
    cache's config for the same case."""
    bf16_twin = bf16_twin or committed
    out = [committed, lazy_variant(committed), short]
    if fp8:
        out += fp8_variants(committed, bf16_twin)
    tiles = ([(64, 8, 2, 1, False), (32, 4, 3, 2, True), (64, 8, 3, 1, True)] if fp8 else
             [(32, 4, 3, 2, True), (64, 8, 3, 1, True), (32, 4, 4, 2, True)])
    for most in (1024, 512, 2048):  # the likeliest first: tuning stops at the deadline
        for waves in (8, 4, 16):
            cap = most if -(-waves * sms // batch) > 128 else 128
            for bn, w, st, halves, paged in tiles:
                out.append({"BLOCK_N": bn, "num_warps": w, "num_stages": st, "MIN_SPLIT": 64,
                            "WAVES": waves, "HALVES": halves, "PAGED": paged, "MAX_SPLITS": cap})
    return [c for i, c in enumerate(out) if c not in out[:i]]


def bench_decode_long(b: Bench, bw: float) -> None:
    """Batch 1 and 8 at 128K tokens of context (the 131072 context bucket), bf16 and FP8."""
    h, dl, dr, bs = (16, 512, 64, 16) if not b.smoke else (4, 32, 16, 4)
    ctx = (1 << 17) if not b.smoke else 300
    sm_scale = 192 ** -0.5
    g = torch.Generator(device=b.dev).manual_seed(2)
    batches = (1, 8) if not b.smoke else (1,)
    seq = ctx + DECODE_PAST if not b.smoke else ctx  # as bench_decode: as the runtime launches it
    bound = len_bucket(seq, 1 << 30) if not b.smoke else ctx
    most = max(batches) * -(-seq // bs)
    cache16 = torch.randn(most, bs, dl + dr, generator=g, device=b.dev).to(torch.bfloat16)
    cache8, scale8 = quantize_per_token(cache16)
    sms = torch.cuda.get_device_properties(b.dev).multi_processor_count if not b.smoke else 4
    for batch in batches:
        tables, lens, ql, qp = decode_inputs(b, g, batch, seq, most, bs, h, dl, dr)
        for fp8 in (True, False):
            name = f"decode {'fp8' if fp8 else 'bf16'} batch {batch} ctx {ctx}"
            dtype = cache8.dtype if fp8 else cache16.dtype
            try:
                committed = dec_mod.decode_config(dtype, batch, ctx)
                short = dec_mod.decode_config(dtype, batch, 4096)
                twin = dec_mod.decode_config(cache16.dtype, batch, ctx)
                cands = long_candidates(committed, short, fp8, batch, sms, twin) if not b.smoke else [committed]
                decode_case(b, bw, name, ("fp8" if fp8 else "bf16", batch, ctx), cands, ql, qp,
                            *((cache8, scale8) if fp8 else (cache16, None)), tables, lens, seq, sm_scale,
                            baseline=False, bound=bound, bucket=ctx)
            except Exception:  # noqa: BLE001
                b.errors[name] = traceback.format_exc()[-1500:]
                print(b.errors[name], flush=True)
        del tables, lens, ql, qp
    del cache16, cache8, scale8
    torch.cuda.empty_cache() if not b.smoke else None


# -- 5. KV store and MLA prefill -------------------------------------------------------------

def bench_kv_store(b: Bench, bw: float) -> None:
    dl, dr, bs, blocks = (512, 64, 64, 4096) if not b.smoke else (32, 16, 4, 64)
    for t in ((256, 8192) if not b.smoke else (16,)):
        for fp8 in (False, True):
            name = f"kv_store {'fp8' if fp8 else 'bf16'} tokens {t}"
            try:
                g = torch.Generator(device=b.dev).manual_seed(t)
                lat = torch.randn(t, dl, generator=g, device=b.dev).to(torch.bfloat16)
                pe = torch.randn(t, dr, generator=g, device=b.dev).to(torch.bfloat16)
                slots = torch.randperm(blocks * bs, generator=g, device=b.dev)[:t]
                dtype = moe_mod.FP8 if fp8 else torch.bfloat16
                cache = torch.zeros(blocks, bs, dl + dr, device=b.dev).to(dtype)
                ref = cache.clone()
                scale = torch.zeros(blocks, bs, device=b.dev) if fp8 else None
                ref_scale = scale.clone() if fp8 else None
                run = lambda: kv_store(cache, lat, pe, slots, scale)  # noqa: E731
                run()
                kv_store_reference(ref, lat, pe, slots, ref_scale)
                d = (cache.view(torch.uint8).int() - ref.view(torch.uint8).int()).abs()
                ok = int(d.max()) <= 1 and float((d > 0).float().mean()) < 1e-3
                b.checks[name] = ok
                nbytes = t * ((dl + dr) * 2 + (dl + dr) * (1 if fp8 else 2) + 8 + (4 if fp8 else 0))
                us = b.graph_us(run)
                b.row("kv_store", name, us=us, us_eager=b.eager_us(run), bytes_mb=nbytes / 1e6,
                      frac_roofline=1e6 * nbytes / bw / us,
                      check=f"{'ok' if ok else 'FAIL'} bytes_differing={int((d > 0).sum())}")
            except Exception:  # noqa: BLE001
                b.errors[name] = traceback.format_exc()[-1500:]
                print(b.errors[name], flush=True)


def _prefill_case(b: Bench, new: list[int], prefix: list[int], fp8: bool):
    h, dn, dr, dv, dl, bs = (16, 128, 64, 128, 512, 64) if not b.smoke else (2, 16, 16, 16, 32, 4)
    g = torch.Generator(device=b.dev).manual_seed(sum(new))
    t = sum(new)
    bf = torch.bfloat16
    cu = torch.tensor([0] + new, device=b.dev).cumsum(0).to(torch.int32)
    q = (torch.randn(t, h, dn + dr, generator=g, device=b.dev) * 0.3).to(bf)
    kn = torch.randn(t, h, dn, generator=g, device=b.dev).to(bf)
    kp = torch.randn(t, dr, generator=g, device=b.dev).to(bf)
    v = torch.randn(t, h, dv, generator=g, device=b.dev).to(bf)
    per = max(-(-p // bs) for p in prefix)
    tables = torch.randperm(len(new) * per, generator=g, device=b.dev).view(len(new), per).to(torch.int32)
    cache = torch.randn(len(new) * per, bs, dl + dr, generator=g, device=b.dev).to(bf)
    scale = None
    if fp8:
        cache, scale = quantize_per_token(cache)
    w = (torch.randn(h * (dn + dv), dl, generator=g, device=b.dev) * dl ** -0.5).to(bf)
    return q, kn, kp, v, cu, max(new), prefix, cache, tables, w, (dn + dr) ** -0.5, scale


def _attention_alone(b: Bench, args, cfg: dict) -> None:
    """The attention kernel alone, one unmasked pass of a prefix chunk (the new tokens against
    16K expanded keys), at the old config and the tuned one: its TFLOP/s, without the
    expansion GEMM and the gathers around it."""
    q, h, dn, dr, dv = args[0], args[0].shape[1], args[1].shape[2], args[2].shape[1], args[3].shape[2]
    nk = 16384 if not b.smoke else 24
    g = torch.Generator(device=b.dev).manual_seed(7)
    kn = torch.randn(nk, h, dn, generator=g, device=b.dev).to(q.dtype)
    kp = torch.randn(nk, dr, generator=g, device=b.dev).to(q.dtype)
    v = torch.randn(nk, h, dv, generator=g, device=b.dev).to(q.dtype)
    cu_q = torch.tensor([0, q.shape[0]], device=b.dev, dtype=torch.int32)
    cu_k = torch.tensor([0, nk], device=b.dev, dtype=torch.int32)
    out = torch.zeros(q.shape[0], h, dv, dtype=torch.float32, device=b.dev)
    lse = torch.full((q.shape[0], h), float("-inf"), dtype=torch.float32, device=b.dev)
    flops = 2 * h * q.shape[0] * nk * (dn + dr + dv)
    for label, c in (("before", {**PREFILL_CONFIG, "SPLIT": 0}), ("tuned", cfg)):
        name = f"prefill attention alone ({label}: {c})"
        try:
            us = b.graph_us(lambda: mla_attention(q, kn, kp, v, cu_q, cu_k, q.shape[0], 0.1, causal=False,
                                                  out=out, lse=lse, merge=True, config=c))
            b.row("mla_prefill", name, us=us,
                  note=f"{flops / (us * 1e-6) / 1e12:.0f} TFLOP/s ({flops / (us * 1e-6) / 989e12:.0%} of 989)")
        except Exception:  # noqa: BLE001
            b.errors[name] = traceback.format_exc()[-1500:]
            print(b.errors[name], flush=True)


def bench_prefill(b: Bench) -> None:
    small = ([300, 77], [2000, 513]) if not b.smoke else ([5, 9], [10, 3])
    big = [(4096, 32768), (16384, 131072)] if not b.smoke else [(16, 40)]
    for fp8 in (False, True):
        name = f"prefill {'fp8' if fp8 else 'bf16'} check"
        try:
            args = _prefill_case(b, *small, fp8)
            out = mla_prefill(*args, chunk_tokens=1024 if not b.smoke else 8)
            b.row("mla_prefill", name, check=b.check(name, out, mla_prefill_reference(*args[:5], *args[6:])))
        except Exception:  # noqa: BLE001
            b.errors[name] = traceback.format_exc()[-1500:]
            print(b.errors[name], flush=True)
    cfg = dict(PREFILL_CONFIG)
    for i, (new, prefix) in enumerate(big):
        name = f"prefill bf16 {new} new on {prefix} cached"
        try:
            args = _prefill_case(b, [new], [prefix], False)
            if i == 0:  # tuned on the first case; the others run its winner
                cands = [dict(PREFILL_CONFIG)] + [
                    {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": st, "SPLIT": sp}
                    for m, n, w, st, sp in (  # session 15's first tuning, then its second
                        (128, 64, 8, 2, 0), (128, 64, 8, 3, 0), (128, 64, 8, 4, 1), (128, 128, 8, 2, 1),
                        (128, 64, 16, 3, 1), (64, 64, 4, 4, 1), (128, 32, 8, 4, 1), (64, 128, 8, 2, 1))]
                if b.smoke:
                    cands = [{"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "SPLIT": sp}
                             for sp in (0, 1)]
                cfg, _ = b.autotune("mla_prefill.PREFILL_CONFIG", cands,
                                    lambda c: mla_prefill(*args, config=c))
                _attention_alone(b, args, cfg)
            us = b.eager_us(lambda: mla_prefill(*args, config=cfg), iters=5, warmup=1)
            q, kn, kp, v, cache = args[0], args[1], args[2], args[3], args[7]
            h, dn, dr, dv, dl = q.shape[1], kn.shape[2], kp.shape[1], v.shape[2], cache.shape[2] - kp.shape[1]
            flops = 2 * h * new * (prefix + new / 2) * (dn + dr + dv) + 2 * prefix * dl * h * (dn + dv)
            b.row("mla_prefill", name, us=us, us_eager=us,
                  note=f"{new / (us * 1e-6):.0f} tokens/s; {flops / (us * 1e-6) / 1e12:.0f} TFLOP/s "
                       f"({flops / (us * 1e-6) / 989e12:.0%} of 989 dense bf16)")
        except Exception:  # noqa: BLE001
            b.errors[name] = traceback.format_exc()[-1500:]
            print(b.errors[name], flush=True)
