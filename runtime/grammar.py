"""Structured outputs (vLLM's): a request's JSON schema, regex, choice or grammar masks its
logits each step, through xgrammar.

The engine checks a request's grammar when the request is made (``grammar_check.check``), so
a bad schema is a RequestError naming the field, not a runtime's failure. The runtime compiles
it against the model's vocabulary (``Grammars``; the compiler caches equal grammars) and keeps
one matcher per request. Each step a guided row's matcher takes the request's outputs it has
not yet seen, then fills the row's bitmask of the tokens that keep the output inside the grammar; once the output is complete only the end of
sequence is allowed. With ``after`` (a reasoning model's end of thinking) the grammar applies
from the output after those ids; the thinking is not constrained. The matcher follows the
outputs by index: a step the scheduler dropped (its request preempted while it ran) or
outputs recomputed differently restart it from the outputs that stand.

A step with a guided request is launched ahead like any other: its forward pass goes to the
device first, then the runtime waits for the last step's tokens, and fills the masks while
the forward runs (as vLLM overlaps its bitmasks with the forward).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import json
import logging
import os
import threading

import numpy as np
import torch

from .grammar_check import xgrammar_message, load_xgrammar, choice_ebnf, prepare_schema
from .models.batch import to_device

log = logging.getLogger("lockstep.runtime")
FILL_THREADS = min(4, os.cpu_count() or 1)  # xgrammar's threads filling a step's masks
CACHE_BYTES = 512 * 2**20  # xgrammar's compiled grammars (as vLLM caps them)
RECENT_KEPT = 16  # compiled grammars kept at hand, by spec (Grammars._recent; past xgrammar's cache cap too)


def tokenizer_info(tokenizer, vocab_size: int, stop_ids: list[int]):
    """xgrammar's view of the tokenizer's vocabulary: ``tokenizer`` is lockstep's (a
    ByteTokenizer or an HFTokenizer); ``stop_ids`` end a complete output. It covers the
    tokenizer's ids only, at most the model's ``vocab_size``: the model's ids past them (a
    preset's 102,400 against the byte tokenizer's 259) are masked apart (``Grammars.mask``),
    since xgrammar counts ids that decode to nothing as special and checks each accepted
    token against them one by one (20 µs a token with 100K of them)."""
    xgr = load_xgrammar()
    from lockstep.runtime.tokenizer import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        # ids 3..258 are the bytes: byte-fallback tokens; the specials decode to nothing, which
        # xgrammar never allows (but for the stop ids)
        vocab = ["", "", ""] + [f"<0x{b:02X}>" for b in range(256)]
        return xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_FALLBACK, vocab_size=min(len(vocab), vocab_size),
                                 stop_token_ids=stop_ids)
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=min(len(hf), vocab_size), stop_token_ids=stop_ids)


class _Guide:
    __slots__ = ("future", "early", "_matcher", "tokens", "after", "start", "scanned", "matched", "broken")

    def __init__(self, future, after: list[int], early=None):
        self.future = future  # the matcher, once its grammar is compiled
        self.early = early  # () -> a matcher, or None: its grammar compiled for another request meanwhile
        self._matcher = None
        self.tokens: list[int] = []  # the request's outputs by index, as far as known
        self.after = after  # the grammar applies after these ids (a reasoning model's end of thinking)
        self.start = None if after else 0  # the output where the grammar starts, once known
        self.scanned = 0  # outputs searched for the marker so far (a long thinking is searched once)
        self.matched = 0  # how many outputs from there the matcher has taken
        self.broken = False  # no grammar to follow (it did not compile, or refused an output): the output ends

    @property
    def matcher(self):
        if self._matcher is None:
            # Equal grammars compile once: a request queued behind another's compile on the
            # pool takes the one already made rather than waiting its turn.
            made = None if self.future.done() or self.early is None else self.early()
            if made is not None:
                self.future.cancel()
            self._matcher = made if made is not None else self.future.result()  # (waits for a compile still running)
        return self._matcher

    def keep(self, k: int) -> None:
        """Outputs from ``k`` on are gone (or differ): the matcher rolls back to the outputs
        before ``k`` (restarts, where its grammar's start moved)."""
        del self.tokens[k:]
        start = self.start
        if self.after and self.start is not None and self.start > k:  # (the marker may end elsewhere)
            self.start = None
        self.scanned = min(self.scanned, k)
        if self._matcher is None or start is None:  # (nothing taken yet; or it never compiled: broken stays)
            return
        if self.start is None:  # (the grammar started inside what is gone)
            if self.matched:
                self._matcher.reset()
            self.matched, self.broken = 0, False
        elif start + self.matched > k:
            self._matcher.rollback(start + self.matched - k)
            self.matched, self.broken = k - start, False
        elif self.broken and k <= start + self.matched:  # the output it refused is gone
            self.broken = False

    def find_start(self, k: int) -> bool:
        """Whether the grammar applies to output ``k`` (its marker is among the outputs before)."""
        if self.start is None:
            n, first = len(self.after), self.after[0]
            lo = max(0, self.scanned - n + 1)
            at = next((i for i in range(lo, k - n + 1)
                       if self.tokens[i] == first and self.tokens[i:i + n] == self.after), None)
            self.scanned = max(self.scanned, k)
            if at is None:
                return False
            self.start = at + n
        return self.start <= k


class Grammars:
    """One matcher per guided request, and the masks of a step's guided rows.

    Grammars compile on a thread of their own as requests arrive (the vocabulary is read
    there too, for the first one): a new JSON schema over a 100K-token vocabulary takes tens
    to hundreds of milliseconds, which then overlaps the request's prefill and other
    requests' steps instead of stopping them; the first step that samples for the request
    waits for what is left. Each result tells the engine whose grammars are done
    (``take_ready``): while others run, the engine holds a guided request back until then,
    so that this wait never holds up their steps."""

    def __init__(self, make_info, vocab_size: int, max_rows: int):
        self._make_info, self.vocab = make_info, vocab_size
        self._compiler = None
        self._pool = None
        self.guides: dict[int, _Guide] = {}
        self._ready: collections.deque[int] = collections.deque()  # compiled, not yet reported
        # The grammars compiled last, by spec: a request with one of them gets its matcher at
        # once, not through the pool, where it could wait behind another grammar's compile.
        self._recent: collections.OrderedDict[tuple, object] = collections.OrderedDict()
        self._recent_lock = threading.Lock()
        self._bitmask = None  # made with the vocabulary (its width: the tokenizer's ids)
        self.tok_vocab = vocab_size
        self.max_rows = max_rows

    def __bool__(self) -> bool:
        return bool(self.guides)

    def __contains__(self, rid: int) -> bool:
        return rid in self.guides

    def add(self, rid: int, spec: list[str], after: list[int] = ()) -> None:
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lockstep-grammar")
            self._batch = load_xgrammar().BatchGrammarMatcher(max_threads=FILL_THREADS)
        key = tuple(spec)
        compiled = self._compiled(key)
        if compiled is not None:
            future = concurrent.futures.Future()
            future.set_result(load_xgrammar().GrammarMatcher(compiled))
            self._ready.append(rid)
        else:
            future = self._pool.submit(self._compile, key)
            # (on the compile's thread; a compile cancelled by ``forget`` is not reported: it
            # did not happen, and the engine must not take its grammar for compiled)
            future.add_done_callback(lambda f, rid=rid: None if f.cancelled() else self._ready.append(rid))
        self.guides[rid] = _Guide(future, list(after), functools.partial(self._matcher_now, key, rid))

    def take_ready(self) -> list[int]:
        """The requests whose grammar finished compiling (or failing to) since the last call."""
        out = []
        while self._ready:
            out.append(self._ready.popleft())
        return out

    def _compiled(self, key: tuple):
        """The grammar compiled for ``key`` lately, or None."""
        with self._recent_lock:
            compiled = self._recent.get(key)
            if compiled is not None:
                self._recent.move_to_end(key)
            return compiled

    def _matcher_now(self, key: tuple, rid: int):
        """A matcher for ``rid`` from a grammar compiled for another request, or None; its
        compile still queued is then cancelled, so ``rid`` is reported here."""
        compiled = self._compiled(key)
        if compiled is None:
            return None
        self._ready.append(rid)
        return load_xgrammar().GrammarMatcher(compiled)

    def _compile(self, spec: tuple):
        xgr = load_xgrammar()
        if self._compiler is None:  # (the vocabulary is read once, for the first guided request)
            info = self._make_info()
            self._bitmask = xgr.allocate_token_bitmask(self.max_rows, info.vocab_size)
            stop = np.zeros(self._bitmask.shape[1], np.uint32)  # the bitmask row of the stop ids alone
            for t in info.stop_token_ids:
                if t < info.vocab_size:
                    stop[t // 32] |= np.uint32(1 << (t % 32))
            self._stop_row = torch.from_numpy(stop.view(np.int32))
            self.tok_vocab = info.vocab_size  # (the model's ids past it: masked apart)
            # (compiled grammars cached up to 512 MB, as vLLM caps them: clients that vary their
            # schemas per request would grow the cache for good)
            self._compiler = xgr.GrammarCompiler(info, max_threads=FILL_THREADS, cache_enabled=True,
                                                 cache_limit_bytes=CACHE_BYTES)
        kind, text, whitespace = spec
        c = self._compiler
        compiled = (c.compile_json_schema(prepare_schema(text), any_whitespace=whitespace == "any") if kind == "json"
                    else c.compile_regex(text) if kind == "regex"
                    else c.compile_grammar(text) if kind == "grammar"
                    else c.compile_grammar(choice_ebnf(json.loads(text))) if kind == "choice"
                    # any JSON object (OpenAI's json_object mode asks for an object; vLLM compiles this too)
                    else c.compile_json_schema('{"type": "object"}', any_whitespace=whitespace == "any"))
        with self._recent_lock:
            self._recent[spec] = compiled
            if len(self._recent) > RECENT_KEPT:
                self._recent.popitem(last=False)
        return xgr.GrammarMatcher(compiled)

    def forget(self, rid: int) -> None:
        g = self.guides.pop(rid, None)
        if g is not None:
            g.future.cancel()

    def output(self, rid: int, k: int, token: int) -> None:
        """Output ``k`` of ``rid`` is ``token`` (drawn, or fed by a plan that recomputes it)."""
        g = self.guides[rid]
        if k < len(g.tokens):
            if g.tokens[k] == token:
                return
            g.keep(k)  # a different output there: what followed it is not the request's
        if k == len(g.tokens):
            g.tokens.append(token)
        # (k past the known outputs: a step whose earlier outputs this runtime never saw; the
        # mask asks for them and fails loudly)

    def mask(self, x: torch.Tensor, rows: list[tuple[int, int, int]]) -> None:
        """Mask rows of ``x``: (row, request, index of the output drawn there)."""
        masked, todo, ending = [], [], []
        rid_of = {j: rid for j, rid, _ in rows}
        for j, rid, k in rows:
            g = self._at(rid, k)
            state = self._catch_up(rid, g, k)
            if state == "end":  # (no grammar to follow: the end of sequence, not tokens outside it)
                ending.append(j)
            elif state == "fill":
                todo.append(g.matcher)
                masked.append(j)
        bm = self._bitmask
        if masked:  # (bitmask row j is x's row j; rows not listed are left as they are)
            self._batch.batch_fill_next_token_bitmask(todo, bm, indices=masked)  # (on xgrammar's threads)
            ending += self._dead(bm, masked, rid_of)
        self._apply(x, bm, masked, ending)

    def mask_drafts(self, x: torch.Tensor, rows: list[tuple[int, int, int, list[int]]]) -> None:
        """Mask a speculative step's rows of ``x``: (first row, request, index of the output
        drawn there, drafts): row first + j draws output index + j as if drafts[:j] were
        accepted. The matcher takes the drafts for this and gives them back after (a draft
        the grammar refuses cannot be accepted: its row's mask leaves it out)."""
        masked, ending, rid_of = [], [], {}
        bm = None
        for r0, rid, k0, drafts in rows:
            g = self._at(rid, k0)
            g.tokens += drafts  # (for now)
            try:
                for j in range(len(drafts) + 1):
                    state = self._catch_up(rid, g, k0 + j, drafts_from=k0)
                    if state == "end":
                        ending.append(r0 + j)
                    if state in ("end", "refused"):  # (the rows after it are never reached)
                        break
                    if state == "fill":
                        if bm is None:  # (made once the first compile read the vocabulary)
                            bm = load_xgrammar().allocate_token_bitmask(len(x), self.tok_vocab)
                        g.matcher.fill_next_token_bitmask(bm, r0 + j)
                        masked.append(r0 + j)
                        rid_of[r0 + j] = rid
            finally:
                g.keep(k0)
        if masked:
            ending += self._dead(bm, masked, rid_of)
        if ending and bm is None and self._bitmask is not None:
            bm = load_xgrammar().allocate_token_bitmask(len(x), self.tok_vocab)
        self._apply(x, bm, masked, ending)

    def mask_next_draft(self, x: torch.Tensor, rows: list[tuple[int, int, int, list[int]]]) -> None:
        """Mask a draft model's rows of ``x``: (row, request, index of the output of its first
        draft, drafts so far): the row draws the next draft, after those."""
        masked, ending, rid_of = [], [], {}
        bm = None
        for row, rid, k0, drafts in rows:
            g = self._at(rid, k0)
            g.tokens += drafts  # (for now)
            try:
                state = self._catch_up(rid, g, k0 + len(drafts), drafts_from=k0)
                if state == "end":
                    ending.append(row)
                elif state == "fill":
                    if bm is None:
                        bm = load_xgrammar().allocate_token_bitmask(len(x), self.tok_vocab)
                    g.matcher.fill_next_token_bitmask(bm, row)
                    masked.append(row)
                    rid_of[row] = rid
            finally:
                g.keep(k0)
        if masked:
            ending += self._dead(bm, masked, rid_of)
        if ending and bm is None and self._bitmask is not None:
            bm = load_xgrammar().allocate_token_bitmask(len(x), self.tok_vocab)
        self._apply(x, bm, masked, ending)

    # -- the pieces of a mask ------------------------------------------------------------------
    def _at(self, rid: int, k: int) -> _Guide:
        """``rid``'s guide, its outputs known up to ``k`` (later ones: a step the scheduler dropped)."""
        g = self.guides[rid]
        if len(g.tokens) < k:
            raise RuntimeError(f"request {rid}: its grammar needs outputs 0..{k - 1} before output {k}, and "
                               f"this runtime knows {len(g.tokens)}")
        if len(g.tokens) > k:
            g.keep(k)
        return g

    def _catch_up(self, rid: int, g: _Guide, k: int, drafts_from: int | None = None) -> str:
        """Bring the matcher to output ``k``: "free" (not constrained yet: still thinking),
        "end" (no grammar to follow), "done" (complete and ended: the row's token is not
        kept), "refused" (a draft, from ``drafts_from`` on, is not in the grammar) or "fill"."""
        if not g.find_start(k):
            return "free"
        if g._matcher is None and not g.broken:
            try:
                g.matcher
            except Exception as e:  # noqa: BLE001 - the engine compiled it once (check): not expected
                g.broken = True
                log.error("request %d: its grammar did not compile here (%s); its output ends here", rid, xgrammar_message(e))
        if g.broken:
            return "end"
        m = g.matcher
        while g.start + g.matched < k and not m.is_terminated():  # (outputs after the end: planned ahead)
            t = g.tokens[g.start + g.matched]
            if t >= self.tok_vocab or not m.accept_token(t):  # (xgrammar would log each id past its vocabulary)
                if drafts_from is not None and g.start + g.matched >= drafts_from:
                    return "refused"
                g.broken = True
                log.warning("request %d: its grammar refused output %d (token %d); its output ends there",
                            rid, g.start + g.matched, t)
                return "end"
            g.matched += 1
        return "done" if m.is_terminated() else "fill"

    @staticmethod
    def _dead(bm, masked: list[int], rid_of: dict[int, int]) -> list[int]:
        """The rows whose grammar allows no token (a regex like [^\\s\\S]): their output ends."""
        dead = [j for j, alive in zip(masked, (bm[masked] != 0).any(1).tolist()) if not alive]
        for j in dead:
            log.warning("request %d: its grammar allows no token here; its output ends there", rid_of[j])
        return dead

    def _apply(self, x: torch.Tensor, bm, masked: list[int], ending: list[int]) -> None:
        """Apply bitmask rows ``masked`` to the same rows of ``x``; rows ``ending`` may draw
        only the stop ids."""
        n = self.tok_vocab
        if ending and bm is None:  # (the vocabulary itself could not be read: logged with the compile)
            ending = []
        if ending:
            for j in ending:
                bm[j] = self._stop_row
            masked = sorted(set(masked) | set(ending))
        if masked:
            # (through pinned memory: a copy from pageable memory would make the host wait for the
            # device, and a step launched ahead would gain nothing)
            rows = to_device(np.array(masked, np.int32), x.device)
            load_xgrammar().apply_token_bitmask_inplace(x, to_device(bm[:masked[-1] + 1].numpy(), x.device),
                                               vocab_size=n, indices=rows)
            if n < x.shape[1]:  # the model's ids past the tokenizer's: never drawn
                x[:, n:].index_fill_(0, rows.long(), float("-inf"))
