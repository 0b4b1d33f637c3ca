"""Anthropic's Messages request body as msgspec structs (POST /v1/messages, /count_tokens), with the
bounds this server keeps (docs/LIMITS.md).

Decoded here, before anything is translated into a chat request (messages_translate.py), so an
error names Anthropic's field (`messages[1].content[0].type`) and the value, not the chat field it
would become. Content blocks are tagged unions on `type`: a type we do not read (image, document,
search_result, server tools' blocks) is a 400 naming it. Unknown top-level fields are a 400 too, as
Anthropic's own API answers; the few it documents that mean nothing here (service_tier,
cache_control, ...) are accepted and ignored.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from ...engine.request import MAX_STOPS
from ..errors import invalid
from .fields import value_at
from .schemas import MaxTokens, StopString, Temperature, TopK, Unit

MAX_MESSAGES = 2048             # messages a request
MAX_BLOCKS = 1024               # content blocks a message (and a tool_result's own blocks)
MAX_TOOLS = 128                 # as the chat route's `tools`
MAX_STOP_SEQUENCES = MAX_STOPS  # the engine's (16)
MAX_NAME_CHARS = 128            # a tool's name, a tool_use id
MAX_USER_ID_CHARS = 256         # metadata.user_id

Blocks = Annotated[list, msgspec.Meta(max_length=MAX_BLOCKS)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
# the tool names Anthropic accepts (and every chat template can print)
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")


class _Block(msgspec.Struct, tag_field="type", kw_only=True):
    """A content block; cache_control is a hint for Anthropic's cache and is ignored (the prefix
    cache here finds shared prefixes by itself)."""
    cache_control: dict[str, Any] | None = None


class TextBlock(_Block, tag="text"):
    text: str
    citations: list[Any] | None = None          # citations of a previous answer: ignored


class ToolUseBlock(_Block, tag="tool_use"):
    id: Name
    name: Name
    input: dict[str, Any]


class ToolResultBlock(_Block, tag="tool_result"):
    tool_use_id: Name
    content: str | Annotated[list[TextBlock], msgspec.Meta(max_length=MAX_BLOCKS)] | None = None
    is_error: bool = False


class ThinkingBlock(_Block, tag="thinking"):
    thinking: str
    signature: str | None = None                # Anthropic's proof of its own thinking: ignored


class RedactedThinkingBlock(_Block, tag="redacted_thinking"):
    data: str = ""                              # encrypted for Anthropic's models: dropped


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
BLOCK_TYPES = "text, tool_use, tool_result, thinking and redacted_thinking"


class Message(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], msgspec.Meta(max_length=MAX_BLOCKS)]


class Tool(msgspec.Struct):
    """A client tool. Anthropic's server tools (web_search_..., bash_..., with a `type` and no
    input_schema) run on Anthropic's side: not here."""
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None


class _Choice(msgspec.Struct, tag_field="type"):
    disable_parallel_tool_use: bool = False


class ChoiceAuto(_Choice, tag="auto"):
    pass


class ChoiceAny(_Choice, tag="any"):
    pass


class ChoiceTool(_Choice, tag="tool"):
    name: str = ""


class ChoiceNone(_Choice, tag="none"):
    pass


class ThinkingEnabled(msgspec.Struct, tag_field="type", tag="enabled"):
    budget_tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(msgspec.Struct, tag_field="type", tag="disabled"):
    pass


class ThinkingAdaptive(msgspec.Struct, tag_field="type", tag="adaptive"):
    """The model decides how much to think: its template's own default, no budget."""


class Metadata(msgspec.Struct, forbid_unknown_fields=True):
    user_id: Annotated[str, msgspec.Meta(max_length=MAX_USER_ID_CHARS)] | None = None


class MessagesRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    messages: Annotated[list[Message], msgspec.Meta(max_length=MAX_MESSAGES)]
    # required by POST /v1/messages (messages.py says so); count_tokens takes none
    max_tokens: MaxTokens | None = None
    system: str | Annotated[list[TextBlock], msgspec.Meta(max_length=MAX_BLOCKS)] | None = None
    tools: Annotated[list[Tool], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ChoiceAuto | ChoiceAny | ChoiceTool | ChoiceNone | None = None
    thinking: ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive | None = None
    stop_sequences: Annotated[list[StopString],
                              msgspec.Meta(max_length=MAX_STOP_SEQUENCES)] | None = None
    temperature: Temperature | None = None
    top_p: Unit | None = None
    top_k: TopK | None = None
    metadata: Metadata | None = None
    stream: bool = False
    # Anthropic's, meaningless here: accepted, ignored
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: dict[str, Any] | None = None


# Anthropic's fields for features that run on its side: named in the 400
REFUSED = {"container": "code-execution containers", "mcp_servers": "remote MCP servers",
           "context_management": "server-side context editing",
           "output_config": "output configuration (effort, structured output)",
           "output_format": "structured output"}


def decode(body: bytes) -> MessagesRequest:
    """The body as a MessagesRequest; a 400 naming the field and the value otherwise."""
    if not body.strip():
        raise invalid("the request body is empty: send a JSON object")
    try:
        return msgspec.json.decode(body, type=MessagesRequest)
    except msgspec.ValidationError as e:
        raise _invalid(str(e), body) from None
    except msgspec.DecodeError as e:
        raise invalid(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise invalid("the request body nests arrays or objects too deeply to read") from None


def _invalid(text: str, body: bytes):
    """msgspec's message with Anthropic's names: the field's path, its value, what it may be."""
    unknown = re.search(r"unknown field `([^`]*)`(?: - at `\$\.?([^`]*)`)?", text)
    if unknown:
        name, where = unknown.group(1), unknown.group(2) or ""
        param = f"{where}.{name}" if where else name
        why = REFUSED.get(name) if not where else None
        if why:
            return invalid(f"{param}: {why} run on Anthropic's side; this server has none",
                           param)
        return invalid(f"{param}: unknown field (see docs/API.md, Anthropic's Messages API)",
                       param)
    missing = re.search(r"missing required field `([^`]*)`(?: - at `\$\.?([^`]*)`)?", text)
    if missing:
        param = ".".join(filter(None, (missing.group(2), missing.group(1))))
        return invalid(f"{param}: field required", param)
    param = text.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in text else None
    if param is None:
        return invalid(f"invalid request: {text}")
    value = value_at(body, param)
    if param.endswith(".type") and "content" in param:
        return invalid(f"{param} = {value}: this server reads {BLOCK_TYPES} blocks (images, "
                       "documents, search results and server tools' blocks are not supported)",
                       param)
    if param in TAGS:
        return invalid(f"{param} = {value}: one of {TAGS[param]}", param)
    if param.endswith(".role"):
        return invalid(f"{param} = {value}: a message's role is user or assistant (the system "
                       "prompt is the top-level `system` field)", param)
    return invalid(f"{param} = {value}: {text.split(' - at ', 1)[0]}", param)


# tagged fields and what they may be
TAGS = {"thinking.type": "enabled, disabled, adaptive",
        "tool_choice.type": "auto, any, tool, none"}

