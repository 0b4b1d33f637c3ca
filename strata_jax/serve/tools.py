"""Tool calling: OpenAI's `tools` / `tool_choice` to the chat template and a grammar, and the model's text back
to `message.tool_calls`.

Two formats, chosen in the engine process by what the model's template does with `tools` (worker.prepare):
- "hermes": the template renders the tools (Qwen's, Hermes'), and the model answers a call as
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- "generic": the template knows no tools (SmolLM2's): llama.cpp's generic way, the tools are described in a
  system message and a call is the JSON object `{"name": ..., "arguments": {...}}` alone.
`tool_choice: "required"` or a named function constrains the output to a call (call_grammar: llguidance's
Lark with the call's JSON schema), so even a weak model emits a valid one; "auto" lets the model choose;
"none" renders no tools.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from ..engine.constrain import JSON_LAYOUT
from .errors import invalid

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def tool_request(tools: list[dict] | None, tool_choice: Any) -> tuple[list[dict], Any] | None:
    """The request's (tools, choice) after OpenAI's rules, or None when no tool is in play; 400 naming the field."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise invalid(f"tool_choice = {json.dumps(tool_choice)[:80]}: the request has no tools", "tool_choice")
        return None
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise invalid(f"tools[{i}]: a tool is {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                          "\"parameters\": {...}}}", f"tools[{i}]")
        if not isinstance(fn.get("parameters", {}), dict):
            raise invalid(f"tools[{i}].function.parameters must be a JSON schema (an object)", f"tools[{i}]")
        names.append(fn["name"])
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) and choice.get("type") == "function" else None
        if name not in names:
            raise invalid(f"tool_choice = {json.dumps(choice)[:80]}: names no tool of the request ({', '.join(names)})",
                          "tool_choice")
    elif choice not in ("auto", "none", "required"):
        raise invalid(f"tool_choice = {json.dumps(choice)[:80]}: one of auto, none, required, or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    return tools, choice


def forced(choice: Any) -> bool:
    return choice == "required" or isinstance(choice, dict)


def call_schema(tools: list[dict], choice: Any) -> dict:
    """The JSON schema of one call to any of the tools (or the named one)."""
    fns = [t["function"] for t in tools]
    if isinstance(choice, dict):
        fns = [f for f in fns if f["name"] == choice["function"]["name"]]
    one = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                             "arguments": f.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False} for f in fns]
    return one[0] if len(one) == 1 else {"anyOf": one}


def call_grammar(tools: list[dict], choice: Any, fmt: str) -> list[str]:
    """The engine's grammar ([kind, text, field]) that makes the output one call in the template's format."""
    schema = call_schema(tools, choice)
    if fmt == "generic":
        return ["json_schema", json.dumps(schema), "tools"]
    # %json inside Lark takes its layout from the schema's x-guidance (constrain.JSON_LAYOUT's, as for schemas)
    schema = {**schema, "x-guidance": JSON_LAYOUT}
    lark = f'start: "{HERMES_OPEN}\\n" call "\\n{HERMES_CLOSE}"\ncall: %json {json.dumps(schema)}\n'
    return ["lark", lark, "tools"]


def generic_messages(messages: list[dict], tools: list[dict], describe: bool = True) -> list[dict]:
    """llama.cpp's generic way for a template that knows no tools: a system message says what the tools are
    and how to call one (unless not `describe`: tool_choice none); earlier calls become their JSON text, tool
    results a `tool` message's content."""
    desc = "\n".join(json.dumps(t["function"]) for t in tools)
    system = ("You can call these tools (JSON schemas of their arguments):\n" + desc + "\nTo call one, answer "
              "with only a JSON object: {\"name\": <tool name>, \"arguments\": {<its arguments>}}. Otherwise "
              "answer in plain text.")
    out = [dict(m) for m in messages]
    if not describe:
        pass
    elif out and out[0].get("role") == "system":
        out[0]["content"] = (out[0].get("content") or "") + "\n\n" + system
    else:
        out.insert(0, {"role": "system", "content": system})
    for m in out:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}
                     for c in m.pop("tool_calls")]
            m["content"] = ((m.get("content") or "") + json.dumps(calls[0] if len(calls) == 1 else calls)).strip()
    return out


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages for a template that renders tools (HF's convention): a call's arguments as an object."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments":
                                      _arguments(c["function"].get("arguments"))}} for c in m["tool_calls"]]}
        out.append(m)
    return out


