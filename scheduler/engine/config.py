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
class EngineConfig:
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

    def _check_experts(self) -> None:
        """Expert parallelism shards the model's routed experts (and the balancer's spare
        slots) evenly over the DEP ranks: read from its config, before any runtime starts."""
        cfg = model_config(self.model)
        overrides = self.runtime_options.get("preset_overrides") or {}
        if cfg is not None and isinstance(overrides, dict) and overrides.get("n_routed_experts"):
            cfg = attrs.evolve(cfg, n_routed_experts=int(overrides["n_routed_experts"]))  # as the runtime builds it
        if cfg is None or not cfg.n_routed_experts:
            return
        experts, spare = cfg.n_routed_experts, 0 if self.eplb is None else self.eplb.redundant_experts
        slots = experts + spare
        if slots % self.dep:
            what = f"{experts} routed experts" + (f" + {spare} redundant" if spare else "")
            fits = [d for d in range(1, slots + 1) if slots % d == 0]
            raise ConfigError(f"engine.dep {self.dep} must divide the expert slots: model {self.model!r} has {what} "
                              f"= {slots} (dep may be one of {fits})")
        if self.prefill_instances and experts % self.prefill_dep:  # the prefill pool's ranks shard them too
            fits = [d for d in range(1, experts + 1) if experts % d == 0]
            raise ConfigError(f"engine.prefill_dep {self.prefill_dep} must divide the routed experts: model "
                              f"{self.model!r} has {experts} (prefill_dep may be one of {fits})")
        if self.draft_model and self.draft_experts == "sharded" and self.dep > 1:
            name = self.draft_model
            draft = cfg if name.startswith("layers:") else model_config(name)  # ("layers:N": the target's)
            n = draft.n_routed_experts if draft is not None else 0
            if n and n % self.dep:
                raise ConfigError(f"engine.draft_experts 'sharded': engine.dep {self.dep} must divide the draft's "
                                  f"routed experts: {name!r} has {n} (or keep the draft's experts replicated)")
        if spare > experts * (self.dep - 1):
            room = (f"so at most {experts * (self.dep - 1)} replicas fit beside model {self.model!r}'s {experts} "
                    "experts" if self.dep > 1 else "so one rank has no room for replicas: use dep >= 2")
            raise ConfigError(f"eplb.redundant_experts {spare}: each of the {self.dep} ranks holds an expert at most "
                              f"once, {room}")

    def _check_unused(self) -> None:
        """Settings that only mean something with P/D or with a draft, set away from their
        defaults without it: an error naming them, not silently ignored."""
        unused = []
        if not self.prefill_instances:
            unused += [f"engine.{f} {v!r}" for f, v, d in (("prefill_dep", self.prefill_dep, 1),
                                                           ("kv_transport", self.kv_transport, "nixl")) if v != d]
            if unused:
                raise ConfigError(f"{', '.join(unused)}: only used with prefill/decode disaggregation "
                                  "(engine.prefill_instances >= 1); drop it or set prefill_instances")
        if not self.draft_model:
            unused += [f"engine.{f} {v!r}" for f, v, d in (("num_spec_tokens", self.num_spec_tokens, 3),
                                                           ("spec_adaptive", self.spec_adaptive, False),
                                                           ("draft_experts", self.draft_experts, "replicated")) if v != d]
            if unused:
                raise ConfigError(f"{', '.join(unused)}: only used with speculative decoding (engine.draft_model); "
                                  "drop it or set a draft model")

    def _check_draft(self) -> None:
        """With the torch runtime: the draft's name, and that it fits the target (``model``):
        ``layers:N`` takes fewer layers than it has, a model shares its vocabulary. Read from
        the configs, before any weights load."""
        name = self.draft_model
        if self.runtime == "timing":  # it prices its deployment's [speculative] draft, whatever the name
            from lockstep.policy.deployment_file import default_deployment, load_deployment

            path = self.runtime_options.get("deployment")
            dep = load_deployment(path) if path else default_deployment()
            if dep.speculative is None:
                raise ConfigError(f"engine.draft_model {name!r}: the timing runtime prices the draft of its "
                                  f"deployment's [speculative] table, and {path or 'the built-in deployment'} has "
                                  "none: give runtime option 'deployment' a file with one")
            if dep.speculative.acceptance == "measured":
                from lockstep.policy.deployment import UNMODELED_ACCEPTANCE
                raise ConfigError(UNMODELED_ACCEPTANCE.format(source=dep.source))
        if self.runtime != "torch":
            return
        if name.startswith("layers:"):
            n = name.split(":", 1)[1]
            if not n.isdigit() or int(n) < 1:
                raise ConfigError(f"engine.draft_model 'layers:N' takes the target's first N layers, N an integer "
                                  f">= 1; got {name!r}")
        elif name not in preset_names() and not (Path(name) / "config.json").is_file():
            raise ConfigError(f"engine.draft_model must be a preset {preset_names()}, 'layers:N' or a checkpoint "
                              f"directory holding config.json, got {name!r}")
        target = model_config(self.model)
        if target is None:
            return  # the model's own check reports it
        overrides = self.runtime_options.get("preset_overrides") or {}
        if isinstance(overrides, dict) and overrides.get("num_hidden_layers"):  # as the runtime builds it
            target = attrs.evolve(target, num_hidden_layers=int(overrides["num_hidden_layers"]))
        if name.startswith("layers:"):
            if int(name.split(":", 1)[1]) >= target.num_hidden_layers:
                raise ConfigError(f"engine.draft_model {name!r}: N must be in [1, {target.num_hidden_layers}) "
                                  f"(model {self.model!r} has {target.num_hidden_layers} layers)")
            return
        draft = model_config(name)
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise ConfigError(f"engine.draft_model {name!r} has a vocabulary of {draft.vocab_size} tokens, model "
                              f"{self.model!r} {target.vocab_size}: a draft must share the target's tokenizer")

    def _check_nodes(self) -> None:
        from .node_group import parse_address

        if not isinstance(self.nodes, int) or self.nodes < 1 or self.dep % self.nodes:
            raise ConfigError(f"engine.nodes must be an integer >= 1 that divides engine.dep ({self.dep}), "
                              f"got {self.nodes!r}")
        if not 0 <= self.node_rank < self.nodes:
            raise ConfigError(f"engine.node_rank must be in [0, {self.nodes}), got {self.node_rank!r}")
        if len(self.node_addresses) != self.nodes:
            raise ConfigError(f"engine.node_addresses must list one HOST:PORT per node ({self.nodes}), "
                              f"got {list(self.node_addresses)}")
        for a in self.node_addresses:
            try:
                parse_address(a)
            except ValueError as e:
                raise ConfigError(f"engine.node_addresses: {e}") from None
        if not self.dist_init.startswith("tcp://") or not _port_ok(self.dist_init[len("tcp://"):]):
            raise ConfigError(f"engine.dist_init must be tcp://HOST:PORT (the same on every node) when "
                              f"engine.nodes > 1, got {self.dist_init!r}")
        if self.prefill_instances or self.instances != 1 or self.eplb is not None or self.draft_model:
            raise ConfigError("engine.nodes > 1 runs one colocated DEP instance so far (no P/D, eplb or "
                              "draft model)")

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

    def _check_types(self) -> None:
        """Each field of the kind it must be, named when it is not (before anything reads it)."""
        for name in ("model", "runtime", "device", "dtype", "hash_secret", "kv_transport", "draft_model",
                     "draft_experts", "kv_cache_dtype", "dist_init", "node_link"):
            v = getattr(self, name)
            if not isinstance(v, str):
                raise ConfigError(f"engine.{name} must be a string, got {v!r}")
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise ConfigError(f"engine.tokenizer must be a path or name, '' (the model's own) or None (token ids "
                              f"only), got {self.tokenizer!r}")
        if not isinstance(self.scheduler, SchedulerConfig):
            raise ConfigError(f"engine.scheduler must be a SchedulerConfig, got {type(self.scheduler).__name__}")
        if self.eplb is not None and not isinstance(self.eplb, EplbConfig):
            raise ConfigError(f"engine.eplb must be None, an EplbConfig or a dict of its fields, got {self.eplb!r}")
        if not isinstance(self.spec_adaptive, bool):  # (tested for truth: 'no' turned it on)
            raise ConfigError(f"engine.spec_adaptive must be true or false, got {self.spec_adaptive!r}")
        for name in ("num_spec_tokens", "instances", "prefill_instances", "prefill_dep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"engine.{name} must be an integer, got {v!r}")
        if not isinstance(self.runtime_options, dict) or not all(isinstance(k, str) for k in self.runtime_options):
            raise ConfigError(f"engine.runtime_options must be a dict with string keys, got {self.runtime_options!r}")
        for name, low in (("seed", 0), ("dep", 1), ("mailbox_size", 1), ("nodes", 1), ("node_rank", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"engine.{name} must be an integer >= {low}, got {v!r}")
        r = self.ring_bytes
        if isinstance(r, bool) or not isinstance(r, int) or r < 4096 or r % 16:
            raise ConfigError(f"engine.ring_bytes must be an integer >= 4096 and a multiple of 16, got {r!r}")
        if isinstance(self.start_timeout_s, bool) or not isinstance(self.start_timeout_s, (int, float)) or \
                not self.start_timeout_s > 0:
            raise ConfigError(f"engine.start_timeout_s must be a number of seconds > 0, got {self.start_timeout_s!r}")
        for name in ("kv_hold_timeout_s", "node_rejoin_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"engine.{name} must be a number of seconds, got {v!r}")

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


def _port_ok(address: str) -> bool:
    port = address.rpartition(":")[2]
    return port.isdigit() and 1 <= int(port) <= 65535


def model_config(model: str):
    """A preset's or a checkpoint directory's ModelConfig; None where it cannot be read here
    (the runtime then reports what is wrong with the model when it loads it)."""
    from lockstep.runtime.models.config import ModelConfigError, ModelConfig, preset, preset_names

    try:
        return preset(model) if model in preset_names() else ModelConfig.from_pretrained(model)
    except (ModelConfigError, OSError, TypeError, ValueError):
        return None


def model_context(model: str) -> int | None:
    """The context a model was built for (``max_position_embeddings``), or None (``model_config``)."""
    cfg = model_config(model)
    return None if cfg is None else int(cfg.max_position_embeddings)
