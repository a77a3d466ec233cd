"""How a ``TorchRuntime`` is put together at load, apart from how it steps: the fast path's
runners (``FastRunner``: graphs captured, sampling warmed up), the speculator and its draft's
runner, the KV transport's endpoint (P/D), and with expert parallelism the process group, the
expert slots and padded dispatch's exchange. ``TorchRuntime.load`` calls these in order."""

from __future__ import annotations

import logging
import os

import torch

from . import sampling
from .base import RuntimeSpec

log = logging.getLogger("lockstep.runtime.torch_runtime")


def exchange_for(asked: str | None, device_type: str, hosts: list) -> str:
    """Padded dispatch's exchange (runtime option ``ep_exchange``, ``asked``; None: the
    default) for ranks on ``hosts`` (one entry a rank): through the peers' memory only where
    every rank is on one host; asked for across hosts, refused."""
    how = asked or ("direct" if device_type == "cuda" else "nccl")
    if how not in ("nccl", "peer", "direct"):
        raise ValueError(f"runtime option ep_exchange must be 'nccl', 'peer' or 'direct', got {how!r}")
    if how != "nccl" and len(set(hosts)) > 1:
        if asked:
            raise ValueError(f"runtime option ep_exchange {how!r} needs every DEP rank on one host; these ranks "
                             f"run on {len(set(hosts))} hosts: use 'nccl'")
        return "nccl"
    return how


