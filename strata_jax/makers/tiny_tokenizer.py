"""A small built-in byte-level BPE tokenizer for synthetic models, as GGUF `tokenizer.*` metadata.

Layout (GPT-2 style, as llama.cpp's "gpt2" tokenizer model and transformers' GGUF converter read
it): ids 0..255 are the 256 bytes in GPT-2's byte-to-unicode spelling (id == byte value), then
merges learned by `tokenizers`' BPE trainer on a fixed text below (so the same every time), then the
special tokens (<|endoftext|>, <|im_start|>, <|im_end|>, and <think>/</think> as user-defined
tokens, as Qwen3 has them), then [PAD<id>] tokens up to the vocabulary size asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from gguf import GGUFValueType, TokenType

from strata_jax.gguf.header import ValueType

CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
USER_DEFINED_TOKENS = ("<think>", "</think>")
MIN_VOCAB = 256 + len(CONTROL_TOKENS) + len(USER_DEFINED_TOKENS)

# ChatML, as Qwen and SmolLM2 use it.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_CORPUS = """\
The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.
The capital of Spain is Madrid, and the capital of Japan is Tokyo. What is the capital of France?
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Hello, world! How are you today? I am fine, thank you. Please tell me a short story about a cat.
Once upon a time there was a little cat who lived in a small house near the river. Every morning
the cat walked along the water and watched the boats. One day a boat stopped, and a girl waved.
Mixture-of-experts language models route each token to a few experts. The router picks the top
experts for every token, and only those experts run. This makes large models cheaper to serve.
def main():
    for i in range(10):
        print(f"hello {i}")
    return 0

if __name__ == "__main__":
    main()
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024 3.14159 42.
The user asked a question and the assistant answered it. The assistant thinks before it answers.
Water boils at 100 degrees Celsius at sea level. The sun rises in the east and sets in the west.
"""  # noqa: E501


@dataclass(frozen=True)
class TinyTokenizer:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    pad_id: int

    def metadata(self, pre: str) -> dict[str, tuple[Any, ValueType]]:
        """GGUF key -> (value, (type, element type)) for `tokenizer.*`."""
        arr = GGUFValueType.ARRAY
        u32 = (GGUFValueType.UINT32, None)
        return {
            "tokenizer.ggml.model": ("gpt2", (GGUFValueType.STRING, None)),
            "tokenizer.ggml.pre": (pre, (GGUFValueType.STRING, None)),
            "tokenizer.ggml.tokens": (self.tokens, (arr, GGUFValueType.STRING)),
            "tokenizer.ggml.token_type": (self.token_types, (arr, GGUFValueType.INT32)),
            "tokenizer.ggml.merges": (self.merges, (arr, GGUFValueType.STRING)),
            "tokenizer.ggml.bos_token_id": (self.bos_id, u32),
            "tokenizer.ggml.eos_token_id": (self.eos_id, u32),
            "tokenizer.ggml.padding_token_id": (self.pad_id, u32),
            "tokenizer.ggml.add_bos_token": (False, (GGUFValueType.BOOL, None)),
            "tokenizer.chat_template": (CHAT_TEMPLATE, (GGUFValueType.STRING, None)),
        }


def tiny_tokenizer(vocab_size: int) -> TinyTokenizer:
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"the built-in tokenizer needs a vocabulary of at least {MIN_VOCAB} "
                         f"tokens (256 bytes + {MIN_VOCAB - 256} special tokens); got {vocab_size}")
    n_merges = vocab_size - MIN_VOCAB
    byte_tokens = _byte_tokens()
    merges = list(_learned_merges())[:n_merges]
    merged = ["".join(pair.split(" ")) for pair in merges]
    tokens = byte_tokens + merged + list(CONTROL_TOKENS) + list(USER_DEFINED_TOKENS)
    types = ([TokenType.NORMAL] * (256 + len(merged)) + [TokenType.CONTROL] * len(CONTROL_TOKENS)
             + [TokenType.USER_DEFINED] * len(USER_DEFINED_TOKENS))
    pads = [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    tokens += pads
    types += [TokenType.UNUSED] * len(pads)
    first_special = 256 + len(merged)
    return TinyTokenizer(tokens=tokens, token_types=[int(t) for t in types], merges=merges,
                         bos_id=first_special, eos_id=first_special + 2, pad_id=first_special)


@lru_cache(maxsize=1)
def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode map, in byte order: printable bytes spell themselves, the rest map to
    256+."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


@lru_cache(maxsize=1)
def _learned_merges() -> tuple[str, ...]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=4096,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    return tuple(" ".join(m) if isinstance(m, list) else m for m in merges)
