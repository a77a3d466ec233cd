"""Prometheus metrics for `lockstep serve`, named as vLLM names them so existing dashboards
work (``vllm:num_requests_running``, ``vllm:time_to_first_token_seconds``, ...), each with a
``model_name`` label. Rendered in the text exposition format, no client library needed.
"""

from __future__ import annotations

import numpy as np

# Buckets as vLLM uses them (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TPOT_BUCKETS = ITL_BUCKETS


def token_buckets(max_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_len`` (vLLM's buckets for per-request token counts)."""
    out, mag = [], 1
    while True:
        for m in (1, 2, 5):
            if m * mag > max_len:
                return tuple(out)
            out.append(float(m * mag))
        mag *= 10


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_, np.array(buckets)
        self.counts = np.zeros(len(buckets) + 1, dtype=np.int64)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[np.searchsorted(self.buckets, value, side="left")] += count
        self.sum += value * count

    def render(self, labels: str) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cum = np.cumsum(self.counts)
        for le, c in zip(self.buckets.tolist(), cum[:-1].tolist()):
            out.append(f'{self.name}_bucket{{{labels},le="{le}"}} {c}')
        out.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {int(cum[-1])}')
        out.append(f"{self.name}_count{{{labels}}} {int(cum[-1])}")
        out.append(f"{self.name}_sum{{{labels}}} {self.sum}")
        return out


def label_value(v: str) -> str:
    """A label value as the text format writes it: backslash, quote and newline escaped."""
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ServerMetrics:
    """Token counts and the first-token and inter-token latencies move as tokens stream (per
    delta, as vLLM counts them per step), so a long request shows while it runs and one
    that fails midway still counts what it produced; the rest when a request ends."""

    def __init__(self, model_name: str, max_model_len: int = 1 << 20):
        self.labels = f'model_name="{label_value(model_name)}"'
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time from arrival to first scheduled.",
                               E2E_BUCKETS)
        # Per finished request, as vLLM's: its token counts, mean time per output token, and
        # its time split into prefill (scheduled to first token) and decode (first to last).
        tokens = token_buckets(max_model_len)
        self.req_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens of finished requests.", tokens)
        self.req_generation = Histogram("vllm:request_generation_tokens", "Output tokens of finished requests.",
                                        tokens)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Mean time per output token of finished requests.", TPOT_BUCKETS)
        self.prefill = Histogram("vllm:request_prefill_time_seconds", "First scheduled to first token.", E2E_BUCKETS)
        self.decode = Histogram("vllm:request_decode_time_seconds", "First token to last.", E2E_BUCKETS)
        self.inference = Histogram("vllm:request_inference_time_seconds", "First scheduled to last token.",
                                   E2E_BUCKETS)

    def tokens(self, state: dict, out, now: float) -> None:
        """A delta of one request (``state``: that request's, empty at first): its tokens
        counted; the first observes TTFT (and counts the prompt), later ones the gap since
        the delta before (one observation per delta, as vLLM observes one per step)."""
        n = len(out.token_ids)
        if not n:
            return
        last = state.get("last")
        if last is None:
            self.prompt_tokens += out.num_prompt_tokens
            if out.ttft_s is not None:
                self.ttft.observe(out.ttft_s)
        else:
            self.itl.observe(now - last)
        state["last"] = now
        self.generation_tokens += n

    def request_done(self, reason: str, e2e: float | None, queue: float | None, ttft: float | None = None,
                     prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.req_prompt.observe(prompt_tokens)
        self.req_generation.observe(output_tokens)
        if e2e is not None and ttft is not None:
            self.decode.observe(e2e - ttft)
            if output_tokens > 1:
                self.tpot.observe((e2e - ttft) / (output_tokens - 1))
            if queue is not None:
                self.prefill.observe(max(ttft - queue, 0.0))
                self.inference.observe(max(e2e - queue, 0.0))
        if e2e is not None:
            self.e2e.observe(e2e)
        if queue is not None:
            self.queue.observe(queue)

    def request_aborted(self) -> None:
        """A request that ended without a final output (its client went away)."""
        self.finished["abort"] = self.finished.get("abort", 0) + 1

    def render(self, stats, accepted_per_pos=(), balancer=None, down: int = 0) -> str:
        """``balancer``: the expert balancer's BalancerStats when it runs; ``down``: ranks
        being restarted now."""
        lb = self.labels
        gauges = [
            ("vllm:num_requests_running", "Requests in model execution batches.", stats.running),
            ("vllm:num_requests_waiting", "Requests waiting to be processed.", stats.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent.",
             stats.kv_blocks_used / max(stats.kv_blocks_total, 1)),
            # P/D (zero when colocated): lockstep's own names, vLLM has none for these.
            ("lockstep:num_requests_waiting_for_kv", "Decode-side requests whose prompt KV is being pulled.",
             stats.waiting_for_kv),
            ("lockstep:num_kv_held", "Prefilled requests whose KV waits for a decode rank's pull.", stats.kv_held),
            ("lockstep:num_ranks_down", "Ranks whose runtime (or DEP group, or nodes) is being restarted.", down),
        ]
        if balancer is not None:  # live expert rebalancing (lockstep serve --redundant-experts)
            gauges.append(("lockstep:eplb_generation", "The newest expert placement generation handed out.",
                           balancer.generation))
            if balancer.balancedness is not None:  # once a plan is made
                gauges.append(("lockstep:eplb_balancedness", "Balancedness (mean / max tokens per GPU) of the "
                               "newest plan, on its window.", balancer.balancedness))
        counters = [
            ("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.", stats.prefix_queries),
            ("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.", stats.prefix_hits),
            ("vllm:num_preemptions", "Cumulative preemptions.", stats.preemptions),
            ("vllm:spec_decode_num_drafts", "Speculative decodes (requests x steps with drafts).", stats.spec_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", stats.spec_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.spec_accepted_tokens),
            ("lockstep:kv_pulls", "P/D KV pulls completed.", stats.kv_pulls),
            ("lockstep:kv_pull_failures", "P/D KV pulls that failed (the decode side prefilled instead).",
             stats.kv_pull_failures),
            ("vllm:prompt_tokens", "Prefill tokens processed.", self.prompt_tokens),
            ("vllm:generation_tokens", "Generation tokens processed.", self.generation_tokens),
            ("lockstep:runtime_restarts", "Runtime restarts (a runtime process, or a rank of its DEP group, died).",
             stats.runtime_restarts),
        ]
        if balancer is not None:
            counters += [
                ("lockstep:eplb_plans", "Expert placement plans made.", balancer.plans),
                ("lockstep:eplb_moved_experts", "Expert slots whose expert changed, over all placements.",
                 balancer.moved_experts),
                ("lockstep:eplb_planner_restarts", "Times the balancer's planner process died and was replaced.",
                 balancer.planner_restarts),
            ]
        out = []
        for name, help_, v in gauges:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name}{{{lb}}} {float(v)}"]
        for name, help_, v in counters:
            out += [f"# HELP {name}_total {help_}", f"# TYPE {name}_total counter",
                    f"{name}_total{{{lb}}} {float(v)}"]
        if len(accepted_per_pos):
            name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
            out += [f"# HELP {name} Speculative decodes that accepted the draft at each position.",
                    f"# TYPE {name} counter"]
            out += [f'{name}{{{lb},position="{j}"}} {float(c)}' for j, c in enumerate(accepted_per_pos)]
        out += ["# HELP vllm:request_success_total Finished requests by reason.",
                "# TYPE vllm:request_success_total counter"]
        for reason, c in sorted(self.finished.items()):
            out.append(f'vllm:request_success_total{{{lb},finished_reason="{reason}"}} {float(c)}')
        for h in (self.ttft, self.itl, self.e2e, self.queue, self.req_prompt, self.req_generation, self.tpot,
                  self.prefill, self.decode, self.inference):
            out += h.render(lb)
        return "\n".join(out) + "\n"


def merge_exposition(texts: list[str]) -> str:
    """Several models' metrics as one exposition: each family's HELP and TYPE once, its
    samples (told apart by their model_name label) together, as the text format requires."""
    if len(texts) == 1:
        return texts[0]
    order: list[str] = []
    head: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for text in texts:
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP "):
                family = line.split()[2]
                if family not in head:
                    order.append(family)
                    head[family], samples[family] = [line], []
            elif line.startswith("# TYPE "):
                if len(head[family]) == 1:
                    head[family].append(line)
            elif line:
                samples[family].append(line)
    return "\n".join(line for f in order for line in head[f] + samples[f]) + "\n"
