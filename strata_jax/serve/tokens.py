"""llama.cpp's /tokenize and /detokenize, answered in the engine process with the engine's own tokenizer (the
one every prompt goes through), so the ids a client gets are the ids the engine would read.

    Tokenize(id, content: str | [str | int, ...], add_special, parse_special, with_pieces)
        -> Answer(id, tokens=[id, ...] | [{"id", "piece"}, ...])
    Detokenize(id, tokens: [int, ...])  -> Answer(id, content=str)

The server has checked the types (serve/llama_routes.py); ids are checked here against the tokenizer's
vocabulary, and one outside it is a "rejected" frame naming the field and the value.
"""

from __future__ import annotations

from typing import Any

from .protocol import Answer, Detokenize, Rejected, Tokenize


def answer(tokenizer: Any, cmd: Tokenize | Detokenize) -> Answer | Rejected:
    try:
        if isinstance(cmd, Tokenize):
            ids = tokenize_mixed(tokenizer, cmd.content, cmd.add_special, cmd.parse_special)
            out: list[Any] = ids
            if cmd.with_pieces:
                out = [{"id": i, "piece": _piece(tokenizer.token_bytes(i))} for i in ids]
            return Answer(cmd.id, tokens=out)
        _check_ids(tokenizer, cmd.tokens, "tokens")
        return Answer(cmd.id, content=tokenizer.decode(cmd.tokens))
    except _OutOfVocabulary as e:
        return Rejected(cmd.id, "invalid", str(e), param=e.param)


class _OutOfVocabulary(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def tokenize_mixed(tokenizer: Any, content: Any, add_special: bool, parse_special: bool) -> list[int]:
    """llama.cpp's tokenize_mixed: a text, or a list of texts and token ids in order; BOS (add_special) only
    before the first element, and only when it is a text."""
    if isinstance(content, str):
        return tokenizer.encode(content, add_special=add_special, parse_special=parse_special)
    _check_ids(tokenizer, [p for p in content if isinstance(p, int)], "content", positions=[
        i for i, p in enumerate(content) if isinstance(p, int)])
    ids: list[int] = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            ids += tokenizer.encode(part, add_special=add_special and i == 0, parse_special=parse_special)
        else:
            ids.append(part)
    return ids


def _check_ids(tokenizer: Any, ids: list[int], param: str, positions: list[int] | None = None) -> None:
    n = tokenizer.vocab_size
    for k, t in enumerate(ids):
        if not 0 <= t < n:
            where = positions[k] if positions is not None else k
            raise _OutOfVocabulary(f"{param}[{where}] = {t}: not a token id of this model's vocabulary "
                                   f"(0..{n - 1})", param)


def _piece(raw: bytes) -> str | list[int]:
    """llama.cpp's piece: the token's text when its bytes are valid UTF-8, else the list of its byte values (a
    token may hold part of a character)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)
