"""The one Deployment schema (TOML) that the simulator, the engine and the server all read.

A deployment names models (shape, context length), hardware, pools (colocated, prefill,
decode) with their instance count and DEP size, scheduler limits, and optionally a draft
model for speculative decoding. Presets fill in known shapes; any field can be overridden.
Errors name the file, the table and the field. This module holds the schema and the presets;
``deployment_file`` reads TOML (or a dict) into it.
"""

from __future__ import annotations

import math
import re

import attrs

from .config import ConfigError, SchedulerConfig
from .rebalance import EplbConfig

ROLES = ("colocated", "prefill", "decode")


def _ranges(obj, rules: dict) -> None:
    """``rules``: field -> (low, high, low inclusive); every value a finite number in range.
    Checked where the spec is built, so a zero, negative, NaN or infinite number is refused by
    name here, not found later as a division by zero or a simulation that never ends."""
    for name, (lo, hi, closed) in rules.items():
        v = getattr(obj, name)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v <= hi and (
            v >= lo if closed else v > lo)
        if not ok:
            def num(x):  # integers whole (2147483647, not 2.14748e+09)
                return f"{x:,}" if isinstance(x, int) else f"{x:g}"
            bound = f"{'>=' if closed else '>'} {num(lo)}" + (f" and <= {num(hi)}" if math.isfinite(hi) else "")
            raise ConfigError(f"field {name!r} must be a finite number {bound}, got {v!r}")


_INF = float("inf")


