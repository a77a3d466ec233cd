"""The ``torch`` runtime: the DeepSeek-V3 family on CPU or CUDA.

State is kept by batch slot (the core's stable slot of each request), in arrays: each slot's
block table and its last sampled token, so turning a StepPlan into a forward batch is a few
vectorized numpy operations, with no per-request Python work on the decode path. PLACEHOLDER
tokens (async scheduling: "what you sampled last step") are filled from the last-token array.
Sampling settings arrive once per request (``NewRequests``) and are dropped on ``forget``.

Two paths run a step. The reference one (the model's own forward, host-side sampling) is
what the CPU tests compare against float64 references. The fast one (default on CUDA for
bfloat16/float16 models; runtime option ``fast``) runs ``models.fast`` through the Triton
kernels via a ``FastRunner`` (device block tables, CUDA graphs for decode steps and
speculative verifies) and
samples on the device; only the sampled ids and expert counts cross to the host. Its steps
can be launched ahead (``launch``/``finish``): the runtime process starts step N+1 before it
waits for step N's tokens, which the device already holds. Options:
``fast`` (bool), ``cuda_graphs`` (on/off/padded), ``cuda_graph_sizes`` (list),
``prefill_graph_sizes`` (token counts of prefill steps replayed as graphs between their
attention cores, ``prefill_graphs.PrefillGraphs``; default 256-8192 with graphs on, [] for none),
``capture_len`` (context bound captured at load; 0: none, each graph when first used),
``compile`` (torch.compile the small steps), ``fused_moe`` (bool), ``moe_fp8`` (FP8
block-scaled expert weights for fused MoE), ``fuse_shared`` (the shared experts inside the
fused MoE launch; default on), ``router_split`` (on Hopper, prefill steps' router GEMM
on tensor cores through the gate split into three bf16 pieces; default off: no gain measured
through the whole model), ``launch_ahead`` (default on: see ``launch``),
``ep_dispatch`` (expert parallelism: ``padded``, the default on the fast path without a
draft model, or ``exact``; see ``models.expert_parallel``). With padded dispatch, a step every rank only decodes in runs
padded to one agreed size on every rank (the DP sync's token count, rounded up to a graph
size) as a CUDA graph, all-to-alls included; other steps use exact dispatch.
``ep_exchange`` (padded dispatch's exchanges: ``direct``, kernels that write and read the
peers' memory, the default on GPUs; ``peer``, block copies into it; or ``nccl``, the default
on CPU; see ``runtime_setup``'s ``_attach_peer_exchange``). Expert
placement options (``eplb_min_stage_steps``, ``eplb_copy_all``): see ``runtime_setup``'s ``_place_experts``.
Benchmarks' changes to random weights (``expert_skew``, ``layer_output_scale``): see
``runtime.synthetic``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import time

import attrs
import numpy as np
import torch

from lockstep.policy.step import PLACEHOLDER, StepPlan, StepResult

from .base import KVConnect, KVPull, NewPlacement, NewRequests, Ready, RuntimeSpec
from .logits import LogitsProcessors, grammar_only
from .prompt_logprobs import PromptScores
from .runtime_setup import RuntimeAssembly
from .launched import HostReturn, Launched
from .models import load_model
from . import synthetic
from .models.batch import ForwardBatch, HostBatch
from .sampling import logprobs as _logprobs, sample, sample_on_device

log = logging.getLogger(__name__)


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def _grammar_info(model: str, cfg):
    """xgrammar's view of the model's vocabulary (structured outputs), from its tokenizer."""
    from .grammar import tokenizer_info
    from .tokenizer import load_tokenizer

    return tokenizer_info(load_tokenizer(model, cfg.vocab_size), cfg.vocab_size, [cfg.eos_token_id])


class TorchRuntime(RuntimeAssembly):
    def load(self, spec: RuntimeSpec) -> Ready:
        if spec.device == "cpu":
            torch.set_num_threads(int(spec.options.get("threads", 1)))
        self.world = 1
        self.device = torch.device(spec.device)
        if self.device.type == "cuda" and self.device.index is None:
            # A GPU per runtime: the engine numbers its runtimes (prefill pool first), else the rank.
            slot = int(spec.options.get("device_slot", spec.rank))
            self.device = torch.device("cuda", slot % torch.cuda.device_count())
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model = load_model(spec.model, dtype=DTYPES[spec.dtype], device=self.device, seed=spec.seed,
                                overrides=spec.options.get("preset_overrides"),
                                # a preset's random weights are drawn where they live on a GPU (a
                                # 16B-parameter model drawn on the CPU took minutes); the option off
                                # draws them on the CPU, the same on any device
                                draw_on_device=bool(spec.options.get("init_on_device", self.device.type == "cuda")))
        synthetic.apply(self.model, spec.options, spec.seed)  # benchmarks' skew and scale options
        self.world = spec.world_size
        if self.world > 1:
            self._join_group(spec)
        cfg = self.model.cfg
        self.moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        self.placements = self._place_experts(spec)
        self.bs = spec.block_size
        kv_dtype = spec.options.get("kv_cache_dtype", "auto")
        if kv_dtype not in ("auto", "fp8"):
            raise ValueError(f"runtime option kv_cache_dtype must be 'auto' or 'fp8', got {kv_dtype!r}")
        self.kv_dtype = torch.float8_e4m3fn if kv_dtype == "fp8" else None  # None: the model's
        self.endpoint = self._kv_endpoint(spec)
        if self.endpoint is None:
            self.idle = None  # nothing to keep moving between steps: the loop sleeps soundly
        storage = None
        if self.endpoint is not None:
            pool = self.endpoint.pool
            storage = pool if isinstance(pool, torch.Tensor) else torch.from_numpy(pool)
        self.kv_pool, self.kv = self.model.make_kv_pool(spec.num_blocks, spec.block_size, self.kv_dtype,
                                                        storage=storage)
        self.tables = np.zeros((spec.max_num_seqs, -(-spec.max_model_len // spec.block_size)), np.int32)
        self.last = np.zeros(spec.max_num_seqs, np.int32)
        self._returns = HostReturn()  # the sampled ids and expert counts, on their way back
        self.launch_ahead = bool(spec.options.get("launch_ahead", True))
        self._outstanding = 0  # steps launched and not yet finished
        self._flight: collections.deque[Launched] = collections.deque()  # those steps, in launch order
        self._finished_at = 0.0  # when the last launched step was finished (perf_counter)
        self.params: dict[int, tuple[float, float, int, int, int]] = {}
        self.gen = torch.Generator(device=self.device).manual_seed(spec.seed)
        self.processors = LogitsProcessors(spec.max_num_seqs, cfg.vocab_size, self.device,
                                           grammar_info=functools.partial(_grammar_info, spec.model, cfg))
        self.scores = PromptScores()
        # The fast path's sampling settings by slot, refreshed when a slot's request changes.
        self.slot_req = np.full(spec.max_num_seqs, -1, np.int64)
        self.slot_float = np.zeros((spec.max_num_seqs, 2), np.float64)  # temperature, top_p
        self.slot_int = np.zeros((spec.max_num_seqs, 3), np.int64)  # top_k, seed (63 bits), logprobs
        dispatch = spec.options.get("ep_dispatch", "exact")
        if dispatch not in ("exact", "padded"):
            raise ValueError(f"runtime option ep_dispatch must be 'exact' or 'padded', got {dispatch!r}")
        if dispatch == "padded" and spec.options.get("draft_model"):
            raise ValueError("runtime option ep_dispatch 'padded' does not run with a draft model (speculative "
                             "steps feed several tokens per request): use 'exact'")
        # Decode steps with padded dispatch (the fast path turns it on by default for DEP; a
        # single rank with expert slots takes it only when asked: tests).
        self.ep_padded = self.placements is not None and dispatch == "padded"
        self.peer_exchange = None
        self.runner = self._fast_runner(spec)
        if self.ep_padded and self.runner is None:  # the reference path pads decode steps to their tokens
            self._attach_peer_exchange(spec, spec.max_num_seqs)
        self.forward_model = self.model if self.runner is None else self.runner.fast
        self.spec = self._speculator(spec)
        draft = self.spec.draft.cfg if self.spec is not None and self.spec.placements is not None else None
        return Ready(name="torch", vocab_size=cfg.vocab_size, eos_token_id=cfg.eos_token_id,
                     num_layers=cfg.num_hidden_layers, num_experts=cfg.n_routed_experts, pid=os.getpid(),
                     moe_layers=self.moe_layers, kv_peer=b"" if self.endpoint is None else self.endpoint.export(),
                     kv_bytes_per_token=self.kv_pool[0].numel() * self.kv_pool.element_size() // self.bs,
                     draft_num_experts=0 if draft is None else draft.n_routed_experts,
                     draft_moe_layers=[] if draft is None else [i for i in range(draft.num_hidden_layers)
                                                                if draft.is_moe_layer(i)])

    # -- P/D KV transfer ---------------------------------------------------------------------
    def kv_connect(self, msg: KVConnect) -> None:
        self._need_endpoint().connect(msg.peer)

    def kv_pull(self, msg: KVPull) -> None:
        self._need_endpoint().pull(msg.req_id, msg.peer, msg.remote, msg.local)

    def idle(self) -> None:
        self.endpoint.progress()

    def _need_endpoint(self):
        if self.endpoint is None:
            raise ValueError("this runtime has no KV transport: start it with runtime option 'kv_transport'")
        return self.endpoint

    def _kv_loads(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
        """(done, failed) KV loads to report with this step."""
        if self.endpoint is None:  # nothing is pulled here: a load is done when planned
            return plan.kv_load_req_ids, np.zeros(0, np.int64)
        done, failed = self.endpoint.poll()
        return np.asarray(done, np.int64), np.asarray(failed, np.int64)

    def new_placement(self, msg: NewPlacement) -> None:
        if msg.model == "draft":
            if self.spec is None or self.spec.placements is None:
                raise ValueError("this runtime has no draft expert slots to place: a draft's experts are placed "
                                 "only when sharded (runtime option draft_experts 'sharded', with dep > 1)")
            self.spec.placements.receive(msg.gen, msg.array())
            return
        if self.placements is None:
            raise ValueError("this runtime has no expert slots to place: the engine balances experts only "
                             "with runtime option 'redundant_experts' set (EngineConfig.eplb)")
        self.placements.receive(msg.gen, msg.array())

    def add_requests(self, msg: NewRequests) -> None:
        for i, rid in enumerate(msg.req_ids):
            lp = msg.logprobs[i] if msg.logprobs else -1
            self.params[rid] = (msg.temperature[i], msg.top_p[i], msg.top_k[i], msg.seed[i], lp)
            if msg.rules and msg.rules[i] is not None:
                if self.spec is not None and not grammar_only(msg.rules[i]):  # (the engine refuses them first)
                    raise ValueError(f"request {rid}: penalties, min_p, min_tokens, logit_bias and allowed_token_ids "
                                     "do not run with a draft model")
                self.processors.add(rid, msg.rules[i], msg.prompts[i] if msg.prompts else b"")
            if msg.prompt_logprobs:
                self.scores.add(rid, msg.prompt_logprobs[i], msg.prompts[i])

    def grammars_ready(self) -> np.ndarray | None:
        """Requests whose grammar finished compiling since the last call (None: none)."""
        done = self.processors.grammars.take_ready() if self.processors.grammars is not None else None
        return np.array(done, np.int64) if done else None

    def feed(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Make ``tokens`` these slots' last samples (what the next step's PLACEHOLDERs read),
        on the host and on the fast path's device: for a test or benchmark that feeds one
        runtime another's tokens, to compare them step by step."""
        self.last[slots] = tokens
        if self.runner is not None:
            self.runner.last[torch.as_tensor(np.asarray(slots, np.int64), device=self.device)] = torch.as_tensor(
                np.asarray(tokens, np.int64), device=self.device)

    def forget(self, req_ids: list[int]) -> None:
        for rid in req_ids:
            self.params.pop(rid, None)
        self.processors.forget(req_ids)
        self.scores.forget(req_ids)
        if self.endpoint is not None:
            self.endpoint.cancel(req_ids)

    def execute(self, plan: StepPlan) -> StepResult:
        if self._outstanding:
            raise RuntimeError(f"execute called with {self._outstanding} launched step(s) not finished: "
                               "finish them first (results go out in plan order)")
        drafts = None if self.spec is None else self.spec.placements
        if drafts is not None:  # the draft's own placement: switched, staged and reported alike
            drafts.use(plan.draft_placement_gen)
            result = self._execute_placed(plan)
            drafts.step_done()
            return attrs.evolve(result, draft_placement_ready=drafts.ready_gen(),
                                draft_expert_counts=self.spec.take_counts())
        return self._execute_placed(plan)

    def _execute_placed(self, plan: StepPlan) -> StepResult:
        if self.placements is None:
            return self._execute(plan)
        self.placements.use(plan.placement_gen)  # a switch, at this step boundary, if the plan says so
        padded = self.ep_padded and plan.uniform_decode
        self._ep_mode(self._pad_size(plan.num_padded_tokens) if padded else 0)
        result = self._execute(plan)
        self.placements.step_done()
        return attrs.evolve(result, placement_ready=self.placements.ready_gen())

    def _pad_size(self, tokens: int) -> int:
        return tokens if self.runner is None else self.runner.pad_size(tokens)

    def _ep_mode(self, pad_tokens: int) -> None:
        """This step's expert dispatch on every MoE layer: padded to ``pad_tokens`` per
        rank (the same on every rank), or exact where 0."""
        for layer in self.placements.layers:
            layer.dispatch, layer.pad_tokens = ("padded", pad_tokens) if pad_tokens else ("exact", 0)

    def _execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        self._update_tables(plan)
        if len(plan.token_ids) == 0:  # nothing to run here (a dummy, or only KV being pulled in)
            if self.world > 1:  # the MoE collectives must still run here
                if self.spec is not None:
                    self.spec.pad_passes(0, plan.draft_passes)
                if self.ep_padded and plan.uniform_decode and self.runner is not None:
                    self.runner.dummy(self._pad_size(plan.num_padded_tokens))
                else:
                    self.model(self._empty_batch(), self.kv)
            done, failed = self._kv_loads(plan)
            return StepResult(step_id=plan.step_id, num_sampled=np.zeros(plan.num_reqs, np.int32),
                              token_ids=np.zeros(0, np.int32), kv_loads_done=done, kv_loads_failed=failed)
        if self.spec is not None:
            done, failed = self._kv_loads(plan)
            return attrs.evolve(self.spec.execute(plan), kv_loads_done=done, kv_loads_failed=failed,
                                host_s=0.0)
        scored, meta = self.scores.rows(plan)  # prompt logprobs: rows beyond the sampled ones
        if self.runner is not None:
            return self._finish(self._launch_fast(plan, t0, scored=scored, meta=meta), plan)
        hb = self._host_batch(plan)
        n = len(hb.sample_index)
        positions = hb.positions[hb.sample_index]
        if meta is not None:
            hb = dataclasses.replace(hb, sample_index=np.concatenate([hb.sample_index, scored]))
        batch = hb.forward_batch(self.tables, self.device)
        t1 = time.perf_counter()
        logits, counts = self.model(batch, self.kv)
        prompt = {} if meta is None else self.scores.score(logits[n:], meta)
        logits = logits[:n]
        tokens, want = self._sample(plan, logits, positions)
        self.last[plan.slots[plan.samples]] = tokens
        lp = _logprobs(logits, tokens, int(want.max())) if len(want) and want.max() >= 0 else (None, None, None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        done, failed = self._kv_loads(plan)
        return StepResult(step_id=plan.step_id, num_sampled=plan.samples.astype(np.int32), token_ids=tokens,
                          kv_loads_done=done, kv_loads_failed=failed, expert_counts=counts.cpu().numpy(),
                          logprobs=lp[0], top_ids=lp[1], top_logprobs=lp[2], host_s=t1 - t0, gpu_s=t2 - t1,
                          **prompt)

    def launch(self, plan: StepPlan) -> Launched | None:
        """Start ``plan`` on the device and return before its tokens are back (``finish``
        gives its result), or None: this plan runs through ``execute``. Launched steps are
        those of the fast path on a lone rank (no draft, no expert slots, no KV transport)
        that ask for no logprobs: such a step reads last step's tokens on the device
        (``FastRunner.last``), so the runtime process launches step N+1 while step N still
        runs, and the GPU does not idle while the host prepares a step."""
        if (not self.launch_ahead or self.runner is None or self.spec is not None or self.placements is not None
                or self.world > 1 or self.endpoint is not None or not len(plan.token_ids)
                or (self.scores and self.scores.rows(plan)[1] is not None)):
            return None
        t0 = time.perf_counter()
        params = self._slot_params(plan)
        if len(params[4]) and params[4].max() >= 0:  # logprobs read the logits after the tokens
            return None
        self._update_tables(plan)
        launched = self._launch_fast(plan, t0, params)
        self._outstanding += 1
        self._flight.append(launched)
        return launched

    def finish(self, launched: Launched) -> StepResult:
        """The result of a ``launch``ed step (waits for the device). Steps are finished in
        the order they were launched."""
        self._outstanding -= 1
        self._flight.popleft()
        result = self._finish(launched, None)
        # Launched steps overlap: each one's GPU time runs from when the one before it was
        # finished (or from its own launch), so that their sum is the wall time they took.
        gpu_s = result.gpu_s - max(0.0, self._finished_at - launched.t1)
        self._finished_at = launched.t1 + result.gpu_s
        return attrs.evolve(result, gpu_s=gpu_s)

    def _launch_fast(self, plan: StepPlan, t0: float, params=None, scored=None, meta=None) -> Launched:
        hb = self._host_batch(plan, fill=False)  # placeholders are read on the device
        t1 = time.perf_counter()
        pad = plan.num_padded_tokens if self.ep_padded and plan.uniform_decode else 0
        prompt = None
        if meta is not None:  # prompt logprobs (never launched ahead): the eager forward's extra rows
            logits, extra, counts = self.runner.forward_scoring(hb, scored)
            prompt = self.scores.score(extra, meta)
        else:
            logits, counts = self.runner.forward(hb, pad_to=pad)
        temp, top_p, top_k, seed, want = params if params is not None else self._slot_params(plan)
        positions = hb.positions[hb.sample_index]
        if self._flight and self.processors.guides(plan):
            # a structured output's mask needs the steps in flight's tokens: wait for them here,
            # with this step's forward already on the device, and fill the masks while it runs
            for p in self._flight:
                if p.pending is not None and p.pending.guided:
                    if p.event is not None:
                        p.event.synchronize()
                    self.processors.confirm_guided(p.pending, p.host[:p.num_tokens].numpy())
        x, pending = self.processors.apply(plan, logits, positions, temp)
        tokens = sample_on_device(x, temp, top_p, top_k, seed, positions, self.gen)
        self.processors.sampled(pending, tokens)
        self.runner.keep_sampled(tokens)
        # One transfer (and, at finish, the step's one wait) for the sampled ids and the expert counts.
        host, event = self._returns.start(torch.cat([tokens.to(torch.int32), counts.flatten()]))
        keep_logits = len(want) and want.max() >= 0
        return Launched(step_id=plan.step_id, num_sampled=plan.samples.astype(np.int32),
                         slots=plan.slots[plan.samples], kv_done=np.array(plan.kv_load_req_ids, np.int64),
                         host=host, num_tokens=len(tokens), counts_shape=tuple(counts.shape), event=event,
                         want=want, logits=logits if keep_logits else None, t0=t0, t1=t1, pending=pending,
                         prompt=prompt)

    def _finish(self, p: Launched, plan: StepPlan | None) -> StepResult:
        tokens, counts = self._returns.take(p)
        self.last[p.slots] = tokens
        self.processors.confirm(p.pending, tokens)
        want = p.want
        lp = (_logprobs(p.logits, tokens, int(want.max())) if p.logits is not None
              else (None, None, None))
        t2 = time.perf_counter()
        done, failed = self._kv_loads(plan) if plan is not None else (p.kv_done, np.zeros(0, np.int64))
        return StepResult(step_id=p.step_id, num_sampled=p.num_sampled, token_ids=tokens,
                          kv_loads_done=done, kv_loads_failed=failed, expert_counts=counts,
                          logprobs=lp[0], top_ids=lp[1], top_logprobs=lp[2], host_s=p.t1 - p.t0, gpu_s=t2 - p.t1,
                          **(p.prompt or {}))

    def _update_tables(self, plan: StepPlan) -> None:
        """New block ids go into each slot's table at block_start onwards."""
        if len(plan.block_ids):
            nb = np.diff(plan.block_offsets)
            rows = np.repeat(plan.slots.astype(np.int64), nb)
            cols = np.repeat(plan.block_start.astype(np.int64) - plan.block_offsets[:-1], nb) + np.arange(len(plan.block_ids))
            self.tables[rows, cols] = plan.block_ids
            if self.runner is not None:
                self.runner.update_tables(rows, cols, plan.block_ids)

    def _batch(self, plan: StepPlan) -> tuple[ForwardBatch, np.ndarray]:
        hb = self._host_batch(plan)
        return hb.forward_batch(self.tables, self.device), hb.positions[hb.sample_index]

    def _host_batch(self, plan: StepPlan, fill: bool = True) -> HostBatch:
        """The plan's forward batch on the host; ``fill``: PLACEHOLDER tokens from ``last``
        (else left for the fast runner to read on the device)."""
        n, bs = plan.num_reqs, self.bs
        slots = plan.slots.astype(np.int64)
        num_new = plan.num_new.astype(np.int64)
        entry = np.repeat(np.arange(n), num_new)
        ids = plan.token_ids.astype(np.int64)
        if fill:
            ph = ids == PLACEHOLDER
            if ph.any():
                ids[ph] = self.last[slots[entry[ph]]]
        pos = plan.start_pos.astype(np.int64)[entry] + np.arange(len(ids)) - plan.token_offsets[entry]
        seq_lens = plan.start_pos.astype(np.int64) + num_new
        width = int(-(-seq_lens.max() // bs))
        slot_mapping = self.tables[slots[entry], pos // bs].astype(np.int64) * bs + pos % bs
        sample_rows = plan.token_offsets[1:][plan.samples] - 1
        query_start = np.array(plan.token_offsets, dtype=np.int64)
        if not num_new.all():  # entries that only carry a block table (KV being pulled in)
            keep = np.flatnonzero(num_new)
            query_start = np.concatenate([query_start[:1], query_start[1:][keep]])
            seq_lens, slots = seq_lens[keep], slots[keep]
        return HostBatch(input_ids=ids, positions=pos, query_start=query_start, seq_lens=seq_lens, rows=slots,
                         width=width, slot_mapping=slot_mapping, sample_index=sample_rows)

    def _sample(self, plan: StepPlan, logits: torch.Tensor, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sampled tokens, top-k logprobs each row asked for: -1 for none)."""
        default = (1.0, 1.0, -1, -1, -1)
        rows = [self.params.get(r, default) for r in plan.req_ids[plan.samples].tolist()]
        temp, top_p, top_k, seed, want = (np.array(col) for col in zip(*rows)) if rows else ([],) * 5
        temp = np.asarray(temp, np.float64)
        x, pending = self.processors.apply(plan, logits, positions, temp)
        tokens = sample(x, temp, np.asarray(top_p, np.float64),
                        np.asarray(top_k, np.int64), np.asarray(seed, np.int64), positions, self.gen)
        self.processors.sampled(pending, tokens)
        self.processors.confirm(pending, tokens)
        return tokens, np.asarray(want, np.int64)

    def _slot_params(self, plan: StepPlan) -> tuple[np.ndarray, ...]:
        """(temperature, top_p, top_k, seed, logprobs) of each sampling entry, as ``_sample``
        reads them, from a per-slot cache: only slots whose request changed cost Python work."""
        slots, rids = plan.slots[plan.samples].astype(np.int64), plan.req_ids[plan.samples]
        for j in np.flatnonzero(self.slot_req[slots] != rids).tolist():
            got = self.params.get(int(rids[j]))
            temp, top_p, top_k, seed, want = got if got is not None else (1.0, 1.0, -1, -1, -1)
            self.slot_float[slots[j]], self.slot_int[slots[j]] = (temp, top_p), (top_k, seed, want)
            self.slot_req[slots[j]] = rids[j] if got is not None else -1  # settings may still come
        f, i = self.slot_float[slots], self.slot_int[slots]
        return f[:, 0], f[:, 1], i[:, 0], i[:, 1], i[:, 2]

    def _empty_batch(self) -> ForwardBatch:
        d, e = self.device, torch.zeros(0, dtype=torch.int64)
        return ForwardBatch(input_ids=e.to(d), positions=e.to(d), query_start=torch.zeros(1, dtype=torch.int64).to(d),
                            seq_lens=e.to(d), block_tables=torch.zeros((0, 1), dtype=torch.int32).to(d),
                            slot_mapping=e.to(d), sample_index=e.to(d))

    def shutdown(self) -> None:
        self.kv = self.kv_pool = None
        if getattr(self, "endpoint", None) is not None:
            self.endpoint.close()
            self.endpoint = None
        if getattr(self, "peer_exchange", None) is not None:
            for layer in self.placements.layers:
                layer.peer = None
            self.peer_exchange.close()
            self.peer_exchange = None
        if self.world > 1:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