def _arguments(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


_HERMES = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), re.DOTALL)


def parse_calls(text: str, fmt: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
    """The model's answer -> (content left, OpenAI tool_calls); ([] when it holds no valid call)."""
    names = {t["function"]["name"] for t in tools}
    found, rest = [], text
    if fmt == "hermes":
        for body in _HERMES.findall(text):
            call = _call(body, names)
            if call is None:
                return text, []
            found.append(call)
        rest = _HERMES.sub("", text).strip()
    else:
        stripped = text.strip()
        call = _call(stripped, names) if stripped.startswith("{") else None
        if call is not None:
            found, rest = [call], ""
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": n, "arguments": json.dumps(a)}} for n, a in found]
    return (rest or None) if calls else text, calls


def _call(body: str, names: set[str]) -> tuple[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if isinstance(obj, dict) and obj.get("name") in names and isinstance(obj.get("arguments", {}), dict):
        return obj["name"], obj.get("arguments", {})
    return None


def may_be_call(text: str, fmt: str) -> bool:
    """Whether streamed content so far may still turn out to be a call (then it is held back, not sent)."""
    t = text.lstrip()
    if fmt == "hermes":
        return HERMES_OPEN.startswith(t) or t.startswith(HERMES_OPEN)
    return t == "" or t.startswith("{")


def stream_deltas(calls: list[dict]) -> list[dict]:
    """OpenAI's streamed pieces of the calls: one delta.tool_calls entry a call, with its index."""
    return [{"tool_calls": [{"index": i, **c}]} for i, c in enumerate(calls)]


class HeldCalls:
    """A streamed chat choice's content deltas, held back while they may be a tool call: at the end a call
    goes out as delta.tool_calls (`calls` set), anything else as the content it was."""

    def __init__(self, tools: list[dict] | None, fmt: str | None):
        self.tools, self.fmt = tools, fmt
        self.text, self.holding, self.calls = "", bool(tools), []

    def feed(self, pieces: list, last: bool = False) -> list:
        if not self.holding:
            return pieces
        out = []
        for piece in pieces:
            if isinstance(piece, dict) and "content" in piece and self.holding:
                self.text += piece["content"]
                if not may_be_call(self.text, self.fmt):
                    self.holding = False
                    out.append({"content": self.text})
            else:
                out.append(piece)
        if last and self.holding:
            self.holding = False
            rest, self.calls = parse_calls(self.text, self.fmt, self.tools)
            out += ([{"content": rest}] if rest else []) + stream_deltas(self.calls)
        return out


def tool_prompt(tk, messages: list, kwargs: dict, tools: list, choice) -> tuple[list, dict, dict]:
    """The messages and template variables for a chat with tools, and {"tool_format", "grammar"} (tools.py):
    the template's own rendering when it shows the tools (their first name appears in the text), else
    llama.cpp's generic way."""
    own = template_messages(messages)
    name = tools[0]["function"]["name"]
    try:
        text = tk.apply_chat_template(**{"messages": own, "add_generation_prompt": True, **kwargs, "tools": tools})
        fmt = "hermes" if name in text and name not in tk.apply_chat_template(
            **{"messages": own, "add_generation_prompt": True, **kwargs}) else "generic"
    except ValueError:          # a template that cannot render these messages (tool_calls, tool roles)
        fmt = "generic"
    if fmt == "hermes":         # tool_choice none: the template without the tools (vLLM's default)
        messages, kwargs = own, {**kwargs, "tools": tools} if choice != "none" else kwargs
    else:
        messages = generic_messages(messages, tools, describe=choice != "none")
    grammar = call_grammar(tools, choice, fmt) if forced(choice) else None
    return messages, kwargs, {"tool_format": fmt, "grammar": grammar}
