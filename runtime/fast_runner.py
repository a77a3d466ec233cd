"""Runs the torch runtime's forwards through the fast model path: steps whose sequences each
feed at most ``DECODE_MAX_NEW`` tokens (decodes, speculative verifies, draft passes) replay a
CUDA graph; prefill steps of up to ``PREFILL_GRAPH_SIZES[-1]`` tokens replay graphs between
their attention cores (``prefill_graphs.PrefillGraphs``); anything else (longer steps, and with
expert parallelism any step but a one-token-per-sequence decode) runs eagerly.

State that lives on the device between steps: the block tables (one row per batch slot,
updated with each plan's new block ids, never re-sent whole), and the graphs' input buffers
(token ids, positions, KV slots, table rows, and the slots of the sampled tokens), written by
one host-to-device copy per step from a pinned staging array (two of them, used in turn: with
steps launched ahead, the next step is staged while the last one's copy may still be queued).
``last`` holds each slot's last sampled token on the device: a token id of PLACEHOLDER (-1,
"what this sequence sampled last step") is read from it inside the forward (and the graph),
and ``keep_sampled`` writes a step's samples into it. So a step needs nothing back from the
step before it: the host can launch step N+1 before step N's tokens reach it.

A graph is captured per (padded token count, context bound): the decode kernel's split
count depends on the bound, and each graph bakes in its launches. A batch pads
to the next captured size with tokens whose KV slot is -1: they store nothing, attend to
nothing, choose no expert and are not counted. Every token of a graph attends as a query of
its own (its context is its position + 1, read through its sequence's table row), so a step
whose sequences each feed at most ``DECODE_MAX_NEW`` tokens replays one too: a speculative
verify (the last token and its drafts), or a draft pass that catches up on two tokens.

``graphs``: "on" (CUDA), "off", or "padded" (the graph path's buffers and padding without
capturing: how the CPU tests run that code).

The KV cache (bf16, or FP8 with per-token scales) is the runtime's pool, whose per-layer
views never move: a graph bakes in their addresses as it does the input buffers'.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from .models.batch import HostBatch, to_device
from .models.fast import FastDeepseek
from .models.fast_inputs import DECODE_MAX_NEW, AttnPlan, FastInputs, len_bucket

log = logging.getLogger(__name__)

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # tokens; a runner keeps those up to its capacity
_PAD = (0, 0, -1, 0, 0)  # token id, position, KV slot, table row, sample slot of a padding token


def graph_sizes(sizes, cap: int) -> list[int]:
    """The token counts a runner captures graphs for: ``sizes`` below ``cap``, then the
    smallest one at or above it (``cap`` where none is)."""
    want = sorted({int(s) for s in sizes if s >= 1})
    return [s for s in want if s < cap] + [min([s for s in want if s >= cap], default=cap)]


class StagedInputs:
    """Int64 rows on the device, written by one host-to-device copy per step from a pinned
    staging array: two of them, used in turn (with steps launched ahead, the next step is
    staged while the last one's copy may still be queued)."""

    def __init__(self, rows: int, n: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self._stagings = [torch.zeros(rows, n, dtype=torch.int64, pin_memory=self.cuda) for _ in range(2)]
        self._copied: list = [None, None]  # per staging array: an event after its last copy (CUDA)
        self._turn = 0
        self.device = torch.zeros(rows, n, dtype=torch.int64, device=device)

    def stage(self) -> np.ndarray:
        """The staging array to fill next (its previous copy to the device waited for)."""
        self._turn ^= 1
        done = self._copied[self._turn]
        if done is not None and not done.query():  # (it almost always is done)
            done.synchronize()
        return self._stagings[self._turn].numpy()

    def upload(self) -> None:
        """Copy the array last staged to the device: whole rows, one contiguous copy."""
        self.device.copy_(self._stagings[self._turn], non_blocking=True)
        if self.cuda:
            ev = self._copied[self._turn] or torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device.device))
            self._copied[self._turn] = ev


