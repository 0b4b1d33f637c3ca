"""llama.cpp's /tokenize and /detokenize, answered in the engine process with the engine's own
tokenizer (the one every prompt goes through), so the ids a client gets are the ids the engine would
read.

    Tokenize(id, content: str | [str | int, ...], add_special, parse_special, with_pieces)
        -> Answer(id, tokens=[id, ...] | [{"id", "piece"}, ...])
    Detokenize(id, tokens: [int, ...])  -> Answer(id, content=str)

The server has checked the types and the sizes it can see (serve/llama/llama_routes.py: the text's
bytes, the ids); ids are checked here against the tokenizer's vocabulary, and one outside it is a
"rejected" frame naming the field and the value. What only the answer tells is bounded here, before
it is built or sent: a text of more ids than `max_ids` (--max-tokenize-ids), ids whose text is
longer than `max_bytes` (--max-tokenize-bytes), refused as "too_large" (a 413). These run on a
thread of their own (serve/worker/worker.py), and a long text's tokenizing lets go of the GIL
(gguf/tokenizer.py), so the engine loop and its heartbeat go on meanwhile.
"""

from __future__ import annotations

from typing import Any

from .errors import ApiError
from .protocol import Answer, Detokenize, Rejected, Tokenize


def answer(tokenizer: Any, cmd: Tokenize | Detokenize) -> Answer | Rejected:
    try:
        if isinstance(cmd, Tokenize):
            ids = tokenize_mixed(tokenizer, cmd.content, cmd.add_special, cmd.parse_special)
            if cmd.max_ids and len(ids) > cmd.max_ids:
                return Rejected(cmd.id, "too_large",
                                f"content: its text is {len(ids)} tokens; /tokenize answers at "
                                f"most {cmd.max_ids} (--max-tokenize-ids)", param="content")
            out: list[Any] = ids
            if cmd.with_pieces:
                out = [{"id": i, "piece": _piece(tokenizer.token_bytes(i))} for i in ids]
            return Answer(cmd.id, tokens=out)
        _check_ids(tokenizer, cmd.tokens, "tokens")
        text = tokenizer.decode(cmd.tokens)
        size = len(text.encode("utf-8", "surrogatepass"))
        if cmd.max_bytes and size > cmd.max_bytes:
            return Rejected(cmd.id, "too_large",
                            f"tokens: their text is {size} bytes; /detokenize answers at most "
                            f"{cmd.max_bytes} (--max-tokenize-bytes)", param="tokens")
        return Answer(cmd.id, content=text)
    except _OutOfVocabulary as e:
        return Rejected(cmd.id, "invalid", str(e), param=e.param)


def check_sizes(value: Any, param: str, max_bytes: int, max_ids: int) -> None:
    """The server's check, before anything reads more: /tokenize's content (a text, or texts and
    ids) or /detokenize's tokens beyond --max-tokenize-bytes of text or --max-tokenize-ids ids is a
    413 naming the field, its size and the bound. Counted before the parts' types are checked
    (anything not a text counts as an id), so a list of millions costs a count, not a check each."""
    parts = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    texts = [p for p in parts if isinstance(p, str)]
    n_ids = len(parts) - len(texts)
    if n_ids > max_ids:
        raise ApiError(413, f"{param}: {n_ids} token ids; /tokenize and /detokenize read at most "
                            f"{max_ids} (--max-tokenize-ids)", "invalid_request_error", param)
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if size > max_bytes:
        raise ApiError(413, f"{param}: {size} bytes of text; /tokenize reads at most {max_bytes} "
                            "(--max-tokenize-bytes)", "invalid_request_error", param)


class _OutOfVocabulary(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def tokenize_mixed(tokenizer: Any, content: Any, add_special: bool,
                   parse_special: bool) -> list[int]:
    """llama.cpp's tokenize_mixed: a text, or a list of texts and token ids in order; BOS
    (add_special) only before the first element, and only when it is a text."""
    if isinstance(content, str):
        return tokenizer.encode(content, add_special=add_special, parse_special=parse_special)
    _check_ids(tokenizer, [p for p in content if isinstance(p, int)], "content", positions=[
        i for i, p in enumerate(content) if isinstance(p, int)])
    ids: list[int] = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            ids += tokenizer.encode(part, add_special=add_special and i == 0,
                                    parse_special=parse_special)
        else:
            ids.append(part)
    return ids


def _check_ids(tokenizer: Any, ids: list[int], param: str,
               positions: list[int] | None = None) -> None:
    n = tokenizer.vocab_size
    for k, t in enumerate(ids):
        if not 0 <= t < n:
            where = positions[k] if positions is not None else k
            raise _OutOfVocabulary(f"{param}[{where}] = {t}: not a token id of this model's "
                                   f"vocabulary (0..{n - 1})", param)


def _piece(raw: bytes) -> str | list[int]:
    """llama.cpp's piece: the token's text when its bytes are valid UTF-8, else the list of its byte
    values (a token may hold part of a character)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)
