"""The grammar that forces a call in a format (tool_choice required or a named function)."""

from __future__ import annotations

import json
from typing import Any

from ...engine.grammar.constrain import JSON_LAYOUT
from .marks import (
    ARG_KEY,
    ARG_KEY_END,
    ARG_VALUE,
    ARG_VALUE_END,
    ARGS,
    DS_CALL,
    DS_CALL_END,
    DS_CALLS,
    DS_CALLS_END,
    DS_FENCE,
    DS_SEP,
    FUNCTION,
    FUNCTION_END,
    H_CHANNEL,
    H_CONSTRAIN,
    H_END,
    H_MESSAGE,
    H_START,
    HERMES_CLOSE,
    HERMES_OPEN,
    PARAMETER,
    PARAMETER_END,
    TOOL_CALLS,
    is_string,
    parameters,
)

NL = "\n"


def call_grammar(fmt: str, fns: list[dict], parallel: bool, specials: dict[str, int]) -> list[str]:
    """The engine's grammar [kind, text, field] that makes the output a call (several if `parallel`)
    in `fmt` to one of `fns` (the tools' "function" objects). specials: mark text -> id of the one
    special token it is."""
    def lit(text: str) -> str:
        return f"<[{specials[text]}]>" if text in specials else json.dumps(text, ensure_ascii=False)

    if fmt == "generic":
        one = _any_call(fns, "arguments")
        schema = ({"anyOf": [one, {"type": "array", "items": one, "minItems": 1}]} if parallel
                  else one)
        return ["json_schema", json.dumps(schema), "tools"]
    if fmt == "glm45":
        rules = [_glm_call(i, f, lit) for i, f in enumerate(fns)]
        calls = " | ".join(f"call{i}" for i in range(len(fns)))
        # GLM opens its answer with <think></think>
        think = f'({lit("<think>")} {lit("</think>")} "\\n"?)?'
        start = f'start: {think} call ("\\n" call)*' if parallel else f"start: {think} call"
        return ["lark", "\n".join([start, f"call: {calls}", *rules]) + "\n", "tools"]
    if fmt == "qwen3_coder":
        rules = [_xml_call(i, f, lit) for i, f in enumerate(fns)]
        calls = " | ".join(f"call{i}" for i in range(len(fns)))
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return ["lark", "\n".join([start, f"call: {calls}", *rules]) + "\n", "tools"]
    if fmt == "mistral_args":
        rules = [f"call{i}: {lit(TOOL_CALLS)} {json.dumps(f['name'])} {lit(ARGS)} %json "
                 f"{json.dumps(_layout(parameters(f)))}" for i, f in enumerate(fns)]
        calls = " | ".join(f"call{i}" for i in range(len(fns)))
        return ["lark", "\n".join(["start: call+" if parallel else "start: call", f"call: {calls}",
                                   *rules]) + "\n",
                "tools"]
    if fmt == "mistral":
        one = _any_call(fns, "arguments", with_id=True)
        body = 'call ("," " " call)*' if parallel else "call"
        return ["lark", (f'start: {lit(TOOL_CALLS)} "[" {body} "]"\ncall: %json '
                         f'{json.dumps(_layout(one))}\n'), "tools"]
    if fmt == "harmony":
        return ["lark", _harmony(fns, lit), "tools"]
    if fmt.startswith("deepseek"):
        return ["lark", _deepseek(fmt, fns, parallel, lit), "tools"]
    if fmt == "llama3":         # one call: Llama 3.1's template renders no more than one a message
        return ["lark", ("start: call\ncall: %json "
                         f"{json.dumps(_layout(_any_call(fns, 'parameters')))}\n"), "tools"]
    one = f"call: %json {json.dumps(_layout(_any_call(fns, 'arguments')))}"
    tc = f'{lit(HERMES_OPEN)} "\\n" call "\\n" {lit(HERMES_CLOSE)}'
    start = f'start: tc ("\\n" tc)*\ntc: {tc}' if parallel else f"start: {tc}"
    return ["lark", f"{start}\n{one}\n", "tools"]


def _layout(schema: dict) -> dict:
    # %json inside Lark takes its layout from the schema's x-guidance (constrain.JSON_LAYOUT's, as
    # for schemas)
    return {**schema, "x-guidance": JSON_LAYOUT}


def _any_call(fns: list[dict], args_key: str, with_id: bool = False) -> dict:
    """The JSON schema of one call object to any of fns: {"name": ..., args_key: {...}} (and
    Mistral's "id")."""
    one = []
    for f in fns:
        props: dict[str, Any] = {"name": {"const": f["name"]}, args_key: parameters(f)}
        if with_id:
            props["id"] = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
        one.append({"type": "object", "properties": props, "required": list(props),
                    "additionalProperties": False})
    return one[0] if len(one) == 1 else {"anyOf": one}


def _glm_call(i: int, fn: dict, lit) -> str:
    """GLM-4.5's call to fn: one <arg_key>/<arg_value> pair a property, in the schema's order (the
    optional ones may be left out); a string value is its raw text (no <), any other a JSON
    value."""
    params = parameters(fn)
    required = set(params.get("required") or ())
    pairs = []
    for key, prop in (params.get("properties") or {}).items():
        value = _glm_string(prop) if is_string(prop) else f"%json {json.dumps(_layout(prop))}"
        pair = (f"{lit(ARG_KEY)} {json.dumps(key, ensure_ascii=False)} {lit(ARG_KEY_END)} \"\\n\" "
                f"{lit(ARG_VALUE)} {value} {lit(ARG_VALUE_END)} \"\\n\"")
        pairs.append(f"({pair})" if key in required else f"({pair})?")
    body = " ".join(pairs) or '""'
    return (f"call{i}: {lit(HERMES_OPEN)} {json.dumps(fn['name'])} \"\\n\" {body} "
            f"{lit(HERMES_CLOSE)}")


