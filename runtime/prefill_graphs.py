"""Prefill steps replayed as CUDA graphs between their attention cores, for ``FastRunner``.

An eager prefill step of v2-lite launches ~670 kernels at ~50 us of host time each: a
256-token chunk took 33-54 ms for 11 ms of kernels on the H200. Replayed piecewise it takes
13.4 ms (``benchmarks/gpu/prefill_host.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from .fast_runner import _PAD, StagedInputs
from .models.batch import HostBatch
from .models.fast import Step
from .models.fast_inputs import AttnPlan, FastInputs

if TYPE_CHECKING:
    from .fast_runner import FastRunner

log = logging.getLogger(__name__)

# Token counts of the prefill steps replayed piecewise, up to the default token budget (8,192);
# longer steps run eagerly, where the host's ~50 us a launch is small against their kernels.
# (H200, v2-lite: an 8,192-token chunk on an 8K prefix 181.4 ms eagerly, 173.7 replayed;
# capturing 6,144 and 8,192 moved the memory reserved by 0.03 GiB.)
PREFILL_GRAPH_SIZES = (256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


class PrefillGraphs:
    """Prefill steps (some sequence feeds more than ``DECODE_MAX_NEW`` tokens) of up to
    ``sizes[-1]`` tokens, padded to the next size and run as one CUDA graph per piece between
    the layers' attention cores, which run eagerly on the real tokens (where each sequence's
    prefix lies changes every step; nothing else does, for a given token count).

    Piece 0 is the embedding and the first layer's ``attn_in``; piece i (0 < i < L) the
    output projection and FFN of layer i - 1, then layer i's ``attn_in``; piece L the last
    layer's, the final norm and the expert counts. Each core reads the piece before's
    outputs and writes the values into one static buffer the next piece reads. The logits
    of the sampled rows are one eager GEMM on the last piece's output. Eagerly a 256-token
    prefill chunk of v2-lite makes ~670 launches at ~50 us of host time each (the GPU waits
    two-thirds of the step); replayed, 28 graphs and the cores' ~8 launches a layer.

    Padding tokens (KV slot -1) store nothing and choose no expert (``Step.valid``, made
    inside piece 0 as the rope's cos and sin are). Mode "padded" (the CPU tests) runs the
    pieces without capturing them, on the same buffers and padding."""

    def __init__(self, runner: FastRunner, sizes: list[int]):
        self.runner, self.fast, self.sizes = runner, runner.fast, sizes
        n, dev = sizes[-1], runner.device
        # ids, positions, KV slots, table rows, then the sample rows and their slots
        self._staged = StagedInputs(6, n, dev)
        self._static = self._staged.device
        cfg, dt = self.fast.cfg, self.fast.model.dtype
        heads, dn, dr = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self._vals = torch.zeros(n, heads, cfg.v_head_dim, dtype=dt, device=dev)
        # What a piece hands the next (and its core): the residual stream (the final norm's
        # output after the last piece), q_nope, q_pe, latent, k_pe. Static, shared by all
        # sizes, so the pool holds only the pieces' temporaries (kept as graph outputs, 28
        # pieces' of 2,048 tokens took 1.15 GB).
        self._outs = (torch.zeros(n, cfg.hidden_size, dtype=dt, device=dev),
                      torch.zeros(n, heads, dn, dtype=dt, device=dev), torch.zeros(n, heads, dr, dtype=dt, device=dev),
                      torch.zeros(n, cfg.kv_lora_rank, dtype=dt, device=dev), torch.zeros(n, dr, dtype=dt, device=dev))
        self.graphs: dict[int, list] = {}  # size -> [(graph, outputs)] per piece
        self._held: dict[int, list] = {}
        self.errors: dict[int, str] = {}
        self.replays = 0

    def _inputs(self, size: int) -> FastInputs:
        s = self._static[:, :size]
        none = AttnPlan(0, None, 0, 0, None, None, None, 0, [])  # the pieces hold no attention
        return FastInputs(s[0], s[1], s[2], self.runner.tables, s[3], none, padded=True, last=self.runner.last)

    def _pieces(self, size: int):
        """The pieces' functions for ``size`` tokens: piece j takes the outputs of piece
        j - 1 (piece 0 nothing) and returns its own."""
        fast, kv, vals = self.fast, self.runner.kv, self._vals[:size]
        inp = self._inputs(size)
        state: dict = {}
        outs = tuple(b[:size] for b in self._outs)

        def hand_on(*got):
            for buf, t in zip(outs, got):
                buf.copy_(t)
            return outs

        def first(_):
            step = state["step"] = Step(inp, fast, kv)  # its cos, sin and valid: made in the graph
            state["chosen"] = []
            x, h = fast.embed(inp)
            return hand_on(x, *fast.attn_in(h, fast.layers[0], 0, inp.slot_mapping, step))

        def middle(i):
            def piece(prev):
                step = state["step"]
                x, h = fast.ffn(i - 1, prev[0], fast.attn_out(vals, fast.layers[i - 1], _PREFILL), step,
                                state["chosen"])
                return hand_on(x, *fast.attn_in(h, fast.layers[i], i, inp.slot_mapping, step))
            return piece

        def last(prev):
            n = len(fast.layers) - 1
            x, h = fast.ffn(n, prev[0], fast.attn_out(vals, fast.layers[n], _PREFILL), state["step"],
                            state["chosen"])
            return hand_on(h)[0], fast._counts(state["chosen"], size, x.device)

        return [first] + [middle(i) for i in range(1, len(fast.layers))] + [last]

    def _run(self, size: int, core) -> tuple:
        """All pieces in order, ``core(i, outputs of piece i)`` between them; with graphs
        captured for ``size``, replays."""
        got = self.graphs.get(size)
        if got is not None:
            graph, out = got[0]
            graph.replay()
            for i, (graph, nxt) in enumerate(got[1:]):
                core(i, out)
                graph.replay()
                out = nxt
            return out
        out = None
        for i, piece in enumerate(self._pieces(size)):
            if i:
                core(i - 1, out)
            out = piece(out)
        return out

    def forward(self, hb: HostBatch, score_rows: torch.Tensor | None = None) -> tuple | None:
        """The step through the pieces, or None where it does not go this way (its size
        failed to capture, or it decodes only). With ``score_rows`` (prompt logprobs) also
        those token rows' logits, from a product of their own (the sampled rows' stays as
        without them): (logits, counts, scored logits)."""
        t = len(hb.input_ids)
        if self.runner._decode_rows(hb):
            return None
        size = next(s for s in self.sizes if s >= t)
        if self.runner.mode == "on" and size not in self.graphs and size not in self.errors:
            self.capture([size])  # before staging: capture clobbers the inputs
        if size in self.errors or (self.runner.mode == "on" and size not in self.graphs):
            return None
        rows = np.repeat(hb.rows, hb.num_new)
        s = len(hb.sample_index)
        st = self._staged.stage()
        st[0, :t], st[1, :t], st[2, :t], st[3, :t] = hb.input_ids, hb.positions, hb.slot_mapping, rows
        st[:4, t:size] = np.array(_PAD[:4], dtype=np.int64)[:, None]
        st[4, :s], st[5, :s] = hb.sample_index, rows[hb.sample_index]
        self._staged.upload()
        st_dev = self._static
        plan = AttnPlan.build(hb.num_new, hb.seq_lens, hb.rows, self.runner.len_cap, self.runner.device)
        inp = FastInputs(st_dev[0, :t], st_dev[1, :t], st_dev[2, :t], self.runner.tables, st_dev[3, :t], plan)
        step = Step(inp, self.fast, self.runner.kv, rope=False)
        vals = self._vals

        def core(i: int, out) -> None:
            _, q_nope, q_pe, latent, k_pe = out
            vals[:t].copy_(self.fast.attn_core(q_nope[:t], q_pe[:t], latent[:t], k_pe[:t], i, inp, step))

        with torch.inference_mode():
            h, counts = self._run(size, core)
            logits = self.fast._linear(h[st_dev[4, :s]], self.fast.model.lm_head.weight).float()
            scored = None if score_rows is None else self.fast._linear(h[score_rows], self.fast.model.lm_head.weight).float()
        self.runner._sample_slots = st_dev[5, :s]
        self.replays += 1
        return (logits, counts) if score_rows is None else (logits, counts, scored)

    def capture(self, sizes: list[int] | None = None) -> None:
        """Every size's pieces (or ``sizes``'), largest first, in the runner's graph pool: each
        piece warmed up (compiled) on padding, then captured on the outputs of the piece
        captured before."""
        r = self.runner
        for size in sorted(self.sizes if sizes is None else sizes, reverse=True):
            if size in self.graphs or size in self.errors:
                continue
            self._static[:4, :size] = torch.tensor(_PAD[:4], device=r.device)[:, None]
            pieces = self._pieces(size)
            try:
                side = torch.cuda.Stream(r.device)
                side.wait_stream(torch.cuda.current_stream(r.device))
                with torch.cuda.stream(side), torch.inference_mode():
                    for _ in range(2):
                        out = None
                        for piece in pieces:
                            out = piece(out)
                torch.cuda.current_stream(r.device).wait_stream(side)
                if r._pool is None:
                    r._pool = torch.cuda.graph_pool_handle()
                got, out = [], None
                with torch.inference_mode():
                    for piece in pieces:
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=r._pool):
                            out = piece(out)
                        got.append((graph, out))
            except Exception as e:  # noqa: BLE001 - recorded; steps of this size then run eagerly
                self.errors[size] = f"{type(e).__name__}: {e}"
                log.warning("prefill graph capture for %d tokens failed: %s", size, self.errors[size])
                continue
            # The pieces' closures hold what later pieces read (the step's valid, cos and
            # sin, the expert ids): kept, so no later capture in the pool takes their memory.
            self.graphs[size] = got
            self._held[size] = pieces


# A prefill step's plan, as far as its output projections ask (``attn_out``).
_PREFILL = AttnPlan(0, None, 0, 1, None, None, None, 0, [])
