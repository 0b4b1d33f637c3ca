"""Request bodies of the OpenAI API, as msgspec structs: decoding checks every type and names the field
that is wrong (`Expected int, got str - at $.max_tokens`). Fields OpenAI clients send that we do not use
(user, logit_bias, tools, ...) are ignored, as msgspec ignores unknown fields by default."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

# Bounds that catch nonsense early; the engine checks the finer rules (top_p in (0, 1], ...).
MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=1 << 24)]
Seed = Annotated[int, msgspec.Meta(ge=-1, le=2**63 - 1)]   # -1: a random seed (llama.cpp)
Stop = str | list[str] | None


class TextPart(msgspec.Struct):
    type: str = "text"
    text: str | None = None


class Message(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    reasoning_content: str | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Sampling(msgspec.Struct):
    """What chat and completions share."""

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: Seed | None = None
    stop: Stop = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False            # llama.cpp's extra: keep going past the end-of-text token


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = msgspec.field(default_factory=list)
    max_completion_tokens: MaxTokens | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_format: Literal["auto", "deepseek", "none"] = "auto"   # llama.cpp's: "none" keeps <think> in content


class CompletionRequest(_Sampling):
    prompt: str | list[int | str] | None = None     # text, token ids, or a list of one text
    echo: bool = False


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """The body as `kind`; raises msgspec.ValidationError / DecodeError naming the field."""
    return msgspec.json.decode(body, type=kind)
