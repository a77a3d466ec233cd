"""Pieces of the decode benchmarks on the GPU (``bench_decode.py`` and the scripts beside it):
a runtime loaded for a preset and freed with its memory, hand-made decode plans, CUDA-event
timing, the device copy bandwidth, and the bytes a decode step must read (its roofline)."""

from __future__ import annotations

import gc
import statistics

import numpy as np
import torch

from lockstep.policy.step import PLACEHOLDER, StepPlan
from lockstep.runtime.base import NewRequests, RuntimeSpec
from lockstep.runtime.torch_runtime import TorchRuntime

from decode_checks import BS

def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        y.copy_(x)
    b.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (a.elapsed_time(b) / 1e3)


def runtime(model: str, device: str, *, blocks: int, max_seqs: int, max_len: int, overrides=None,
            dtype: str = "bfloat16", **options) -> TorchRuntime:
    rt = TorchRuntime()
    opts = {"init_on_device": device != "cpu", **options}
    if overrides:
        opts["preset_overrides"] = overrides
    rt.load(RuntimeSpec(model=model, device=device, dtype=dtype, num_blocks=blocks, block_size=BS,
                        max_num_seqs=max_seqs, max_model_len=max_len, seed=0, options=opts))
    return rt


def free(*runtimes) -> None:
    for rt in runtimes:
        if rt is not None:
            rt.shutdown()
            rt.__dict__.clear()  # the model, its graphs and their memory pool go with it
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def step_bytes(cfg, batch: int, ctx: int, touched: float, expert_bytes: int = 2,
               kv_token_bytes: float | None = None) -> float:
    """Bytes a decode step must read: non-expert weights, ``touched`` routed experts per MoE
    layer (``expert_bytes`` per weight), the latent KV of every sequence (``kv_token_bytes``
    per token, every layer; default bf16), the embedding rows and the LM head."""
    h, e2 = cfg.hidden_size, 2
    if cfg.q_lora_rank is None:
        q = h * cfg.num_attention_heads * cfg.qk_head_dim
    else:
        q = h * cfg.q_lora_rank + cfg.q_lora_rank * cfg.num_attention_heads * cfg.qk_head_dim
    attn = (q + h * cfg.kv_cache_dim + cfg.kv_lora_rank * cfg.num_attention_heads
            * (cfg.qk_nope_head_dim + cfg.v_head_dim) + cfg.num_attention_heads * cfg.v_head_dim * h) * e2
    expert = 3 * h * cfg.moe_intermediate_size * e2
    dense = cfg.first_k_dense_replace
    moe = cfg.num_hidden_layers - dense
    weights = (cfg.num_hidden_layers * attn + dense * 3 * h * cfg.intermediate_size * e2
               + moe * (cfg.n_shared_experts * expert + touched * expert * expert_bytes / e2
                        + cfg.n_routed_experts * h * 4))
    if kv_token_bytes is None:
        kv_token_bytes = cfg.num_hidden_layers * cfg.kv_cache_dim * e2
    kv = batch * (ctx + 1) * kv_token_bytes
    return weights + kv + cfg.vocab_size * h * e2 + batch * h * e2


def decode_plan(step_id: int, req_ids: np.ndarray, pos: int, tables: np.ndarray | None) -> StepPlan:
    """Every slot i < n decodes one token at position ``pos``; ``tables`` (n, blocks): the
    whole block tables, sent with the first plan only."""
    n = len(req_ids)
    if tables is None:
        blk, boff = np.zeros(0, np.int32), np.zeros(n + 1, np.int64)
    else:
        blk = tables.reshape(-1).astype(np.int32)
        boff = np.arange(n + 1, dtype=np.int64) * tables.shape[1]
    return StepPlan(step_id=step_id, req_ids=req_ids.astype(np.int64), slots=np.arange(n, dtype=np.int32),
                    num_new=np.ones(n, np.int32), start_pos=np.full(n, pos, np.int32), samples=np.ones(n, bool),
                    token_ids=np.full(n, PLACEHOLDER, np.int32), token_offsets=np.arange(n + 1, dtype=np.int64),
                    block_start=np.zeros(n, np.int32), block_ids=blk, block_offsets=boff,
                    num_tokens=n, num_padded_tokens=n)


def add_requests(rt: TorchRuntime, req_ids, temperature=0.0, top_p=1.0, top_k=-1) -> None:
    n = len(req_ids)
    rt.add_requests(NewRequests([int(r) for r in req_ids], [temperature] * n, [top_p] * n, [top_k] * n, [-1] * n))


def events_ms(fn, iters: int) -> float:
    """Median GPU ms of fn() back to back (CUDA events)."""
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def fill_kv(rt: TorchRuntime) -> None:
    """Cache content does not change the time; keep it finite (FP8: codes below 0x70, under
    128 in magnitude, and every per-token scale 1/448)."""
    with torch.no_grad():
        if rt.kv_dtype is None:
            rt.kv_pool.normal_(0.0, 1.0)
            return
        rt.kv_pool.random_(0, 0x70)
        for layer in rt.kv:
            layer.scales.fill_(1 / 448)
