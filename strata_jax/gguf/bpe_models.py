"""The `tokenizers` models of the two BPE kinds: byte-level from the file's merges, SentencePiece
from its scores."""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from strata_jax.gguf.pretokenizers import PreTokenizer
from strata_jax.gguf.vocab import (
    BYTE,
    CONTROL,
    MAX_SPM_MERGES,
    UNKNOWN,
    USER_DEFINED,
    TokenizerError,
)

# The tokenizer's log, whichever of its modules writes to it.
_log = logging.getLogger("strata_jax.gguf.tokenizer")

SPACE_MARK = "\u2581"  # SentencePiece's visible space

# Pieces up to this long have their merges found by slicing (a few dozen cuts at most); longer ones
# by chains.
_SHORT_PIECE = 64


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte written as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_level_model(ids: dict[str, int], merges: list[str], spec: PreTokenizer) -> _HFTokenizer:
    """Byte-level BPE over `ids` (token -> id) with the file's merges, splitting text first as
    `spec` says."""
    pairs, dropped = [], []
    for i, merge in enumerate(merges):
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise TokenizerError(f"tokenizer.ggml.merges[{i}] = {merge!r} is not two tokens "
                                 "separated by a space")
        # The `tokenizers` library refuses (or panics on) a merge whose parts or result are not
        # tokens. Such a merge can only produce text that is then spelled in smaller tokens, so it
        # is left out.
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
        # Missing ASCII bytes break plain text; missing rare lead bytes (SmolLM2 lacks 0xF1..0xF4)
        # are a note.
        level = logging.WARNING if min(missing) < 0x80 else logging.INFO
        _log.log(level, "%d of the 256 bytes have no token in this byte-level vocabulary (first: "
                  "0x%02X); text holding them cannot be encoded and they are left out",
                  len(missing), missing[0])
    tk = _HFTokenizer(models.BPE(vocab=ids, merges=pairs, ignore_merges=spec.ignore_merges))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tk.decoder = decoders.ByteLevel()
    return tk


def sentencepiece_model(tokens: list[str], scores: Sequence[float], token_types: Sequence[int],
                        ids: dict[str, int],
                        unk_id: int | None, add_space_prefix: bool) -> _HFTokenizer:
    """SentencePiece BPE over the pieces, merged best score first, with `<0xXX>` byte pieces for the
    rest."""
    unk = tokens[unk_id] if unk_id is not None else None
    merges = sentencepiece_merges(tokens, scores, token_types, ids)
    tk = _HFTokenizer(models.BPE(vocab=ids, merges=merges, unk_token=unk, fuse_unk=True,
                                 byte_fallback=True))
    # A normalizer, not `Metaspace`: llama.cpp puts the space before every stretch of text between
    # special tokens, even one that starts with a space, where `Metaspace` adds none. The stretch is
    # not cut at spaces: pieces may hold several.
    spaces = normalizers.Replace(" ", SPACE_MARK)
    if add_space_prefix:
        tk.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARK), spaces])
    else:
        tk.normalizer = spaces
    tk.decoder = decoders.Sequence([decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(),
                                    decoders.Fuse()])
    return tk


def sentencepiece_merges(tokens: list[str], scores: Sequence[float], token_types: Sequence[int],
                         ids: dict[str, int]) -> list[tuple[str, str]]:
    """The merges of a SentencePiece vocabulary (the file stores none), in the order they apply."""
    # Every way to cut a piece into two pieces is a merge; a better-scored result merges first.
    # Ties: longer left part first (as transformers orders them), then vocabulary order.
    # The cuts tried are at the piece's token prefixes only (a chain, see
    # `_longest_token_prefixes`). For a long piece the right parts are found the same way, from its
    # chain of token suffixes, not by slicing and hashing: that keeps the cost linear in the
    # vocabulary's length, where trying every cut of every piece is quadratic in a piece's length
    # (0.6 s for one piece of 60,000 characters here). The sort keys go in flat arrays: 24 bytes a
    # merge, not a tuple of five Python objects.
    lengths = [len(t) for t in tokens]
    prefix = _longest_token_prefixes(tokens)
    suffix: list[int] | None = None  # made when a long piece first needs it
    by_score, by_lengths, by_ids = array("d"), array("q"), array("q")
    add_score, add_lengths, add_ids = by_score.append, by_lengths.append, by_ids.append
    for i, kind in zip(range(len(tokens)), token_types):
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
                f"tokenizer.ggml.tokens: its first {i + 1:,} SentencePiece pieces already make "
                f"more than {MAX_SPM_MERGES:,} merges (pairs of pieces that join into a piece), "
                "where real vocabularies make one to two a piece. This is not a real vocabulary: "
                "re-convert the model"
            )
    keys = np.frombuffer(by_ids, dtype=np.int64)
    order = np.lexsort((keys, np.frombuffer(by_lengths, dtype=np.int64), np.frombuffer(by_score)))
    return [(tokens[k >> 32], tokens[k & 0xFFFFFFFF]) for k in keys[order].tolist()]


def add_special_tokens(tk: _HFTokenizer, tokens: Sequence[str], token_types: Sequence[int]) -> None:
    """Have `tk` match CONTROL, UNKNOWN and USER_DEFINED tokens whole in the text, before anything
    else."""
    special, plain = [], []
    for text, kind in zip(tokens, token_types):
        if kind in (CONTROL, UNKNOWN):
            special.append(AddedToken(text, special=True, normalized=False))
        elif kind == USER_DEFINED:
            plain.append(AddedToken(text, special=False, normalized=False))
    # Both keep their ids: the text is already in the model's vocabulary.
    tk.add_special_tokens(special)
    tk.add_tokens(plain)


def _chain_by_length(parent: Sequence[int], lengths: Sequence[int], i: int) -> dict[int, int]:
    """The chain of token `i`'s `parent` links (its token prefixes, or suffixes), by length."""
    chain = {}
    j = parent[i]
    while j >= 0:
        chain[lengths[j]] = j
        j = parent[j]
    return chain


def _longest_token_prefixes(tokens: Sequence[str]) -> list[int]:
    """For each token, the id of its longest proper prefix that is also a token (-1 if none):
    following these ids from a token gives all its token prefixes, longest first.

    In sorted order every prefix of a string comes before it, and a prefix A of P is also a prefix
    of every string sorted between A and P. So a stack of tokens, each a prefix of the next, popped
    of those that are not a prefix of the next token in sorted order, holds exactly that token's
    token prefixes when it comes.
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