@attrs.frozen
class ModelSpec:
    name: str
    num_layers: int
    num_dense_layers: int  # leading layers with a dense MLP instead of MoE
    hidden_size: int
    num_routed_experts: int
    num_shared_experts: int
    top_k: int
    moe_intermediate_size: int
    dense_params: float  # parameters outside routed experts (attention, dense MLPs, shared, embeddings)
    kv_bytes_per_token: int  # all layers
    context_length: int
    vocab_size: int
    bytes_per_param: float = 1.0  # FP8 weights
    attn_flops_per_pair: float = 0.0  # per layer, per (query token, context token)
    eos_token_id: int = 1
    checkpoint: str = ""  # Hugging Face checkpoint directory the engine loads (relative to the file)

    def __attrs_post_init__(self) -> None:
        _ranges(self, {"num_layers": (1, _INF, True), "num_dense_layers": (0, _INF, True),
                       "hidden_size": (1, _INF, True), "num_routed_experts": (0, _INF, True),
                       "num_shared_experts": (0, _INF, True), "top_k": (0, _INF, True),
                       "moe_intermediate_size": (0, _INF, True), "dense_params": (0, _INF, True),
                       "kv_bytes_per_token": (0, _INF, False), "context_length": (1, 2**31 - 1, True),
                       "vocab_size": (1, 2**31 - 1, True), "bytes_per_param": (0, _INF, False),
                       "attn_flops_per_pair": (0, _INF, True)})

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def expert_bytes(self) -> float:
        """Bytes of one routed expert in one layer (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size * self.bytes_per_param

    @property
    def routed_bytes(self) -> float:
        return self.expert_bytes * self.num_routed_experts * self.moe_layers

    @property
    def dense_bytes(self) -> float:
        return self.dense_params * self.bytes_per_param


@attrs.frozen
class HardwareSpec:
    name: str
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s actually reachable (copy bandwidth)
    flops: float  # dense BF16 FLOP/s (FP8 GEMMs are charged at twice this)
    link_bandwidth: float  # bytes/s per GPU per direction inside the scale-up domain
    gpus_per_node: int
    host_kv_bytes: float = 0.0  # host DRAM per GPU for the second-level prefix cache
    host_bandwidth: float = 50e9  # bytes/s host -> GPU (PCIe 5 x16)
    gpu_memory_utilization: float = 0.9
    # bytes/s per GPU per direction between scale-up domains (a 400 Gb/s NIC a GPU): what a
    # DEP group wider than gpus_per_node pays for its off-node share of the all-to-alls
    scaleout_bandwidth: float = 50e9

    def __attrs_post_init__(self) -> None:
        # at least 1 MB (/s, FLOP/s): a smaller figure is a unit slip, and prices steps at
        # centuries (1e-310 B/s made step times infinite and the simulation never end)
        _ranges(self, {"hbm_bytes": (1e6, _INF, True), "hbm_bandwidth": (1e6, _INF, True),
                       "flops": (1e6, _INF, True), "link_bandwidth": (1e6, _INF, True),
                       "gpus_per_node": (1, _INF, True), "host_kv_bytes": (0, _INF, True),
                       "host_bandwidth": (1e6, _INF, True), "gpu_memory_utilization": (0, 1, False),
                       "scaleout_bandwidth": (1e6, _INF, True)})


@attrs.frozen
class PoolSpec:
    name: str
    role: str
    model: str
    instances: int = 1
    dep: int = 1

    @property
    def num_gpus(self) -> int:
        return self.instances * self.dep


@attrs.frozen
class CostSpec:
    """Knobs of the analytic cost model that are not hardware facts."""

    expert_balancedness: float = 0.8  # mean/max tokens per GPU in the MoE layers
    # With expert_skew > 0 the simulator draws drifting expert loads instead of the fixed
    # figure above (see lockstep.sim.experts): power-law exponent, per-window drift, window.
    expert_skew: float = 0.0
    expert_drift: float = 0.1
    expert_window_s: float = 60.0
    a2a_overlap: float = 0.5  # share of all-to-all time hidden behind compute
    # Fixed cost of each of a MoE layer's two exchanges (dispatch, combine), on top of its
    # bytes over the link: NCCL's per-call latency. 0 prices bytes only (kernels that overlap
    # and pipeline their exchanges); lockstep's padded NCCL dispatch measured about 55 us a
    # call between two H200s (benchmarks/results/2026-11-30-h200x2-session7.md).
    a2a_latency_s: float = 0.0

    def __attrs_post_init__(self) -> None:
        _ranges(self, {"expert_balancedness": (0, 1, False), "expert_skew": (0, _INF, True),
                       "expert_drift": (0, _INF, True), "expert_window_s": (0, _INF, False),
                       "a2a_overlap": (0, 1, True), "a2a_latency_s": (0, _INF, True)})
    # A measured profile (`lockstep profile`, JSON; relative to the deployment file): the
    # simulator prices its model's pools from it instead (lockstep.sim.profile).
    profile: str = ""


SYNC_LINKS = ("allreduce", "gloo")


@attrs.frozen
class HostSpec:
    """The host's share of a DEP step, built from components measured here
    (benchmarks/results): the scheduler step and the plan/result dispatch, which async
    scheduling hides behind the GPU step unless they outlast it, and the per-step DP sync,
    which nothing hides. Sync costs: lockstep's recursive-doubling all-reduce takes
    ceil(log2 n) rounds of ``sync_round_s``; Gloo's ring takes 2(n - 1) hops of ``gloo_hop_s``
    (283 us between 2 processes here)."""

    scheduler_s: float = 100e-6  # bench_scheduler: 0.08-0.14 ms at 256 running
    dispatch_s: float = 60e-6  # bench_dispatch: 53-101 us round trip
    sync: str = "allreduce"  # or "gloo"
    sync_round_s: float = 6e-6  # bench_allreduce: 5.6 us at 2 ranks (one round)
    gloo_hop_s: float = 141e-6
    overlap: bool = True  # async scheduling: host work of step N+1 runs during step N

    def __attrs_post_init__(self) -> None:
        if self.sync not in SYNC_LINKS:
            raise ConfigError(f"host.sync must be one of {SYNC_LINKS}, got {self.sync!r}")
        _ranges(self, {"scheduler_s": (0, _INF, True), "dispatch_s": (0, _INF, True),
                       "sync_round_s": (0, _INF, True), "gloo_hop_s": (0, _INF, True)})

    def sync_s(self, dep: int) -> float:
        if dep <= 1:
            return 0.0
        if self.sync == "gloo":
            return 2 * (dep - 1) * self.gloo_hop_s
        return (dep - 1).bit_length() * self.sync_round_s

    def step_terms(self, dep: int) -> tuple[float, float]:
        """(floor, added): a step costs max(GPU time, floor) + added."""
        work = self.scheduler_s + self.dispatch_s
        return (work, self.sync_s(dep)) if self.overlap else (0.0, work + self.sync_s(dep))


# An engine without lockstep's host-side work: vLLM's scheduler step at 256 running (8.1 ms,
# the foundation issue's reference), pickled dispatch (~0.5 ms here), Gloo's ring all-reduce,
# no overlap. For comparing deployments against the host-side fixes.
UNTUNED_HOST = HostSpec(scheduler_s=8.1e-3, dispatch_s=0.5e-3, sync="gloo", overlap=False)


@attrs.frozen
class EngineSpec:
    """How the engine and server run a pool's ranks (the simulator checks it, then ignores it)."""

    runtime: str = "torch"  # a name in the lockstep.runtimes entry-point group
    device: str = "cuda"
    dtype: str = "bfloat16"
    num_blocks: int = 0  # KV blocks per rank; 0 derives them from [hardware] (capped on CPU)
    kv_transport: str = "nixl"  # P/D pools: how decode runtimes pull KV ("nixl" or "shm")
    kv_hold_timeout_s: float = 120.0  # P/D: a prefill frees KV no decode rank claimed by then
    kv_cache_dtype: str = "auto"  # "fp8": e4m3 KV with a scale per token and layer

    def __attrs_post_init__(self) -> None:
        # The engine's own rules (lockstep.engine.config), checked where the file is read, so a
        # file the simulator takes is one the server takes too.
        if not (isinstance(self.runtime, str) and self.runtime):
            raise ConfigError(f"engine.runtime must name a runtime (torch, timing, ...), got {self.runtime!r}")
        if not (isinstance(self.device, str) and re.fullmatch(r"cpu|cuda(:\d+)?", self.device)):
            raise ConfigError(f"engine.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype not in ("float32", "float64", "bfloat16", "float16"):
            raise ConfigError(f"engine.dtype must be float32, float64, bfloat16 or float16, got {self.dtype!r}")
        if not (isinstance(self.num_blocks, int) and not isinstance(self.num_blocks, bool) and self.num_blocks >= 0):
            raise ConfigError(f"engine.num_blocks must be an integer >= 0 (0: from [hardware]), got {self.num_blocks!r}")
        if self.kv_transport not in ("nixl", "shm"):
            raise ConfigError(f"engine.kv_transport must be 'nixl' or 'shm', got {self.kv_transport!r}")
        t = self.kv_hold_timeout_s
        if not (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0):
            raise ConfigError(f"engine.kv_hold_timeout_s must be a finite number of seconds > 0, got {t!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ConfigError(f"engine.kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")


def _at_least_zero(inst, attribute, value):
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0):
        raise ConfigError(f"kv_transfer.{attribute.name} must be a finite number >= 0, got {value!r}")


def _link_bandwidth(inst, attribute, value):
    _at_least_zero(inst, attribute, value)
    if 0 < value < 1e6:  # as [hardware]'s: a unit slip, that prices pulls at years
        raise ConfigError(f"kv_transfer.bandwidth must be 0 ([hardware] link_bandwidth) or at least 1e6 bytes/s, "
                          f"got {value!r}")


@attrs.frozen
class KVTransferSpec:
    """The link a decode rank pulls prefill KV over (P/D pools) and the host work a pull
    costs, for the simulator (the engine's transport measures these instead). A pull takes
    ``setup_s + descriptors * per_descriptor_s + bytes / bandwidth``; pulls in flight on one
    decode GPU share its bandwidth. Descriptors are posted by the runtime's host thread, so
    ``start_s + descriptors * per_descriptor_s`` per pull started is host time in the step
    that starts it, and ``done_s`` per pulled request in the step it first runs in."""

    # bytes/s per decode GPU; 0: [hardware] link_bandwidth (the pools share one NVLink domain)
    bandwidth: float = attrs.field(default=0.0, validator=_link_bandwidth)
    setup_s: float = attrs.field(default=20e-6, validator=_at_least_zero)  # per pull, before bytes move
    per_descriptor_s: float = attrs.field(default=3.4e-6, validator=_at_least_zero)  # NIXL over UCX, measured here
    merged: bool = True  # one descriptor per run of blocks contiguous on both sides; false: one per block
    start_s: float = attrs.field(default=50e-6, validator=_at_least_zero)  # host work per pull started
    done_s: float = attrs.field(default=20e-6, validator=_at_least_zero)  # host work per pulled request joining
    handoff_s: float = attrs.field(default=50e-6, validator=_at_least_zero)  # prefill end -> decode queue


ACCEPTANCE_MODELS = ("fixed", "per_position", "replay", "measured")
UNMODELED_ACCEPTANCE = ("{source}: [speculative]: the simulator and the timing runtime draw accepted drafts from a "
                        "model, and this table gives none (a serving engine measures them): add acceptance = 'fixed' "
                        "with rate, 'per_position' with rates, or 'replay' with file")
MAX_SPEC_TOKENS = 16


@attrs.frozen
class SpeculativeSpec:
    """[speculative]: a draft model proposes ``num_spec_tokens`` tokens per decode and the
    target verifies them in one step. The draft sits on every GPU of the pools next to the
    target (its weights and its KV cache take memory there). Prefill pools run it over
    prompts only; colocated and decode pools speculate.

    How many drafts the target accepts is a fact of the models and the traffic, which the
    simulator takes from ``acceptance``: ``fixed`` (each draft with probability ``rate``,
    independently), ``per_position`` (draft j with probability ``rates[j - 1]`` given drafts
    1..j-1 were), or ``replay`` (``file``: drafts accepted per speculative decode, one integer
    per line, used in turn and cycled; loaded into ``replay``). A table that gives none of
    them is ``measured``: what a serving engine's real draft and target decide, which the
    simulator and the timing runtime cannot draw (they refuse it). ``adaptive``: the runtime
    proposes fewer drafts when acceptance drops (lockstep.sim.spec has the rule)."""

    draft_model: str
    draft: ModelSpec
    num_spec_tokens: int
    acceptance: str = "fixed"
    rate: float = 0.0
    rates: tuple[float, ...] = ()
    file: str = ""
    replay: tuple[int, ...] = ()
    adaptive: bool = False

    def __attrs_post_init__(self) -> None:
        k = self.num_spec_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPEC_TOKENS:
            raise ConfigError(f"num_spec_tokens must be an integer in [1, {MAX_SPEC_TOKENS}], got {k!r} "
                              "(to turn speculation off, drop the [speculative] table)")
        if self.acceptance not in ACCEPTANCE_MODELS:
            raise ConfigError(f"acceptance must be one of {ACCEPTANCE_MODELS}, got {self.acceptance!r}")
        if self.acceptance == "fixed" and not 0 <= self.rate <= 1:
            raise ConfigError(f"rate must be a probability in [0, 1], got {self.rate!r}")
        if self.acceptance == "per_position":
            if len(self.rates) < k:
                raise ConfigError(f"rates gives {len(self.rates)} positions but num_spec_tokens is {k}: "
                                  "give one rate per draft position")
            if not all(0 <= r <= 1 for r in self.rates):
                raise ConfigError(f"rates must be probabilities in [0, 1], got {list(self.rates)}")
        if self.acceptance == "replay" and not self.replay:
            raise ConfigError(f"file {self.file!r} holds no accepted-draft counts")

    def position_rates(self) -> tuple[float, ...]:
        """Acceptance probability of each draft position given the ones before it."""
        k = self.num_spec_tokens
        return (self.rate,) * k if self.acceptance == "fixed" else tuple(self.rates[:k])


@attrs.frozen
class Deployment:
    name: str
    models: tuple[ModelSpec, ...]
    hardware: HardwareSpec
    pools: tuple[PoolSpec, ...]
    scheduler: SchedulerConfig
    cost: CostSpec = CostSpec()
    host: HostSpec = HostSpec()
    engine: EngineSpec = EngineSpec()
    eplb: EplbConfig | None = None  # expert load balancing for the engine's DEP pools
    kv_transfer: KVTransferSpec = KVTransferSpec()  # P/D: the prefill -> decode KV link
    speculative: SpeculativeSpec | None = None  # a draft model next to the target
    hash_secret: str = "lockstep"
    seed: int = 0
    source: str = "<built-in>"
    # Tables the file left out whose defaults price a run (the simulator says so): "hardware"
    defaulted: tuple[str, ...] = ()

    def model(self, name: str) -> ModelSpec:
        for m in self.models:
            if m.name == name:
                return m
        raise ConfigError(f"{self.source}: no model named {name!r} (have {[m.name for m in self.models]})")

    @property
    def num_gpus(self) -> int:
        return sum(p.num_gpus for p in self.pools)

    def kv_blocks_per_rank(self, pool: PoolSpec) -> int:
        """KV blocks one rank holds: memory left after its share of the weights."""
        m, hw = self.model(pool.model), self.hardware
        weights = m.dense_bytes + m.routed_bytes / pool.dep
        name = m.name
        spare = self.eplb.redundant_experts if self.eplb is not None and pool.dep > 1 else 0
        if spare:  # [eplb]'s redundant slots hold copies of experts: each rank its share of them
            weights += spare / pool.dep * m.expert_bytes * m.moe_layers
            name = f"{m.name} with {spare} redundant expert slots"
        if self.speculative is not None:  # the draft's weights sit next to the target's
            dr = self.speculative.draft
            weights += dr.dense_bytes + dr.routed_bytes / pool.dep
            name = f"{name} and draft {dr.name}" if spare else f"{m.name} with draft {dr.name}"
        free = hw.hbm_bytes * hw.gpu_memory_utilization - weights
        per_block = self.kv_bytes_per_token(pool) * self.scheduler.block_size
        blocks = int(free // per_block)
        if blocks < 16 and free >= 16 * 16 * self.kv_bytes_per_token(pool):  # (sixteen 16-token blocks would fit)
            raise ConfigError(
                f"{self.source}: pool {pool.name!r}: a KV block of {self.scheduler.block_size} tokens takes "
                f"{per_block / 1e9:.3g} GB, and a GPU has {free / 1e9:.1f} GB left for KV: only {max(blocks, 0)} "
                "blocks fit; lower [scheduler] block_size (16 by default)")
        if blocks < 16:
            raise ConfigError(
                f"{self.source}: pool {pool.name!r}: {name} needs {weights / 1e9:.1f} GB of "
                f"weights per GPU at DEP{pool.dep}, leaving room for only {max(blocks, 0)} KV "
                f"blocks on {hw.name}; raise dep{', use fewer redundant slots ([eplb])' if spare else ''} or pick "
                "bigger hardware"
            )
        return blocks

    def kv_bytes_per_token(self, pool: PoolSpec) -> int:
        """KV bytes a token takes on a rank of the pool: the target's, plus the draft's
        own cache when there is one (a block holds both)."""
        per_token = self.model(pool.model).kv_bytes_per_token
        if self.speculative is not None:
            per_token += self.speculative.draft.kv_bytes_per_token
        return per_token

    def scheduler_for(self, pool: PoolSpec) -> SchedulerConfig:
        m = self.model(pool.model)
        per_block = self.kv_bytes_per_token(pool) * self.scheduler.block_size
        spec = {}
        if self.speculative is not None and pool.role != "prefill":  # prefill pools never decode
            spec = {"num_spec_tokens": self.speculative.num_spec_tokens}
        blocks, host = self.kv_blocks_per_rank(pool), int(self.hardware.host_kv_bytes // per_block)
        if 0 < host < 2 * blocks:  # (the host tier must hold an admission's evictions and its loads)
            raise ConfigError(
                f"{self.source}: [hardware] host_kv_bytes ({self.hardware.host_kv_bytes:.3g}) holds {host} KV "
                f"blocks, fewer than twice the {blocks} a GPU of pool {pool.name!r} holds: set it to 0 (no host "
                f"tier) or at least {2 * blocks * per_block:.3g} bytes")
        return attrs.evolve(
            self.scheduler,
            num_blocks=blocks,
            host_cache_blocks=host,
            max_model_len=min(self.scheduler.max_model_len, m.context_length),
            **spec,
        )


# -- presets ----------------------------------------------------------------------------------
def _mla_kv_bytes(layers: int, kv_lora: int = 512, rope: int = 64, dtype_bytes: float = 2) -> int:
    return int(layers * (kv_lora + rope) * dtype_bytes)


def _MHA_PAIR_FLOPS(heads: int, qk_dim: int = 192, v_dim: int = 128) -> int:  # noqa: N802
    """Attention FLOPs per layer per (query, key) pair in MLA's prefill (expanded) form."""
    return 2 * heads * (qk_dim + v_dim)


MODEL_PRESETS: dict[str, dict] = {
    "deepseek-v3": dict(
        num_layers=61, num_dense_layers=3, hidden_size=7168, num_routed_experts=256,
        num_shared_experts=1, top_k=8, moe_intermediate_size=2048, dense_params=17.0e9,
        kv_bytes_per_token=_mla_kv_bytes(61), context_length=131072, vocab_size=129280,
        bytes_per_param=1.0, attn_flops_per_pair=_MHA_PAIR_FLOPS(128), eos_token_id=1,
    ),
    # DeepSeek-V2-Lite's shape (~15.7B parameters, bf16): the GPU runtime's target.
    "v2-lite": dict(
        num_layers=27, num_dense_layers=1, hidden_size=2048, num_routed_experts=64,
        num_shared_experts=2, top_k=6, moe_intermediate_size=1408, dense_params=1.6e9,
        kv_bytes_per_token=_mla_kv_bytes(27), context_length=32768, vocab_size=102400,
        bytes_per_param=2.0, attn_flops_per_pair=_MHA_PAIR_FLOPS(16), eos_token_id=100001,
    ),
    # A draft for v2-lite: its shape cut to two layers (one dense, one MoE), with its own head
    # over the same vocabulary; embeddings are looked up, not read, so they are not counted.
    # Parameters: attention 2 x 14M, the dense MLP 67M, shared experts 17M, the head 210M.
    "v2-lite-draft": dict(
        num_layers=2, num_dense_layers=1, hidden_size=2048, num_routed_experts=64,
        num_shared_experts=2, top_k=6, moe_intermediate_size=1408, dense_params=0.32e9,
        kv_bytes_per_token=_mla_kv_bytes(2), context_length=32768, vocab_size=102400,
        bytes_per_param=2.0, attn_flops_per_pair=_MHA_PAIR_FLOPS(16), eos_token_id=100001,
    ),
    # A DeepSeek-V3-sized model with a compact KV layout: cross-layer sharing + FP4.
    "compact-kv": dict(
        num_layers=61, num_dense_layers=3, hidden_size=7168, num_routed_experts=256,
        num_shared_experts=1, top_k=8, moe_intermediate_size=2048, dense_params=17.0e9,
        kv_bytes_per_token=890, context_length=1048576, vocab_size=129280,
        bytes_per_param=1.0, attn_flops_per_pair=_MHA_PAIR_FLOPS(128), eos_token_id=1,
    ),
    "tiny": dict(
        num_layers=4, num_dense_layers=1, hidden_size=64, num_routed_experts=8,
        num_shared_experts=1, top_k=2, moe_intermediate_size=32, dense_params=0.2e6,
        kv_bytes_per_token=_mla_kv_bytes(4, 32, 16, 4), context_length=4096, vocab_size=512,
        bytes_per_param=4.0, attn_flops_per_pair=_MHA_PAIR_FLOPS(4, 32, 24), eos_token_id=1,
    ),
    "tiny-draft": dict(
        num_layers=2, num_dense_layers=1, hidden_size=32, num_routed_experts=4,
        num_shared_experts=1, top_k=2, moe_intermediate_size=16, dense_params=0.05e6,
        kv_bytes_per_token=_mla_kv_bytes(2, 16, 8, 4), context_length=4096, vocab_size=512,
        bytes_per_param=4.0, attn_flops_per_pair=_MHA_PAIR_FLOPS(2, 16, 8), eos_token_id=1,
    ),
}

HARDWARE_PRESETS: dict[str, dict] = {
    # Copy bandwidth measured on an H200 (4.19 TB/s); dense BF16 peak; NVLink 4 per direction.
    "h200": dict(hbm_bytes=141e9, hbm_bandwidth=4.19e12, flops=989e12,
                 link_bandwidth=450e9, gpus_per_node=8),
    # GB300 NVL72: 288 GB HBM3e, one 72-GPU NVLink domain, NVLink 5 per direction.
    "gb300": dict(hbm_bytes=288e9, hbm_bandwidth=7.0e12, flops=2500e12,
                  link_bandwidth=900e9, gpus_per_node=72, scaleout_bandwidth=100e9),
}
