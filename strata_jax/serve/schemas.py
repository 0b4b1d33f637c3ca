"""Request bodies of the OpenAI API, as msgspec structs: decoding checks every type and names the field
that is wrong (`Expected int, got str - at $.max_tokens`). Fields OpenAI clients send that we do not use
(user, logit_bias, tools, ...) are ignored, as msgspec ignores unknown fields by default."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from ..engine.request import MAX_STOP_CHARS, MAX_STOPS, MAX_TEMPERATURE

# Bounds that catch nonsense before anything is built from it: every number fits the array it goes into
# (int32 top_k, a 64-bit seed folded to 32), no float is NaN or inf (JSON has neither; 1e999 is refused),
# stop strings are few and short. The engine checks the finer rules again (top_k within the vocabulary, ...).
MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=1 << 24)]
Seed = Annotated[int, msgspec.Meta(ge=-1, le=2**63 - 1)]   # -1: a random seed (llama.cpp); int64 (OpenAI), folded to 32 bits
TopK = Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)]   # 0 or -1 (vLLM's): off
Unit = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TEMPERATURE)]
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOPS)] | None
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]   # int32 arrays; the engine checks the vocabulary


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
    temperature: Temperature | None = None
    top_p: Unit | None = None
    top_k: TopK | None = None
    min_p: Unit | None = None
    seed: Seed | None = None
    stop: Stop = None
    n: Annotated[int, msgspec.Meta(ge=1, le=128)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False            # llama.cpp's extra: keep going past the end-of-text token


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = msgspec.field(default_factory=list)
    max_completion_tokens: MaxTokens | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_format: Literal["auto", "deepseek", "none"] = "auto"   # llama.cpp's: "none" keeps <think> in content


class CompletionRequest(_Sampling):
    prompt: str | list[TokenId | str] | None = None     # text, token ids, or a list of one text
    echo: bool = False


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """The body as `kind`; raises msgspec.ValidationError / DecodeError naming the field."""
    return msgspec.json.decode(body, type=kind)
