"""Tool calling: OpenAI's `tools` / `tool_choice` / `parallel_tool_calls` to the chat template and a
grammar, and the model's text back to `message.tool_calls` (whole) or `delta.tool_calls` pieces
(streamed).

The format is chosen in the engine process by what the model's template does with `tools`
(worker.prepare -> tool_prompt): a template that renders them speaks its family's format, told by
its marks (tool_formats/: Hermes / Qwen, Llama 3, Mistral's two, GLM-4.5); one that knows no tools
(SmolLM2's) gets llama.cpp's generic way: the tools are described in a system message and a call is
the JSON object `{"name": ..., "arguments": {...}}` alone (or an array of them). `tool_choice:
"required"` or a named function constrains the output to a call in that format (call_grammar:
llguidance's Lark with the call's JSON schema), so even a weak model emits a valid one; "auto" lets
the model choose; "none" renders no tools. `parallel_tool_calls: false` allows one call: the grammar
writes one, and the parser reads only the first.
"""

from __future__ import annotations

import json
from typing import Any

from . import tool_formats as formats
from .errors import invalid
from .tool_formats import CallStream


def tool_request(tools: list[dict] | None, tool_choice: Any) -> tuple[list[dict], Any] | None:
    """The request's (tools, choice) after OpenAI's rules, or None when no tool is in play; 400
    naming the field."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise invalid(f"tool_choice = {json.dumps(tool_choice)[:80]}: the request has no tools",
                          "tool_choice")
        return None
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type", "function") == "function"
                and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise invalid(f"tools[{i}]: a tool is {{\"type\": \"function\", \"function\": "
                          "{\"name\": ..., \"parameters\": {...}}}", f"tools[{i}]")
        if not isinstance(fn.get("parameters", {}), dict):
            raise invalid(f"tools[{i}].function.parameters must be a JSON schema (an object)",
                          f"tools[{i}]")
        names.append(fn["name"])
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) and choice.get("type") == "function" else None
        if name not in names:
            raise invalid(f"tool_choice = {json.dumps(choice)[:80]}: names no tool of the request "
                          f"({', '.join(names)})", "tool_choice")
    elif choice not in ("auto", "none", "required"):
        raise invalid(f"tool_choice = {json.dumps(choice)[:80]}: one of auto, none, required, or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    return tools, choice


def forced(choice: Any) -> bool:
    return choice == "required" or isinstance(choice, dict)


def call_grammar(tools: list[dict], choice: Any, fmt: str, parallel: bool = True,
                 specials: dict[str, int] | None = None) -> list[str]:
    """The engine's grammar ([kind, text, field]) that makes the output a call (to the named
    function, or any) in the template's format; several calls when `parallel` and the format has a
    way to write them."""
    fns = [t["function"] for t in tools]
    if isinstance(choice, dict):
        fns = [f for f in fns if f["name"] == choice["function"]["name"]]
    return formats.call_grammar(fmt, fns, parallel, specials or {})


def with_tools_described(messages: list[dict], tools: list[dict], how: str) -> list[dict]:
    """The messages with a system message that says what the tools are (their JSON) and `how` to
    call one (after the first system message's own text, if there is one)."""
    desc = "\n".join(json.dumps(t["function"]) for t in tools)
    system = "You can call these tools (JSON schemas of their arguments):\n" + desc + "\n" + how
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = (out[0].get("content") or "") + "\n\n" + system
    else:
        out.insert(0, {"role": "system", "content": system})
    return out


# How to call a tool in DeepSeek's way, for its templates, which render no tools (llama.cpp's
# minja describes them in a system message the same way, with an example call)
_DEEPSEEK_HOW = {
    "deepseek_v3": (f"To call one, answer with {formats.DS_CALLS}{formats.DS_CALL}function"
                    f"{formats.DS_SEP}<tool name>\n{formats.DS_FENCE}\n{{<its arguments as JSON>}}"
                    f"\n```{formats.DS_CALL_END}{formats.DS_CALLS_END}"),
    "deepseek_v31": (f"To call one, answer with {formats.DS_CALLS}{formats.DS_CALL}<tool name>"
                     f"{formats.DS_SEP}{{<its arguments as JSON>}}{formats.DS_CALL_END}"
                     f"{formats.DS_CALLS_END}"),
}


def generic_messages(messages: list[dict], tools: list[dict], describe: bool = True,
                     parallel: bool = True) -> list[dict]:
    """llama.cpp's generic way for a template that knows no tools: a system message says what the
    tools are and how to call one (unless not `describe`: tool_choice none); earlier calls become
    their JSON text, tool results a `tool` message's content."""
    how = ("To call one, answer with only a JSON object: {\"name\": <tool name>, \"arguments\": "
           "{<its arguments>}}" + (" (to call several, a JSON array of them)" if parallel else "")
           + ". Otherwise answer in plain text.")
    out = (with_tools_described(messages, tools, how) if describe
           else [dict(m) for m in messages])
    for m in out:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"],
                      "arguments": _arguments(c["function"].get("arguments"))}
                     for c in m.pop("tool_calls")]
            m["content"] = ((m.get("content") or "")
                            + json.dumps(calls[0] if len(calls) == 1 else calls)).strip()
    return out


