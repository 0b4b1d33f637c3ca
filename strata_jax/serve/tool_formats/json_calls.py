"""CallStream's states for calls written as JSON objects: hermes, llama3, mistral and generic."""

from __future__ import annotations

from .json_scan import JsonScan
from .marks import HERMES_CLOSE


class JsonCalls:
    """A call object alone (llama3, generic), inside <tool_call> marks (hermes), or in a JSON array
    of them (mistral after [TOOL_CALLS], generic). A part of CallStream: the attributes these states
    read and set are CallStream's."""

    def _json_call(self, final: bool) -> bool:
        """A call object {"name": ..., "arguments" (llama3: "parameters"): {...}}: its arguments are
        sent as they come, once its name is known."""
        if self.scan is None:
            self.scan = JsonScan()
        scan = self.scan
        scan.feed(self.rest)
        self.i = len(self.buf)
        args_key = next((k for k in ("arguments", "parameters") if k in scan.keys), None)
        if not self._started():
            name = scan.value("name")
            if scan.keys.get("name", [0, None])[1] is not None and name not in self.fns:
                return self._fail()
            if name in self.fns and args_key and scan.text[scan.keys[args_key][0]] == "{":
                self._begin(name)
        if self._started():
            span = scan.keys[args_key]
            upto = span[1] if span[1] is not None else len(scan.text)
            self._args(scan.text[span[0] + self._sent:upto])
            self._sent = upto - span[0]
        if scan.end is None:
            if final:
                return self._fail() if not self._started() else self._stop()
            return False
        self.i -= len(scan.text) - scan.end           # what follows the object is read again
        self.scan = None
        if not self._started():
            return self._fail()
        self._complete()
        self.state = ("ignore" if not self.parallel else "array_after" if self._array else
                      "hermes_close" if self.fmt == "hermes" else "llama_next"
                      if self.fmt == "llama3" else "text")
        return True

    def _hermes_body(self, final: bool) -> bool:
        rest = self.rest.lstrip()
        if not rest and not final:
            return False
        self.i = len(self.buf) - len(rest)
        if not rest.startswith("{"):
            return self._fail()
        self.state = "json_call"
        return True

    def _hermes_close(self, final: bool) -> bool:
        rest = self.rest.lstrip()
        if rest.startswith(HERMES_CLOSE):
            self.i, self.state = len(self.buf) - len(rest) + len(HERMES_CLOSE), "content"
            return True
        if not final and HERMES_CLOSE.startswith(rest):
            return False
        self.state = "content"            # a call without its closing mark: taken as it is
        return True

    def _llama_next(self, final: bool) -> bool:
        """Llama 3: calls after the first follow a `;`."""
        rest = self.rest.lstrip()
        if not rest and not final:
            return False
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
            if not rest and not final:
                return False
            if rest.startswith("{"):
                self.i = len(self.buf) - len(rest)
                self.state = "json_call"
                return True
        self.state = "text"
        return True

    def _mistral_open(self, final: bool) -> bool:
        rest = self.rest.lstrip()
        if not rest and not final:
            return False
        if not rest.startswith("["):
            return self._fail()
        self.i, self.state, self._array = len(self.buf) - len(rest) + 1, "array_next", True
        return True

    def _array_next(self, final: bool) -> bool:
        rest = self.rest.lstrip()
        if not rest and not final:
            return False
        if not rest.startswith("{"):
            return self._fail()
        self.i = len(self.buf) - len(rest)
        self.state = "json_call"
        return True

    def _array_after(self, final: bool) -> bool:
        rest = self.rest.lstrip()
        if not rest and not final:
            return False
        self.i = len(self.buf) - len(rest) + (1 if rest[:1] in (",", "]") else 0)
        self.state = ("array_next" if rest.startswith(",") else "content" if self.fmt == "mistral"
                      else "text")
        if not rest.startswith(","):
            self._array = False
        return True