class FastRunner:
    def __init__(self, fast: FastDeepseek, kv: list, *, max_num_seqs: int, max_blocks: int,
                 max_model_len: int, device: torch.device, graphs: str = "on",
                 sizes: tuple[int, ...] = GRAPH_SIZES, collective=None, max_tokens: int = 0,
                 prefill_sizes: tuple[int, ...] | None = None, token_budget: int = 0):
        if graphs not in ("on", "off", "padded"):
            raise ValueError(f"cuda_graphs must be on, off or padded, got {graphs!r}")
        if graphs == "on" and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; this runtime's is {device}")
        self.fast, self.kv, self.device, self.mode = fast, kv, device, graphs
        # Expert parallelism with padded dispatch: ``collective(size)`` readies the MoE layers
        # for a forward of ``size`` tokens per rank. Every rank must then run the same
        # collectives in every step: graphs are captured at load only (the same ones on every
        # rank), a step pads to the size the ranks agreed on, and a context bound without a
        # graph uses the smallest larger one captured, or runs eagerly.
        self.collective = collective
        self.len_cap = len_bucket(max_model_len, 1 << 30)
        fast.len_cap = self.len_cap
        self.tables = torch.zeros(max_num_seqs, max_blocks, dtype=torch.int32, device=device)
        # Tokens a decode-rows step may feed: one per sequence, or more with speculation.
        self.sizes = graph_sizes(sizes, max(max_tokens, max_num_seqs))
        n = self.sizes[-1]
        self._staged = StagedInputs(5, n, device)
        self._static = self._staged.device
        self.last = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)  # per slot
        self._sample_slots = self._static[4, :0]
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool = None
        self.graph_errors: dict[tuple[int, int], str] = {}
        self.replays = self.eager_steps = 0  # replays: graph steps (padded ones without a graph)
        # Prefill steps as CUDA graphs between their attention cores: not with expert
        # parallelism (a rank's collectives must match its peers', step by step).
        # ``prefill_sizes`` None: PREFILL_GRAPH_SIZES with graphs "on", none otherwise.
        from .prefill_graphs import PREFILL_GRAPH_SIZES, PrefillGraphs

        if prefill_sizes is None:
            prefill_sizes = PREFILL_GRAPH_SIZES if graphs == "on" else ()
        if not isinstance(prefill_sizes, (list, tuple)):
            raise ValueError(f"runtime option prefill_graph_sizes must be a list of token counts, got {prefill_sizes!r}")
        bad = [x for x in prefill_sizes if isinstance(x, bool) or not isinstance(x, int) or x < 1]
        if bad:
            raise ValueError(f"runtime option prefill_graph_sizes must list token counts >= 1, got {bad[0]!r}")
        # No size beyond the first that holds every token a step may have: the runtime's
        # sequences', and the scheduler's token budget where the spec gives it.
        cap = max_num_seqs * max_model_len
        if token_budget > 0:
            cap = min(cap, token_budget)
        want = sorted(set(prefill_sizes))
        prefill_sizes = [x for x in want if x < cap] + [x for x in want if x >= cap][:1]
        self.prefill = None
        if graphs != "off" and collective is None and fast.use_fused_moe and prefill_sizes:
            self.prefill = PrefillGraphs(self, prefill_sizes)

    # -- block tables -------------------------------------------------------------------------
    def update_tables(self, rows: np.ndarray, cols: np.ndarray, block_ids: np.ndarray) -> None:
        """Apply one plan's new block ids (the same deltas as the host table's)."""
        if not len(rows):
            return
        packed = to_device(np.stack([rows, cols, block_ids.astype(np.int64)]), self.device)
        self.tables[packed[0], packed[1]] = packed[2].to(torch.int32)

    # -- a step -----------------------------------------------------------------------------------
    def forward(self, hb: HostBatch, pad_to: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits of hb.sample_index's rows, expert counts); ``pad_to``: the token count
        the DEP ranks agreed on for a decode step (padded expert dispatch), else 0."""
        t = len(hb.input_ids)
        # With padded expert dispatch a graph holds padded all-to-alls: a step the ranks did
        # not agree to pad (some rank prefills) runs eagerly, with exact dispatch.
        graphs = self.mode != "off" and (self.collective is None or pad_to > 0)
        if graphs and max(t, pad_to) <= self.sizes[-1] and self._decode_rows(hb):
            size = self.pad_size(max(t, pad_to))
            key = (size, len_bucket(int(hb.seq_lens.max()), self.len_cap))
            if self.collective is not None and self.mode == "on":
                key = self._captured(key)
            if key is not None and key not in self.graph_errors:
                return self._replay(hb, key)
        if self.prefill is not None and pad_to == 0 and t <= self.prefill.sizes[-1]:
            got = self.prefill.forward(hb)
            if got is not None:
                return got
        self.eager_steps += 1
        return self._eager(hb)

    def _decode_rows(self, hb: HostBatch) -> bool:
        """Every token attends as a decode query: one token per sequence, or (no padded
        dispatch, whose agreed size counts sequences) a few each."""
        if hb.is_decode():
            return True
        return self.collective is None and int(hb.num_new.max()) <= DECODE_MAX_NEW

    def pad_size(self, tokens: int) -> int:
        """The token count a graph step of ``tokens`` tokens runs at: the next graph size, or
        ``tokens`` beyond the largest."""
        return next((s for s in self.sizes if s >= tokens), tokens)

    def _captured(self, key: tuple[int, int]) -> tuple[int, int] | None:
        bounds = [b for (s, b) in self._graphs if s == key[0] and b >= key[1]]
        return (key[0], min(bounds)) if bounds else None

    def dummy(self, size: int) -> None:
        """A step with no tokens of this rank's own, padded to ``size`` (expert parallelism:
        the collectives must run): a captured graph's replay on padding only, or eagerly."""
        keys = sorted(k for k in self._graphs if k[0] == size)
        if keys:
            st = self._staged.stage()
            st[:, :size] = np.array(_PAD, dtype=np.int64)[:, None]
            self._staged.upload()
            self._graphs[keys[0]][0].replay()
            self.replays += 1
            return
        self._static[:, :size] = torch.tensor(_PAD, device=self.device)[:, None]
        self.fast.forward(self._static_inputs(size, len_bucket(1, self.len_cap)), self.kv)
        self.eager_steps += 1

    def _eager(self, hb: HostBatch) -> tuple[torch.Tensor, torch.Tensor]:
        tok_rows = np.repeat(hb.rows, hb.num_new)
        t, s = len(hb.input_ids), len(hb.sample_index)
        flat = to_device(np.concatenate([hb.input_ids, hb.positions, hb.slot_mapping, tok_rows, hb.sample_index,
                                         tok_rows[hb.sample_index]]), self.device)
        plan = AttnPlan.build(hb.num_new, hb.seq_lens, hb.rows, self.len_cap, self.device)
        rows = flat[3 * t:4 * t]
        inp = FastInputs(flat[:t], flat[t:2 * t], flat[2 * t:3 * t], self.tables, rows, plan,
                         sample_index=flat[4 * t:4 * t + s], last=self.last)
        self._sample_slots = flat[4 * t + s:]
        return self.fast.forward(inp, self.kv)

    def forward_scoring(self, hb: HostBatch, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits of hb.sample_index's rows, logits of token ``rows``, expert counts) for a
        step that scores prompts: through the prefill graphs where ``forward`` would take
        them (the same products; the scored rows' logits from one of their own), else one
        eager forward returning more rows than it samples. Never a decode graph: those
        return the sampled rows only (a prompt that short goes eagerly)."""
        t = len(hb.input_ids)
        if self.prefill is not None and t <= self.prefill.sizes[-1]:  # as ``forward`` would run it
            got = self.prefill.forward(hb, score_rows=to_device(rows, self.device))
            if got is not None:
                return got[0], got[2], got[1]
        n = len(hb.sample_index)
        self.eager_steps += 1
        logits, counts = self._eager(dataclasses.replace(hb, sample_index=np.concatenate([hb.sample_index, rows])))
        self._sample_slots = self._sample_slots[:n]  # the tokens drawn are the sampled rows' only
        return logits[:n], logits[n:], counts

    def keep_sampled(self, tokens: torch.Tensor) -> None:
        """Record the last forward's sampled tokens (one per sample_index entry) as their
        slots' last tokens, on the device, in stream order."""
        if len(tokens):
            self.last.index_copy_(0, self._sample_slots, tokens.to(torch.int64))

    def _replay(self, hb: HostBatch, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        size, b = key[0], len(hb.input_ids)
        got = None
        if self.mode == "on":
            got = self._graphs.get(key)
            if got is None and self.collective is None:
                got = self._capture(key)  # before staging: capture clobbers the inputs
            if got is None:
                self.eager_steps += 1
                return self._eager(hb)
        st = self._staged.stage()
        rows = hb.rows if b == len(hb.rows) else np.repeat(hb.rows, hb.num_new)
        st[0, :b], st[1, :b], st[2, :b], st[3, :b] = hb.input_ids, hb.positions, hb.slot_mapping, rows
        st[:, b:size] = np.array(_PAD, dtype=np.int64)[:, None]
        s = len(hb.sample_index)
        st[4, :s] = rows[hb.sample_index]
        self._staged.upload()
        self._sample_slots = self._static[4, :s]
        if got is None:
            if self.collective is not None:  # as a captured graph would: its dispatch is baked in
                self.collective(size)
            logits, counts = self.fast.forward(self._static_inputs(*key), self.kv)
        else:
            graph, logits, counts = got
            graph.replay()
        self.replays += 1
        logits = logits[:b]
        if len(hb.sample_index) != b or (hb.sample_index != np.arange(b)).any():
            logits = logits[to_device(hb.sample_index, self.device)]
        return logits, counts

    # -- graphs -----------------------------------------------------------------------------------
    def _static_inputs(self, size: int, bound: int) -> FastInputs:
        s = self._static[:, :size]
        # Batches pad only between captured sizes: one right after the last never pads.
        prev = max([p for p in self.sizes if p < size], default=0)
        return FastInputs(s[0], s[1], s[2], self.tables, s[3], AttnPlan.decode_only(size, bound),
                          padded=size > prev + 1, last=self.last)

    def capture(self, max_len: int) -> None:
        """Capture every size for contexts up to ``max_len`` (largest first, so the shared
        memory pool is sized by the first), then the prefill steps' pieces."""
        if self.mode != "on":
            return
        bound = len_bucket(max_len, self.len_cap)
        for size in reversed(self.sizes):
            if (size, bound) not in self._graphs:
                self._capture((size, bound))
        if self.prefill is not None:
            self.prefill.capture()

    def _capture(self, key: tuple[int, int]):
        """Warm up (compiles happen here, outside the capture), then capture on padding-only
        inputs: a captured forward's launches do not depend on the data."""
        inp = self._static_inputs(*key)
        self._static[:, :key[0]] = torch.tensor(_PAD, device=self.device)[:, None]
        if self.collective is not None:
            self.collective(key[0])
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.fast.forward(inp, self.kv)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits, counts = self.fast.forward(inp, self.kv)
        except Exception as e:  # noqa: BLE001 - recorded; this size then runs eagerly
            self.graph_errors[key] = f"{type(e).__name__}: {e}"
            log.warning("CUDA graph capture for %d tokens, context bound %d failed: %s", *key, self.graph_errors[key])
            return None
        self._graphs[key] = (graph, logits, counts)
        return self._graphs[key]

    def graph_for(self, batch: int, max_len: int) -> torch.cuda.CUDAGraph | None:
        """The captured graph a decode step of ``batch`` one-token sequences up to ``max_len``
        tokens of context replays, if any (benchmarks time bare replays with it)."""
        size = next((s for s in self.sizes if s >= batch), None)
        got = None if size is None else self._graphs.get((size, len_bucket(max_len, self.len_cap)))
        return None if got is None else got[0]

    def statistics(self) -> dict:
        """Plain values (JSON-ready): graphs as "tokens x context bound"."""
        name = "{}x{}".format
        out = {"graphs": [name(*k) for k in sorted(self._graphs)],
               "graph_errors": {name(*k): v for k, v in self.graph_errors.items()},
               "replays": self.replays, "eager_steps": self.eager_steps, "compile_errors": self.fast.ops.errors()}
        if self.prefill is not None:
            out["prefill_graphs"] = sorted(self.prefill.graphs)
            out["prefill_graph_errors"] = dict(self.prefill.errors)
            out["prefill_replays"] = self.prefill.replays
        return out