def template_messages(messages: list[dict], fmt: str = "hermes") -> list[dict]:
    """Messages for a template that renders tools (HF's convention): a call's arguments as an
    object; for Mistral's templates, call ids they accept (formats.mistral_id)."""
    ids = formats.mistral_id if fmt.startswith("mistral") else (lambda cid: cid)
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "id": ids(c.get("id")),
                                      "type": c.get("type", "function"),
                                      "function": {**c["function"], "arguments":
                                      _arguments(c["function"].get("arguments"))}}
                                     for c in m["tool_calls"]]}
            # gpt-oss's template takes a call's reasoning or its text, not both (it refuses): the
            # reasoning stays, as llama.cpp keeps it
            if fmt == "harmony" and m.get("reasoning_content") and m.get("content"):
                m = {k: v for k, v in m.items() if k != "content"}
        elif m.get("role") == "tool" and "tool_call_id" in m:
            m = {**m, "tool_call_id": ids(m["tool_call_id"])}
        out.append(m)
    return _one_call_a_turn(out) if fmt == "harmony" else out


def _one_call_a_turn(messages: list[dict]) -> list[dict]:
    """gpt-oss's template renders one call a message (the first) and names a result by the call
    before it: an assistant message with several calls becomes one a call, each followed by its
    result (matched by tool_call_id; results it cannot match follow the last)."""
    out, i = [], 0
    while i < len(messages):
        m, i = messages[i], i + 1
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if not calls or len(calls) < 2:
            out.append(m)
            continue
        results = []
        while i < len(messages) and messages[i].get("role") == "tool":
            results.append(messages[i])
            i += 1
        by_id: dict = {}
        unmatched = []
        for r in results:
            if r.get("tool_call_id") in by_id:
                unmatched.append(r)
            else:
                by_id[r.get("tool_call_id")] = r
        for k, call in enumerate(calls):
            out.append({**m, "tool_calls": [call]} if k == 0
                       else {"role": "assistant", "tool_calls": [call]})
            if call.get("id") in by_id:
                out.append(by_id.pop(call.get("id")))
        out += [*by_id.values(), *unmatched]
    return out