def _xml_call(i: int, fn: dict, lit) -> str:
    """Qwen3-Coder's call to fn (Qwen3.5's template's layout): one <parameter=k> a property, in the
    schema's order (the optional ones may be left out); a string value is its raw text (no <), any
    other a JSON value."""
    def text(t: str) -> str:
        return json.dumps(t, ensure_ascii=False)

    params = parameters(fn)
    required = set(params.get("required") or ())
    pairs = []
    for key, prop in (params.get("properties") or {}).items():
        value = _glm_string(prop) if is_string(prop) else f"%json {json.dumps(_layout(prop))}"
        pair = f"{text(PARAMETER + key + '>' + NL)} {value} {text(NL + PARAMETER_END + NL)}"
        pairs.append(f"({pair})" if key in required else f"({pair})?")
    body = " ".join(pairs) or '""'
    head, tail = text(NL + FUNCTION + fn["name"] + ">" + NL), text(FUNCTION_END + NL)
    return f"call{i}: {lit(HERMES_OPEN)} {head} {body} {tail} {lit(HERMES_CLOSE)}"


def _harmony(fns: list[dict], lit) -> str:
    """gpt-oss's call (one: <|call|> ends its answer), maybe after its reasoning (an analysis
    message, as llama.cpp's grammar allows), the recipient in the channel's header or the role's."""
    def text(t: str) -> str:
        return json.dumps(t, ensure_ascii=False)

    rules = []
    for i, f in enumerate(fns):
        to = "to=functions." + f["name"]
        head = (f"(({lit(H_CHANNEL)} {text('commentary ' + to)}) | "
                f"({text(' ' + to)} {lit(H_CHANNEL)} \"commentary\"))")
        rules.append(f"call{i}: {head} \" \" {lit(H_CONSTRAIN)} \"json\" {lit(H_MESSAGE)} %json "
                     f"{json.dumps(_layout(parameters(f)))}")
    calls = " | ".join(f"call{i}" for i in range(len(fns)))
    return "\n".join(["start: analysis? call", f"analysis: {_analysis(lit)}", f"call: {calls}",
                      *rules]) + "\n"


def harmony_structured(grammar: list[str], specials: dict[str, int]) -> list[str]:
    """A structured output's grammar ([kind, text, field]: json_schema, json_object) as gpt-oss
    writes one: its reasoning first, then the final message, whose text is the JSON (llama.cpp's
    response format for gpt-oss); other grammars as they are."""
    kind, text, field = grammar
    schema = {"type": "object"} if kind == "json_object" else (
        json.loads(text) if kind == "json_schema" else None)
    if not isinstance(schema, dict):
        return grammar

    def lit(t: str) -> str:
        return f"<[{specials[t]}]>" if t in specials else json.dumps(t, ensure_ascii=False)

    final = (f'{lit(H_CHANNEL)} "final" (" " {lit(H_CONSTRAIN)}? "json")? {lit(H_MESSAGE)} '
             f"%json {json.dumps(_layout(schema))}")
    return ["lark", "\n".join(["start: analysis? final", f"analysis: {_analysis(lit)}",
                               f"final: {final}"]) + "\n", field]


def _analysis(lit) -> str:
    """gpt-oss's reasoning message, before its call or its final answer."""
    return (f'{lit(H_CHANNEL)} "analysis" {lit(H_MESSAGE)} /(?s:.*)/ {lit(H_END)} '
            f'{lit(H_START)} "assistant"')


def _deepseek(fmt: str, fns: list[dict], parallel: bool, lit) -> str:
    """DeepSeek's calls' section: V3's (and R1's) `function<｜tool▁sep｜>NAME` and fenced JSON, or
    V3.1's `NAME<｜tool▁sep｜>` and bare JSON; V3's template writes a newline between calls."""
    rules = []
    for i, f in enumerate(fns):
        args = f"%json {json.dumps(_layout(parameters(f)))}"
        if fmt == "deepseek_v3":
            body = (f'"function" {lit(DS_SEP)} {json.dumps(f["name"] + NL + DS_FENCE + NL)} {args} '
                    f'"\\n```"')
        else:
            body = f'{json.dumps(f["name"])} {lit(DS_SEP)} {args}'
        rules.append(f"call{i}: {lit(DS_CALL)} {body} {lit(DS_CALL_END)}")
    more = ('("\\n" call)*' if fmt == "deepseek_v3" else "call*") if parallel else ""
    calls = " | ".join(f"call{i}" for i in range(len(fns)))
    return "\n".join([f"start: {lit(DS_CALLS)} call {more} {lit(DS_CALLS_END)}",
                      f"call: {calls}", *rules]) + "\n"


def _glm_string(prop: dict) -> str:
    options = prop.get("enum") or ([prop["const"]] if "const" in prop else None)
    if options:
        return "(" + " | ".join(json.dumps(o, ensure_ascii=False) for o in options) + ")"
    lo, hi = int(prop.get("minLength", 0)), prop.get("maxLength")
    return f"/[^<]{{{lo},{'' if hi is None else int(hi)}}}/"
