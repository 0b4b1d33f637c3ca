"""A made model's vocabulary and chat template made to speak a family's chat format: the family's
special tokens (gpt-oss's harmony marks, DeepSeek's role and tool marks) as control tokens, and its
own template (gguf/family_templates.py), so the server reads its answers as it reads the family's.

    rewrite_gguf(tiny, out, set_metadata=family_chat_metadata(GGUFModel.open(tiny).metadata,
                                                              "gpt-oss"))

The marks take the places of the built-in tokenizer's last merged tokens (and their merges go), so
the vocabulary keeps its size and the tensors their shapes. A family with BOS, EOS and padding
tokens of its own (DeepSeek's) has them in the places of the built-in specials, with the file's ids
and add_bos set to them as a real file of the family has them: its chat turns end on its EOS (its
template writes it after each answer), not on ChatML's <|im_end|>, which it no longer has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..gguf.family_templates import family_template

CONTROL = 3         # gguf TokenType.CONTROL

HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
                  "<|constrain|>")
DEEPSEEK_TOKENS = tuple(f"<\uff5c{name}\uff5c>" for name in (
    "User", "Assistant", "tool\u2581calls\u2581begin",
    "tool\u2581calls\u2581end", "tool\u2581call\u2581begin", "tool\u2581call\u2581end",
    "tool\u2581sep", "tool\u2581outputs\u2581begin", "tool\u2581outputs\u2581end",
    "tool\u2581output\u2581begin", "tool\u2581output\u2581end"))
FAMILY_TOKENS = {"gpt-oss": HARMONY_TOKENS, "deepseek-r1": DEEPSEEK_TOKENS,
                 "deepseek-v3.1": DEEPSEEK_TOKENS}
# bos / eos / padding: DeepSeek's (V3, R1 and V3.1 alike: ids 0, 1 and 2 of their vocabulary)
DEEPSEEK_SPECIALS = {"bos": "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
                     "eos": "<\uff5cend\u2581of\u2581sentence\uff5c>",
                     "padding": "<\uff5c\u2581pad\u2581\uff5c>"}
FAMILY_SPECIALS = {"deepseek-r1": DEEPSEEK_SPECIALS, "deepseek-v3.1": DEEPSEEK_SPECIALS}
# the built-in tokenizer's specials (tiny_tokenizer.py) whose places a family's own take
_BUILT_IN_SPECIALS = {"bos": "<|endoftext|>", "eos": "<|im_end|>", "padding": "<|im_start|>"}


def with_special_tokens(metadata: Mapping[str, Any], marks: Sequence[str]) -> dict[str, Any]:
    """`tokenizer.ggml.*` with the last merged tokens before the built-in specials (and their
    merges) given to `marks`, as control tokens."""
    tokens, types = (list(metadata["tokenizer.ggml.tokens"]),
                     list(metadata["tokenizer.ggml.token_type"]))
    first_special = tokens.index("<|endoftext|>")
    if len(metadata["tokenizer.ggml.merges"]) < len(marks):
        raise ValueError(f"the family's {len(marks)} marks take the places of merged tokens, and "
                         f"this vocabulary has {len(metadata['tokenizer.ggml.merges'])}: give a "
                         "larger --vocab")
    for j, mark in enumerate(marks):
        tokens[first_special - 1 - j], types[first_special - 1 - j] = mark, CONTROL
    return {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": list(metadata["tokenizer.ggml.merges"])[:-len(marks)]}


def family_chat_metadata(metadata: Mapping[str, Any], family: str) -> dict[str, Any]:
    """The metadata to set on a made model (its own `metadata`, the built-in tokenizer's) for it to
    speak `family`'s chat format: one of FAMILY_TOKENS."""
    if family not in FAMILY_TOKENS:
        raise KeyError(f"no family chat {family!r}; there are {', '.join(FAMILY_TOKENS)}")
    out = {"tokenizer.chat_template": family_template(family),
           **with_special_tokens(metadata, FAMILY_TOKENS[family])}
    if family in FAMILY_SPECIALS:
        out |= _own_specials(out, FAMILY_SPECIALS[family])
    return out


def _own_specials(keys: Mapping[str, Any], specials: Mapping[str, str]) -> dict[str, Any]:
    """`keys`' tokens with the family's bos / eos / padding in the built-in specials' places, as
    control tokens, their ids and add_bos (a real DeepSeek file's) set."""
    tokens, types = list(keys["tokenizer.ggml.tokens"]), list(keys["tokenizer.ggml.token_type"])
    out: dict[str, Any] = {"tokenizer.ggml.add_bos_token": True}
    for role, text in specials.items():
        if _BUILT_IN_SPECIALS[role] not in tokens:
            raise ValueError(f"the family's {role} token {text} takes the place of the built-in "
                             f"tokenizer's {_BUILT_IN_SPECIALS[role]}, and this vocabulary has no "
                             "such token")
        i = tokens.index(_BUILT_IN_SPECIALS[role])
        tokens[i], types[i] = text, CONTROL
        out[f"tokenizer.ggml.{role}_token_id"] = i
    return {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, **out}
