"""Splitting a model's output into its reasoning (`<think>...</think>`) and its answer, as it
streams.

Text arrives in pieces that may cut a tag anywhere (`</th` + `ink>`), so the parser holds back the
end of what it has that could still become a tag, and emits the rest. Rules (as llama.cpp's
"deepseek" format):

- output starts inside the reasoning when the chat template opened it (the generation prompt ends
  with `<think>`, as Qwen3's and DeepSeek-R1's do); else a `<think>` before any answer text opens
  it;
- `</think>` closes it; a `<think>` later in the answer is just text;
- with tools, the format's call mark (`<tool_call>`) closes it too, and is the answer's first text
  (as llama.cpp's thinking end tags for Qwen3-Coder / Qwen3.5: a call is never reasoning, so a call
  forced while the template has opened the reasoning is a call);
- whitespace at the start of each part and at the end of the reasoning is dropped
  (`<think>\\n...\\n</think>\\n\\n`).

    p = ReasoningParser(in_reasoning=True)
    p.feed("Let me th") + p.feed("ink</th") + p.feed("ink>\\n\\nParis") + p.flush()
    -> [("reasoning", "Let me th"), ("reasoning", "ink"), ("content", "Paris")]
"""

from __future__ import annotations

REASONING, CONTENT = "reasoning", "content"


class ReasoningParser:
    def __init__(self, in_reasoning: bool = False, enabled: bool = True, open_tag: str = "<think>",
                 close_tag: str = "</think>", call_mark: str | None = None):
        self.enabled = enabled
        self.call_mark = call_mark
        self.in_reasoning = enabled and in_reasoning
        self.saw_reasoning = self.in_reasoning
        self.open_tag, self.close_tag = open_tag, close_tag
        self._held = ""
        # no answer text yet: a <think> may still open reasoning
        self._may_open = enabled and not in_reasoning
        # drop leading whitespace of the part just opened
        self._strip = self.in_reasoning

    def feed(self, text: str) -> list[tuple[str, str]]:
        if not self.enabled:
            return [(CONTENT, text)] if text else []
        out: list[tuple[str, str]] = []
        buf = self._held + text
        self._held = ""
        while buf:
            if self.in_reasoning:
                buf = self._reasoning(buf, out)
            else:
                buf = self._content(buf, out)
        return out

    def flush(self) -> list[tuple[str, str]]:
        """The end of the output: what was held back is text after all (trailing reasoning space
        goes)."""
        held, self._held = self._held, ""
        if not held:
            return []
        if self.in_reasoning:
            held = held.rstrip()
            return [(REASONING, held)] if held else []
        return [(CONTENT, held)]

    # each returns the part of `buf` still to parse; what must wait for more text goes to self._held

    def _reasoning(self, buf: str, out: list) -> str:
        if self._strip:
            buf = buf.lstrip()
            if not buf:
                return ""
            self._strip = False
        end = buf.find(self.close_tag)
        call = buf.find(self.call_mark) if self.call_mark else -1
        # a call: the reasoning ends, the mark is the answer's
        if call >= 0 and (end < 0 or call < end):
            _emit(out, REASONING, buf[:call].rstrip())
            self.in_reasoning = False
            return buf[call:]
        if end >= 0:
            _emit(out, REASONING, buf[:end].rstrip())
            self.in_reasoning, self._strip = False, True
            return buf[end + len(self.close_tag):]
        # hold a possible start of the close tag (or call mark), and trailing space (it goes if the
        # tag follows)
        keep = max(_partial_suffix(buf, self.close_tag), _partial_suffix(buf, self.call_mark or ""))
        body = buf[:len(buf) - keep]
        stripped = body.rstrip()
        _emit(out, REASONING, stripped)
        self._held = buf[len(stripped):]
        return ""

    def _content(self, buf: str, out: list) -> str:
        if self._strip:                               # just after </think>
            buf = buf.lstrip()
            if not buf:
                return ""
            self._strip = False
        if self._may_open:
            lead = buf.lstrip()
            if lead.startswith(self.open_tag):
                self.in_reasoning = self.saw_reasoning = True
                self._may_open, self._strip = False, True
                return lead[len(self.open_tag):]
            if self.open_tag.startswith(lead):       # could still become <think>
                self._held = buf
                return ""
            self._may_open = False
        _emit(out, CONTENT, buf)
        return ""


def _emit(out: list, kind: str, text: str) -> None:
    if text:
        out.append((kind, text))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_reasoning(text: str, in_reasoning: bool = False, enabled: bool = True,
                    call_mark: str | None = None) -> tuple[str | None, str]:
    """Whole text -> (reasoning or None, content): what the streamed pieces add up to."""
    p = ReasoningParser(in_reasoning, enabled, call_mark=call_mark)
    parts = p.feed(text) + p.flush()
    reasoning = "".join(t for k, t in parts if k == REASONING)
    content = "".join(t for k, t in parts if k == CONTENT)
    return (reasoning if p.saw_reasoning else None), content
