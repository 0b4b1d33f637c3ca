"""CallStream's states for DeepSeek's calls, after <｜tool▁calls▁begin｜> (llama.cpp's
common_chat_parse_deepseek_r1 and _v3_1 read them the same way):

    V3, R1:  <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
             ```json
             {"city": "Paris"}
             ```<｜tool▁call▁end｜>
    V3.1:    <｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>

then more calls (V3's template puts a newline between them), then <｜tool▁calls▁end｜>.
Either form is read whatever the template's (deepseek_v3 or deepseek_v31); the arguments
are one JSON object, read as Mistral's after [ARGS] (named_calls.py)."""

from __future__ import annotations

from .marks import DS_CALL, DS_CALL_END, DS_CALLS_END, DS_FENCE, DS_SEP

FENCE_END = "```"


class DeepSeekCalls:
    """A part of CallStream (the attributes these states read and set are CallStream's)."""

    def _ds_next(self, final: bool) -> bool:
        """In the calls' section: the next call, or the section's end."""
        rest = self.rest.lstrip()
        at = len(self.buf) - len(rest)
        if rest.startswith(DS_CALLS_END):
            self.i, self.state = at + len(DS_CALLS_END), "content"
            return True
        if rest.startswith(DS_CALL):
            self.i, self.state = at + len(DS_CALL), "ds_head"
            return True
        if not final and (DS_CALL.startswith(rest) or DS_CALLS_END.startswith(rest)):
            return False
        return self._fail()

    def _ds_head(self, final: bool) -> bool:
        """`function<｜tool▁sep｜>NAME\\n```json\\n` (V3) or `NAME<｜tool▁sep｜>` (V3.1)."""
        rest = self.rest
        j = rest.find(DS_SEP)
        if j < 0:
            return self._fail() if final or len(rest) > 256 else False
        head, after = rest[:j].strip(), rest[j + len(DS_SEP):]
        if head == "function":
            nl = after.find("\n")
            if nl < 0:
                return self._fail() if final or len(after) > 256 else False
            name = after[:nl].strip()
            if name not in self.fns:
                return self._fail()
            self.i += j + len(DS_SEP) + nl + 1
            self._pending_name, self.state = name, "ds_fence"
            return True
        if head not in self.fns:
            return self._fail()
        self.i += j + len(DS_SEP)
        self._begin(head)
        self.state = "mistral_args"
        return True

    def _ds_fence(self, final: bool) -> bool:
        """```json before V3's arguments (a call without it is read as well)."""
        rest = self.rest.lstrip()
        if rest.startswith(DS_FENCE):
            self.i = len(self.buf) - len(rest) + len(DS_FENCE)
        elif not final and DS_FENCE.startswith(rest):
            return False
        self._begin(self._pending_name)
        self.state = "mistral_args"
        return True

    def _ds_after(self, final: bool) -> bool:
        """After a call's arguments: V3's closing ```, then <｜tool▁call▁end｜> (either may be
        missing)."""
        rest = self.rest.lstrip()
        if rest.startswith(FENCE_END):
            rest = rest[len(FENCE_END):].lstrip()
        elif not final and FENCE_END.startswith(rest):
            return False
        if rest.startswith(DS_CALL_END):
            rest = rest[len(DS_CALL_END):]
        elif not final and DS_CALL_END.startswith(rest):
            return False
        self.i = self.seg = len(self.buf) - len(rest)
        self.state = "ds_next" if self.parallel else "ignore"
        return True