def _arguments(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def parse_calls(text: str, fmt: str, tools: list[dict],
                parallel: bool = True) -> tuple[str | None, list[dict]]:
    """The model's whole answer -> (content left, OpenAI tool_calls), read as the stream reads it
    (formats.CallStream); a call cut short or whose arguments are not a JSON object is left out, and
    with no call left the answer is the text it was."""
    stream = CallStream(fmt, tools, parallel)
    events = stream.feed(text) + stream.end()
    calls = [_openai(c) for c in stream.calls if c["complete"]]
    if not calls:
        return text, []
    content = "".join(e[1] for e in events if e[0] == "content").strip()
    return content or None, calls


def _openai(call: dict) -> dict:
    return {"id": call["id"], "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]}}


def deltas(events: list[tuple]) -> list[dict]:
    """CallStream's events as OpenAI's streamed deltas: a call's first piece has its index, id,
    type, name and arguments "", then its arguments come in pieces as the model writes them."""
    out = []
    for ev in events:
        if ev[0] == "content":
            out.append({"content": ev[1]})
        elif ev[0] == "call":
            out.append({"tool_calls": [{"index": ev[1], "id": ev[2], "type": "function",
                                        "function": {"name": ev[3], "arguments": ""}}]})
        else:
            out.append({"tool_calls": [{"index": ev[1], "function": {"arguments": ev[2]}}]})
    return out


class HeldCalls:
    """A streamed chat choice's content deltas through the format's CallStream: text that may be a
    call is held back, calls go out as delta.tool_calls pieces, the rest as the content it was."""

    def __init__(self, tools: list[dict] | None, fmt: str | None, parallel: bool = True):
        self.stream = CallStream(fmt or "generic", tools, parallel) if tools else None

    @property
    def calls(self) -> list[dict]:
        return self.stream.calls if self.stream else []

    def feed(self, pieces: list, last: bool = False) -> list:
        if self.stream is None:
            return pieces
        out = []
        for piece in pieces:
            if isinstance(piece, dict) and "content" in piece:
                out += deltas(self.stream.feed(piece["content"]))
            else:
                out.append(piece)
        if last:
            out += deltas(self.stream.end())
        return out


def finish_reason(calls: list, engine_reason: str) -> str:
    """OpenAI's: "tool_calls" when the answer made calls, unless it was cut short ("length")."""
    if engine_reason == "length":
        return "length"
    return "tool_calls" if calls else "stop"


def tool_prompt(tk, messages: list, kwargs: dict, tools: list, choice, parallel: bool = True
                ) -> tuple[list, dict, dict]:
    """The messages and template variables for a chat with tools, and {"tool_format", "grammar"}:
    the template's own rendering when it shows the tools (their first name appears in the text more
    often with them than without; its format told by its marks, formats.detect), else llama.cpp's
    generic way."""
    fmt = formats.detect(tk.chat_template)
    own = template_messages(messages, fmt)
    name = tools[0]["function"]["name"]
    try:
        text = tk.apply_chat_template(**{"messages": own, "add_generation_prompt": True, **kwargs,
                                         "tools": tools})
        # shown: the tools add the name (earlier calls in the messages may show it already)
        if text.count(name) <= tk.apply_chat_template(
                **{"messages": own, "add_generation_prompt": True, **kwargs}).count(name):
            fmt = "generic"
    # a template that cannot render these messages (tool_calls, tool roles)
    except ValueError:
        fmt = "generic"
    if fmt == "generic" and formats.detect(tk.chat_template) in _DEEPSEEK_HOW:
        # DeepSeek's templates render calls and results but not the tools: they are described as
        # llama.cpp describes them, and the model calls in its own format
        fmt = formats.detect(tk.chat_template)
        messages = (with_tools_described(own, tools, _DEEPSEEK_HOW[fmt]) if choice != "none"
                    else own)
    elif fmt != "generic":      # tool_choice none: the template without the tools (vLLM's default)
        messages, kwargs = own, {**kwargs, "tools": tools} if choice != "none" else kwargs
    else:
        messages = generic_messages(messages, tools, describe=choice != "none", parallel=parallel)
    grammar = (call_grammar(tools, choice, fmt, parallel, special_marks(tk)) if forced(choice)
               else None)
    return messages, kwargs, {"tool_format": fmt, "grammar": grammar}


MARKS = (formats.TOOL_CALLS, formats.ARGS, formats.HERMES_OPEN, formats.HERMES_CLOSE,
         formats.ARG_KEY, formats.ARG_KEY_END, formats.ARG_VALUE, formats.ARG_VALUE_END, "<think>",
         "</think>", formats.H_START, formats.H_CHANNEL, formats.H_MESSAGE, formats.H_END,
         formats.H_CONSTRAIN, formats.DS_CALLS, formats.DS_CALLS_END, formats.DS_CALL,
         formats.DS_CALL_END, formats.DS_SEP)


def special_marks(tk) -> dict[str, int]:
    """The marks that are one control token of the vocabulary: the grammar names those tokens."""
    out = {}
    for mark in MARKS:
        i = tk.token_to_id(mark)
        if i is not None and tk.is_special(i):
            out[mark] = i
    return out
