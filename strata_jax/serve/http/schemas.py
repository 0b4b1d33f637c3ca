"""Request bodies of the OpenAI API, as msgspec structs: decoding checks every type and range and
names the field that is wrong (`Expected int, got str - at $.max_tokens`). Fields OpenAI clients
send that we do not use (user, tools, ...) are ignored, as msgspec ignores unknown fields by
default."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from ...engine.request import (
    MAX_CACHE_SALT_CHARS,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TEMPERATURE,
)

# Bounds that catch nonsense before anything is built from it: every number fits the array it goes
# into (int32 top_k, a 64-bit seed folded to 32), no float is NaN or inf (JSON has neither; 1e999 is
# refused), stop strings are few and short. The engine checks the finer rules again (top_k within
# the vocabulary, ...).
MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=1 << 24)]
# -1: a random seed (llama.cpp); int64 (OpenAI), folded to 32 bits
Seed = Annotated[int, msgspec.Meta(ge=-1, le=2**63 - 1)]
TopK = Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)]   # 0 or -1 (vLLM's): off
Unit = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TEMPERATURE)]
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOPS)] | None
# int32 arrays; the engine checks the vocabulary
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
# OpenAI's presence / frequency penalties
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
# token id (a string of digits in JSON) -> bias; generate.py checks the biases (-100..100: its
# message shows the token and the value), the engine the vocabulary
LogitBias = Annotated[dict[str, float], msgspec.Meta(max_length=MAX_LOGIT_BIAS)]
RepeatPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=10.0)]           # llama.cpp's; 1 is off
# llama.cpp's; -1: all, 0: off
RepeatLastN = Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]
ThinkingBudget = Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)]
MAX_CHOICES = 8


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


GrammarText = Annotated[str, msgspec.Meta(max_length=MAX_GRAMMAR_CHARS)]


class JsonSchemaFormat(msgspec.Struct):
    """OpenAI's response_format.json_schema: {name, description, schema, strict}."""
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct):
    """OpenAI's response_format; llama.cpp also reads a `schema` beside `type: json_object`."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema: dict[str, Any] | bool | None = None


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
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)] | None = None
    logit_bias: LogitBias | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repeat_penalty: RepeatPenalty | None = None
    repeat_last_n: RepeatLastN | None = None
    # vLLM's name: repeat_penalty over all of prompt + output
    repetition_penalty: RepeatPenalty | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False            # llama.cpp's extra: keep going past the end-of-text token
    # llama.cpp's: the answer also carries "__verbose" (the prompt text, ...)
    verbose: bool = False
    # llama.cpp's: a stream also sends prompt_progress as the prompt is read
    return_progress: bool = False
    timings_per_token: bool = False     # llama.cpp's: streamed chunks carry timings
    # structured output (serve/http/fields.py: grammar_param): OpenAI's response_format, llama.cpp's
    # grammar (GBNF) and json_schema
    response_format: ResponseFormat | None = None
    grammar: GrammarText | None = None
    json_schema: dict[str, Any] | bool | None = None
    # vLLM's: prefix-cache KV is shared only among requests of the same salt
    # (engine/schedule/prefix_cache.py)
    cache_salt: CacheSalt | None = None
    # vLLM's: the most tokens the reasoning section takes, then the engine closes it (-1: no limit,
    # 0: no reasoning); the server's --reasoning-budget when left out
    thinking_token_budget: ThinkingBudget | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = msgspec.field(default_factory=list)
    max_completion_tokens: MaxTokens | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # llama.cpp's: "none" keeps <think> in content
    reasoning_format: Literal["auto", "deepseek", "none"] = "auto"
    # OpenAI's: goes to the template as chat_template_kwargs.reasoning_effort (gpt-oss's reads it)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = \
        None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    # serve/tools.py
    tools: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=128)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: a chat whose last message is the assistant's is continued (no new turn) with
    # continue_final_message; add_generation_prompt false renders no assistant header after the last
    # message
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class CompletionRequest(_Sampling):
    prompt: str | list[TokenId | str] | None = None     # text, token ids, or a list of one text
    echo: bool = False
    # the top N alternatives of each token (and its own)
    logprobs: TopLogprobs | None = None


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """The body as `kind`; raises msgspec.ValidationError / DecodeError naming the field."""
    return msgspec.json.decode(body, type=kind)
