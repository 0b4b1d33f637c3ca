"""The request fields of sampling controls, logprobs and structured output, from a decoded body to
the engine's parameters.

msgspec has checked their types and most ranges (schemas.py); here are the rules it cannot say:
logit_bias keys are token ids and its biases are -100..100 (the message shows the token and the
value), and chat's `top_logprobs` needs `logprobs: true` (OpenAI's rule). The engine checks the
token ids against the vocabulary. Structured output: one of response_format (json_object,
json_schema), grammar (GBNF) and json_schema at a time; the engine compiles it
(engine/grammar/constrain.py) and refuses what it cannot compile, naming the field.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import msgspec

from ...engine.request import MAX_GRAMMAR_CHARS
from ..errors import invalid

MAX_SHOWN = 60              # characters of a bad value an error message shows


def control_params(req: Any, chat: bool) -> dict[str, Any]:
    """The engine's parameters for the controls a request sets (the engine's defaults for those it
    leaves out). vLLM's `repetition_penalty` is llama.cpp's `repeat_penalty` over the whole prompt
    and output (repeat_last_n -1), unless the request sets those."""
    repeat, last_n = req.repeat_penalty, req.repeat_last_n
    if repeat is None and req.repetition_penalty is not None:
        repeat, last_n = req.repetition_penalty, -1 if last_n is None else last_n
    return {"logit_bias": _logit_bias(req.logit_bias),
            "presence_penalty": float(req.presence_penalty or 0.0),
            "frequency_penalty": float(req.frequency_penalty or 0.0),
            "repeat_penalty": float(repeat if repeat is not None else 1.0),
            "repeat_last_n": last_n if last_n is not None else 64,
            "logprobs": _chat_logprobs(req) if chat else req.logprobs,
            "grammar": grammar_param(req)}


def grammar_param(req: Any) -> list[str] | None:
    """[kind, text, field] of the request's structured output (constrain.py's grammar), or None."""
    rf = req.response_format
    asked = [name for name, v in (("response_format", rf is not None and rf.type != "text"),
                                  ("grammar", req.grammar is not None),
                                  ("json_schema", req.json_schema is not None))
             if v]
    if len(asked) > 1:
        raise invalid(f"{asked[1]}: a request may constrain its output one way; it sets "
                      f"{' and '.join(asked)}", asked[1])
    if req.grammar is not None:
        return ["gbnf", req.grammar, "grammar"]
    if req.json_schema is not None:
        return ["json_schema", _schema_text(req.json_schema, "json_schema"), "json_schema"]
    if not asked:
        return None
    if rf.type == "json_object":
        if rf.schema is not None:          # llama.cpp's: a schema beside json_object
            return ["json_schema", _schema_text(rf.schema, "response_format.schema"),
                    "response_format"]
        return ["json_object", "", "response_format"]
    if rf.json_schema is None or rf.json_schema.schema is None:
        raise invalid("response_format.json_schema.schema is missing: {\"type\": \"json_schema\", "
                      "\"json_schema\": {\"name\": ..., \"schema\": {...}, \"strict\": true}}",
                      "response_format")
    return ["json_schema",
            _schema_text(rf.json_schema.schema, "response_format.json_schema.schema"),
            "response_format"]


def _schema_text(schema: Any, field: str) -> str:
    text = json.dumps(schema, allow_nan=False) if not isinstance(schema, str) else schema
    if len(text) > MAX_GRAMMAR_CHARS:
        raise invalid(f"{field}: the JSON schema is {len(text)} characters; at most "
                      f"{MAX_GRAMMAR_CHARS}", field)
    return text


def _chat_logprobs(req: Any) -> int | None:
    """Chat: `logprobs: true` asks for each token's logprob, `top_logprobs: N` for N alternatives
    too."""
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid(f"top_logprobs = {req.top_logprobs}: set logprobs to true to get "
                      "top_logprobs", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def _logit_bias(bias: dict[str, float] | None) -> list[list]:
    """{"token id": bias} -> [[id, bias], ...] (msgpack carries the pairs; its map keys would be
    strings)."""
    pairs = []
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise invalid(f"logit_bias: the key {key[:40]!r} is not a token id (a whole number >= "
                          "0, as a string)", "logit_bias")
        if not (math.isfinite(value) and -100.0 <= value <= 100.0):
            raise invalid(f"logit_bias: the bias of token {key} is {value!r}; a bias is a number "
                          "from -100 to 100", "logit_bias")
        pairs.append([int(key), float(value)])
    return pairs


def json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise invalid(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise invalid("the request body nests arrays or objects too deeply to read") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body is {shown(body)}: send a JSON object")
    return body


def check_token_id(value: Any, where: str, param: str) -> None:
    # JSON true is not a token; an id is range-checked by the engine, but one beyond 64 bits cannot
    # cross the pipe
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{where} = {shown(value)}: a token id is a whole number", param)
    if not 0 <= value < 1 << 62:
        raise invalid(f"{where} = {shown(value)}: not a token id of this model's vocabulary", param)


def shown(value: Any) -> str:
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


PATH_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def value_at(body: bytes, path: str) -> str:
    """The value at msgspec's error path (`stop[0]`, `messages[1].role`) in the raw body, shown
    short."""
    try:
        value: Any = msgspec.json.decode(body)
        for key, index in PATH_PART.findall(path):
            value = value[int(index)] if index else value[key]
    except Exception:  # noqa: BLE001 - only decoration for the message
        return "a value of another type"
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= 60 else text[:57] + "..."
