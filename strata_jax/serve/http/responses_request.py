"""A Responses request body (POST /v1/responses) to the chat-completions body it asks for, checked
field by field so a bad value is a 400 naming the Responses field (not the chat field it becomes).

    instructions          -> a system message first (not carried to the next turn, as OpenAI's)
    input                 -> messages (responses_items.py), after the previous response's
    tools (flat)          -> chat tools ({"type": "function", "function": {...}})
    tool_choice           -> the same, a named function as {"type": "function", "function": ...}
    text.format           -> response_format (json_schema, json_object)
    reasoning.effort      -> chat_template_kwargs.reasoning_effort (gpt-oss-style templates);
                             none / minimal also enable_thinking false (Qwen-style templates)
    max_output_tokens     -> max_tokens
    temperature, top_p, parallel_tool_calls, and the server's extras (top_k, min_p, seed, stop,
    penalties, cache_salt, chat_template_kwargs, thinking_token_budget) pass through unchanged.

`truncation: "auto"` is refused: the server never drops input items to fit (an input beyond the
context is a 400 exceed_context_size_error). Fields OpenAI has that this server does not use
(include, prompt_cache_key, safety_identifier, service_tier, ...) are ignored, as chat's are;
`background`, `conversation` and `prompt` (stored prompts) are refused, since ignoring them would
change the answer's meaning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import invalid
from .responses_items import input_messages, shown

MAX_TOOLS = 128                   # as chat's `tools`
MAX_OUTPUT_TOKENS = 1 << 24       # as chat's max_tokens
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# the server's chat extras a Responses body may set too, passed as they are
EXTRAS = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
          "frequency_penalty", "repeat_penalty", "repeat_last_n", "cache_salt",
          "thinking_token_budget", "parallel_tool_calls")
REFUSED = {"background": "background responses", "conversation": "conversations (use "
           "previous_response_id)", "prompt": "stored prompts"}
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


@dataclass
class Asked:
    """What a request asks for: the chat body, the conversation it continues (its messages without
    the instructions), and the fields the response object echoes."""
    chat: dict[str, Any]
    conversation: list[dict[str, Any]]
    echo: dict[str, Any]
    stream: bool
    store: bool


def translate(body: dict[str, Any], history: list[dict[str, Any]]) -> Asked:
    """`history`: the previous response's stored messages (empty without previous_response_id)."""
    for key, what in REFUSED.items():
        if body.get(key) not in (None, False):
            raise invalid(f"{key} = {shown(body[key])}: this server does not have {what}", key)
    stream, store = _flag(body, "stream", False), _flag(body, "store", True)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid(f"instructions = {shown(instructions)}: a string (a system message)",
                      "instructions")
    conversation = [*history, *input_messages(body.get("input"), history)]
    system = [{"role": "system", "content": instructions}] if instructions else []
    messages = system + conversation
    chat: dict[str, Any] = {"messages": messages, "stream": stream}
    chat.update({k: body[k] for k in EXTRAS if body.get(k) is not None})
    if stream:
        chat["stream_options"] = {"include_usage": True}
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not (isinstance(limit, int) and not isinstance(limit, bool)
                and 1 <= limit <= MAX_OUTPUT_TOKENS):
            raise invalid(f"max_output_tokens = {shown(limit)}: a whole number from 1 to "
                          f"{MAX_OUTPUT_TOKENS}", "max_output_tokens")
        chat["max_tokens"] = limit
    tools, names = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"), names)
    if choice is not None:
        chat["tool_choice"] = choice
    text = body.get("text")
    response_format = _text_format(text)
    if response_format is not None:
        chat["response_format"] = response_format
    reasoning = body.get("reasoning")
    kwargs = _template_kwargs(reasoning, body.get("chat_template_kwargs"))
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    truncation = body.get("truncation", "disabled")
    if truncation not in (None, "disabled"):
        raise invalid(f"truncation = {shown(truncation)}: this server never drops input items to "
                      "fit the context (an input beyond it is a 400); leave truncation out or "
                      "set it to \"disabled\"", "truncation")
    metadata = _metadata(body.get("metadata"))
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise invalid(f"user = {shown(body['user'])}: a string", "user")
    echo = {"instructions": instructions, "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_output_tokens": limit, "previous_response_id": body.get("previous_response_id"),
            "text": text if isinstance(text, dict) else {"format": {"type": "text"}},
            "reasoning": reasoning if isinstance(reasoning, dict) else None,
            "truncation": "disabled", "store": store, "metadata": metadata,
            "user": body.get("user")}
    return Asked(chat, conversation, echo, stream, store)


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{key} = {shown(value)}: true or false", key)
    return value