class RuntimeAssembly:
    """The load-time half of ``TorchRuntime`` (a mixin: the methods read and set its state)."""

    def _fast_runner(self, spec: RuntimeSpec):
        """The fast path: on by default on CUDA for bfloat16/float16 models, over either KV
        cache dtype (FP8: the kernels take the pool's per-token scales)."""
        opts = spec.options
        want = opts.get("fast", self.device.type == "cuda" and self.model.dtype in (torch.bfloat16, torch.float16))
        if not want:
            return None
        from .models.fast import FastDeepseek

        cuda = self.device.type == "cuda"
        fast = FastDeepseek(self.model, fused_moe=bool(opts.get("fused_moe", self.placements is None)),
                            compile=bool(opts.get("compile", cuda)), moe_fp8=bool(opts.get("moe_fp8", False)),
                            fuse_shared=bool(opts.get("fuse_shared", True)),
                            router_split=bool(opts.get("router_split", False)))
        if self.world > 1 and "ep_dispatch" not in opts and not opts.get("draft_model"):
            self.ep_padded = True  # the fast path's default
        # Exact expert dispatch syncs the host inside every MoE layer: no graphs there.
        graphs = opts.get("cuda_graphs", "on" if cuda and (self.placements is None or self.ep_padded) else "off")
        graphs = {True: "on", False: "off"}.get(graphs, graphs)
        if graphs == "on" and self.placements is not None and not self.ep_padded:
            # Capturing would fail on one rank mid-collective and leave its peers waiting.
            raise ValueError("runtime option cuda_graphs 'on' does not run with ep_dispatch 'exact' (it syncs "
                             "the host inside every MoE layer): use ep_dispatch 'padded' or cuda_graphs 'off'")
        # With a draft, a verify feeds 1 + k tokens a request: graphs sized for them (up to
        # the most tokens a sequence may feed and still replay one).
        from .models.fast_inputs import DECODE_MAX_NEW

        k = int(opts.get("num_spec_tokens", 3)) if opts.get("draft_model") else 0
        cap = min(spec.max_num_seqs * min(1 + k, DECODE_MAX_NEW), max(spec.max_num_seqs, 1024))  # logits: ~0.4 GB
        if self.ep_padded:  # before any graph is captured: graphs hold its copies and barriers
            from .fast_runner import GRAPH_SIZES, graph_sizes

            sizes = graph_sizes(opts.get("cuda_graph_sizes", GRAPH_SIZES), max(cap, spec.max_num_seqs))
            self._attach_peer_exchange(spec, sizes[-1])
        return self._make_runner(fast, self.kv, spec, graphs, max_tokens=cap,
                                 collective=self._ep_mode if self.ep_padded else None)

    def _make_runner(self, fast, kv, spec: RuntimeSpec, graphs: str, *, max_tokens: int, collective=None,
                     tables=None):
        """A FastRunner over ``kv``, its graphs captured at load (runtime option
        ``capture_len``); ``tables``: another runner's device tables, to share."""
        from .fast_runner import GRAPH_SIZES, FastRunner

        opts = spec.options
        runner = FastRunner(fast, kv, max_num_seqs=spec.max_num_seqs, max_blocks=self.tables.shape[1],
                            max_model_len=spec.max_model_len, device=self.device, graphs=graphs,
                            sizes=tuple(opts.get("cuda_graph_sizes", GRAPH_SIZES)), collective=collective,
                            max_tokens=max_tokens, prefill_sizes=opts.get("prefill_graph_sizes"),
                            token_budget=spec.max_num_batched_tokens)
        if tables is not None:
            runner.tables = tables  # before any capture: graphs bake in its address
        capture_len = int(opts.get("capture_len", min(spec.max_model_len, 4096)))
        if capture_len > 0:  # 0: capture each graph when a step first needs it
            runner.capture(capture_len)
        sampling.warm_up(fast.cfg.vocab_size, self.device)  # no compile inside the first sampled step
        return runner

    def _draft_runner(self, spec: RuntimeSpec, own_layers: bool):
        """Makes the draft's FastRunner, on the target's fast path (drafts with replicated
        experts: a sharded draft's passes run the model's own all-to-alls). A draft that is
        the target's own layers reads its experts as the target does."""
        if self.runner is None:
            return None
        from .models.fast import FastDeepseek

        target = self.runner.fast
        opts = spec.options

        def make(draft, kv):
            # A draft of the target's own layers must not re-point their experts: the target's
            # graphs, captured already, read them where they are (fuse_shared as the target).
            fast = FastDeepseek(draft, fused_moe=target.use_fused_moe if own_layers else True,
                                compile=bool(opts.get("compile", self.device.type == "cuda")),
                                moe_fp8=target.moe_fp8 if own_layers else False,
                                fuse_shared=target.fuse_shared if own_layers else bool(opts.get("fuse_shared", True)),
                                router_split=bool(opts.get("router_split", False)))
            # A draft pass feeds one or two tokens a request (two after a fully accepted step).
            return self._make_runner(fast, kv, spec, self.runner.mode, max_tokens=2 * spec.max_num_seqs,
                                     tables=self.runner.tables)
        return make

    def _speculator(self, spec: RuntimeSpec):
        """Speculative decoding with the draft named by runtime option ``draft_model``."""
        name = spec.options.get("draft_model")
        if not name:
            return None
        placement = spec.options.get("draft_experts", "replicated")
        if placement not in ("replicated", "sharded"):
            raise ValueError(f"runtime option draft_experts must be 'replicated' or 'sharded', got {placement!r}")
        from .speculative import Speculator, load_draft

        draft = load_draft(str(name), self.model, dtype=self.model.dtype, device=self.device,
                           seed=int(spec.options.get("draft_seed", spec.seed)))
        # With expert parallelism a draft's experts are sharded over the ranks when asked, and
        # always for "layers:N" (the target's own, already sharded, layers). Every rank then
        # runs as many draft passes as the busiest (the DP sync's draft_passes).
        own_layers = str(name).startswith("layers:")
        lockstep = self.world > 1 and (own_layers or placement == "sharded")
        placements = None
        if lockstep and not own_layers:
            # Its own placement, which the balancer plans apart from the target's (spare
            # storage for a new one when balancing); "layers:N" shares the target's.
            from lockstep.policy.eplb import Topology, naive

            from .models.expert_parallel import shard_experts
            from .placements import ExpertPlacements

            e = draft.cfg.n_routed_experts
            moe = sum(draft.cfg.is_moe_layer(i) for i in range(draft.cfg.num_hidden_layers))
            topo = Topology(e, e, self.world)
            layers = shard_experts(draft, naive(topo, moe).phy2log, spec.rank, self.world,
                                   spare=topo.slots_per_rank if "redundant_experts" in spec.options else 0)
            placements = ExpertPlacements(layers, self.device, int(spec.options.get("eplb_min_stage_steps", 0)))
        return Speculator(self, draft, spec.num_blocks, spec.block_size, spec.max_num_seqs, spec.seed,
                          adaptive=bool(spec.options.get("spec_adaptive", False)), lockstep=lockstep,
                          placements=placements, fast_runner=None if lockstep else self._draft_runner(spec, own_layers))

    def _kv_endpoint(self, spec: RuntimeSpec):
        """P/D: the pool lives in (or is registered with) a KV transport."""
        kind = spec.options.get("kv_transport")
        if not kind:
            return None
        if self.device.type != "cpu" and kind != "nixl":
            raise ValueError(f"kv_transport {kind!r} moves CPU KV pools only; this runtime's device is "
                             f"{self.device}: use 'nixl' (VRAM to VRAM)")
        from .kv import KVEndpoint

        block_bytes = self.model.kv_block_bytes(spec.block_size, self.kv_dtype)
        return KVEndpoint(kind, spec.options.get("kv_name", f"runtime-{os.getpid()}"), spec.num_blocks, block_bytes,
                          device=self.device)

    def _join_group(self, spec: RuntimeSpec) -> None:
        """Expert parallelism over the DEP instance: Gloo on CPU, NCCL on GPU."""
        import torch.distributed as dist

        for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
            os.environ[var] = "0" if var == "NCCL_NVLS_ENABLE" else "1"  # multicast off, whatever was set
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=spec.options["dist_init"], rank=spec.rank,
                                world_size=spec.world_size,
                                device_id=self.device if self.device.type == "cuda" else None)

    def _attach_peer_exchange(self, spec: RuntimeSpec, pad_tokens: int) -> None:
        """Runtime option ``ep_exchange``: padded dispatch's all-to-alls as NCCL (Gloo) calls
        ("nccl"); as block copies into the peers' memory and a barrier ("peer": symmetric
        memory over NVLink on GPUs, a shared file on CPU; ``models.peer_exchange``); or as
        kernels that write each pair's row straight into its owner's memory and read the
        results back from there ("direct": ``kernels.ep_dispatch``; Triton, so on CPU only
        under the interpreter). Sized for steps of up to ``pad_tokens`` tokens. The default is
        "direct" on GPUs, "nccl" on CPU."""
        asked = spec.options.get("ep_exchange")
        if exchange_for(asked, self.device.type, ["here"]) == "nccl" or self.world == 1:
            return
        import torch.distributed as dist

        from .models.peer_exchange import host_id

        hosts = [None] * self.world  # the peers' memory is reachable only on one host
        dist.all_gather_object(hosts, host_id())
        how = exchange_for(asked, self.device.type, hosts)
        if how == "nccl":
            log.info("DEP ranks on %d hosts: expert exchange through NCCL", len(set(hosts)))
            return
        from .models.expert_parallel import attach_peer_exchange

        self.peer_exchange = attach_peer_exchange(self.placements.layers, pad_tokens,
                                                  self.model.cfg.num_experts_per_tok, None, self.device,
                                                  direct=how == "direct")

    def _place_experts(self, spec: RuntimeSpec):
        """Physical expert slots: always with expert parallelism, and on one rank when the
        engine balances experts (it then sets options["redundant_experts"], maybe 0). Spare
        storage (a second entry per slot, so any new placement fits) only when balancing.
        Option ``eplb_copy_all`` (benchmarks and tests): a switch copies every expert that
        changes slot from host memory, as a rank copies one it lacked (see
        ``models.expert_parallel``); one rank, which holds every expert, otherwise copies none."""
        balancing = "redundant_experts" in spec.options
        if self.world == 1 and not balancing:
            return None
        from lockstep.policy.eplb import Topology, naive

        from .models.expert_parallel import shard_experts
        from .placements import ExpertPlacements

        e = self.model.cfg.n_routed_experts
        topo = Topology(e, e + int(spec.options.get("redundant_experts", 0)), self.world)
        layers = shard_experts(self.model, naive(topo, len(self.moe_layers)).phy2log, spec.rank, self.world,
                               spare=topo.slots_per_rank if balancing else 0,
                               split=str(spec.options.get("expert_token_split", "even")),
                               copy_all=bool(spec.options.get("eplb_copy_all", False)))
        return ExpertPlacements(layers, self.device, int(spec.options.get("eplb_min_stage_steps", 0)))
