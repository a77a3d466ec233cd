"""How xgrammar costs scale with a 100K-token BPE vocabulary (synthetic: random byte-level
strings, since no real tokenizer can be downloaded here; its tokens hold quotes and braces
more often than a real one, so its mask fills are a pessimistic bound): TokenizerInfo, a
schema compile at 1 and 2 threads, the mask fill and accept per row inside a JSON string.
Run: .venv/bin/python benchmarks/experiments/grammar_big_vocab.py (writes /tmp/bigtok)."""
import json, os, random, time
os.makedirs("/tmp/bigtok", exist_ok=True)
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
random.seed(0)
alphabet = pre_tokenizers.ByteLevel.alphabet()
vocab = {c: i for i, c in enumerate(sorted(alphabet))}
letters = "abcdefghijklmnopqrstuvwxyzĠ{}\":,0123456789 "
while len(vocab) < 100000:
    w = "".join(random.choice(letters) for _ in range(random.randint(2, 8)))
    vocab.setdefault(w, len(vocab))
tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.add_special_tokens(["<s>", "</s>"])
tok.save("/tmp/bigtok/tokenizer.json")
json.dump({"bos_token": "<s>", "eos_token": "</s>"}, open("/tmp/bigtok/tokenizer_config.json", "w"))
from lockstep.runtime.tokenizer import HFTokenizer
from lockstep.runtime.grammar import tokenizer_info
from lockstep.runtime.grammar_check import prepare_schema
import xgrammar as xgr
t = HFTokenizer("/tmp/bigtok")
t0 = time.perf_counter(); info = tokenizer_info(t, 100002, [t.eos_token_id]); print("info", round(time.perf_counter() - t0, 2), "s", info.vocab_size)
for threads in (1, 2):
    comp = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
    for name, sch in [("small", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}),
                      ("20 fields", {"type": "object", "properties": {f"f{i}": {"type": ["string", "integer", "boolean"][i % 3]} for i in range(20)}, "required": [f"f{i}" for i in range(20)]})]:
        t0 = time.perf_counter(); comp.compile_json_schema(prepare_schema(json.dumps(sch))); print(threads, name, round((time.perf_counter() - t0) * 1e3), "ms")
comp = xgr.GrammarCompiler(info, max_threads=2)
cg = comp.compile_json_schema(json.dumps({"type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"}}, "required": ["text", "n"]}), any_whitespace=False)
ms = [xgr.GrammarMatcher(cg) for _ in range(64)]
bm = xgr.allocate_token_bitmask(64, info.vocab_size)
for m in ms:
    for ch in ['{"', 'text', '":', ' "']:
        ids = t.encode(ch).tolist()
        for i in ids: assert m.accept_token(i), ch
for state in ("in a string", ):
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i, m in enumerate(ms): m.fill_next_token_bitmask(bm, i)
        ts.append((time.perf_counter() - t0) / 64 * 1e6)
    print(state, "fill us/row", [round(x) for x in ts])
t0 = time.perf_counter()
for m in ms: m.accept_token(t.encode("ab").tolist()[0])
print("accept us/row", round((time.perf_counter() - t0) / 64 * 1e6, 1))
