"""A GGUF's vocabulary as its `tokenizer.ggml.*` keys say: read, checked and bounded before anything
is built."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from strata_jax.gguf.header import MAX_ARRAY_STRING_BYTES
from strata_jax.gguf.pretokenizers import PRE_TOKENIZERS, supported_names

# The tokenizer's log, whichever of its modules writes to it.
_log = logging.getLogger("strata_jax.gguf.tokenizer")

# tokenizer.ggml.token_type values (gguf.TokenType; llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# ---- bounds on a vocabulary: a GGUF may come from anywhere, and building its tokenizer must take
# seconds at most Tokens: the largest real vocabularies have 262,144 (Gemma 3); a million builds in
# about 4 s here.
MAX_VOCAB_TOKENS = 1 << 20
# One token: llama.cpp's vocabularies hold tokens of at most a few hundred bytes (SmolLM2's longest:
# 162). The same bound as the GGUF reader's for any string in an array, so a file and its metadata
# as a dict agree.
MAX_TOKEN_BYTES = MAX_ARRAY_STRING_BYTES
# Tokens matched whole in the text (CONTROL, USER_DEFINED, UNKNOWN), all together: the `tokenizers`
# library builds an automaton over them that costs about 2.5 s a MB here (20 MB: 10 to 110 s). Real
# vocabularies have a few thousand short ones (Gemma 3's ~6,000 `<unusedN>` are under 100 KB).
MAX_SPECIAL_TOKEN_BYTES = 512 << 10
# Merges made from SentencePiece pieces (pairs of pieces that join into a piece), each kept in
# Python and in the `tokenizers` model while it is built: real vocabularies make one to two a piece
# (a 32,000-piece one trained on Python's sources: 60,874, as many as Llama 2's), so even a
# 262,144-piece one is far below.
MAX_SPM_MERGES = 1 << 21

# Tokens that end a turn when the file does not say so, by their text (llama.cpp's list, in its
# priority).
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>",
)  # fmt: skip
# Every token that ends generation, by text (llama.cpp's `special_eog_ids` list).
_EOG_TEXTS = frozenset(
    _EOT_TEXTS
    + ("<|return|>", "<|call|>", "</s>", "<|eom_id|>", "[EOS]", "<eos>")
    + ("<|fim_pad|>", "<|fim_repo|>", "<|repo_name|>", "<|file_sep|>")
)


class TokenizerError(ValueError):
    """The GGUF's vocabulary cannot be turned into a tokenizer: says which key or value, and why."""


class UnknownPreTokenizerError(TokenizerError):
    def __init__(self, name: str):
        self.name = name
        super().__init__(
            f"unknown pre-tokenizer {name!r} (tokenizer.ggml.pre) in this GGUF; "
            f"supported: {', '.join(supported_names())}. "
            "If it splits text like one of these, re-write the file's tokenizer.ggml.pre."
        )


class Vocabulary:
    """What the file's `tokenizer.ggml.*` keys say, checked: the tokens, their types and scores, the
    special ids and the flags (see `Tokenizer`, which builds its models from them)."""

    def __init__(self, metadata: Mapping[str, Any]):
        md = metadata
        self.model = get_str(md, "tokenizer.ggml.model")
        if self.model is None:
            raise TokenizerError("this GGUF has no vocabulary: tokenizer.ggml.model is missing")
        if self.model not in ("gpt2", "llama"):
            raise TokenizerError(
                f"tokenizer.ggml.model = {self.model!r} is not supported; supported: 'gpt2' "
                "(byte-level BPE) and 'llama' (SentencePiece)"
            )
        self.tokens: list[str] = get_list(md, "tokenizer.ggml.tokens", str)
        if not self.tokens:
            raise TokenizerError("tokenizer.ggml.tokens is missing or empty")
        n = len(self.tokens)
        self.token_types: list[int] = get_list(md, "tokenizer.ggml.token_type", int) or [NORMAL] * n
        self.scores: list[float] = get_list(md, "tokenizer.ggml.scores", float) or [0.0] * n
        for key, values in (("tokenizer.ggml.token_type", self.token_types),
                            ("tokenizer.ggml.scores", self.scores)):
            if len(values) < n:
                raise TokenizerError(f"{key} has {len(values)} entries for {n} tokens")
        check_vocabulary_bounds(self.tokens, self.token_types)
        self._ids: dict[str, int] = {}
        for i, text in enumerate(self.tokens):
            if not text:  # llama.cpp's name for an empty token
                text = self.tokens[i] = f"[EMPTY_{i}]"
            if self._ids.setdefault(text, i) != i:
                raise TokenizerError(
                    f"duplicate token {text!r} in tokenizer.ggml.tokens: ids {self._ids[text]} and "
                    f"{i}"
                )

        spm = self.model == "llama"
        if spm:
            self.pre = None
            add_bos_default = True
        else:
            self.pre = get_str(md, "tokenizer.ggml.pre")
            if not self.pre:
                _log.warning("tokenizer.ggml.pre is missing: splitting text the 'default' way, as "
                             "llama.cpp does; text may be tokenized differently from how the model "
                             "was trained")
                self.pre = "default"
            if self.pre not in PRE_TOKENIZERS:
                raise UnknownPreTokenizerError(self.pre)
            add_bos_default = PRE_TOKENIZERS[self.pre].add_bos

        # Special ids: the file's, else llama.cpp's SentencePiece defaults; ids outside the
        # vocabulary are ignored.
        def special(key: str, default: int | None = None) -> int | None:
            value = get_int(md, f"tokenizer.ggml.{key}")
            value = default if value is None else value
            return value if value is not None and 0 <= value < n else None

        self.bos_id = special("bos_token_id", 1 if spm else None)
        self.eos_id = special("eos_token_id", 2 if spm else None)
        self.unk_id = special("unknown_token_id", 0 if spm else None)
        self.pad_id = special("padding_token_id")
        self.eot_id = special("eot_token_id")
        self.eom_id = special("eom_token_id")
        if self.eot_id is None:
            self.eot_id = next((self._ids[t] for t in _EOT_TEXTS if t in self._ids), None)
        if self.eom_id is None:
            self.eom_id = self._ids.get("<|eom_id|>")

        self.add_bos = get_bool(md, "tokenizer.ggml.add_bos_token", add_bos_default)
        self.add_eos = get_bool(md, "tokenizer.ggml.add_eos_token", False)
        # llama.cpp reads this key for every model but only the SentencePiece path uses it.
        self.add_space_prefix = spm and get_bool(md, "tokenizer.ggml.add_space_prefix", True)
        for flag, id_, what in ((self.add_bos, self.bos_id, "bos"),
                                (self.add_eos, self.eos_id, "eos")):
            if flag and id_ is None:
                raise TokenizerError(
                    f"tokenizer.ggml.add_{what}_token is true, but the file has no valid {what} "
                    "token id"
                )

        self.eos_ids: frozenset[int] = self._end_of_generation_ids()
        # llama.cpp: a token known by its text to end generation is a control token, whatever the
        # file says
        for text in _EOG_TEXTS:
            i = self._ids.get(text)
            if (i is not None and i in self.eos_ids
                    and self.token_types[i] not in (CONTROL, UNKNOWN)):
                self.token_types[i] = CONTROL

    def _end_of_generation_ids(self) -> frozenset[int]:
        ids = {self._ids[t] for t in _EOG_TEXTS if t in self._ids}
        ids |= {i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None}
        # gpt-oss: "<|end|>" ends a message, not the answer, when "<|return|>" and "<|call|>" exist.
        if {"<|return|>", "<|call|>", "<|end|>"} <= self._ids.keys():
            ids.discard(self._ids["<|end|>"])
        return frozenset(ids)


