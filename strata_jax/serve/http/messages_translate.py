"""An Anthropic Messages request (messages_schema.py, decoded and bounded) as the OpenAI chat body
the chat route reads (parse.py: parse_chat), so both run through the same rendering, tools, grammar
and engine.

    system (text or text blocks)          -> a system message first
    user text blocks                      -> a user message (text parts)
    user tool_result blocks               -> `tool` messages with tool_call_id, in block order
    assistant text / thinking / tool_use  -> one assistant message: content, reasoning_content,
                                             tool_calls (arguments = the input as JSON)
    a final assistant message of text     -> continued (Anthropic's prefill): continue_final_message
    tools [{name, description, input_schema}]  -> function tools
    tool_choice auto / any / tool / none  -> "auto" / "required" / {"function": {"name"}} / "none"
                                             (disable_parallel_tool_use -> parallel_tool_calls)
    thinking enabled {budget_tokens}      -> thinking_token_budget (and enable_thinking true)
    thinking disabled                     -> enable_thinking false, thinking_token_budget 0
    stop_sequences, temperature, top_p, top_k -> stop, temperature, top_p, top_k

Checks that need more than one field (a budget under max_tokens, a tool_choice naming a tool of
the request, blocks in the role that may send them) are 400s naming Anthropic's field.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import invalid
from .messages_schema import (
    TOOL_NAME,
    ChoiceAny,
    ChoiceNone,
    ChoiceTool,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingAdaptive,
    ThinkingBlock,
    ThinkingDisabled,
    ToolResultBlock,
    ToolUseBlock,
)

ERROR_PREFIX = "Error: "            # a tool_result with is_error, as the model reads it


def chat_body(req: MessagesRequest) -> dict[str, Any]:
    """The chat body for `req` (its max_tokens checked by the caller where it is required)."""
    if not req.messages:
        raise invalid("messages is empty: a conversation needs at least one message", "messages")
    messages = _system(req.system) + [m for i, msg in enumerate(req.messages)
                                      for m in _messages(msg, i)]
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream,
                            "stream_options": {"include_usage": True} if req.stream else None}
    for key in ("max_tokens", "temperature", "top_p", "top_k"):
        if getattr(req, key) is not None:
            body[key] = getattr(req, key)
    if req.stop_sequences:
        body["stop"] = list(req.stop_sequences)
    last = req.messages[-1]
    if last.role == "assistant" and not messages[-1].get("tool_calls"):
        # Anthropic's prefill: the answer goes on from the assistant's text
        body["add_generation_prompt"], body["continue_final_message"] = False, True
    body.update(_tools(req))
    body.update(_thinking(req))
    return body


def _system(system: str | list[TextBlock] | None) -> list[dict[str, Any]]:
    if system is None or system == "" or system == []:
        return []
    content = system if isinstance(system, str) else _parts(system)
    return [{"role": "system", "content": content}]


def _parts(blocks: list[TextBlock]) -> list[dict[str, str]]:
    """Text blocks as the chat route's text parts (it joins them as it joins any)."""
    return [{"type": "text", "text": b.text} for b in blocks]


