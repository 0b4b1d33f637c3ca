"""The GGUF tokenizer against its oracles.

- SmolLM2's real GGUF (pre `smollm`) and made byte-level BPE vocabularies (`qwen2`, `llama-bpe`,
  `gpt2`): the same ids as transformers' GGUF tokenizer.
- Pre-tokenizers transformers does not know (`deepseek-v3`, `default`, ...): the split equals
  llama.cpp's regexes applied one after another with Python's `regex` module, and the ids are BPE of
  those pieces.
- A SentencePiece vocabulary: the same ids as llama.cpp's algorithm (re-written below), as
  sentencepiece itself, and as transformers where transformers agrees with llama.cpp.
"""

from __future__ import annotations

import heapq
import io

import pytest
import regex
from tokenizer_data import (
    EMOJI_CJK,
    TEXTS,
    made_tokenizer,
    made_transformers,
    made_vocab,
    smollm2_tokenizer,
    smollm2_transformers,
)

from strata_jax.gguf.pretokenizers import PRE_TOKENIZERS
from strata_jax.gguf.tokenizer import load_tokenizer
from strata_jax.gguf.vocab import (
    CONTROL,
    NORMAL,
    TokenizerError,
    UnknownPreTokenizerError,
)

SPECIAL_MARKERS = ("<|", "<think>", "</think>")
PLAIN_TEXTS = [t for t in TEXTS if not any(m in t for m in SPECIAL_MARKERS)]


def _mismatches(tok, hf, texts):
    out = []
    for text in texts:
        ours, theirs = (tok.encode(text, add_special=False),
                        hf.encode(text, add_special_tokens=False))
        if ours != theirs:
            out.append((text, [tok.id_to_token(i) for i in ours], hf.convert_ids_to_tokens(theirs)))
    return out


# ---- SmolLM2 (real GGUF)


def test_smollm2_ids_match_transformers():
    tok, hf = smollm2_tokenizer(), smollm2_transformers()
    assert _mismatches(tok, hf, TEXTS) == []
    # add_bos_token is false in this file: nothing is added
    assert (tok.encode("Hello", add_special=True) == hf.encode("Hello")
            == tok.encode("Hello", add_special=False))


def test_smollm2_metadata():
    tok = smollm2_tokenizer()
    assert (tok.model, tok.pre, tok.vocab_size) == ("gpt2", "smollm", 49152)
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (1, 2, False, False)
    assert tok.token_to_id("<|im_start|>") == 1 and tok.id_to_token(2) == "<|im_end|>"
    assert tok.token_to_id("no such token") is None
    # <|endoftext|> and <|im_end|>, as llama.cpp's end-of-generation set
    assert tok.eos_ids == {0, 2}
    assert tok.is_special(1) and not tok.is_special(tok.encode("Hi")[0])
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([49152])


def test_smollm2_special_tokens_parsed():
    tok = smollm2_tokenizer()
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    as_text = tok.encode("<|im_start|>user", parse_special=False)
    assert 1 not in as_text and tok.decode(as_text) == "<|im_start|>user"
    assert tok.decode(ids, skip_special=True) == "user\nHi"


# ---- made byte-level BPE vocabularies


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt2"])
def test_made_bpe_ids_match_transformers(pre):
    assert _mismatches(made_tokenizer(pre), made_transformers(pre), TEXTS) == []


def _regex_split(text, regexes):
    # llama.cpp's unicode_regex_split: each regex cuts every piece into its matches and the text
    # between.
    pieces = [text]
    for pattern in regexes:
        rx = regex.compile(pattern)
        cut = []
        for piece in pieces:
            pos = 0
            for m in rx.finditer(piece):
                if m.start() > pos:
                    cut.append(piece[pos : m.start()])
                if m.end() > m.start():
                    cut.append(m.group())
                pos = m.end()
            if pos < len(piece):
                cut.append(piece[pos:])
        pieces = cut
    return pieces


# one name for each distinct pre-tokenizer
DISTINCT_PRES = sorted({next(n for n, s in PRE_TOKENIZERS.items() if s is spec)
                        for spec in PRE_TOKENIZERS.values()})


@pytest.mark.parametrize("pre", DISTINCT_PRES)
def test_pre_tokenizer_regexes_split_like_reference(pre):
    from tokenizers import Regex, pre_tokenizers

    regexes = PRE_TOKENIZERS[pre].regexes
    splitter = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated")
                                        for r in regexes])
    for text in TEXTS:
        assert [p for p, _ in splitter.pre_tokenize_str(text)] == _regex_split(text, regexes), text


