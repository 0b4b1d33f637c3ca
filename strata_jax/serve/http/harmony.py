"""gpt-oss's harmony format split into reasoning, answer and calls as it streams: the reasoning
parser of a chat whose template speaks harmony (in reasoning.py's place).

The model writes messages, each a header and a body (llama.cpp's common/parsers/gpt-oss.cpp reads
them the same way):

    <|channel|>analysis<|message|>I should look it up.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>

(the generation prompt ends with `<|start|>assistant`, so the first message has no `<|start|>`).
`<|return|>` ends the answer after a `final` message, `<|call|>` after a call (both end generation:
gguf/vocab.py), `<|end|>` any other message. By channel:

- analysis: the reasoning (`reasoning_content`); with `reasoning_format: none`, content as written;
- final, and commentary to no one (a preamble the user may see): the answer (`content`);
- a message to `functions.NAME` (in the channel's header or the role's): a call. With tools in play
  it goes on as content in one normal form, `<|start|>assistant to=functions.NAME<|message|>ARGS`,
  whatever header the model wrote, for the harmony CallStream (tool_formats/harmony_calls.py);
  without tools, and to any other recipient (gpt-oss's built-in browser or python), it is left out,
  as llama.cpp leaves out calls no tool asked for.

Text that is no harmony message (a model that does not follow it) is content. Headers are held
until their `<|message|>`; bodies stream, holding back only what may be the start of an end mark.

HarmonyTokens counts the reasoning tokens (usage's reasoning_tokens): the analysis messages' body
tokens, by token id, as the engine's Thinking counts those inside <think> for the other formats.
"""

from __future__ import annotations

import re

from ..tool_formats.marks import (
    H_CALL,
    H_CHANNEL,
    H_END,
    H_MESSAGE,
    H_RETURN,
    H_START,
    HARMONY_CALL,
)
from .reasoning import CONTENT, REASONING, _partial_suffix

# A header: [<|start|>ROLE] [to=RECIPIENT] [<|channel|>CHANNEL] [to=RECIPIENT] [[<|constrain|>]TYPE]
_HEADER = re.compile(
    r"\s*(?:<\|start\|>\s*(?P<role>[^\s<]+))?(?:\s*to=(?P<to1>[^\s<]+))?"
    r"(?:\s*<\|channel\|>\s*(?P<channel>[^\s<]+))?(?:\s*to=(?P<to2>[^\s<]+))?"
    r"(?:\s*(?:<\|constrain\|>)?\s*[^\s<]+)?\s*")
_OPENERS = (H_START, H_CHANNEL, "to=")
_ENDS = (H_END, H_CALL, H_RETURN, H_START)      # what ends a body (<|start|>: a new message)
MAX_HEADER = 256                                # chars: longer, it is no header


