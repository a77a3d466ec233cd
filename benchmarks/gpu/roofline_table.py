"""A `lockstep profile` file's decode points next to the memory roofline (issue 8's table):

    python3 benchmarks/gpu/roofline_table.py benchmarks/profiles/h200-v2lite-grid.json --copy-tbs 4.27

Per (batch, context): step ms, output tokens/s, roofline ms and the fraction of it. The
roofline is bench_decode.py's: all non-expert weights, the routed experts the step's tokens
select, the KV read (bf16, or FP8 with its per-token scale when the profile says so), the LM
head, over the copy bandwidth (read + write) measured on that GPU. The experts a step
touches are the expected number of distinct experts among batch x top-k uniform picks (a
profile does not record them; bench_decode's measured counts agree: 6 at batch 1, 34.9 at 8,
63.9 at 64). Prefill points are printed as tokens/s. Runs on the CPU (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_pieces import step_bytes  # noqa: E402

from lockstep.runtime.models import preset  # noqa: E402


def touched(cfg, batch: int) -> float:
    """Expected distinct experts for ``batch`` tokens, each picking k distinct of e uniformly: an
    expert is missed by a token with probability 1 - k/e (6 at one token, 34.9 at 8 for v2-lite,
    as measured; drawing the k with replacement, as before session 18, gave 5.77 and 33.9)."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile")
    ap.add_argument("--copy-tbs", type=float, required=True, help="copy bandwidth (read + write), TB/s")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    prof = json.loads(Path(args.profile).read_text())
    cfg = preset(prof["model"])
    fp8 = prof.get("kv_cache_dtype") == "fp8"
    kv_token = cfg.num_hidden_layers * (cfg.kv_cache_dim + 4 if fp8 else cfg.kv_cache_dim * 2)
    rows = []
    print("batch | context | step ms | output tokens/s | roofline ms | fraction of roofline")
    for batch, ctx, s in prof["decode"]:
        roof = 1e3 * step_bytes(cfg, batch, ctx, touched(cfg, batch), kv_token_bytes=kv_token) / (args.copy_tbs * 1e12)
        rows.append({"batch": batch, "context": ctx, "step_ms": 1e3 * s, "tokens_per_s": batch / s,
                     "roofline_ms": roof, "fraction": roof / (1e3 * s)})
        r = rows[-1]
        print(f"{batch} | {ctx:,} | {r['step_ms']:.2f} | {r['tokens_per_s']:,.0f} | {roof:.2f} | {r['fraction']:.2f}")
    print("\nchunk | cached prefix | step ms | new tokens/s")
    for chunk, ctx, s in prof["prefill"]:
        print(f"{chunk:,} | {ctx:,} | {1e3 * s:.1f} | {chunk / s:,.0f}")
    if args.json:
        print(json.dumps({"profile": args.profile, "decode": rows}))


if __name__ == "__main__":
    main()