def _messages(msg: Any, i: int) -> list[dict[str, Any]]:
    if isinstance(msg.content, str):
        return [{"role": msg.role, "content": msg.content}]
    if msg.role == "assistant":
        return [_assistant(msg.content, i)]
    out: list[dict[str, Any]] = []
    texts: list[TextBlock] = []
    for j, block in enumerate(msg.content):
        where = f"messages[{i}].content[{j}]"
        if isinstance(block, TextBlock):
            texts.append(block)
        elif isinstance(block, ToolResultBlock):
            if texts:
                out.append({"role": "user", "content": _parts(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _result_text(block)})
        else:
            raise invalid(f"{where}.type = {block.__struct_config__.tag!r}: a user message holds "
                          "text and tool_result blocks (tool_use and thinking blocks are the "
                          "assistant's)", f"{where}.type")
    if texts or not out:
        out.append({"role": "user", "content": _parts(texts)})
    return out


def _assistant(blocks: list, i: int) -> dict[str, Any]:
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if isinstance(block, TextBlock):
            texts.append(block)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name,
                                       "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, RedactedThinkingBlock):
            continue                # Anthropic's encrypted thinking: nothing a model here can read
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        else:
            raise invalid(f"{where}.type = {block.__struct_config__.tag!r}: an assistant message "
                          "holds text, thinking and tool_use blocks (tool_result blocks are the "
                          "user's)", f"{where}.type")
    out: dict[str, Any] = {"role": "assistant"}
    if texts or not calls:
        out["content"] = _parts(texts)
    if thoughts:
        out["reasoning_content"] = "\n".join(thoughts)
    if calls:
        out["tool_calls"] = calls
    return out


def _result_text(block: ToolResultBlock) -> str:
    content = block.content
    text = ("" if content is None else content if isinstance(content, str)
            else "\n".join(b.text for b in content))
    return ERROR_PREFIX + text if block.is_error else text


def _tools(req: MessagesRequest) -> dict[str, Any]:
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and not isinstance(choice, ChoiceNone):
            raise invalid(f"tool_choice.type = {choice.__struct_config__.tag!r}: the request has "
                          "no tools", "tool_choice")
        return {}
    names = []
    for k, tool in enumerate(req.tools):
        if not TOOL_NAME.fullmatch(tool.name):
            raise invalid(f"tools[{k}].name = {json.dumps(tool.name)[:80]}: 1 to 128 letters, "
                          "digits, '_' or '-'", f"tools[{k}].name")
        if tool.name in names:
            raise invalid(f"tools[{k}].name = {tool.name!r}: two tools have that name",
                          f"tools[{k}].name")
        if tool.input_schema.get("type", "object") != "object":
            raise invalid(f"tools[{k}].input_schema.type = "
                          f"{json.dumps(tool.input_schema.get('type'))[:40]}: a tool's input is "
                          "an object (\"type\": \"object\")", f"tools[{k}].input_schema.type")
        names.append(tool.name)
    out: dict[str, Any] = {"tools": [
        {"type": "function", "function": {"name": t.name, "description": t.description or "",
                                          "parameters": t.input_schema}}
        for t in req.tools]}
    if isinstance(choice, ChoiceTool):
        if choice.name not in names:
            raise invalid(f"tool_choice.name = {json.dumps(choice.name)[:80]}: names no tool of "
                          f"the request ({', '.join(names)[:200]})", "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif isinstance(choice, ChoiceAny):
        out["tool_choice"] = "required"
    elif isinstance(choice, ChoiceNone):
        out["tool_choice"] = "none"
    else:
        out["tool_choice"] = "auto"
    if choice is not None and choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


def _thinking(req: MessagesRequest) -> dict[str, Any]:
    """The reasoning the request asks for; none said: the model's template decides (Qwen3's
    thinks)."""
    thinking = req.thinking
    if thinking is None or isinstance(thinking, ThinkingAdaptive):
        return {}
    if isinstance(thinking, ThinkingDisabled):
        return {"chat_template_kwargs": {"enable_thinking": False}, "thinking_token_budget": 0}
    budget = thinking.budget_tokens
    if req.max_tokens is not None and budget >= req.max_tokens:
        raise invalid(f"thinking.budget_tokens = {budget}: the budget is part of max_tokens "
                      f"({req.max_tokens}), so it must be less", "thinking.budget_tokens")
    if isinstance(req.tool_choice, ChoiceAny | ChoiceTool):
        # (Anthropic's rule: a forced call is the whole answer, written by its grammar)
        raise invalid(f"tool_choice.type = {req.tool_choice.__struct_config__.tag!r}: thinking "
                      "may not be enabled when tool_choice forces tool use; use auto or none, or "
                      "leave thinking out", "tool_choice.type")
    return {"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": budget}
