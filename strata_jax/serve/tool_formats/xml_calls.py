"""CallStream's states for Qwen3-Coder's XML calls (qwen3_coder: Qwen3.5, Qwen3-Coder), after
<tool_call>:

    <function=get_weather>
    <parameter=city>
    Zürich
    </parameter>
    </function>
    </tool_call>

A value is the text between its tags less the newline on each side: a string property's as it is,
any other's JSON (as the template renders them: `tojson` for objects and arrays, the text of the
rest); llama.cpp's common/parsers/qwen3-coder.cpp reads them the same way."""

from __future__ import annotations

from .marks import FUNCTION, FUNCTION_END, HERMES_CLOSE, PARAMETER, PARAMETER_END


class XmlCalls:
    """A part of CallStream (the attributes these states read and set are CallStream's; the
    key/value pairs are NamedCalls' _pair / _pairs_end)."""

    def _xml_function(self, final: bool) -> bool:
        """<function=NAME>: the call starts once its name is known to be a tool's."""
        rest = self.rest.lstrip()
        if not rest.startswith(FUNCTION):
            if final or not FUNCTION.startswith(rest):
                return self._fail()
            return False
        j = rest.find(">")
        if j < 0:
            return self._fail() if final or len(rest) > 256 or "\n" in rest else False
        name = rest[len(FUNCTION):j].strip()
        if name not in self.fns:
            return self._fail()
        self.i = len(self.buf) - len(rest) + j + 1
        self._begin(name)
        self._n_pairs = 0
        self.state = "xml_args"
        return True

    def _xml_args(self, final: bool) -> bool:
        """<parameter=KEY>\\nVALUE\\n</parameter> pairs, a piece of the arguments each, up to
        </function>."""
        rest = self.rest.lstrip()
        at = len(self.buf) - len(rest)
        if rest.startswith(FUNCTION_END):
            self._args("}" if self._n_pairs else "{}")
            self.i = at + len(FUNCTION_END)
            self.state = "xml_close"
            return True
        if rest.startswith(PARAMETER):
            j, end = rest.find(">"), rest.find(PARAMETER_END)
            if 0 <= j < end:
                raw = rest[j + 1:end].removeprefix("\n").removesuffix("\n")
                self._pair(rest[len(PARAMETER):j].strip(), raw)
                self.i = at + end + len(PARAMETER_END)
                return True
            if end >= 0:
                return self._pairs_broken()
        elif rest and not (PARAMETER.startswith(rest) or FUNCTION_END.startswith(rest)):
            return self._pairs_broken()
        return self._stop() if final else False

    def _xml_close(self, final: bool) -> bool:
        """</tool_call> after </function> (a call the answer ends without it is still whole)."""
        rest = self.rest.lstrip()
        if rest.startswith(HERMES_CLOSE):
            self.i = len(self.buf) - len(rest) + len(HERMES_CLOSE)
        # (rest may be "": the mark may be coming)
        elif not final and HERMES_CLOSE.startswith(rest):
            return False
        self._complete()
        self.state = "content" if self.parallel else "ignore"
        return True
