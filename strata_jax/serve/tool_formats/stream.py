"""CallStream: one answer's content read as it arrives, into content text and calls with their
arguments."""

from __future__ import annotations

import json

from .deepseek_calls import DeepSeekCalls
from .harmony_calls import HarmonyCalls
from .json_calls import JsonCalls
from .json_scan import JsonScan
from .marks import PYTHON_TAG, call_id, call_mark, mistral_id
from .named_calls import NamedCalls
from .xml_calls import XmlCalls

# the state that reads what follows a format's call mark (hermes: hermes_body)
_AFTER_MARK = {"mistral": "mistral_open", "mistral_args": "mistral_name", "glm45": "glm_name",
               "qwen3_coder": "xml_function", "harmony": "harmony_name",
               "deepseek_v3": "ds_next", "deepseek_v31": "ds_next"}


class CallStream(JsonCalls, NamedCalls, XmlCalls, HarmonyCalls, DeepSeekCalls):
    """One answer's content -> events, as it arrives: ("content", text), ("call", index, id, name),
    ("args", index, json_text). `feed` what came, `end` at the end of the answer; `calls` holds each
    call started so far as {"id", "name", "arguments", "complete"}. Text that may still turn out to
    be a call is held back; a call to no tool of the request, or one that is not a call after all,
    is content.

    The reading is a state machine: state S is the method `_S` (False: wait for more text), those
    that read one family's calls in JsonCalls (json_calls.py), NamedCalls (named_calls.py) and
    XmlCalls (xml_calls.py), HarmonyCalls (harmony_calls.py) and DeepSeekCalls
    (deepseek_calls.py)."""

    def __init__(self, fmt: str, tools: list[dict], parallel: bool = True):
        self.fmt, self.parallel = fmt, parallel
        self.fns = {t["function"]["name"]: t["function"] for t in tools}
        self.buf, self.i = "", 0            # the text fed, and how much of it is consumed
        self.calls: list[dict] = []
        self.state = "start" if fmt in ("llama3", "generic") else "content"
        # where the call being read began (its text is content if it fails)
        self.seg = 0
        self.scan: JsonScan | None = None
        # of the current call's arguments: chars of the value sent
        self._sent = 0
        self._array = False                 # reading a JSON array of calls (mistral, generic)
        self._out: list[tuple] = []
        self._content_seen, self._ws = False, ""
        self._pending_name, self._n_pairs = "", 0

    # -- feeding

    def feed(self, text: str) -> list[tuple]:
        self.buf += text
        return self._run(final=False)

    def end(self) -> list[tuple]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[tuple]:
        while getattr(self, "_" + self.state)(final):
            pass
        out, self._out = self._out, []
        return out

    @property
    def rest(self) -> str:
        return self.buf[self.i:]

    def _content(self, final: bool) -> bool:
        """Text before, between and after calls, watching for the mark that opens one."""
        mark = call_mark(self.fmt)
        rest = self.rest
        at = rest.find(mark)
        if at < 0:
            keep = 0 if final else _partial_suffix(rest, mark)
            self._say(rest[:len(rest) - keep])
            self.i += len(rest) - keep
            return False
        self._say(rest[:at])
        self.seg, self.i = self.i + at, self.i + at + len(mark)
        self.state = _AFTER_MARK.get(self.fmt, "hermes_body")
        return True

    def _text(self, final: bool) -> bool:
        """Not a call after all: everything left is content."""
        self._say(self.rest)
        self.i = len(self.buf)
        return False

    def _ignore(self, final: bool) -> bool:
        """parallel_tool_calls false: what follows the first call is left out."""
        self.i = len(self.buf)
        return False

    def _start(self, final: bool) -> bool:
        """llama3 / generic: a call is the whole answer, so it opens with { (or [, or
        <|python_tag|>)."""
        rest = self.rest.lstrip()
        tagged = self.fmt == "llama3" and rest.startswith(PYTHON_TAG)
        body = rest[len(PYTHON_TAG):].lstrip() if tagged else rest
        if not final and (not body or (self.fmt == "llama3" and PYTHON_TAG.startswith(rest))):
            return False
        self.seg = self.i
        if body.startswith("{"):
            self.i, self.state = len(self.buf) - len(body), "json_call"
        elif body.startswith("[") and self.fmt == "generic":
            self.i, self.state, self._array = len(self.buf) - len(body) + 1, "array_next", True
        else:
            self.state = "text"
        return True

    # -- bookkeeping

    def _started(self) -> bool:
        return bool(self.calls) and not self.calls[-1]["done"]

    def _begin(self, name: str, cid: str | None = None) -> None:
        cid = (cid if cid and (not self.fmt.startswith("mistral") or mistral_id(cid) == cid)
               else call_id(self.fmt))
        self.calls.append({"id": cid, "name": name, "arguments": "", "complete": False,
                           "done": False})
        self._sent = 0
        self._out.append(("call", len(self.calls) - 1, cid, name))

    def _args(self, text: str) -> None:
        if text:
            self.calls[-1]["arguments"] += text
            self._out.append(("args", len(self.calls) - 1, text))

    def _complete(self, broken: bool = False) -> None:
        call = self.calls[-1]
        call["done"] = True
        call["complete"] = not broken and _is_object(call["arguments"])
        self.seg = self.i                       # a later failure is content from here

    def _args_read(self) -> str:
        """The state after a call's JSON arguments (mistral_args, harmony, deepseek)."""
        if self.fmt.startswith("deepseek"):
            return "ds_after"
        return "content" if self.parallel else "ignore"

    def _stop(self) -> bool:
        """The answer ended inside a call (max_tokens): it stays incomplete."""
        self.calls[-1]["done"] = True
        self.i, self.state = len(self.buf), "ignore"
        return False

    def _fail(self) -> bool:
        """Not a call: its text is content, read again from where the call began (after its
        mark)."""
        self.scan, self._array = None, False
        self.i = self.seg
        mark = call_mark(self.fmt)
        if mark is None:
            self.state = "text"
        else:
            if self.buf.startswith(mark, self.seg):
                self._say(mark)
                self.i += len(mark)
            self.state = "content"
        return True

    def _say(self, text: str) -> None:
        """Content out; whitespace is held until more content follows (none before or between
        calls)."""
        if not text:
            return
        if not text.strip():
            self._ws += text
            return
        text = ((self._ws if self._content_seen else "")
                + (text if self._content_seen else text.lstrip()))
        self._ws, self._content_seen = "", True
        self._out.append(("content", text))


def _partial_suffix(text: str, mark: str) -> int:
    """The length of the longest end of text that begins mark (held back: the mark may be
    coming)."""
    for k in range(min(len(mark) - 1, len(text)), 0, -1):
        if mark.startswith(text[-k:]):
            return k
    return 0


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
