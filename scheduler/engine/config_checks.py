"""EngineConfig's checks, run where a config is made (``EngineConfig.__attrs_post_init__``):
each field of its kind, the model's experts against the ranks that shard them, a draft that
fits its target, the multi-node settings, and the settings that mean nothing without P/D or a
draft. Also the model's config as read here, before any runtime starts (``model_config``)."""

from __future__ import annotations

from pathlib import Path

import attrs

from lockstep.policy.config import ConfigError, SchedulerConfig
from lockstep.policy.rebalance import EplbConfig
from lockstep.runtime.models.config import preset_names


class ConfigChecks:
    __slots__ = ()

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