def _tools(given: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """Responses' flat function tools -> chat's nested ones, and their names."""
    if given is None:
        return [], []
    if not isinstance(given, list) or len(given) > MAX_TOOLS:
        raise invalid(f"tools: a list of at most {MAX_TOOLS} function tools", "tools")
    out, names = [], []
    for i, tool in enumerate(given):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise invalid(f"tools[{i}].type = {shown(kind)}: this server calls functions only "
                          "({\"type\": \"function\", \"name\": ..., \"parameters\": {...}}; no "
                          "hosted tools: web search, file search, MCP, ...)", f"tools[{i}].type")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"tools[{i}].name = {shown(name)}: a function tool has a name",
                          f"tools[{i}].name")
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid(f"tools[{i}].parameters = {shown(parameters)}: a JSON schema (an "
                          "object)", f"tools[{i}].parameters")
        function = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
        for key in ("description", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
        names.append(name)
    return out, names


def _tool_choice(given: Any, names: list[str]) -> Any:
    if given is None or given in ("auto", "none", "required"):
        if given == "required" and not names:
            raise invalid("tool_choice = \"required\": the request has no tools", "tool_choice")
        return given
    if isinstance(given, dict) and given.get("type") == "function":
        if given.get("name") not in names:
            raise invalid(f"tool_choice = {shown(given)}: names no function of the request's tools "
                          f"({', '.join(names) or 'none'})", "tool_choice")
        return {"type": "function", "function": {"name": given["name"]}}
    raise invalid(f"tool_choice = {shown(given)}: one of auto, none, required, or "
                  "{\"type\": \"function\", \"name\": ...}", "tool_choice")


def _text_format(text: Any) -> dict[str, Any] | None:
    """`text.format` -> chat's response_format (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid(f"text = {shown(text)}: an object, {{\"format\": {{...}}}}", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise invalid(f"text.format.type = {shown(kind)}: one of text, json_object, json_schema",
                      "text.format.type")
    if not isinstance(fmt.get("schema"), dict):
        raise invalid(f"text.format.schema = {shown(fmt.get('schema'))}: a json_schema format "
                      "needs its JSON schema, {\"type\": \"json_schema\", \"name\": ..., "
                      "\"schema\": {...}}", "text.format.schema")
    schema = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
    for key in ("description", "strict"):
        if fmt.get(key) is not None:
            schema[key] = fmt[key]
    return {"type": "json_schema", "json_schema": schema}


def _template_kwargs(reasoning: Any, given: Any) -> dict[str, Any]:
    """reasoning.effort as the templates read it; the request's own chat_template_kwargs win."""
    kwargs: dict[str, Any] = {}
    if reasoning is not None:
        effort = reasoning.get("effort") if isinstance(reasoning, dict) else reasoning
        if not isinstance(reasoning, dict) or (effort is not None and effort not in EFFORTS):
            raise invalid(f"reasoning.effort = {shown(effort)}: one of {', '.join(EFFORTS)}",
                          "reasoning.effort")
        if effort is not None:
            kwargs["reasoning_effort"] = effort
            if effort in ("none", "minimal"):
                kwargs["enable_thinking"] = False
    if given is not None and not isinstance(given, dict):
        raise invalid(f"chat_template_kwargs = {shown(given)}: an object", "chat_template_kwargs")
    return {**kwargs, **(given or {})}


def _metadata(given: Any) -> dict[str, str] | None:
    """OpenAI's rule: at most 16 pairs, keys up to 64 characters, values strings up to 512."""
    if given is None:
        return None
    if not isinstance(given, dict) or len(given) > METADATA_KEYS:
        raise invalid(f"metadata: an object of at most {METADATA_KEYS} string values", "metadata")
    for key, value in given.items():
        if len(key) > METADATA_KEY_CHARS or not isinstance(value, str) \
                or len(value) > METADATA_VALUE_CHARS:
            raise invalid(f"metadata.{key[:METADATA_KEY_CHARS]}: keys up to {METADATA_KEY_CHARS} "
                          f"characters, values strings up to {METADATA_VALUE_CHARS}",
                          f"metadata.{key[:METADATA_KEY_CHARS]}")
    return given