class HarmonySplit:
    """feed(text) / flush() -> [(REASONING | CONTENT, text)], as ReasoningParser's. enabled: the
    analysis channel is the reasoning (else content, as written); calls: tools are in play (a call
    goes on as content, in its normal form; else it is left out)."""

    def __init__(self, enabled: bool = True, calls: bool = False):
        self.enabled, self.calls = enabled, calls
        self.saw_reasoning = False
        self._buf = ""
        self._in_body = False
        self._plain = False             # the body is text that was no header
        # the current body's: REASONING, CONTENT, "raw" (analysis shown as written), "drop"
        self._kind = CONTENT

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        return self._run(final=False)

    def flush(self) -> list[tuple[str, str]]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while self._buf and (self._body(out, final) if self._in_body else self._header(out, final)):
            pass
        return out

    # each returns whether it consumed something (then the loop goes on)

    def _header(self, out: list, final: bool) -> bool:
        buf = self._buf
        at = buf.find(H_MESSAGE)
        head = buf if at < 0 else buf[:at]
        m = _HEADER.fullmatch(head) if at >= 0 else None
        if m is None:
            if at < 0 and _may_be_header(buf):
                if not final:
                    return False                # wait for its <|message|>
                self._buf = ""                  # a header cut short (max_tokens): no text
                return False
            self._in_body, self._kind = True, CONTENT       # no harmony: text as it is
            self._plain = True
            return True
        self._buf = buf[at + len(H_MESSAGE):]
        self._in_body, self._plain = True, False
        to = _recipient(m)
        if to:
            self._kind = CONTENT if self.calls and to.startswith("functions.") else "drop"
            if self._kind == CONTENT:
                _emit(out, CONTENT, HARMONY_CALL + to[len("functions."):] + H_MESSAGE)
        elif m.group("channel") == "analysis":
            self.saw_reasoning = self.saw_reasoning or self.enabled
            self._kind = REASONING if self.enabled else "raw"
            if not self.enabled:
                _emit(out, CONTENT, head.lstrip() + H_MESSAGE)
        else:
            self._kind = CONTENT
        return True

    def _body(self, out: list, final: bool) -> bool:
        buf = self._buf
        # (text that was no header and opens with <|start|>: that <|start|> is text, or it would be
        # read as a header again)
        found = [(j, mark) for mark in _ENDS
                 if (j := buf.find(mark, 1 if self._plain and mark == H_START else 0)) >= 0]
        if not found:
            keep = 0 if final else max(_partial_suffix(buf, mark) for mark in _ENDS)
            self._say(out, buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            if final:
                self._buf = ""
            return False
        j, mark = min(found)
        self._say(out, buf[:j])
        if self._kind == "raw" and mark == H_END:
            _emit(out, CONTENT, H_END)
        # a new message's <|start|> stays: its header is read next
        self._buf = buf[j + (0 if mark == H_START else len(mark)):]
        self._in_body = False
        return True

    def _say(self, out: list, text: str) -> None:
        if self._kind != "drop":
            _emit(out, REASONING if self._kind == REASONING else CONTENT, text)


class HarmonyTokens:
    """The answer's reasoning tokens, counted as the engine emits them (one token id at a time):
    the tokens of analysis messages' bodies, neither their headers nor their marks, whether the
    server splits the analysis out or not (reasoning_format none), as the engine's Thinking counts
    the tokens inside <think> (engine/schedule/thinking.py). By id, not by text: harmony's marks are
    tokens of their own, so each token is in a body or not, wherever a held stop string's text goes.
    A vocabulary without the marks counts none."""

    def __init__(self, tokenizer):
        ids = {m: tokenizer.token_to_id(m) for m in (H_MESSAGE, *_ENDS)}
        self.decode = tokenizer.decode
        self.message, self.start = ids[H_MESSAGE], ids[H_START]
        self.ends = {ids[m] for m in _ENDS} - {None}
        self.tokens = 0
        self._header: list[int] | None = []     # the header read so far; None: in a body
        self._analysis = False                  # the body is an analysis message's

    def add(self, token: int) -> None:
        if self._header is None:
            if token in self.ends:              # a new message's <|start|> opens its header
                self._header = [token] if token == self.start else []
            elif self._analysis:
                self.tokens += 1
            return
        if token != self.message:
            self._header.append(token)
            if len(self._header) > MAX_HEADER:  # text that is no harmony: no reasoning
                self._header, self._analysis = None, False
            return
        m = _HEADER.fullmatch(self.decode(self._header))
        # (as HarmonySplit reads a header: a message to a recipient is a call, not reasoning)
        self._analysis = bool(m and not _recipient(m) and m.group("channel") == "analysis")
        self._header = None


def _recipient(m: re.Match) -> str | None:
    """A header's recipient (`to=`), None for the assistant itself: a message to anyone else is a
    call (functions.NAME) or another tool's."""
    to = m.group("to1") or m.group("to2")
    return None if to in (None, "assistant") else to


def _may_be_header(buf: str) -> bool:
    """Whether `buf` (no <|message|> yet) may still become a header: it opens like one (or is the
    start of an opener) and is short."""
    lead = buf.lstrip()
    return len(buf) <= MAX_HEADER and any(lead.startswith(o) or o.startswith(lead)
                                          for o in _OPENERS)


def _emit(out: list, kind: str, text: str) -> None:
    if text:
        out.append((kind, text))


def split_harmony(text: str, enabled: bool = True,
                  calls: bool = False) -> tuple[str | None, str]:
    """Whole text -> (reasoning or None, content): what the streamed pieces add up to."""
    p = HarmonySplit(enabled, calls)
    parts = p.feed(text) + p.flush()
    reasoning = "".join(t for k, t in parts if k == REASONING)
    return (reasoning if p.saw_reasoning and enabled else None,
            "".join(t for k, t in parts if k == CONTENT))
