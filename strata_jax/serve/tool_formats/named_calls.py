"""CallStream's states for calls whose name is written before their arguments: mistral_args and
glm45 (and the key/value pairs that glm45 and qwen3_coder (xml_calls.py) write their arguments
as)."""

from __future__ import annotations

import json
import re
from typing import Any

from .json_scan import JsonScan
from .marks import (
    ARG_KEY,
    ARG_KEY_END,
    ARG_VALUE,
    ARG_VALUE_END,
    ARGS,
    CALL_ID,
    HERMES_CLOSE,
    is_string,
    parameters,
)

# JSON as constrain.JSON_LAYOUT lays it out
_SEP = {"separators": (", ", ": "), "ensure_ascii": False}


class NamedCalls:
    """The name after the opening mark, then the arguments: one JSON object after [ARGS]
    (mistral_args), or <arg_key>/<arg_value> pairs (glm45). A part of CallStream: the attributes
    these states read and set are CallStream's."""

    # -- Mistral's [TOOL_CALLS]name[ARGS]{...}

    def _mistral_name(self, final: bool) -> bool:
        rest = self.rest
        at = [j for j in (rest.find(ARGS), rest.find(CALL_ID)) if j >= 0]
        if not at:
            if final or len(rest) > 256 or "\n" in rest:
                return self._fail()
            return False
        j = min(at)
        name = rest[:j].strip()
        if name not in self.fns:
            return self._fail()
        self._pending_name = name
        if rest.startswith(CALL_ID, j):
            self.i += j + len(CALL_ID)
            self.state = "mistral_id"
        else:
            self.i += j + len(ARGS)
            self._begin(name)
            self.state = "mistral_args"
        return True

    def _mistral_id(self, final: bool) -> bool:
        rest = self.rest
        j = rest.find(ARGS)
        if j < 0:
            return self._fail() if final or len(rest) > 64 else False
        self.i += j + len(ARGS)
        self._begin(self._pending_name, rest[:j].strip() or None)
        self.state = "mistral_args"
        return True

    def _mistral_args(self, final: bool) -> bool:
        if self.scan is None:
            rest = self.rest.lstrip()
            if not rest:
                return self._stop() if final else False
            self.i = len(self.buf) - len(rest)
            if not rest.startswith("{"):
                self._complete(broken=True)
                self.state = "content"
                return True
            self.scan = JsonScan()
        scan = self.scan
        scan.feed(self.rest)
        self.i = len(self.buf)
        upto = scan.end if scan.end is not None else len(scan.text)
        self._args(scan.text[self._sent:upto])
        self._sent = upto
        if scan.end is None:
            return self._stop() if final else False
        self.i -= len(scan.text) - scan.end
        self.scan = None
        self._complete()
        self.state = self._args_read()
        return True

    # -- GLM-4.5's <tool_call>name <arg_key>k</arg_key> <arg_value>v</arg_value> </tool_call>

    def _glm_name(self, final: bool) -> bool:
        rest = self.rest
        at = [j for j in (rest.find("\n"), rest.find(ARG_KEY), rest.find(HERMES_CLOSE)) if j >= 0]
        if not at:
            return self._fail() if final or len(rest) > 256 else False
        j = min(at)
        name = rest[:j].strip()
        if name not in self.fns:
            return self._fail()
        self.i += j
        self._begin(name)
        self._n_pairs = 0
        self.state = "glm_args"
        return True

    def _glm_args(self, final: bool) -> bool:
        rest = self.rest.lstrip()
        if rest.startswith(HERMES_CLOSE):
            self.i = len(self.buf) - len(rest) + len(HERMES_CLOSE)
            self._pairs_end()
            self.state = "content" if self.parallel else "ignore"
            return True
        if rest.startswith(ARG_KEY):
            end = rest.find(ARG_VALUE_END)
            if end >= 0:
                m = re.match(re.escape(ARG_KEY) + r"(.*?)" + re.escape(ARG_KEY_END) + r"\s"
                             r"*" + re.escape(ARG_VALUE) + r"(.*)", rest[:end], re.DOTALL)
                if m is None:
                    return self._pairs_broken()
                self._pair(m.group(1).strip(), m.group(2))
                self.i = len(self.buf) - len(rest) + end + len(ARG_VALUE_END)
                return True
        elif rest and not (ARG_KEY.startswith(rest) or HERMES_CLOSE.startswith(rest)):
            return self._pairs_broken()
        return self._stop() if final else False

    # -- arguments as key/value pairs (glm45, qwen3_coder)

    def _pair(self, key: str, raw: str) -> None:
        """One argument, its key and its raw text: a string property's value is the text, any
        other's is JSON (the text itself where it is not JSON); sent as the next piece of the
        arguments' JSON object."""
        prop = (parameters(self.fns[self.calls[-1]["name"]]).get("properties") or {}).get(key)
        value = raw if is_string(prop) else _json_or_text(raw)
        self._args(("{" if not self._n_pairs else ", ") + json.dumps(key, **_SEP) + ": "
                   + json.dumps(value, **_SEP))
        self._n_pairs += 1

    def _pairs_end(self, broken: bool = False) -> None:
        self._args("}" if self._n_pairs else "{}")
        self._complete(broken)

    def _pairs_broken(self) -> bool:
        self._pairs_end(broken=True)
        self.state = "content"
        return True


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw
