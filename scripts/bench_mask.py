"""Mask time a token of a constrained-decoding library on a GGUF's vocabulary: a JSON schema's
document is fed token by token, and each allowed-token bitmask is timed (docs/BENCHMARKS.md,
"Constrained decoding").

    python scripts/bench_mask.py VOCAB.gguf llguidance|xgrammar

Any GGUF with a vocabulary works (llama.cpp's models/ggml-vocab-qwen2.gguf: 151,936 tokens; SmolLM2:
49,152). xgrammar is not a dependency (it needs torch at run time): install it beside to compare.
"""
import json
import statistics
import sys
import time

from strata_jax.gguf import load_tokenizer

path, lib = sys.argv[1], sys.argv[2]
tk = load_tokenizer(path)
V = tk.vocab_size
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}},
          "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
DOC = json.dumps({"name": "Ada Lovelace, the first programmer", "age": 36,
                  "tags": ["math", "engines", "poetry", "notes"], "ok": True})
ids = tk.encode(DOC, add_special=False, parse_special=False)
times = []
REPEAT = 20     # the document fed again with a fresh matcher, for steadier figures
if lib == "llguidance":
    import llguidance as llg
    import llguidance.numpy as llnp

    from strata_jax.engine.grammar.constrain import Grammars
    g = Grammars(tk, V)
    t = time.perf_counter(); llt = g.ll_tokenizer; t_tok = time.perf_counter() - t
    grammar = llg.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={
        "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    t = time.perf_counter(); m = llg.LLMatcher(llt, grammar); t_comp = time.perf_counter() - t
    for _ in range(REPEAT):
        m = llg.LLMatcher(llt, grammar)
        assert not m.is_error(), m.get_error()
        mask = llnp.allocate_token_bitmask(1, V)
        for tok in ids:
            t = time.perf_counter(); llnp.fill_next_token_bitmask(m, mask); times.append(
                time.perf_counter() - t)
            assert (mask[0, tok // 32] >> (tok % 32)) & 1, tok
            assert m.consume_token(tok), m.get_error()
else:
    import xgrammar as xgr
    enc = [tk.token_bytes(i) for i in range(V)]
    t = time.perf_counter()
    info = xgr.TokenizerInfo(enc, vocab_type=xgr.VocabType.RAW, vocab_size=V,
                             stop_token_ids=sorted(tk.eos_ids))
    comp = xgr.GrammarCompiler(info, max_threads=1); t_tok = time.perf_counter() - t
    t = time.perf_counter()
    cg = comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    t_comp = time.perf_counter() - t
    for _ in range(REPEAT):
        m = xgr.GrammarMatcher(cg)
        mask = xgr.allocate_token_bitmask(1, V)
        for tok in ids:
            t = time.perf_counter(); m.fill_next_token_bitmask(mask); times.append(
                time.perf_counter() - t)
            assert (int(mask[0, tok // 32]) >> (tok % 32)) & 1, tok
            assert m.accept_token(tok)
times.sort()
print(f"{lib}: vocab {V}, {len(ids)} tokens x {REPEAT}; tokenizer {t_tok*1000:.0f} ms, schema "
      f"compile {t_comp*1000:.1f} ms; mask a token mean {statistics.mean(times)*1e6:.0f} us, p50 "
      f"{times[len(times)//2]*1e6:.0f} us, max {times[-1]*1e6:.0f} us")
