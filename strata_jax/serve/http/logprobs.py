"""Logprobs in OpenAI's response shapes, from the engine's token events.

The engine sends, with each token event of a request that asked for them, `[token bytes, logprob,
[[bytes, logprob], ...top alternatives]]` (worker.py): the raw model distribution's
log-probabilities (engine/execute/controls.py), before logit_bias, penalties, temperature, top_k,
top_p or min_p.

Chat (`logprobs: true`, `top_logprobs: N`): choice.logprobs = {"content": [{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": null}. Completions
(`logprobs: N`): choice.logprobs = {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
"text_offset"}. Streamed, each chunk carries the entries of the tokens whose text it carries (a
token whose text is held back, e.g. inside a possible stop string, goes with the next chunk).
"""

from __future__ import annotations

from typing import Any


def _text(raw: bytes) -> str:
    return bytes(raw).decode("utf-8", errors="replace")


def chat_entry(lp: list) -> dict[str, Any]:
    raw, logprob, top = lp
    return {"token": _text(raw), "logprob": logprob, "bytes": list(bytes(raw)),
            "top_logprobs": [{"token": _text(t), "logprob": v, "bytes": list(bytes(t))}
                             for t, v in top]}


def chat_logprobs(entries: list[list]) -> dict[str, Any]:
    return {"content": [chat_entry(lp) for lp in entries], "refusal": None}


def text_logprobs(entries: list[list], offset: int) -> dict[str, Any]:
    """Completions' shape; text_offset counts characters from `offset` (the text before these
    tokens)."""
    tokens, offsets = [], []
    for raw, _, _ in entries:
        offsets.append(offset)
        tokens.append(_text(raw))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [lp[1] for lp in entries],
            "top_logprobs": [_top_dict(lp[2]) for lp in entries], "text_offset": offsets}


def _top_dict(top: list) -> dict[str, float]:
    """{token text: logprob}, most probable first; tokens whose text is the same (bytes of one
    character, shown as U+FFFD alone) keep the first, most probable, entry."""
    out: dict[str, float] = {}
    for t, v in top:
        out.setdefault(_text(t), v)
    return out


class LogprobsOf:
    """One choice's logprobs: entries not yet sent (streams) and all of them (whole answers)."""

    def __init__(self, chat: bool, wanted: bool, offset: int = 0):
        self.chat, self.wanted = chat, wanted
        self.pending: list[list] = []
        self.all: list[list] = []
        self.offset = offset              # completions' text_offset of the next token sent

    def add(self, lp: list | None) -> None:
        if self.wanted and lp is not None:
            self.pending.append(lp)
            self.all.append(lp)

    def take(self) -> dict[str, Any] | None:
        """The pending entries in the response's shape (None if logprobs were not asked for)."""
        if not self.wanted:
            return None
        entries, self.pending = self.pending, []
        if self.chat:
            return chat_logprobs(entries)
        out = text_logprobs(entries, self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out

    def whole(self) -> dict[str, Any] | None:
        if not self.wanted:
            return None
        return chat_logprobs(self.all) if self.chat else text_logprobs(self.all, self.offset)
