"""The torch runtime on an H200, before any Triton kernel: is the CUDA path right, and how
far is the reference implementation from the hardware limit?

1. The tiny model in fp32 on CUDA against the same model on the CPU (logits, greedy tokens).
2. The whole engine (`LLM`, runtime processes from the forkserver) on CUDA: greedy tokens
   equal the CPU engine's.
3. Decode-step time of the v2-lite shape (bf16, random weights, `--layers` of its 27 layers,
   the first dense) at batch 1-256 with 1,024 cached tokens per sequence, next to the
   memory roofline of the same step (weights and KV it must read over the copy bandwidth
   measured in the same run), extrapolated to 27 layers.

Prints a table and, with --json, the house JSON line (headline: fraction of the roofline at
batch 64; the issue's kernels are what should move it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import emit  # noqa: E402

from lockstep.runtime.models import load_model, preset  # noqa: E402
from lockstep.runtime.models.batch import ForwardBatch  # noqa: E402
from lockstep.runtime.models.deepseek_v3 import DeepseekV3  # noqa: E402

from decode_pieces import copy_bandwidth  # noqa: E402


def check_tiny() -> dict:
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 500, n).tolist() for n in (1, 17, 64, 130)]
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(len(seqs))]
    out = {}
    for dev in ("cpu", "cuda"):
        m = load_model("tiny", dtype=torch.float32, device=dev, seed=0)
        kv = m.make_kv_cache(64, 16)
        logits, _ = m(ForwardBatch.build(seqs, [0] * len(seqs), tables, 16, device=dev), kv)
        out[dev] = logits.float().cpu()
    err = float((out["cpu"] - out["cuda"]).abs().max() / out["cpu"].abs().max())
    return {"tiny_logits_rel_err": err, "tiny_argmax_equal": bool((out["cpu"].argmax(-1) == out["cuda"].argmax(-1)).all())}


def check_engine() -> dict:
    from lockstep.llm import LLM
    from lockstep.policy.request import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["hello", "the quick brown fox", "x" * 200]
    with LLM("tiny", device="cpu") as llm:
        cpu = llm.generate(prompts, params)
    with LLM("tiny", device="cuda", runtime_options={"init_on_device": False}) as llm:  # the CPU's weights
        gpu = llm.generate(prompts, params)
    return {"engine_cuda_equals_cpu": all(a.token_ids.tolist() == b.token_ids.tolist() for a, b in zip(cpu, gpu))}


def decode_step_ms(model: DeepseekV3, batch: int, ctx: int, kv) -> float:
    bs = 16
    per = -(-(ctx + 1) // bs)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    fb = ForwardBatch.build([[5]] * batch, [ctx] * batch, tables, bs, device="cuda")
    for _ in range(3):
        model(fb, kv)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        model(fb, kv)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def roofline_bytes(cfg, layers: int, batch: int, ctx: int) -> float:
    """Bytes one decode step must read: non-expert weights, the experts the batch touches
    (expected distinct experts per MoE layer), and the latent KV of every sequence."""
    h, e, k = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    expert = 3 * h * cfg.moe_intermediate_size * 2
    distinct = e * (1 - (1 - k / e) ** batch)
    moe_layers = layers - cfg.first_k_dense_replace
    attn = (h * cfg.num_attention_heads * cfg.qk_head_dim + h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            + cfg.kv_lora_rank * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
            + cfg.num_attention_heads * cfg.v_head_dim * h) * 2
    dense_mlp = 3 * h * cfg.intermediate_size * 2
    shared = 3 * h * cfg.moe_intermediate_size * cfg.n_shared_experts * 2
    weights = layers * attn + cfg.first_k_dense_replace * dense_mlp + moe_layers * (shared + distinct * expert)
    kv = layers * batch * (ctx + 1) * cfg.kv_cache_dim * 2
    return weights + kv + 2 * cfg.vocab_size * h  # embeddings row reads are tiny; lm_head is not


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=1024)
    args = ap.parse_args()
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    bw = copy_bandwidth() / 2  # the roofline reads; a copy moves each byte twice
    info.update(check_tiny())
    try:
        info.update(check_engine())
    except Exception as e:  # noqa: BLE001 - recorded, the timing part still runs
        info["engine_cuda_equals_cpu"] = f"failed: {e!r}"
    print(json.dumps(info))
    cfg = preset("v2-lite", num_hidden_layers=args.layers)
    model = DeepseekV3.random_init(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    rows = []
    for batch in (1, 16, 64, 256):
        kv = model.make_kv_cache(batch * (-(-(args.ctx + 1) // 16)) + 8, 16)
        ms = decode_step_ms(model, batch, args.ctx, kv)
        roof_ms = 1e3 * roofline_bytes(cfg, args.layers, batch, args.ctx) / bw
        rows.append({"batch": batch, "layers": args.layers, "step_ms": ms, "roofline_ms": roof_ms,
                     "fraction_of_roofline": roof_ms / ms, "step_ms_27_layers": ms * 27 / args.layers,
                     "decode_tokens_per_s_27_layers": batch / (ms * 27 / args.layers / 1e3)})
        del kv
        torch.cuda.empty_cache()
    at64 = next(r for r in rows if r["batch"] == 64)
    rows.append({"batch": "copy GB/s (read side)", "layers": 0, "step_ms": bw / 1e9, "roofline_ms": 0.0,
                 "fraction_of_roofline": 0.0, "step_ms_27_layers": 0.0, "decode_tokens_per_s_27_layers": 0.0})
    emit("bench_torch_runtime_h200", rows, {
        "metric": "v2-lite decode step at batch 64, ctx 1024 (torch reference runtime, no Triton kernels)",
        "unit": "fraction of memory roofline", "value": at64["fraction_of_roofline"],
        "baseline": {"name": "memory roofline at the copy bandwidth measured in the same run", "value": 1.0},
        "ratio": at64["fraction_of_roofline"], "target": "kernels issue: >= 0.7 (to be set there)",
        "meets_target": False, "checks": info,
    }, args.json)


if __name__ == "__main__":
    main()
