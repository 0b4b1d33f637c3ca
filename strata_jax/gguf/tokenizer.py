"""The tokenizer a GGUF file describes, built with the `tokenizers` library.

A GGUF stores no `tokenizer.json`: it stores llama.cpp's description of the vocabulary
(`tokenizer.ggml.*`), and llama.cpp's behaviour is the definition of what those keys mean. Two kinds
are supported:

- `tokenizer.ggml.model = gpt2`: byte-level BPE. The vocabulary and merges are in the file; how text
  is split before merging is named by `tokenizer.ggml.pre` (see `pretokenizers.py`).
- `tokenizer.ggml.model = llama`: SentencePiece BPE. The file has pieces and scores but no merges; a
  pair merges when the piece it makes is in the vocabulary, best score first (llama.cpp's
  `llm_tokenizer_spm`), which is BPE with merges ranked by the merged piece's score. Spaces are
  written as U+2581, a space is put before the text and after every special token
  (`add_space_prefix`), and characters with no piece fall back to the `<0xXX>` byte pieces.

Tokens typed CONTROL, USER_DEFINED or UNKNOWN are matched whole in the text before anything else,
like llama.cpp does (`parse_special`). Decoding is done here, token by token, from each token's
bytes, so that streaming can hold back the bytes of a character that is not complete yet.

The file's keys are read and bounded in `vocab.py` (`Vocabulary`, which `Tokenizer` extends), and
the `tokenizers` models built in `bpe_models.py`.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from strata_jax.gguf.bpe_models import (
    SPACE_MARK,
    add_special_tokens,
    byte_level_model,
    bytes_to_unicode,
    sentencepiece_model,
)
from strata_jax.gguf.pretokenizers import PRE_TOKENIZERS
from strata_jax.gguf.vocab import (
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    USER_DEFINED,
    TokenizerError,
    Vocabulary,
    get_list,
    get_str,
)


def load_tokenizer(path_or_metadata: str | os.PathLike | Mapping[str, Any],
                   **kwargs: Any) -> Tokenizer:
    """A `Tokenizer` from a GGUF file (full model, first part of a split model, or vocabulary-only
    file like llama.cpp's ggml-vocab-*.gguf) or from its metadata as a dict of plain values.

    Keyword arguments go to `Tokenizer` (e.g. `chat_template=` to use a template the file does not
    have).
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


# str.translate table from the byte alphabet back to bytes (as latin-1 characters). Characters below
# 256 that are not in the alphabet map to U+FFFF, so encoding the result as latin-1 fails for any
# text that is not written in the alphabet.
_UNBYTE = {ord(ch): b for b, ch in bytes_to_unicode().items()}
# A text longer than this is encoded by encode_batch, which lets go of the GIL while it works: a
# text of megabytes takes seconds, which must not stop the engine loop and its heartbeat (issue 32,
# item 4)
_HOLDS_GIL = 1 << 16
_UNBYTE.update({c: 0xFFFF for c in range(256) if c not in _UNBYTE})


def _byte_level_bytes(text: str) -> bytes | None:
    try:
        return text.translate(_UNBYTE).encode("latin-1")
    except UnicodeEncodeError:
        return None


class Tokenizer(Vocabulary):
    """Encode, decode and chat-format text the way the GGUF's vocabulary says.

    Attributes: `model` ("gpt2" or "llama"), `pre` (pre-tokenizer name, gpt2 only), `vocab_size`,
    `bos_id`, `eos_id`, `eot_id`, `eom_id`, `unk_id`, `pad_id` (int or None), `eos_ids` (every id
    that ends generation), `add_bos`, `add_eos`, `add_space_prefix`, `chat_template` (str or None).
    """

    def __init__(self, metadata: Mapping[str, Any], *, chat_template: str | None = None):
        super().__init__(metadata)
        self.chat_template: str | None = (chat_template
                                          or get_str(metadata, "tokenizer.chat_template"))
        self._template = None  # compiled lazily

        if self.model == "llama":
            self._tk = sentencepiece_model(self.tokens, self.scores, self.token_types, self._ids,
                                           self.unk_id, self.add_space_prefix)
        else:
            merges = get_list(metadata, "tokenizer.ggml.merges", str)
            if not merges:
                raise TokenizerError("tokenizer.ggml.merges is missing: a gpt2 (byte-level BPE) "
                                     "vocabulary needs them")
            self._tk = byte_level_model(self._ids, merges, PRE_TOKENIZERS[self.pre])
        add_special_tokens(self._tk, self.tokens, self.token_types)
        # a copy that leaves special-token text as text, made when first needed
        self._tk_no_special = None
        self._pieces, self._skippable = self._decoding_tables()

    def use_chat_template(self, source: str) -> None:
        """Render chats with this template instead of the model's (--chat-template /
        --chat-template-file)."""
        self.chat_template, self._template = source, None

    # ---- construction

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
        parse_special: text of control tokens (e.g. "<|im_start|>") becomes that token; with False
        it is encoded as ordinary text (user-defined tokens are still matched, as in llama.cpp).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        tk = self._tk if parse_special else self._no_special_tokenizer()
        # encode_batch lets go of the GIL (encode does not): other threads run
        if len(text) > _HOLDS_GIL:
            ids = tk.encode_batch([text], add_special_tokens=False)[0].ids
        else:
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

        skip_special: leave out control tokens (BOS, EOS, <|im_start|>, ...). For SentencePiece
        vocabularies the space that encoding puts before the text is taken off again.
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

    def stream_decoder(self, skip_special: bool = False,
                       start_of_text: bool = False) -> StreamDecoder:
        """An incremental decoder: `.add(token_id)` returns only complete characters, `.flush()` the
        rest.

        start_of_text: the tokens start the text (not a continuation of a prompt), so the
        SentencePiece prefix space is taken off like `decode` does.
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
        """A control token (BOS, EOS, <|im_start|>, ...), left out by
        `decode(skip_special=True)`."""
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
        """The prompt text for a chat, rendered with the model's template
        (`tokenizer.chat_template`).

        Extra keyword arguments reach the template as variables (e.g. `enable_thinking=False`; any
        name, even `self`), and override the special tokens. Raises NoChatTemplateError when the
        model has none and `chat_template` is not given, ChatTemplateError when rendering fails or
        passes its bounds (output size, time: see template_bounds.py).
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
        return template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                               **variables)

    def __repr__(self) -> str:
        pre = f", pre={self.pre!r}" if self.pre else ""
        return (
            f"Tokenizer(model={self.model!r}{pre}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_ids={sorted(self.eos_ids)})"
        )

    # ---- helpers

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < len(self.tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary "
                             f"(0..{len(self.tokens) - 1})")
        return int(token_id)

    def _no_special_tokenizer(self) -> _HFTokenizer:
        if self._tk_no_special is None:
            tk = _HFTokenizer.from_str(self._tk.to_str())
            tk.encode_special_tokens = True
            self._tk_no_special = tk
        return self._tk_no_special


class StreamDecoder:
    """Turns token ids into text as they arrive, never splitting a character across two outputs.

    A character can span several tokens (byte-level BPE pieces, `<0xXX>` byte tokens): its bytes are
    held until it is complete. The outputs joined, plus `flush()`, equal `Tokenizer.decode` of all
    the ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False,
                 start_of_text: bool = False):
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


def _is_byte_piece(text: str) -> bool:
    return len(text) == 6 and text.startswith("<0x") and text.endswith(">")