@pytest.mark.parametrize("pre", ["deepseek-v3", "default", "qwen2"])
def test_bpe_ids_are_merges_of_llama_cpp_split(pre):
    # transformers does not know deepseek-v3's or default's split; the reference is llama.cpp's
    # regexes.
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    tok = made_tokenizer(pre)
    _, md = made_vocab(pre)
    vocab = {t: i for i, t in enumerate(md["tokenizer.ggml.tokens"])}
    bpe = HFTokenizer(models.BPE(vocab=vocab,
                                 merges=[tuple(m.split(" ")) for m in md["tokenizer.ggml.merges"]]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for text in PLAIN_TEXTS:
        expected = [i for piece in _regex_split(text, PRE_TOKENIZERS[pre].regexes)
                    for i in bpe.encode(piece).ids]
        assert tok.encode(text, add_special=False) == expected, text


def test_deepseek_v3_split_examples():
    tok = made_tokenizer("deepseek-v3")
    pieces = lambda text: [tok.decode([i]) for i in tok.encode(text, add_special=False)]
    assert "".join(pieces("1234567")) == "1234567" and all(len(p) <= 3 for p in pieces("1234567"))
    # A run of CJK is cut away from neighbouring latin text, never merged with it.
    assert not any("日" in p and "a" in p for p in pieces("a日本語a"))


def test_qwen2_style_vocab():
    tok = made_tokenizer("qwen2")
    _, md = made_vocab("qwen2")
    ids = {t: i for i, t in enumerate(md["tokenizer.ggml.tokens"])}
    assert tok.eos_ids == {ids["<|endoftext|>"], ids["<|im_end|>"]}
    assert tok.eos_id == ids["<|im_end|>"] and tok.eot_id == ids["<|im_end|>"]
    # user-defined tokens are matched whole, also when control-token text is left as text
    assert tok.encode("<think>", parse_special=False) == [ids["<think>"]]
    assert ids["<|im_start|>"] not in tok.encode("<|im_start|>", parse_special=False)
    assert tok.decode([ids["<think>"]], skip_special=True) == "<think>"  # user-defined: kept
    assert tok.decode([ids["<|im_end|>"]], skip_special=True) == ""
    assert tok.decode([ids["[PAD0]"]]) == ""  # unused: renders nothing, as in llama.cpp


# ---- SentencePiece (tokenizer.ggml.model = llama)


def _llama_cpp_spm(md, text, add_special=True):
    """llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm + tokenizer_st_partition), re-written
    plainly."""
    tokens, scores, types = (md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"],
                             md["tokenizer.ggml.token_type"])
    ids = {t: i for i, t in enumerate(tokens)}
    specials = sorted((i for i, k in enumerate(types) if k in (2, 3, 4)),
                      key=lambda i: -len(tokens[i]))
    fragments = [text] if text else []
    for sid in specials:
        cut = []
        for frag in fragments:
            if isinstance(frag, int):
                cut.append(frag)
                continue
            parts = frag.split(tokens[sid])
            for j, part in enumerate(parts):
                if j:
                    cut.append(sid)
                if part:
                    cut.append(part)
        fragments = cut

    def spm(s):
        syms = list(s)  # characters; merged symbols hold their text, merged-away ones hold ""
        prev, nxt = list(range(-1, len(syms) - 1)), [*range(1, len(syms)), -1]
        heap = []

        def push(left, right):
            if left != -1 and right != -1 and syms[left] + syms[right] in ids:
                merged = syms[left] + syms[right]
                heapq.heappush(heap, (-scores[ids[merged]], left, right, merged))

        for i in range(1, len(syms)):
            push(i - 1, i)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not syms[left] or not syms[right] or syms[left] + syms[right] != merged:
                continue
            syms[left], syms[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[right] != -1:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])
        out, i = [], 0
        while i != -1:
            sym = syms[i]
            if sym in ids:
                out.append(ids[sym])
            else:
                out.extend(ids[f"<0x{b:02X}>"] for b in sym.encode())
            i = nxt[i]
        return out

    out = ([md["tokenizer.ggml.bos_token_id"]] if add_special and md["tokenizer.ggml.add_bos_token"]
           else [])
    prev_special = True
    for frag in fragments:
        if isinstance(frag, int):
            out.append(frag)
            prev_special = True
        else:
            prefix = " " if md["tokenizer.ggml.add_space_prefix"] and prev_special else ""
            out.extend(spm((prefix + frag).replace(" ", "\u2581")))
            prev_special = False
    return out


def test_sentencepiece_ids_match_llama_cpp_algorithm():
    tok = made_tokenizer("spm")
    _, md = made_vocab("spm")
    for text in TEXTS:
        for add_special in (True, False):
            assert tok.encode(text, add_special) == _llama_cpp_spm(md, text, add_special), text


def test_sentencepiece_ids_match_sentencepiece():
    import sentencepiece as spm

    tok = made_tokenizer("spm")
    _, md = made_vocab("spm")
    sp = spm.SentencePieceProcessor(model_proto=md["_sentencepiece_model"])
    for text in PLAIN_TEXTS:
        assert tok.encode(text, add_special=False) == sp.encode(text), text


def test_sentencepiece_ids_match_transformers_where_it_agrees_with_llama_cpp():
    # transformers' Metaspace puts no space before text that starts with one, nor after a special
    # token; llama.cpp (and sentencepiece) do. On other text the two agree.
    texts = [t for t in PLAIN_TEXTS if not t.startswith(" ")]
    assert len(texts) > 20
    assert _mismatches(made_tokenizer("spm"), made_transformers("spm"), texts) == []
    hf = made_transformers("spm")
    assert made_tokenizer("spm").encode("Hello") == hf.encode("Hello")  # BOS added by both


def test_sentencepiece_vocab_details():
    tok = made_tokenizer("spm")
    assert (tok.model, tok.bos_id, tok.eos_id, tok.unk_id) == ("llama", 1, 2, 0)
    assert tok.add_bos and tok.add_space_prefix and not tok.add_eos
    ids = tok.encode("x🫠", add_special=False)
    # byte fallback
    assert [tok.id_to_token(i) for i in ids][-4:] == ["<0xF0>", "<0x9F>", "<0xAB>", "<0xA0>"]
    assert tok.decode(tok.encode("  two spaces")) == "<s>  two spaces"
    assert tok.decode(tok.encode("  two spaces"), skip_special=True) == "  two spaces"
    # llama.cpp puts a space before the text after every special token; decoding takes off only the
    # first
    assert tok.decode(tok.encode("<|im_start|>user", add_special=False)) == "<|im_start|>user"
    assert tok.decode(tok.encode("a<|im_end|>b", add_special=False)) == "a<|im_end|> b"


# ---- all vocabularies


ALL = ["smollm2", "qwen2", "llama-bpe", "deepseek-v3", "default", "spm"]


def _tok(name):
    return smollm2_tokenizer() if name == "smollm2" else made_tokenizer(name)


@pytest.mark.parametrize("name", ALL)
def test_decode_inverts_encode(name):
    tok = _tok(name)
    # (see test_sentencepiece_vocab_details for specials)
    texts = PLAIN_TEXTS if name == "spm" else TEXTS
    for text in texts:
        assert tok.decode(tok.encode(text, add_special=False)) == text
    for text in PLAIN_TEXTS:
        assert tok.decode(tok.encode(text, add_special=True), skip_special=True) == text


@pytest.mark.parametrize("name", ALL)
def test_stream_decoder_yields_whole_characters(name):
    tok = _tok(name)
    for text in (EMOJI_CJK, *PLAIN_TEXTS[:8]):
        ids = tok.encode(text, add_special=False)
        stream = tok.stream_decoder(start_of_text=True)
        outputs = [stream.add(i) for i in ids]
        outputs.append(stream.flush())
        assert "".join(outputs) == tok.decode(ids) == text
        assert not any("\ufffd" in o for o in outputs)
    # the emoji and CJK text really has characters that span tokens
    ids = tok.encode(EMOJI_CJK, add_special=False)
    assert any(len(tok.token_bytes(i).decode("utf-8", errors="ignore")) == 0 and tok.token_bytes(i)
               for i in ids)
    stream = tok.stream_decoder()
    assert "" in [stream.add(i) for i in ids]


def test_stream_decoder_broken_bytes_and_flush():
    tok = smollm2_tokenizer()
    first_byte_of_emoji = next(i for i in tok.encode("🫠", add_special=False))
    stream = tok.stream_decoder()
    assert stream.add(first_byte_of_emoji) == "" and stream.pending
    assert stream.flush() == "\ufffd" and not stream.pending
    assert tok.decode([first_byte_of_emoji]) == "\ufffd"


# ---- metadata handling and errors


def _smollm2_like_metadata(**changes):
    _, md = made_vocab("qwen2")
    md = {k: v for k, v in md.items() if not k.startswith("_")}
    md.update(changes)
    return {k: v for k, v in md.items() if v is not None}


def test_add_bos_and_eos_follow_metadata():
    md = _smollm2_like_metadata(**{"tokenizer.ggml.add_bos_token": True,
                                   "tokenizer.ggml.add_eos_token": True})
    tok = load_tokenizer(md)
    ids = tok.encode("hi")
    assert (ids[0] == tok.bos_id and ids[-1] == tok.eos_id
            and tok.encode("hi", add_special=False) == ids[1:-1])
    assert tok.encode("", add_special=True) == [tok.bos_id, tok.eos_id]
    # llama-bpe (Llama 3) adds BOS when the file does not say
    llama3 = _smollm2_like_metadata(**{"tokenizer.ggml.pre": "llama-bpe",
                                       "tokenizer.ggml.add_bos_token": None})
    assert load_tokenizer(llama3).add_bos
    no_bos = _smollm2_like_metadata(**{"tokenizer.ggml.add_bos_token": True,
                                       "tokenizer.ggml.bos_token_id": None})
    with pytest.raises(TokenizerError, match="add_bos_token is true"):
        load_tokenizer(no_bos)


def test_unknown_pre_tokenizer_is_named(tmp_path):
    from strata_jax.testing.vocab_files import write_vocab_gguf

    with pytest.raises(UnknownPreTokenizerError) as err:
        load_tokenizer(_smollm2_like_metadata(**{"tokenizer.ggml.pre": "mystery-bpe-9"}))
    message = str(err.value)
    assert "'mystery-bpe-9'" in message and "tokenizer.ggml.pre" in message
    assert all(name in message
               for name in ("default", "gpt2", "llama-bpe", "qwen2", "smollm", "deepseek-v3"))
    # from a file, the error also names the file
    path = write_vocab_gguf(tmp_path / "odd.gguf",
                            _smollm2_like_metadata(**{"tokenizer.ggml.pre": "mystery-bpe-9"}))
    with pytest.raises(UnknownPreTokenizerError,
                       match=f"^{path}: unknown pre-tokenizer 'mystery-bpe-9'"):
        load_tokenizer(path)


def test_bad_vocabularies_say_what_is_wrong():
    with pytest.raises(TokenizerError, match="'bert' is not supported"):
        load_tokenizer(_smollm2_like_metadata(**{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(TokenizerError, match="no vocabulary"):
        load_tokenizer({"general.architecture": "llama"})
    with pytest.raises(TokenizerError, match="merges is missing"):
        load_tokenizer(_smollm2_like_metadata(**{"tokenizer.ggml.merges": None}))
    tokens = _smollm2_like_metadata()["tokenizer.ggml.tokens"]
    with pytest.raises(TokenizerError, match="duplicate token"):
        load_tokenizer(_smollm2_like_metadata(**{"tokenizer.ggml.tokens": tokens[:-1]
                                                                          + [tokens[0]]}))
    with pytest.raises(ValueError, match="no such file"):
        load_tokenizer("/nonexistent/model.gguf")


def test_metadata_from_numpy_and_types_default_to_normal():
    import numpy as np

    md = _smollm2_like_metadata(**{"tokenizer.ggml.token_type": None,
                                   "tokenizer.ggml.eos_token_id": np.uint32(5)})
    tok = load_tokenizer(md)
    assert tok.eos_id == 5 and tok.token_types[0] == NORMAL
    # <|im_end|> ends generation by its text, and becomes a control token, as in llama.cpp
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end in tok.eos_ids and tok.token_types[im_end] == CONTROL


def test_vocab_only_gguf_roundtrip_through_file():
    # the made files have no tensors at all, like llama.cpp's ggml-vocab-*.gguf
    import gguf

    path, md = made_vocab("llama-bpe")
    assert len(gguf.GGUFReader(path).tensors) == 0
    tok = load_tokenizer(path)
    assert tok.tokens == md["tokenizer.ggml.tokens"] and tok.pre == "llama-bpe"
    assert io.StringIO(repr(tok)).getvalue().startswith("Tokenizer(model='gpt2', pre='llama-bpe'")


def test_malformed_vocabulary_degrades_with_warnings(caplog):
    # merges whose parts or result are not tokens make the `tokenizers` library panic: they are left
    # out
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab", ""],
        "tokenizer.ggml.merges": ["a b", "b a", "a c"],
    }
    with caplog.at_level("WARNING", logger="strata_jax.gguf.tokenizer"):
        tok = load_tokenizer(md)
    assert tok.pre == "default" and tok.tokens[3] == "[EMPTY_3]"
    assert tok.encode("abba") == [2, 1, 0]
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert ("tokenizer.ggml.pre is missing" in messages and "2 merges" in messages
            and "256 bytes" in messages)
