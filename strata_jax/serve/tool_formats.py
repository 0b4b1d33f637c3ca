"""The tool-call formats of the model families we serve: which one a chat template speaks, the grammar that
forces a call in it, and the parser that turns the model's text into calls as it arrives.

| format         | a call, as the model writes it                                                  | template says  |
| -------------- | ------------------------------------------------------------------------------- | -------------- |
| "hermes"       | `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` (Qwen, Hermes) | `<tool_call>`  |
| "llama3"       | `{"name": "f", "parameters": {...}}`, maybe after `<|python_tag|>`; `; ` between | `ipython`      |
| "mistral"      | `[TOOL_CALLS][{"name": "f", "arguments": {...}, "id": "a1b2c3d4e"}, ...]` (Nemo)  | `[TOOL_CALLS]` |
| "mistral_args" | `[TOOL_CALLS]f[ARGS]{...}`, once a call (Mistral Small 3.2, Devstral, Magistral) | `[ARGS]`       |
| "glm45"        | `<tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>`  | `<arg_key>`    |
| "generic"      | `{"name": "f", "arguments": {...}}` or an array of them: the whole answer       | (no tools)     |

(llama.cpp's common/chat.cpp tells them apart by the same marks; vLLM has a parser for each.) A mark that is
one special token of the vocabulary (`[TOOL_CALLS]` in Mistral's) is that token in the grammar (`<[id]>`),
so a forced call is written with it, as the model was trained to.

`CallStream` reads one answer's content as it comes, piece by piece, and says what it holds: content text,
the start of a call (its index, id, name), and pieces of its arguments (JSON text) as the model writes them.
The whole answer is parsed by the same object, so a streamed answer and a whole one are the same calls.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from typing import Any

from ..engine.constrain import JSON_LAYOUT

FORMATS = ("hermes", "llama3", "mistral", "mistral_args", "glm45", "generic")
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_SEP = {"separators": (", ", ": "), "ensure_ascii": False}      # JSON as JSON_LAYOUT lays it out


def detect(template: str | None) -> str:
    """The format of a template that renders the tools, told by the marks in its source (llama.cpp's way);
    "hermes" when it has none of them."""
    t = template or ""
    if ARG_KEY in t:
        return "glm45"
    if TOOL_CALLS in t:
        return "mistral_args" if ARGS in t else "mistral"
    if "ipython" in t or PYTHON_TAG in t:
        return "llama3"
    return "hermes"


def call_id(fmt: str) -> str:
    """A new call's id: Mistral's templates take exactly 9 letters or digits, the others OpenAI's call_..."""
    if fmt.startswith("mistral"):
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_id(cid: Any) -> Any:
    """An id a Mistral template accepts (9 letters or digits), the same for the same id: ids from other
    servers (call_...) are mapped, so a conversation carried over still renders."""
    if not isinstance(cid, str) or re.fullmatch(r"[A-Za-z0-9]{9}", cid):
        return cid
    return uuid.uuid5(uuid.NAMESPACE_URL, cid).hex[:9]


# ---- grammars (a forced call: tool_choice required or a named function) ---------------------------------


def call_grammar(fmt: str, fns: list[dict], parallel: bool, specials: dict[str, int]) -> list[str]:
    """The engine's grammar [kind, text, field] that makes the output a call (several if `parallel`) in `fmt`
    to one of `fns` (the tools' "function" objects). specials: mark text -> id of the one special token it is."""
    def lit(text: str) -> str:
        return f"<[{specials[text]}]>" if text in specials else json.dumps(text, ensure_ascii=False)

    if fmt == "generic":
        one = _any_call(fns, "arguments")
        schema = {"anyOf": [one, {"type": "array", "items": one, "minItems": 1}]} if parallel else one
        return ["json_schema", json.dumps(schema), "tools"]
    if fmt == "glm45":
        rules = [_glm_call(i, f, lit) for i, f in enumerate(fns)]
        calls = " | ".join(f"call{i}" for i in range(len(fns)))
        think = f'({lit("<think>")} {lit("</think>")} "\\n"?)?'   # GLM opens its answer with <think></think>
        start = f'start: {think} call ("\\n" call)*' if parallel else f"start: {think} call"
        return ["lark", "\n".join([start, f"call: {calls}", *rules]) + "\n", "tools"]
    if fmt == "mistral_args":
        rules = [f"call{i}: {lit(TOOL_CALLS)} {json.dumps(f['name'])} {lit(ARGS)} %json "
                 f"{json.dumps(_layout(_params(f)))}" for i, f in enumerate(fns)]
        calls = " | ".join(f"call{i}" for i in range(len(fns)))
        return ["lark", "\n".join(["start: call+" if parallel else "start: call", f"call: {calls}", *rules]) + "\n",
                "tools"]
    if fmt == "mistral":
        one = _any_call(fns, "arguments", with_id=True)
        body = 'call ("," " " call)*' if parallel else "call"
        return ["lark", f'start: {lit(TOOL_CALLS)} "[" {body} "]"\ncall: %json {json.dumps(_layout(one))}\n', "tools"]
    if fmt == "llama3":         # one call: Llama 3.1's template renders no more than one a message
        return ["lark", f"start: call\ncall: %json {json.dumps(_layout(_any_call(fns, 'parameters')))}\n", "tools"]
    one = f"call: %json {json.dumps(_layout(_any_call(fns, 'arguments')))}"
    tc = f'{lit(HERMES_OPEN)} "\\n" call "\\n" {lit(HERMES_CLOSE)}'
    start = f'start: tc ("\\n" tc)*\ntc: {tc}' if parallel else f"start: {tc}"
    return ["lark", f"{start}\n{one}\n", "tools"]


def _params(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object"}


def _layout(schema: dict) -> dict:
    # %json inside Lark takes its layout from the schema's x-guidance (constrain.JSON_LAYOUT's, as for schemas)
    return {**schema, "x-guidance": JSON_LAYOUT}


def _any_call(fns: list[dict], args_key: str, with_id: bool = False) -> dict:
    """The JSON schema of one call object to any of fns: {"name": ..., args_key: {...}} (and Mistral's "id")."""
    one = []
    for f in fns:
        props: dict[str, Any] = {"name": {"const": f["name"]}, args_key: _params(f)}
        if with_id:
            props["id"] = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
        one.append({"type": "object", "properties": props, "required": list(props), "additionalProperties": False})
    return one[0] if len(one) == 1 else {"anyOf": one}


def _glm_call(i: int, fn: dict, lit) -> str:
    """GLM-4.5's call to fn: one <arg_key>/<arg_value> pair a property, in the schema's order (the optional
    ones may be left out); a string value is its raw text (no <), any other a JSON value."""
    params = _params(fn)
    required = set(params.get("required") or ())
    pairs = []
    for key, prop in (params.get("properties") or {}).items():
        value = _glm_string(prop) if is_string(prop) else f"%json {json.dumps(_layout(prop))}"
        pair = (f"{lit(ARG_KEY)} {json.dumps(key, ensure_ascii=False)} {lit(ARG_KEY_END)} \"\\n\" {lit(ARG_VALUE)} "
                f"{value} {lit(ARG_VALUE_END)} \"\\n\"")
        pairs.append(f"({pair})" if key in required else f"({pair})?")
    body = " ".join(pairs) or '""'
    return f"call{i}: {lit(HERMES_OPEN)} {json.dumps(fn['name'])} \"\\n\" {body} {lit(HERMES_CLOSE)}"


def is_string(prop: Any) -> bool:
    """Whether a property's value is a string (GLM writes those raw, everything else as JSON)."""
    if not isinstance(prop, dict):
        return False
    if prop.get("type") == "string":
        return True
    options = prop.get("enum") or ([prop["const"]] if "const" in prop else None)
    return bool(options) and all(isinstance(o, str) for o in options)


def _glm_string(prop: dict) -> str:
    options = prop.get("enum") or ([prop["const"]] if "const" in prop else None)
    if options:
        return "(" + " | ".join(json.dumps(o, ensure_ascii=False) for o in options) + ")"
    lo, hi = int(prop.get("minLength", 0)), prop.get("maxLength")
    return f"/[^<]{{{lo},{'' if hi is None else int(hi)}}}/"


# ---- parsing ----------------------------------------------------------------------------------------------


class _JsonScan:
    """One JSON object or array as its text arrives: where it ends, and where each of its own keys' values
    lie (spans into the text it was fed). It checks brackets and strings only: json.loads says the rest."""

    def __init__(self):
        self.text, self.depth, self.in_str, self.esc = "", 0, False, False
        self.end: int | None = None           # one past the closing bracket
        self.keys: dict[str, list] = {}       # key -> [start, end or None]
        self._key_at: int | None = None        # a key's opening quote (depth 1)
        self._expect_key, self._key = True, None
        self._open: list | None = None         # the value span being read (depth 1)

    def feed(self, text: str) -> None:
        base = len(self.text)
        self.text += text
        for i, c in enumerate(text, base):
            if self.end is not None:
                return
            self._char(i, c)

    def _char(self, i: int, c: str) -> None:
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
                if self.depth == 1 and self._key_at is not None:
                    try:
                        self._key = json.loads(self.text[self._key_at:i + 1])
                    except ValueError:
                        self._key = None
                    self._key_at = None
                elif self.depth == 1 and self._open is not None:
                    self._open[1] = i + 1
                    self._open = None
            return
        if self._open is not None and self.depth == 1 and (c.isspace() or c in ",}]"):
            self._open[1], self._open = i, None          # the end of a number, true, false or null
        if c.isspace():
            return
        if c == '"':
            self.in_str = True
            if self.depth == 1 and self._expect_key:
                self._key_at = i
            elif self.depth == 1:
                self._start_value(i)
        elif c in "{[":
            if self.depth == 1 and not self._expect_key:
                self._start_value(i)
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1 and self._open is not None:
                self._open[1], self._open = i + 1, None
            if self.depth == 0:
                self.end = i + 1
        elif self.depth == 1 and c == ":":
            self._expect_key = False
        elif self.depth == 1 and c == ",":
            self._expect_key = True
        elif self.depth == 1 and not self._expect_key and self._open is None:
            self._start_value(i)

    def _start_value(self, i: int) -> None:
        self._open = [i, None]
        if self._key is not None and self._key not in self.keys:
            self.keys[self._key] = self._open
        self._key = None

    def value(self, key: str) -> Any:
        span = self.keys.get(key)
        if not span or span[1] is None:
            return None
        try:
            return json.loads(self.text[span[0]:span[1]])
        except ValueError:
            return None


class CallStream:
    """One answer's content -> events, as it arrives: ("content", text), ("call", index, id, name),
    ("args", index, json_text). `feed` what came, `end` at the end of the answer; `calls` holds each call
    started so far as {"id", "name", "arguments", "complete"}. Text that may still turn out to be a call is
    held back; a call to no tool of the request, or one that is not a call after all, is content."""

    def __init__(self, fmt: str, tools: list[dict], parallel: bool = True):
        self.fmt, self.parallel = fmt, parallel
        self.fns = {t["function"]["name"]: t["function"] for t in tools}
        self.buf, self.i = "", 0            # the text fed, and how much of it is consumed
        self.calls: list[dict] = []
        self.state = "start" if fmt in ("llama3", "generic") else "content"
        self.seg = 0                        # where the call being read began (its text is content if it fails)
        self.scan: _JsonScan | None = None
        self._sent = 0                      # of the current call's arguments: chars of the value sent
        self._array = False                 # reading a JSON array of calls (mistral, generic)
        self._out: list[tuple] = []
        self._content_seen, self._ws = False, ""
        self._pending_name, self._glm_n = "", 0

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
        mark = TOOL_CALLS if self.fmt.startswith("mistral") else HERMES_OPEN
        rest = self.rest
        at = rest.find(mark)
        if at < 0:
            keep = 0 if final else _partial_suffix(rest, mark)
            self._say(rest[:len(rest) - keep])
            self.i += len(rest) - keep
            return False
        self._say(rest[:at])
        self.seg, self.i = self.i + at, self.i + at + len(mark)
        self.state = {"mistral": "mistral_open", "mistral_args": "mistral_name", "glm45": "glm_name"}.get(
            self.fmt, "hermes_body")
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
        """llama3 / generic: a call is the whole answer, so it opens with { (or [, or <|python_tag|>)."""
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

    # -- calls written as JSON objects

    def _json_call(self, final: bool) -> bool:
        """A call object {"name": ..., "arguments" (llama3: "parameters"): {...}}: its arguments are sent as
        they come, once its name is known."""
        if self.scan is None:
            self.scan = _JsonScan()
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
                      "hermes_close" if self.fmt == "hermes" else "llama_next" if self.fmt == "llama3" else "text")
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
        self.state = "array_next" if rest.startswith(",") else "content" if self.fmt == "mistral" else "text"
        if not rest.startswith(","):
            self._array = False
        return True

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
            self.scan = _JsonScan()
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
        self.state = "content" if self.parallel else "ignore"
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
        self._glm_n = 0
        self.state = "glm_args"
        return True

    def _glm_args(self, final: bool) -> bool:
        rest = self.rest.lstrip()
        call = self.calls[-1]
        if rest.startswith(HERMES_CLOSE):
            self._args("}" if self._glm_n else "{}")
            self.i = len(self.buf) - len(rest) + len(HERMES_CLOSE)
            self._complete()
            self.state = "content" if self.parallel else "ignore"
            return True
        if rest.startswith(ARG_KEY):
            end = rest.find(ARG_VALUE_END)
            if end >= 0:
                m = re.match(re.escape(ARG_KEY) + r"(.*?)" + re.escape(ARG_KEY_END) + r"\s*" + re.escape(ARG_VALUE)
                             + r"(.*)", rest[:end], re.DOTALL)
                if m is None:
                    return self._glm_broken()
                key, raw = m.group(1).strip(), m.group(2)
                prop = (_params(self.fns[call["name"]]).get("properties") or {}).get(key)
                value = raw if is_string(prop) else _json_or_text(raw)
                self._args(("{" if not self._glm_n else ", ") + json.dumps(key, **_SEP) + ": "
                           + json.dumps(value, **_SEP))
                self._glm_n += 1
                self.i = len(self.buf) - len(rest) + end + len(ARG_VALUE_END)
                return True
        elif rest and not (ARG_KEY.startswith(rest) or HERMES_CLOSE.startswith(rest)):
            return self._glm_broken()
        return self._stop() if final else False

    def _glm_broken(self) -> bool:
        self._args("}" if self._glm_n else "{}")
        self._complete(broken=True)
        self.state = "content"
        return True

    # -- bookkeeping

    def _started(self) -> bool:
        return bool(self.calls) and not self.calls[-1]["done"]

    def _begin(self, name: str, cid: str | None = None) -> None:
        cid = cid if cid and (not self.fmt.startswith("mistral") or mistral_id(cid) == cid) else call_id(self.fmt)
        self.calls.append({"id": cid, "name": name, "arguments": "", "complete": False, "done": False})
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

    def _stop(self) -> bool:
        """The answer ended inside a call (max_tokens): it stays incomplete."""
        self.calls[-1]["done"] = True
        self.i, self.state = len(self.buf), "ignore"
        return False

    def _fail(self) -> bool:
        """Not a call: its text is content, read again from where the call began (after its mark)."""
        self.scan, self._array = None, False
        self.i = self.seg
        mark = TOOL_CALLS if self.fmt.startswith("mistral") else HERMES_OPEN
        if self.fmt in ("llama3", "generic"):
            self.state = "text"
        else:
            if self.buf.startswith(mark, self.seg):
                self._say(mark)
                self.i += len(mark)
            self.state = "content"
        return True

    def _say(self, text: str) -> None:
        """Content out; whitespace is held until more content follows (none before or between calls)."""
        if not text:
            return
        if not text.strip():
            self._ws += text
            return
        text = (self._ws if self._content_seen else "") + (text if self._content_seen else text.lstrip())
        self._ws, self._content_seen = "", True
        self._out.append(("content", text))


def _partial_suffix(text: str, mark: str) -> int:
    """The length of the longest end of text that begins mark (held back: the mark may be coming)."""
    for k in range(min(len(mark) - 1, len(text)), 0, -1):
        if mark.startswith(text[-k:]):
            return k
    return 0


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
