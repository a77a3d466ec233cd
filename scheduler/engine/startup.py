"""Starting an engine: the checks an EngineConfig must pass before any process starts, then
the runtime processes and the actors that drive them, laid out flat: with P/D the prefill
pool's ranks come first (new requests go there), then the decode pool's; otherwise every rank
of every instance takes requests. ``lockstep.api.open_engine`` wraps what this starts in an
``Engine``."""

from __future__ import annotations

from contextlib import asynccontextmanager
from functools import partial
from typing import AsyncIterator

import attrs
import trio

from lockstep.policy.config import ConfigError
from lockstep.runtime.models.config import ModelConfig, ModelConfigError, preset_names

from .balancer import Balancer
from .config import EngineConfig
from .config_checks import model_context
from .disagg import DecodeSide, Disagg, PrefillSide
from .frontend import Frontend
from .group import LocalGroup
from .node_group import NodeGroup, parse_address
from .scheduler import Scheduler


@attrs.frozen
class Actors:
    """What ``start_actors`` started (every rank's Scheduler, in rank order)."""

    schedulers: list[Scheduler]
    frontend: Frontend
    tokenizer: object
    balancer: Balancer | None


def _check_context(config: EngineConfig) -> None:
    """A max_model_len past the model's own context would be accepted, advertised and then
    served past the positions the model was built for; one past what a rank's KV cache holds
    for one request would be advertised and then refused request by request: both are
    refused at start (as vLLM refuses a max_model_len its KV cache cannot hold)."""
    s = config.scheduler
    if config.runtime == "torch" and config.model not in preset_names():  # a checkpoint's config.json,
        try:  # read here: its errors are the user's to fix, not a runtime's traceback
            ModelConfig.from_pretrained(config.model)
        except (ModelConfigError, OSError, ValueError) as e:
            raise ConfigError(f"engine.model: {e}") from None
    context = model_context(config.model)
    if context is not None and s.max_model_len > context:
        raise ConfigError(f"max_model_len {s.max_model_len} exceeds the context of model "
                          f"{config.model!r} ({context} tokens, its max_position_embeddings): lower it")
    if s.max_model_len > s.request_tokens:
        raise ConfigError(f"max_model_len {s.max_model_len} exceeds what one rank's KV cache holds for one request "
                          f"({s.request_tokens} tokens: num_blocks {s.num_blocks} x block_size {s.block_size}, "
                          f"less the {s.watermark:g} watermark): lower max_model_len or raise num_blocks")


def _check_device(config: EngineConfig) -> None:
    """A torch runtime on CUDA needs a GPU this process can see: say so before starting
    runtime processes that would fail one by one (with a modulo by zero GPUs)."""
    if config.runtime != "torch" or not config.device.startswith("cuda"):
        return
    import torch

    if torch.cuda.device_count() == 0:
        raise ConfigError(f"engine.device is {config.device!r} but no CUDA device is visible here "
                          "(CUDA_VISIBLE_DEVICES, drivers); use device 'cpu' or run on a GPU machine")


@asynccontextmanager
async def start_actors(config: EngineConfig) -> AsyncIterator[Actors]:
    """Check ``config``, start the runtime processes and the actors (schedulers, frontend,
    balancer) under one nursery, yield them; cancel them all on exit."""
    _check_device(config)
    _check_context(config)
    tokenizer = config.load_tokenizer()  # a bad tokenizer path fails here, before any process starts
    balancer = Balancer(config.eplb) if config.eplb is not None else None
    loads = None if balancer is None else balancer.send_channel
    disagg = Disagg(config.kv_transport, config.kv_hold_timeout_s) if config.prefill_instances else None
    async with trio.open_nursery() as nursery:
        schedulers: list[Scheduler] = []
        if disagg is not None:
            disagg.prefill = _pool(config, "prefill", config.prefill_instances, config.prefill_dep, disagg, None)
            schedulers += disagg.prefill
        if config.nodes > 1:  # this process hosts a share of one instance spread over nodes
            group = NodeGroup(NodeGroup.local_size(config.dep, config.nodes), config.node_rank,
                              [parse_address(a) for a in config.node_addresses], config.dist_init,
                              link=config.node_link, rejoin_timeout_s=config.node_rejoin_timeout_s,
                              join_timeout_s=config.start_timeout_s, digest=config.settings_digest())
            await nursery.start(group.run)
            pool = [Scheduler(config.make_core, partial(_node_client, config, group, r), group=group, rank=r)
                    for r in range(group.size)]
        else:
            first = 0 if disagg is None else len(disagg.prefill)
            pool = _pool(config, "decode" if disagg else "colocated", config.instances, config.dep, disagg, loads,
                         first)
        if disagg is not None:
            disagg.decode = pool
        schedulers += pool
        async with trio.open_nursery() as starting:  # together: each instance's runtimes join one group
            for s in schedulers:
                starting.start_soon(nursery.start, s.run)
        ready = schedulers[0].client.ready
        if balancer is not None:
            await nursery.start(balancer.run, ready, [s.place_nowait for s in schedulers])
        targets = disagg.prefill if disagg is not None else schedulers
        frontend = Frontend(tokenizer, config.hasher(), targets, max_model_len=config.scheduler.max_model_len,
                            vocab_size=ready.vocab_size, eos_token_id=ready.eos_token_id,
                            mailbox_size=config.mailbox_size)
        if disagg is not None:
            first = len(disagg.prefill)
            disagg.on_moved = lambda rid, j: frontend.rank_of.__setitem__(rid, first + j)
        await nursery.start(frontend.run)
        try:
            yield Actors(schedulers, frontend, tokenizer, balancer)
        finally:
            nursery.cancel_scope.cancel()



def _pool(config: EngineConfig, role: str, instances: int, dep: int, disagg: Disagg | None, loads,
          first_slot: int = 0) -> list[Scheduler]:
    """The Scheduler actors of ``instances`` instances of ``dep`` ranks each (not started).
    Their runtimes are numbered from ``first_slot`` on: on ``cuda`` each takes the GPU of its
    number (modulo the GPUs there are), so a P/D engine's pools land on different GPUs."""
    out = []
    for _ in range(instances):
        group = LocalGroup(dep, config.dist_init_address) if dep > 1 else None
        for rank in range(dep):
            side = None
            if disagg is not None:
                side = (PrefillSide if role == "prefill" else DecodeSide)(disagg, len(out))
            make_client = partial(_client, config, group, rank, dep, disagg, role, first_slot + len(out))
            out.append(Scheduler(config.make_core, make_client, group=group, rank=rank, loads=loads, role=side))
    return out


def _node_client(config: EngineConfig, group: NodeGroup, local: int):
    return config.make_client(group.global_rank(local), group.dist_init, world_size=config.dep)


def _client(config: EngineConfig, group: LocalGroup | None, rank: int, dep: int, disagg: Disagg | None, role: str,
            slot: int = 0):
    options = dict(config.runtime_options) if disagg is None else disagg.runtime_options(role, config.runtime_options)
    if config.device == "cuda":  # no index given: one GPU per runtime
        options.setdefault("device_slot", slot)
    return config.make_client(rank, None if group is None else group.dist_init, world_size=dep, options=options)
