"""The tokenizer a GGUF file describes, built with the `tokenizers` library.

A GGUF stores no `tokenizer.json`: it stores llama.cpp's description of the vocabulary (`tokenizer.ggml.*`),
and llama.cpp's behaviour is the definition of what those keys mean. Two kinds are supported:

- `tokenizer.ggml.model = gpt2`: byte-level BPE. The vocabulary and merges are in the file; how text is
  split before merging is named by `tokenizer.ggml.pre` (see `pretokenizers.py`).
- `tokenizer.ggml.model = llama`: SentencePiece BPE. The file has pieces and scores but no merges; a pair
  merges when the piece it makes is in the vocabulary, best score first (llama.cpp's `llm_tokenizer_spm`),
  which is BPE with merges ranked by the merged piece's score. Spaces are written as U+2581, a space is
  put before the text and after every special token (`add_space_prefix`), and characters with no piece
  fall back to the `<0xXX>` byte pieces.

Tokens typed CONTROL, USER_DEFINED or UNKNOWN are matched whole in the text before anything else, like
llama.cpp does (`parse_special`). Decoding is done here, token by token, from each token's bytes, so that
streaming can hold back the bytes of a character that is not complete yet.
"""

from __future__ import annotations

import codecs
import logging
import os
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from strata_jax.gguf.header import MAX_ARRAY_STRING_BYTES
from strata_jax.gguf.pretokenizers import PRE_TOKENIZERS, supported_names

_log = logging.getLogger(__name__)

# tokenizer.ggml.token_type values (gguf.TokenType; llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE_MARK = "\u2581"  # SentencePiece's visible space

# ---- bounds on a vocabulary: a GGUF may come from anywhere, and building its tokenizer must take seconds at most
# Tokens: the largest real vocabularies have 262,144 (Gemma 3); a million builds in about 4 s here.
MAX_VOCAB_TOKENS = 1 << 20
# One token: llama.cpp's vocabularies hold tokens of at most a few hundred bytes (SmolLM2's longest: 162).
# The same bound as the GGUF reader's for any string in an array, so a file and its metadata as a dict agree.
MAX_TOKEN_BYTES = MAX_ARRAY_STRING_BYTES
# Tokens matched whole in the text (CONTROL, USER_DEFINED, UNKNOWN), all together: the `tokenizers` library
# builds an automaton over them that costs about 2.5 s a MB here (20 MB: 10 to 110 s). Real vocabularies
# have a few thousand short ones (Gemma 3's ~6,000 `<unusedN>` are under 100 KB).
MAX_SPECIAL_TOKEN_BYTES = 512 << 10
# Merges made from SentencePiece pieces (pairs of pieces that join into a piece), each kept in Python and in
# the `tokenizers` model while it is built: real vocabularies make one to two a piece (a 32,000-piece one
# trained on Python's sources: 60,874, as many as Llama 2's), so even a 262,144-piece one is far below.
MAX_SPM_MERGES = 1 << 21
# Pieces up to this long have their merges found by slicing (a few dozen cuts at most); longer ones by chains.
_SHORT_PIECE = 64

# Tokens that end a turn when the file does not say so, by their text (llama.cpp's list, in its priority).
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


def load_tokenizer(path_or_metadata: str | os.PathLike | Mapping[str, Any], **kwargs: Any) -> Tokenizer:
    """A `Tokenizer` from a GGUF file (full model, first part of a split model, or vocabulary-only file like
    llama.cpp's ggml-vocab-*.gguf) or from its metadata as a dict of plain values.

    Keyword arguments go to `Tokenizer` (e.g. `chat_template=` to use a template the file does not have).
    """
    if isinstance(path_or_metadata, Mapping):
        return Tokenizer(path_or_metadata, **kwargs)
    from strata_jax.gguf.reader import (
        read_metadata,  # reads the key-value section only, no tensor data
    )

    metadata = read_metadata(path_or_metadata)
    try:
        return Tokenizer(metadata, **kwargs)
    except TokenizerError as e:
        e.args = (f"{os.fspath(path_or_metadata)}: {e.args[0]}",)
        raise


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte written as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# str.translate table from the byte alphabet back to bytes (as latin-1 characters). Characters below 256
# that are not in the alphabet map to U+FFFF, so encoding the result as latin-1 fails for any text that
# is not written in the alphabet.
_UNBYTE = {ord(ch): b for b, ch in bytes_to_unicode().items()}
_UNBYTE.update({c: 0xFFFF for c in range(256) if c not in _UNBYTE})