# ---- metadata access: values may be plain Python or numpy (from other readers)


def get_str(md: Mapping[str, Any], key: str) -> str | None:
    value = md.get(key)
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8")
    if not isinstance(value, str):
        raise TokenizerError(f"{key} should be a string, got {type(value).__name__}")
    return value


def get_int(md: Mapping[str, Any], key: str) -> int | None:
    value = md.get(key)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise TokenizerError(f"{key} should be an integer, got {value!r}") from None


def get_bool(md: Mapping[str, Any], key: str, default: bool) -> bool:
    value = md.get(key)
    return default if value is None else bool(value)


def get_list(md: Mapping[str, Any], key: str, kind: type) -> list:
    value = md.get(key)
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TokenizerError(f"{key} should be a list, got {type(value).__name__}")
    if kind is str:
        return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in value]
    try:
        return [kind(v) for v in value]
    except (TypeError, ValueError):
        i, bad = next((i, v) for i, v in enumerate(value) if not _converts(kind, v))
        what = {int: "an integer", float: "a number"}.get(kind, kind.__name__)
        raise TokenizerError(f"{key}[{i}] should be {what}, got {str(bad)[:100]!r}") from None


def _converts(kind: type, value: Any) -> bool:
    try:
        kind(value)
    except (TypeError, ValueError):
        return False
    return True


def check_vocabulary_bounds(tokens: Sequence[str], token_types: Sequence[int]) -> None:
    """Refuse, before anything is built from them, vocabularies beyond MAX_VOCAB_TOKENS, tokens
    beyond MAX_TOKEN_BYTES and special tokens beyond MAX_SPECIAL_TOKEN_BYTES (see there why)."""
    if len(tokens) > MAX_VOCAB_TOKENS:
        raise TokenizerError(
            f"tokenizer.ggml.tokens holds {len(tokens):,} tokens; strata-jax reads vocabularies of "
            f"at most {MAX_VOCAB_TOKENS:,} (the largest real ones: 262,144). This is not a real "
            "vocabulary: re-convert the model"
        )
    # a character is at most 4 bytes: else none is too long
    if max(map(len, tokens)) * 4 > MAX_TOKEN_BYTES:
        for i, text in enumerate(tokens):
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > MAX_TOKEN_BYTES:
                raise TokenizerError(
                    f"tokenizer.ggml.tokens[{i}] is a token of {size:,} bytes; strata-jax reads "
                    f"tokens of at most {MAX_TOKEN_BYTES:,} bytes (llama.cpp's vocabularies: a few "
                    "hundred at most). This is not a real vocabulary: re-convert the model"
                )
    special = [text for text, kind in zip(tokens, token_types)
               if kind in (CONTROL, UNKNOWN, USER_DEFINED)]
    size = sum(len(text.encode("utf-8", "surrogatepass")) for text in special)
    if size > MAX_SPECIAL_TOKEN_BYTES:
        raise TokenizerError(
            f"tokenizer.ggml.tokens: its {len(special):,} CONTROL, USER_DEFINED and UNKNOWN tokens "
            f"(by tokenizer.ggml.token_type) hold {size:,} bytes; strata-jax matches at most "
            f"{MAX_SPECIAL_TOKEN_BYTES:,} bytes of such tokens, as building their matcher takes "
            "seconds a MB (real vocabularies: well under 100 KB). This is not a real vocabulary: "
            "re-convert the model"
        )
