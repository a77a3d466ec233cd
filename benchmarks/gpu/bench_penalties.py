"""Logits processing on the GPU (penalties, min_p, min_tokens, logit_bias, allowed_token_ids,
structured outputs):
what it costs a decode step through the whole engine.

The v2-lite shape (random weights, bf16) on one GPU through ``open_engine`` (runtime
process, fast path, CUDA graphs, steps launched one ahead): --batch requests of 512-token
random prompts, --tokens output tokens each (ignore_eos), submitted together. Per setting,
output tokens per second of wall time from the first token to the last (the decode phase;
the median of --repeat rounds), and its ratio to the plain setting of the same sampling
mode measured in the same run:
- greedy; greedy with repetition 1.1, frequency 0.2 and presence 0.2 on every request;
  greedy with a logit_bias of 32 random ids (-100 to 100) on every request;
- sampled (temperature 1, top-p 0.95); the same with min_p 0.05; with min_tokens (= --tokens);
  with 1,000 random allowed_token_ids on every request;
- structured outputs (xgrammar's masks, filled on the host each step, the step not launched
  ahead): greedy under the regex [a-z]{tokens + 50}, sampled under a JSON schema whose one
  string is at least 2 x tokens characters long (neither can end within --tokens).
That steps launched ahead count as steps run whole do is tests/test_fast_path.py's
test_penalties_count_alike_with_steps_launched_ahead (the same plans, so the same kernels:
two engines would batch differently, and bf16 near-ties then go either way).

Prints a table and, with --json, the house JSON line; headline: penalized greedy decode
throughput as a fraction of plain greedy at --batch (no target in the issues: vLLM's V1
sampler pays a gather of the (batch, vocab) counts and a few elementwise passes, the same
work as here).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import emit  # noqa: E402

from lockstep.api import open_engine  # noqa: E402
from lockstep.engine.config import EngineConfig  # noqa: E402
from lockstep.policy.config import SchedulerConfig  # noqa: E402
from lockstep.policy.request import SamplingParams  # noqa: E402
from lockstep.policy.request import StructuredOutputsParams as S  # noqa: E402

PEN = dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.2)


def settings(tokens: int, vocab: int) -> dict[str, tuple[str, SamplingParams]]:
    g = dict(max_tokens=tokens, ignore_eos=True)
    s = dict(g, temperature=1.0, top_p=0.95, seed=None)
    rng = np.random.default_rng(1)
    bias = {int(t): float(b) for t, b in zip(rng.choice(vocab, 32, replace=False), rng.uniform(-100, 100, 32))}
    allowed = tuple(int(t) for t in rng.choice(vocab, min(1000, vocab // 2), replace=False))
    return {
        "greedy": ("greedy", SamplingParams(temperature=0.0, **g)),
        "greedy + penalties": ("greedy", SamplingParams(temperature=0.0, **g, **PEN)),
        "greedy + logit_bias (32 ids)": ("greedy", SamplingParams(temperature=0.0, **g, logit_bias=bias)),
        "sampled": ("sampled", SamplingParams(**s)),
        "sampled + min_p 0.05": ("sampled", SamplingParams(**s, min_p=0.05)),
        # every token must not be the end of sequence: its logit masked on every step
        "sampled + min_tokens": ("sampled", SamplingParams(**dict(s, ignore_eos=False), min_tokens=tokens)),
        "sampled + allowed_token_ids (1,000)": ("sampled", SamplingParams(**s, allowed_token_ids=allowed)),
        # structured outputs whose grammar cannot end within --tokens: every step masked
        "greedy + regex (letters)": ("greedy", SamplingParams(temperature=0.0, **g, structured_outputs=S(
            regex=f"[a-z]{{{tokens + 50}}}"))),
        "sampled + JSON schema (a long string)": ("sampled", SamplingParams(**s, structured_outputs=S(json={
            "type": "object", "properties": {"text": {"type": "string", "minLength": 2 * tokens}},
            "required": ["text"]}))),
    }


def config(args) -> EngineConfig:
    sched = SchedulerConfig(num_blocks=args.batch * 48 + 64, block_size=16, max_num_seqs=args.batch,
                            max_num_batched_tokens=8192, max_model_len=2048)
    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, scheduler=sched, tokenizer=None)


async def round_(engine, prompts, params) -> tuple[float, list[list[int]]]:
    """(decode tokens per second, each request's tokens)."""
    firsts, lasts, toks = [], [], [None] * len(prompts)

    async def one(i):
        got = []
        async for out in engine.generate(prompts[i], params):
            if not got:
                firsts.append(time.perf_counter())
            got.extend(out.token_ids.tolist())
        lasts.append(time.perf_counter())
        toks[i] = got
    async with trio.open_nursery() as n:
        for i in range(len(prompts)):
            n.start_soon(one, i)
    decode = sum(len(t) - 1 for t in toks)
    return decode / (max(lasts) - max(firsts)), toks


async def main_async(args) -> None:
    rng = np.random.default_rng(0)
    vocab = 100000 if args.model == "v2-lite" else 500
    prompts = [rng.integers(3, vocab, 512).astype(np.int32) for _ in range(args.batch)]
    rows, tokens = [], {}
    async with open_engine(config(args)) as engine:
        # warm up with a whole round: the first one at a batch this large ran 5-8% slower
        # (session 22), which read as a gain for the settings after it
        await round_(engine, prompts, SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True))
        base = {}
        chosen = settings(args.tokens, vocab)
        if args.only:  # (the plain settings stay: the others' ratios are to them)
            unknown = set(args.only) - set(chosen)
            if unknown:
                raise SystemExit(f"--only: unknown setting(s) {sorted(unknown)}; the settings are {list(chosen)}")
            chosen = {k: v for k, v in chosen.items() if k in args.only or k in ("greedy", "sampled")}
        for name, (mode, params) in chosen.items():
            rates = []
            for _ in range(args.repeat):
                rate, toks = await round_(engine, prompts, params)
                rates.append(rate)
            tokens[name] = toks
            rate = statistics.median(rates)
            base.setdefault(mode, rate)
            rows.append({"setting": name, "batch": args.batch, "decode_tok_s": rate,
                         "vs_plain": rate / base[mode]})
            print(rows[-1], flush=True)
    # Checks (in the table's last column): how many requests the penalties changed, and tokens
    # drawn outside what allowed_token_ids or the regex allow (both must be 0)
    if "greedy + penalties" in tokens:
        changed = sum(a != b for a, b in zip(tokens["greedy"], tokens["greedy + penalties"]))
        rows.append({"setting": "requests whose tokens the penalties changed", "batch": args.batch,
                     "decode_tok_s": 0.0, "vs_plain": float(changed)})
    if "sampled + allowed_token_ids (1,000)" in tokens:
        allowed = set(settings(args.tokens, vocab)["sampled + allowed_token_ids (1,000)"][1].allowed_token_ids)
        outside = sum(t not in allowed for toks in tokens["sampled + allowed_token_ids (1,000)"] for t in toks)
        rows.append({"setting": "tokens drawn outside allowed_token_ids (must be 0)", "batch": args.batch,
                     "decode_tok_s": 0.0, "vs_plain": float(outside)})
    if "greedy + regex (letters)" in tokens:  # the byte tokenizer's ids 3..258 are the bytes: 'a'..'z' alone
        bad = sum(not 100 <= t <= 125 for toks in tokens["greedy + regex (letters)"] for t in toks)
        rows.append({"setting": "tokens outside the regex (must be 0)", "batch": args.batch,
                     "decode_tok_s": 0.0, "vs_plain": float(bad)})
    # headline: the penalties against plain greedy (or, with --only, the first setting run)
    head = next((r for r in rows if r["setting"] == "greedy + penalties"), None) or next(
        r for r in rows if r["setting"] not in ("greedy", "sampled"))
    mode = "sampled" if head["setting"].startswith("sampled") else "greedy"
    emit("bench_penalties", rows, {
        "metric": f"decode throughput with {head['setting']} / plain {mode}, {args.model} {args.dtype}, "
                  f"batch {args.batch}",
        "unit": "fraction", "value": head["vs_plain"],
        "baseline": {"name": f"plain {mode}, same run (tokens/s)",
                     "value": next(r["decode_tok_s"] for r in rows if r["setting"] == mode)},
        "ratio": head["vs_plain"], "target": None, "meets_target": None}, args.json)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--model", default="v2-lite", help="a preset (tiny: a CPU smoke run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--only", type=lambda v: v.split(","), default=None, metavar="NAME,NAME",
                    help="run only these settings (and the plain greedy and sampled ones)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    trio.run(main_async, args)


if __name__ == "__main__":
    main()