def _byte_level_bytes(text: str) -> bytes | None:
    try:
        return text.translate(_UNBYTE).encode("latin-1")
    except UnicodeEncodeError:
        return None


class Tokenizer:
    """Encode, decode and chat-format text the way the GGUF's vocabulary says.

    Attributes: `model` ("gpt2" or "llama"), `pre` (pre-tokenizer name, gpt2 only), `vocab_size`,
    `bos_id`, `eos_id`, `eot_id`, `eom_id`, `unk_id`, `pad_id` (int or None), `eos_ids` (every id that ends
    generation), `add_bos`, `add_eos`, `add_space_prefix`, `chat_template` (str or None).
    """

    def __init__(self, metadata: Mapping[str, Any], *, chat_template: str | None = None):
        md = metadata
        self.model = _get_str(md, "tokenizer.ggml.model")
        if self.model is None:
            raise TokenizerError("this GGUF has no vocabulary: tokenizer.ggml.model is missing")
        if self.model not in ("gpt2", "llama"):
            raise TokenizerError(
                f"tokenizer.ggml.model = {self.model!r} is not supported; supported: 'gpt2' (byte-level BPE) "
                "and 'llama' (SentencePiece)"
            )
        self.tokens: list[str] = _get_list(md, "tokenizer.ggml.tokens", str)
        if not self.tokens:
            raise TokenizerError("tokenizer.ggml.tokens is missing or empty")
        n = len(self.tokens)
        self.token_types: list[int] = _get_list(md, "tokenizer.ggml.token_type", int) or [NORMAL] * n
        self.scores: list[float] = _get_list(md, "tokenizer.ggml.scores", float) or [0.0] * n
        for key, values in (("tokenizer.ggml.token_type", self.token_types), ("tokenizer.ggml.scores", self.scores)):
            if len(values) < n:
                raise TokenizerError(f"{key} has {len(values)} entries for {n} tokens")
        _check_vocabulary_bounds(self.tokens, self.token_types)
        self._ids: dict[str, int] = {}
        for i, text in enumerate(self.tokens):
            if not text:  # llama.cpp's name for an empty token
                text = self.tokens[i] = f"[EMPTY_{i}]"
            if self._ids.setdefault(text, i) != i:
                raise TokenizerError(
                    f"duplicate token {text!r} in tokenizer.ggml.tokens: ids {self._ids[text]} and {i}"
                )

        spm = self.model == "llama"
        if spm:
            self.pre = None
            spec = None
            add_bos_default = True
        else:
            self.pre = _get_str(md, "tokenizer.ggml.pre")
            if not self.pre:
                _log.warning("tokenizer.ggml.pre is missing: splitting text the 'default' way, as llama.cpp does; "
                             "text may be tokenized differently from how the model was trained")
                self.pre = "default"
            if self.pre not in PRE_TOKENIZERS:
                raise UnknownPreTokenizerError(self.pre)
            spec = PRE_TOKENIZERS[self.pre]
            add_bos_default = spec.add_bos

        # Special ids: the file's, else llama.cpp's SentencePiece defaults; ids outside the vocabulary are ignored.
        def special(key: str, default: int | None = None) -> int | None:
            value = _get_int(md, f"tokenizer.ggml.{key}")
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

        self.add_bos = _get_bool(md, "tokenizer.ggml.add_bos_token", add_bos_default)
        self.add_eos = _get_bool(md, "tokenizer.ggml.add_eos_token", False)
        # llama.cpp reads this key for every model but only the SentencePiece path uses it.
        self.add_space_prefix = spm and _get_bool(md, "tokenizer.ggml.add_space_prefix", True)
        for flag, id_, what in ((self.add_bos, self.bos_id, "bos"), (self.add_eos, self.eos_id, "eos")):
            if flag and id_ is None:
                raise TokenizerError(
                    f"tokenizer.ggml.add_{what}_token is true, but the file has no valid {what} token id"
                )

        self.eos_ids: frozenset[int] = self._end_of_generation_ids()
        # llama.cpp: a token known by its text to end generation is a control token, whatever the file says
        for text in _EOG_TEXTS:
            i = self._ids.get(text)
            if i is not None and i in self.eos_ids and self.token_types[i] not in (CONTROL, UNKNOWN):
                self.token_types[i] = CONTROL

        self.chat_template: str | None = chat_template or _get_str(md, "tokenizer.chat_template")
        self._template = None  # compiled lazily

        if spm:
            self._tk = self._build_sentencepiece()
        else:
            merges = _get_list(md, "tokenizer.ggml.merges", str)
            if not merges:
                raise TokenizerError("tokenizer.ggml.merges is missing: a gpt2 (byte-level BPE) vocabulary needs them")
            self._tk = self._build_byte_level(merges, spec)
        self._add_special_tokens()
        self._tk_no_special = None  # a copy that leaves special-token text as text, made when first needed
        self._pieces, self._skippable = self._decoding_tables()

    # ---- construction

    def _end_of_generation_ids(self) -> frozenset[int]:
        ids = {self._ids[t] for t in _EOG_TEXTS if t in self._ids}
        ids |= {i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None}
        # gpt-oss: "<|end|>" ends a message, not the answer, when "<|return|>" and "<|call|>" exist.
        if {"<|return|>", "<|call|>", "<|end|>"} <= self._ids.keys():
            ids.discard(self._ids["<|end|>"])
        return frozenset(ids)

    def _build_byte_level(self, merges: list[str], spec) -> _HFTokenizer:
        pairs, dropped = [], []
        ids = self._ids
        for i, merge in enumerate(merges):
            left, sep, right = merge.partition(" ")
            if not sep or not left or not right:
                raise TokenizerError(f"tokenizer.ggml.merges[{i}] = {merge!r} is not two tokens separated by a space")
            # The `tokenizers` library refuses (or panics on) a merge whose parts or result are not tokens.
            # Such a merge can only produce text that is then spelled in smaller tokens, so it is left out.
            if left in ids and right in ids and left + right in ids:
                pairs.append((left, right))
            else:
                dropped.append(merge)
        if dropped:
            _log.warning("%d merges of tokenizer.ggml.merges make or use text that is not a token, "
                         "and are left out (first: %r)", len(dropped), dropped[0])
        # Bytes that never occur in UTF-8 text (0xC0, 0xC1, 0xF5..0xFF) need no token.
        never = {0xC0, 0xC1, *range(0xF5, 0x100)}
        missing = [b for b, ch in bytes_to_unicode().items() if ch not in ids and b not in never]
        if missing:
            # Missing ASCII bytes break plain text; missing rare lead bytes (SmolLM2 lacks 0xF1..0xF4) are a note.
            level = logging.WARNING if min(missing) < 0x80 else logging.INFO
            _log.log(level, "%d of the 256 bytes have no token in this byte-level vocabulary (first: 0x%02X); "
                      "text holding them cannot be encoded and they are left out", len(missing), missing[0])
        tk = _HFTokenizer(models.BPE(vocab=self._ids, merges=pairs, ignore_merges=spec.ignore_merges))
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tk.decoder = decoders.ByteLevel()
        return tk

    def _build_sentencepiece(self) -> _HFTokenizer:
        unk = self.tokens[self.unk_id] if self.unk_id is not None else None
        merges = self._merges_from_scores()
        tk = _HFTokenizer(models.BPE(vocab=self._ids, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
        # A normalizer, not `Metaspace`: llama.cpp puts the space before every stretch of text between special
        # tokens, even one that starts with a space, where `Metaspace` adds none. The stretch is not cut at
        # spaces: pieces may hold several.
        spaces = normalizers.Replace(" ", SPACE_MARK)
        if self.add_space_prefix:
            tk.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARK), spaces])
        else:
            tk.normalizer = spaces
        tk.decoder = decoders.Sequence([decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()])
        return tk

    def _merges_from_scores(self) -> list[tuple[str, str]]:
        # Every way to cut a piece into two pieces is a merge; a better-scored result merges first.
        # Ties: longer left part first (as transformers orders them), then vocabulary order.
        # The cuts tried are at the piece's token prefixes only (a chain, see `_longest_token_prefixes`). For a
        # long piece the right parts are found the same way, from its chain of token suffixes, not by slicing
        # and hashing: that keeps the cost linear in the vocabulary's length, where trying every cut of every
        # piece is quadratic in a piece's length (0.6 s for one piece of 60,000 characters here).
        # The sort keys go in flat arrays: 24 bytes a merge, not a tuple of five Python objects.
        tokens, scores, ids, lengths = self.tokens, self.scores, self._ids, [len(t) for t in self.tokens]
        prefix = _longest_token_prefixes(tokens)
        suffix: list[int] | None = None  # made when a long piece first needs it
        by_score, by_lengths, by_ids = array("d"), array("q"), array("q")
        add_score, add_lengths, add_ids = by_score.append, by_lengths.append, by_ids.append
        for i, kind in zip(range(len(tokens)), self.token_types):
            j = prefix[i]
            if kind == BYTE or j < 0:
                continue
            piece, n, rights = tokens[i], lengths[i], None
            if n > _SHORT_PIECE:
                if suffix is None:
                    suffix = _longest_token_prefixes([t[::-1] for t in tokens])
                rights = _chain_by_length(suffix, lengths, i)
            while j >= 0:
                right = ids.get(piece[lengths[j]:]) if rights is None else rights.get(n - lengths[j])
                if right is not None:
                    add_score(-scores[i])
                    add_lengths(-(lengths[j] << 32 | lengths[right]))  # longer left, then longer right
                    add_ids(j << 32 | right)
                j = prefix[j]
            if len(by_ids) > MAX_SPM_MERGES:
                raise TokenizerError(
                    f"tokenizer.ggml.tokens: its first {i + 1:,} SentencePiece pieces already make more than "
                    f"{MAX_SPM_MERGES:,} merges (pairs of pieces that join into a piece), where real vocabularies "
                    "make one to two a piece. This is not a real vocabulary: re-convert the model"
                )
        keys = np.frombuffer(by_ids, dtype=np.int64)
        order = np.lexsort((keys, np.frombuffer(by_lengths, dtype=np.int64), np.frombuffer(by_score)))
        return [(tokens[k >> 32], tokens[k & 0xFFFFFFFF]) for k in keys[order].tolist()]

    def _add_special_tokens(self) -> None:
        special, plain = [], []
        for text, kind in zip(self.tokens, self.token_types):
            if kind in (CONTROL, UNKNOWN):
                special.append(AddedToken(text, special=True, normalized=False))
            elif kind == USER_DEFINED:
                plain.append(AddedToken(text, special=False, normalized=False))
        # Both keep their ids: the text is already in the model's vocabulary.
        self._tk.add_special_tokens(special)
        self._tk.add_tokens(plain)

    def _decoding_tables(self) -> tuple[list[bytes], list[bool]]:
        pieces: list[bytes] = []
        spm = self.model == "llama"
        for text, kind in zip(self.tokens, self.token_types):
            if kind in (CONTROL, UNKNOWN, USER_DEFINED):
                piece = text.encode()
            elif kind == BYTE and _is_byte_piece(text):
                piece = bytes([int(text[3:5], 16)])
            elif kind == NORMAL:
                if spm:
                    piece = text.replace(SPACE_MARK, " ").encode()
                else:  # text not written in the byte alphabet is taken as it is
                    piece = _byte_level_bytes(text)
                    piece = text.encode() if piece is None else piece
            else:  # UNUSED, undefined: llama.cpp renders nothing
                piece = b""
            pieces.append(piece)
        skippable = [kind in (CONTROL, UNKNOWN) for kind in self.token_types]
        return pieces, skippable

    # ---- public API

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids for `text`.

        add_special: add BOS (and EOS) where the file says to (`tokenizer.ggml.add_bos_token`, ...).
        parse_special: text of control tokens (e.g. "<|im_start|>") becomes that token; with False it is
        encoded as ordinary text (user-defined tokens are still matched, as in llama.cpp).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        tk = self._tk if parse_special else self._no_special_tokenizer()
        ids = tk.encode(text, add_special_tokens=False).ids if text else []
        if add_special and self.add_bos:
            ids.insert(0, self.bos_id)
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: Sequence[str], add_special: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special) for t in texts]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of `ids`. Bytes that are not valid UTF-8 become U+FFFD.

        skip_special: leave out control tokens (BOS, EOS, <|im_start|>, ...). For SentencePiece vocabularies
        the space that encoding puts before the text is taken off again.
        """
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        out = bytearray()
        strip_space = self.add_space_prefix
        for i in ids:
            i = self._check_id(i)
            if self._skippable[i]:
                if not skip_special:
                    out += self._pieces[i]
                continue
            piece = self._pieces[i]
            if strip_space and self.token_types[i] == NORMAL and piece.startswith(b" "):
                piece = piece[1:]
            strip_space = False
            out += piece
        return bytes(out)

    def stream_decoder(self, skip_special: bool = False, start_of_text: bool = False) -> StreamDecoder:
        """An incremental decoder: `.add(token_id)` returns only complete characters, `.flush()` the rest.

        start_of_text: the tokens start the text (not a continuation of a prompt), so the SentencePiece
        prefix space is taken off like `decode` does.
        """
        return StreamDecoder(self, skip_special, start_of_text)

    def token_to_id(self, token: str) -> int | None:
        return self._ids.get(token)

    def id_to_token(self, token_id: int) -> str:
        return self.tokens[self._check_id(token_id)]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token stands for in text (b"" for unused tokens)."""
        return self._pieces[self._check_id(token_id)]

    def is_special(self, token_id: int) -> bool:
        """A control token (BOS, EOS, <|im_start|>, ...), left out by `decode(skip_special=True)`."""
        return self._skippable[self._check_id(token_id)]

    def is_eos(self, token_id: int) -> bool:
        return token_id in self.eos_ids

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self.tokens[self.bos_id]

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_id is None else self.tokens[self.eos_id]

    def apply_chat_template(
        self,
        /,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for a chat, rendered with the model's template (`tokenizer.chat_template`).

        Extra keyword arguments reach the template as variables (e.g. `enable_thinking=False`; any name, even
        `self`), and override the special tokens. Raises NoChatTemplateError when the model has none and
        `chat_template` is not given, ChatTemplateError when rendering fails or passes its bounds (output
        size, time: see chat_template.py).
        """
        from strata_jax.gguf.chat_template import ChatTemplate, NoChatTemplateError

        if chat_template is not None:
            template = ChatTemplate(chat_template)
        else:
            if self.chat_template is None:
                raise NoChatTemplateError()
            if self._template is None:
                self._template = ChatTemplate(self.chat_template)
            template = self._template
        special = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": None if self.unk_id is None else self.tokens[self.unk_id],
            "pad_token": None if self.pad_id is None else self.tokens[self.pad_id],
        }
        variables = {k: v for k, v in special.items() if v is not None}
        variables.update(kwargs)
        return template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **variables)

    def __repr__(self) -> str:
        pre = f", pre={self.pre!r}" if self.pre else ""
        return (
            f"Tokenizer(model={self.model!r}{pre}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_ids={sorted(self.eos_ids)})"
        )

    # ---- helpers

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < len(self.tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary (0..{len(self.tokens) - 1})")
        return int(token_id)

    def _no_special_tokenizer(self) -> _HFTokenizer:
        if self._tk_no_special is None:
            tk = _HFTokenizer.from_str(self._tk.to_str())
            tk.encode_special_tokens = True
            self._tk_no_special = tk
        return self._tk_no_special


class StreamDecoder:
    """Turns token ids into text as they arrive, never splitting a character across two outputs.

    A character can span several tokens (byte-level BPE pieces, `<0xXX>` byte tokens): its bytes are held
    until it is complete. The outputs joined, plus `flush()`, equal `Tokenizer.decode` of all the ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False, start_of_text: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._strip_space = start_of_text and tokenizer.add_space_prefix
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        tok = self._tokenizer
        token_id = tok._check_id(token_id)
        if tok._skippable[token_id]:
            piece = b"" if self._skip_special else tok._pieces[token_id]
        else:
            piece = tok._pieces[token_id]
            if self._strip_space and tok.token_types[token_id] == NORMAL and piece.startswith(b" "):
                piece = piece[1:]
            self._strip_space = False
        return self._utf8.decode(piece)

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(i) for i in token_ids)

    def flush(self) -> str:
        """What is left: an incomplete character at the end becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)

    @property
    def pending(self) -> bool:
        """Bytes are held back, waiting for the rest of a character."""
        return bool(self._utf8.getstate()[0])


# ---- metadata access: values may be plain Python or numpy (from other readers)


def _get_str(md: Mapping[str, Any], key: str) -> str | None:
    value = md.get(key)
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8")
    if not isinstance(value, str):
        raise TokenizerError(f"{key} should be a string, got {type(value).__name__}")
    return value


def _get_int(md: Mapping[str, Any], key: str) -> int | None:
    value = md.get(key)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise TokenizerError(f"{key} should be an integer, got {value!r}") from None


def _get_bool(md: Mapping[str, Any], key: str, default: bool) -> bool:
    value = md.get(key)
    return default if value is None else bool(value)


def _get_list(md: Mapping[str, Any], key: str, kind: type) -> list:
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


def _check_vocabulary_bounds(tokens: Sequence[str], token_types: Sequence[int]) -> None:
    """Refuse, before anything is built from them, vocabularies beyond MAX_VOCAB_TOKENS, tokens beyond
    MAX_TOKEN_BYTES and special tokens beyond MAX_SPECIAL_TOKEN_BYTES (see there why)."""
    if len(tokens) > MAX_VOCAB_TOKENS:
        raise TokenizerError(
            f"tokenizer.ggml.tokens holds {len(tokens):,} tokens; strata-jax reads vocabularies of at most "
            f"{MAX_VOCAB_TOKENS:,} (the largest real ones: 262,144). This is not a real vocabulary: "
            "re-convert the model"
        )
    if max(map(len, tokens)) * 4 > MAX_TOKEN_BYTES:  # a character is at most 4 bytes: else none is too long
        for i, text in enumerate(tokens):
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > MAX_TOKEN_BYTES:
                raise TokenizerError(
                    f"tokenizer.ggml.tokens[{i}] is a token of {size:,} bytes; strata-jax reads tokens of at most "
                    f"{MAX_TOKEN_BYTES:,} bytes (llama.cpp's vocabularies: a few hundred at most). This is not a "
                    "real vocabulary: re-convert the model"
                )
    special = [text for text, kind in zip(tokens, token_types) if kind in (CONTROL, UNKNOWN, USER_DEFINED)]
    size = sum(len(text.encode("utf-8", "surrogatepass")) for text in special)
    if size > MAX_SPECIAL_TOKEN_BYTES:
        raise TokenizerError(
            f"tokenizer.ggml.tokens: its {len(special):,} CONTROL, USER_DEFINED and UNKNOWN tokens (by "
            f"tokenizer.ggml.token_type) hold {size:,} bytes; strata-jax matches at most {MAX_SPECIAL_TOKEN_BYTES:,} "
            "bytes of such tokens, as building their matcher takes seconds a MB (real vocabularies: well under "
            "100 KB). This is not a real vocabulary: re-convert the model"
        )


def _chain_by_length(parent: Sequence[int], lengths: Sequence[int], i: int) -> dict[int, int]:
    """The chain of token `i`'s `parent` links (its token prefixes, or suffixes), by length."""
    chain = {}
    j = parent[i]
    while j >= 0:
        chain[lengths[j]] = j
        j = parent[j]
    return chain


def _longest_token_prefixes(tokens: Sequence[str]) -> list[int]:
    """For each token, the id of its longest proper prefix that is also a token (-1 if none): following these
    ids from a token gives all its token prefixes, longest first.

    In sorted order every prefix of a string comes before it, and a prefix A of P is also a prefix of every
    string sorted between A and P. So a stack of tokens, each a prefix of the next, popped of those that are
    not a prefix of the next token in sorted order, holds exactly that token's token prefixes when it comes.
    """
    parent = [-1] * len(tokens)
    stack: list[int] = []
    for i in sorted(range(len(tokens)), key=tokens.__getitem__):
        text = tokens[i]
        while stack and not text.startswith(tokens[stack[-1]]):
            stack.pop()
        if stack:
            parent[i] = stack[-1]
        stack.append(i)
    return parent


def _is_byte_piece(text: str) -> bool:
    return len(text) == 6 and text.startswith("<0x") and text.endswith(">")
