"""EngineConfig: what one engine (one DP rank) runs: model, runtime, device, scheduler limits."""

from __future__ import annotations

import re
from pathlib import Path

import attrs

from lockstep.policy.config import ConfigError, SchedulerConfig
from lockstep.policy.core import SchedulerCore
from lockstep.policy.hashing import BlockHasher
from lockstep.policy.rebalance import EplbConfig
from lockstep.runtime.base import RuntimeSpec, available
from lockstep.runtime.models.config import preset_names

from .config_checks import ConfigChecks, model_config
from .runtime_client import RuntimeClient


def _small_scheduler() -> SchedulerConfig:
    return SchedulerConfig(num_blocks=1024, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096)


def _eplb(value):
    """EngineConfig.eplb from a dict of EplbConfig's fields (the class need not be imported);
    anything else is left for the type check to name."""
    if isinstance(value, dict):
        try:
            return EplbConfig(**value)
        except TypeError as e:  # an unknown field
            raise ConfigError(f"engine.eplb: {e} (EplbConfig's fields: "
                              f"{', '.join(f.name for f in attrs.fields(EplbConfig))})") from None
    return value


@attrs.frozen
class EngineConfig(ConfigChecks):
    model: str = "tiny"  # a preset name or a Hugging Face checkpoint directory
    runtime: str = "torch"  # a name in the lockstep.runtimes entry-point group
    device: str = "cpu"
    dtype: str = "float32"
    scheduler: SchedulerConfig = attrs.field(factory=_small_scheduler)
    tokenizer: str | None = ""  # "" means the model's own; None means token ids only
    hash_secret: str = "lockstep"  # shared by every rank and router of a deployment
    seed: int = 0
    ring_bytes: int = 1 << 22
    runtime_options: dict = attrs.field(factory=dict)
    mailbox_size: int = 256
    dep: int = 1  # data-parallel ranks per instance (one Scheduler and runtime each)
    # expert load balancing (physical slots, rebalancing); a dict of EplbConfig's fields works too
    eplb: EplbConfig | None = attrs.field(default=None, converter=lambda v: _eplb(v))
    instances: int = 1  # colocated instances, or with P/D the decode pool's
    # Prefill/decode disaggregation: prefill instances (0: colocated serving), their ranks,
    # how KV moves between the pools, and how long a prefill keeps unclaimed KV.
    prefill_instances: int = 0
    prefill_dep: int = 1
    kv_transport: str = "nixl"
    kv_hold_timeout_s: float = 120.0
    # Speculative decoding: a draft model (a preset, a checkpoint directory, or "layers:N",
    # the target's own first N layers) proposes num_spec_tokens tokens per decode step.
    draft_model: str = ""
    num_spec_tokens: int = 3
    spec_adaptive: bool = False  # propose fewer drafts while acceptance is low
    # With dep > 1: the draft's routed experts "replicated" on every rank, or "sharded" over
    # the ranks like the target's (every rank then runs as many draft passes; "layers:N" is
    # always sharded, being the target's own layers).
    draft_experts: str = "replicated"
    kv_cache_dtype: str = "auto"  # "fp8": e4m3 with a scale per token and layer (half of bf16)
    # A DEP instance spread over several engine processes (nodes): this process is node
    # ``node_rank`` and hosts dep / nodes of its ranks; ``node_addresses`` (HOST:PORT, one per
    # node) are where the nodes' per-step all-reduce links listen; ``dist_init`` is the
    # runtimes' shared torch.distributed rendezvous (tcp://HOST:PORT on node 0's host).
    # ``node_link``: how the nodes all-reduce: "shm" (shared memory, every node on this
    # host), "tcp", "mixed" (shared memory among each host's nodes, TCP between hosts), or
    # "auto": shm when the node addresses all name one host (all loopback, or all the same
    # host string), mixed when some host has several nodes, else tcp.
    nodes: int = 1
    node_rank: int = 0
    node_addresses: tuple[str, ...] = ()
    dist_init: str = ""
    node_link: str = "auto"
    # When the instance fails (a node or a runtime died), every node fails its requests and
    # waits up to ``node_rejoin_timeout_s`` for all nodes to join a fresh link (a lost node
    # once its supervisor restarts it), then the instance runs again; 0: stop instead.
    node_rejoin_timeout_s: float = 60.0
    # How long a runtime may take to load its model and report ready (vLLM waits 600 s).
    start_timeout_s: float = 900.0

    def __attrs_post_init__(self) -> None:
        self._check_types()
        if self.device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", self.device):
            raise ConfigError(f"engine.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype not in ("float32", "float64", "bfloat16", "float16"):
            raise ConfigError(f"engine.dtype must be float32, float64, bfloat16 or float16, got {self.dtype!r}")
        if not isinstance(self.dep, int) or self.dep < 1:
            raise ConfigError(f"engine.dep must be an integer >= 1, got {self.dep!r}")
        if self.eplb is not None and self.eplb.redundant_experts % self.dep:
            raise ConfigError(f"eplb.redundant_experts must be a multiple of engine.dep ({self.dep}) so every "
                              f"rank has as many expert slots, got {self.eplb.redundant_experts}")
        for name in ("instances", "prefill_dep"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"engine.{name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.prefill_instances, int) or self.prefill_instances < 0:
            raise ConfigError(f"engine.prefill_instances must be an integer >= 0 (0: no P/D), "
                              f"got {self.prefill_instances!r}")
        if self.kv_transport not in ("nixl", "shm"):
            raise ConfigError(f"engine.kv_transport must be 'nixl' or 'shm', got {self.kv_transport!r}")
        if not self.kv_hold_timeout_s > 0:
            raise ConfigError(f"engine.kv_hold_timeout_s must be > 0, got {self.kv_hold_timeout_s!r}")
        if self.prefill_instances and self.runtime == "torch" and self.device != "cpu" and self.kv_transport != "nixl":
            raise ConfigError(f"engine.kv_transport: P/D on {self.device!r} moves KV between GPUs with 'nixl' "
                              f"(VRAM to VRAM); 'shm' moves CPU pools only, got {self.kv_transport!r}")
        if self.eplb is not None and (self.instances > 1 or self.prefill_instances):
            raise ConfigError("engine.eplb balances one colocated instance so far; got "
                              f"{self.instances} instances and {self.prefill_instances} prefill instances")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ConfigError(f"engine.kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if not isinstance(self.num_spec_tokens, int) or not 1 <= self.num_spec_tokens <= 16:
            raise ConfigError(f"engine.num_spec_tokens must be an integer in [1, 16], got {self.num_spec_tokens!r}")
        rows = self.scheduler.max_scored_tokens_per_step
        need = rows * SCORED_ROW_BYTES + (1 << 16)  # and the rest of the result
        if need > self.ring_bytes // 3:  # a message may take a third of its ring
            raise ConfigError(f"scheduler.max_scored_tokens_per_step {rows}: a step's prompt logprobs take up to "
                              f"{need} bytes of its result, more than a message may take of engine.ring_bytes "
                              f"({self.ring_bytes}, a third): lower it or raise ring_bytes")
        if self.draft_model:
            self._check_draft()
        if self.runtime == "torch" and (self.dep > 1 or self.eplb is not None or self.prefill_dep > 1):
            self._check_experts()
        if self.draft_experts not in ("replicated", "sharded"):
            raise ConfigError(f"engine.draft_experts must be 'replicated' or 'sharded', got {self.draft_experts!r}")
        self._check_unused()
        if not self.node_rejoin_timeout_s >= 0:
            raise ConfigError(f"engine.node_rejoin_timeout_s must be >= 0 seconds (0: stop when a node is "
                              f"lost), got {self.node_rejoin_timeout_s!r}")
        if self.node_link not in ("auto", "tcp", "shm", "mixed"):
            raise ConfigError(f"engine.node_link must be 'auto', 'tcp', 'shm' or 'mixed' (auto: shared memory "
                              f"when the node addresses all name one host), got {self.node_link!r}")
        if self.nodes != 1:
            self._check_nodes()
        runtimes = available()
        if self.runtime not in runtimes:
            raise ConfigError(f"engine.runtime must be one of the registered runtimes {sorted(runtimes)}, "
                              f"got {self.runtime!r}")
        if self.runtime == "torch" and self.model not in preset_names() and not (Path(self.model) / "config.json").is_file():
            raise ConfigError(f"engine.model must be a preset {preset_names()} or a checkpoint directory "
                              f"holding config.json, got {self.model!r}")

    @classmethod
    def from_deployment(cls, dep, pool_index: int | None = None, model: str | None = None) -> EngineConfig:
        """What the deployment's pools for ``model`` say to run (the only model when None),
        as its [engine] table says to run them: its colocated pool (the ``pool_index``-th where
        it has several: an engine runs one), or its prefill and decode pools together. The
        engine has no host-memory KV tier yet, so it is left off here."""
        served = sorted({p.model for p in dep.pools})
        if model is None and len(served) > 1:
            raise ConfigError(f"{dep.source}: the pools serve several models {served}: name one "
                              "(lockstep serve starts an engine for each)")
        if model is not None and model not in served:
            raise ConfigError(f"{dep.source}: no pool serves model {model!r}; pools serve {served}")
        pools = [p for p in dep.pools if model is None or p.model == model]
        roles = sorted(p.role for p in pools)
        if roles == ["decode", "prefill"]:
            prefill = next(p for p in pools if p.role == "prefill")
            pool = next(p for p in pools if p.role == "decode")
            pd = dict(prefill_instances=prefill.instances, prefill_dep=prefill.dep,
                      kv_transport=dep.engine.kv_transport, kv_hold_timeout_s=dep.engine.kv_hold_timeout_s)
        elif set(roles) == {"colocated"}:
            if pool_index is None and len(pools) > 1:  # (serving the first alone dropped the others)
                raise ConfigError(f"{dep.source}: pools {[p.name for p in pools]} all serve model {pools[0].model!r} "
                                  "colocated, and an engine runs one such pool (its instances field makes copies "
                                  "of it): keep one of them")
            pool_index = pool_index or 0
            if not 0 <= pool_index < len(pools):
                raise ConfigError(f"{dep.source}: no pool #{pool_index + 1} (it has {len(pools)})")
            pool, pd = pools[pool_index], {}
        else:
            raise ConfigError(f"{dep.source}: the engine runs a model's colocated pools, or one prefill pool "
                              f"and one decode pool; got pools with roles {roles}")
        model, eng = dep.model(pool.model), dep.engine
        ref = model.checkpoint and str((Path(dep.source).parent / model.checkpoint).resolve())
        sched = attrs.evolve(dep.scheduler_for(pool), host_cache_blocks=0)
        if eng.num_blocks:
            sched = attrs.evolve(sched, num_blocks=eng.num_blocks)
        elif eng.device == "cpu":
            sched = attrs.evolve(sched, num_blocks=min(sched.num_blocks, 4096))
        spec = {}
        if dep.speculative is not None:  # the same draft the simulator prices, run for real
            if dep.speculative.acceptance == "measured" and eng.runtime == "timing":
                from lockstep.policy.deployment import UNMODELED_ACCEPTANCE
                raise ConfigError(UNMODELED_ACCEPTANCE.format(source=dep.source))
            d = dep.speculative.draft
            spec = dict(draft_model=(d.checkpoint and str((Path(dep.source).parent / d.checkpoint).resolve()))
                        or d.name, num_spec_tokens=dep.speculative.num_spec_tokens,
                        spec_adaptive=dep.speculative.adaptive)
        # The timing runtime prices this file's model, hardware and [speculative] draft (else the
        # built-in deployment's): the same pool the engine runs.
        options = {"deployment": dep.source, "pool": dep.pools.index(pool)} if (
            eng.runtime == "timing" and Path(dep.source).is_file()) else {}
        try:
            return cls(model=ref or model.name, runtime=eng.runtime, device=eng.device, dtype=eng.dtype,
                       scheduler=sched, hash_secret=dep.hash_secret, seed=dep.seed, dep=pool.dep, eplb=dep.eplb,
                       instances=pool.instances, kv_cache_dtype=eng.kv_cache_dtype, runtime_options=options,
                       **pd, **spec)
        except ConfigError as e:  # named by the file it came from, as the schema's own errors are
            hint = ""
            if not ref and str(e).startswith("engine.model"):
                hint = (f"; preset {model.name!r} is the simulator's (shape only): to serve it, give its "
                        "[[models]] a checkpoint directory")
            raise ConfigError(f"{dep.source}: {e}{hint}") from None

    def settings_digest(self) -> int:
        """56 bits of what every node of one instance must share: every field but the node's
        own rank and how long it waits (checked when the nodes join)."""
        import hashlib
        import json

        # Not what each node decides for its own host (its rank, timeouts, ring and mailbox
        # sizes, KV blocks for its GPUs' memory, where its checkpoint and tokenizer sit): the
        # model by what its config says, not by its path.
        shared = {k: v for k, v in attrs.asdict(self, recurse=True).items()
                  if k not in ("node_rank", "start_timeout_s", "node_rejoin_timeout_s", "ring_bytes", "mailbox_size",
                               "tokenizer")}
        shared["scheduler"] = {k: v for k, v in shared["scheduler"].items() if k != "num_blocks"}
        for name in ("model", "draft_model"):
            cfg = model_config(getattr(self, name)) if getattr(self, name) else None
            if cfg is not None:
                shared[name] = attrs.asdict(cfg, recurse=True)
        text = json.dumps(shared, sort_keys=True, default=repr)
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")

    def runtime_spec(self, rank: int = 0, dist_init: str | None = None, *, world_size: int | None = None,
                     options: dict | None = None) -> RuntimeSpec:
        s = self.scheduler
        options = dict(self.runtime_options if options is None else options)
        if dist_init is not None:
            options["dist_init"] = dist_init
        if self.eplb is not None:
            options.setdefault("redundant_experts", self.eplb.redundant_experts)
            options.setdefault("expert_token_split", self.eplb.token_split)
        if self.draft_model:
            options.setdefault("draft_model", self.draft_model)
            options.setdefault("num_spec_tokens", self.core_config().num_spec_tokens)  # sizes the fast path's graphs
            if self.spec_adaptive:
                options.setdefault("spec_adaptive", True)
            if self.draft_experts != "replicated":
                options.setdefault("draft_experts", self.draft_experts)
        if self.kv_cache_dtype != "auto":
            options.setdefault("kv_cache_dtype", self.kv_cache_dtype)
        return RuntimeSpec(runtime=self.runtime, model=self.model, device=self.device, dtype=self.dtype,
                           num_blocks=s.num_blocks, block_size=s.block_size, max_num_seqs=s.max_num_seqs,
                           max_model_len=s.max_model_len, max_num_batched_tokens=s.max_num_batched_tokens,
                           seed=self.seed, options=options,
                           rank=rank, world_size=self.dep if world_size is None else world_size)

    def dist_init_address(self) -> str:
        """A fresh rendezvous for the runtimes' torch.distributed group (expert
        parallelism), unless the runtime options fix one."""
        if "dist_init" in self.runtime_options:
            return self.runtime_options["dist_init"]
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"tcp://127.0.0.1:{s.getsockname()[1]}"

    def hasher(self) -> BlockHasher:
        return BlockHasher(self.hash_secret.encode(), self.scheduler.block_size)

    def core_config(self) -> SchedulerConfig:
        """The scheduler limits, with room for drafts when speculating."""
        if self.draft_model and not self.scheduler.num_spec_tokens:
            return attrs.evolve(self.scheduler, num_spec_tokens=self.num_spec_tokens)
        return self.scheduler

    def make_core(self) -> SchedulerCore:
        return SchedulerCore(self.core_config(), self.hasher())

    def make_client(self, rank: int = 0, dist_init: str | None = None, *, world_size: int | None = None,
                    options: dict | None = None) -> RuntimeClient:
        spec = self.runtime_spec(rank, dist_init, world_size=world_size, options=options)
        return RuntimeClient(spec, ring_bytes=self.ring_bytes, start_timeout=self.start_timeout_s)

    def load_tokenizer(self):
        if self.tokenizer is None:
            return None
        from lockstep.runtime.tokenizer import load_tokenizer
        return load_tokenizer(self.tokenizer or self.model)


SCORED_ROW_BYTES = 8 + 8 + 4 + 4 + 8 * 20  # a prompt-logprob row: request, index, logprob, rank, 20 top (id, logprob)
