"""Small vocabulary-only GGUF files for tokenizer tests, made on the spot (no model hub needed).

- `bpe_vocab_metadata(pre)`: a byte-level BPE trained with the `tokenizers` library on `CORPUS`,
  splitting text the way `tokenizer.ggml.pre = pre` says, with Qwen-style special tokens added at
  the end of the vocabulary (control tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`;
  user-defined `<think>` ...).
- `sentencepiece_vocab_metadata()`: a SentencePiece BPE model (byte fallback, like Llama's) trained
  with the `sentencepiece` library, described the way llama.cpp's convert_hf_to_gguf.py describes
  one.
- `write_vocab_gguf(path, metadata)`: those keys written to a GGUF with no tensors, like llama.cpp's
  models/ggml-vocab-*.gguf files.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

# Types of tokenizer.ggml.token_type (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

CORPUS = """\
The quick brown fox jumps over the lazy dog. It's a sunny day, isn't it? We'll see; they've gone.
I'm sure you're right: THE MODEL'S OUTPUT WASN'T WHAT WE'D EXPECTED, and that's fine.
Mixture-of-experts models route each token to a few experts; the router picks the top-k of them.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 4096 65536 3.14159 2.71828 -17 +23 1e-5 1,000,000.
Dates and times: 2024-01-15 12:30:45, 1999/12/31, version v1.2.3, item #7, 50% off, $19.99, 100°C.
def forward(self, x: jnp.ndarray) -> jnp.ndarray:
    # project, activate, project back
    h = jax.nn.silu(x @ self.w_gate) * (x @ self.w_up)
    return h @ self.w_down  # [tokens, hidden]

for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // C-style loop
if __name__ == "__main__":
\tprint("hello, world!")   \t  # tabs and spaces
    return {"key": [1, 2, 3], 'other': None}
<html><body class="main">Hello &amp; welcome!</body></html>
¿Dónde está la biblioteca? Très bien, merci beaucoup. Ünïcödé naïve café résumé façade.
Привет, как дела? Всё хорошо, спасибо. Москва — столица России.
日本語のテキストを分割します。東京は日本の首都です。ひらがなとカタカナ、漢字。
中文文本测试：今天天气很好，我们去公园散步吧。人工智能和机器学习。
한국어 텍스트입니다. 서울은 대한민국의 수도입니다.
مرحبا بالعالم. هذه جملة باللغة العربية.
Emoji: 😀 😂 👍 👍🏽 🎉 🚀 ❤️ 🇫🇷 👨‍👩‍👧 ✨ — and symbols: → ← ↑ ↓ ∑ ∫ √ ∞ ≠ ≤ ≥ ± × ÷ € £ ¥ © ® ™.
Whitespace   runs    and\t\ttabs\n\nand newlines\r\nwindows line ends.
"""  # noqa: E501

QWEN_SPECIALS = (
    ("<|endoftext|>", CONTROL),
    ("<|im_start|>", CONTROL),
    ("<|im_end|>", CONTROL),
    ("<think>", USER_DEFINED),
    ("</think>", USER_DEFINED),
    ("<tool_call>", USER_DEFINED),
    ("</tool_call>", USER_DEFINED),
    ("[PAD0]", UNUSED),
)

# A Qwen-style template (ChatML), enough for rendering tests.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def bpe_vocab_metadata(pre: str, vocab_size: int = 1200, corpus: str = CORPUS) -> dict[str, Any]:
    """GGUF tokenizer metadata of a byte-level BPE trained on `corpus` with `pre`'s split."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from strata_jax.gguf.pretokenizers import PRE_TOKENIZERS

    spec = PRE_TOKENIZERS[pre]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False
    )
    # Each line several times, so that merges across common words are learned.
    tk.train_from_iterator(corpus.splitlines(keepends=True) * 3, trainer=trainer)
    model = json.loads(tk.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [NORMAL] * len(tokens)
    ids = {}
    for text, kind in QWEN_SPECIALS:
        ids[text] = len(tokens)
        tokens.append(text)
        types.append(kind)
    return {
        "general.architecture": "qwen2",
        "general.name": f"vocab-{pre}",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": ids["<|endoftext|>"],
        "tokenizer.ggml.eos_token_id": ids["<|im_end|>"],
        "tokenizer.ggml.padding_token_id": ids["<|endoftext|>"],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }


def sentencepiece_vocab_metadata(vocab_size: int = 1000, corpus: str = CORPUS) -> dict[str, Any]:
    """GGUF tokenizer metadata of a SentencePiece BPE (byte fallback, identity normalization, like
    Llama's)."""
    import sentencepiece as spm

    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus.splitlines() * 3),
        model_writer=buffer,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=0.995,  # rare characters (some emoji) are left to the byte pieces
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        hard_vocab_limit=False,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=buffer.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        if sp.is_unknown(i):
            types.append(UNKNOWN)
        elif sp.is_control(i):
            types.append(CONTROL)
        elif sp.is_unused(i):
            types.append(UNUSED)
        elif sp.is_byte(i):
            types.append(BYTE)
        elif tokens[-1] in ("<|im_start|>", "<|im_end|>"):
            types.append(CONTROL)  # as the converter marks added special tokens
        else:
            types.append(NORMAL)
    return {
        "general.architecture": "llama",
        "general.name": "vocab-spm",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": True,
        # not written to the GGUF: for tests that ask sentencepiece
        "_sentencepiece_model": buffer.getvalue(),
    }


def write_vocab_gguf(path: str | os.PathLike, metadata: dict[str, Any]) -> Path:
    """Write `metadata` (GGUF keys -> Python values) as a GGUF file with no tensors. Keys starting
    "_" are skipped."""
    import gguf

    path = Path(path)
    writer = gguf.GGUFWriter(path, arch=metadata.get("general.architecture", "llama"))
    for key, value in metadata.items():
        if key.startswith("_") or key == "general.architecture":
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, (list, tuple)):
            writer.add_array(key, list(value))
        else:
            raise TypeError(f"cannot write {key} = {type(value).__name__} to a GGUF")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
