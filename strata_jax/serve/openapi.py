"""The server's OpenAPI document with the request bodies its routes read: GET /openapi.json (vLLM's
path).

Litestar describes each route from its handler's signature, but ours read the raw body themselves
(msgspec decodes it and names the field at fault, serve/http/parse.py), so Litestar's own document
(/schema/openapi.json) has no request bodies. This one adds them: the msgspec structs' own JSON
schemas where a route decodes one, a small hand-written schema where it reads a JSON object field by
field. A client generator or a fuzzer (schemathesis, tests/test_openapi_fuzz.py and
scripts/fuzz_openapi.py) then sees what every route takes. The schemas say what a route accepts; the
routes still decide (a schema can't say "a token id within the vocabulary"), so anything the schemas
allow and a route refuses is a 4xx naming the field, never a 500.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .http.messages_schema import MessagesRequest
from .http.schemas import ChatCompletionRequest, CompletionRequest, Message
from .llama.native import NativeRequest

REF = "#/components/schemas/"
TOKEN_ID = {"type": "integer", "minimum": 0}
BOOL = {"type": "boolean"}


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        out["required"] = list(required)
    return out


# Routes that read a JSON object field by field (llama_routes.py, embeddings.py, app.py,
# http/responses.py): what they read.
_PROMPT_PIECES = {"type": "array", "items": {"anyOf": [TOKEN_ID, {"type": "string"}]}}
_EMBED_INPUT = {"anyOf": [{"type": "string"}, _PROMPT_PIECES,
                          {"type": "array",
                           "items": {"anyOf": [{"type": "string"}, _PROMPT_PIECES]}}]}
_SAMPLING_DEFAULTS = _object({k: {"type": "number"} for k in (
    "temperature", "temp", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
    "presence_penalty", "frequency_penalty", "n_predict", "max_tokens")})
HAND_WRITTEN: dict[str, dict[str, Any]] = {
    "/tokenize": _object({"content": {"anyOf": [{"type": "string"}, _PROMPT_PIECES]},
                          "add_special": BOOL, "parse_special": BOOL, "with_pieces": BOOL}),
    "/detokenize": _object({"tokens": {"type": "array", "items": TOKEN_ID}}),
    "/props": _SAMPLING_DEFAULTS,
    "/expert-profile": _object({"name": {"type": "string"}}, ("name",)),
    "/v1/embeddings": _object({"input": _EMBED_INPUT, "model": {"type": "string"},
                               "encoding_format": {"enum": ["float", "base64"]},
                               "dimensions": {"type": "integer"},
                               "embd_normalize": {"type": "integer"}},
                              ("input",)),
    "/embeddings": _object({"content": _EMBED_INPUT, "input": _EMBED_INPUT,
                            "embd_normalize": {"type": "integer"}}),
    "/slots/{slot_id}": _object({"filename": {"type": "string"}}),
    # OpenAI's Responses (http/responses_request.py): the fields it reads
    "/v1/responses": _object({
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "model": {"type": "string"}, "instructions": {"type": "string"},
        "previous_response_id": {"type": "string"}, "store": BOOL, "stream": BOOL,
        "max_output_tokens": {"type": "integer"}, "temperature": {"type": "number"},
        "top_p": {"type": "number"}, "parallel_tool_calls": BOOL,
        "tools": {"type": "array", "items": {"type": "object"}},
        "tool_choice": {"anyOf": [{"enum": ["auto", "none", "required"]}, {"type": "object"}]},
        "text": {"type": "object"}, "reasoning": {"type": "object"},
        "metadata": {"type": "object"}, "truncation": {"enum": ["disabled", "auto"]}},
        ("input",)),
    "/cors-proxy": {},
}
HAND_WRITTEN["/embedding"] = HAND_WRITTEN["/embeddings"]

# Routes that decode a msgspec struct (parse.py, native.py): the struct's own schema.
STRUCTS: dict[str, type[msgspec.Struct]] = {
    "/v1/chat/completions": ChatCompletionRequest, "/chat/completions": ChatCompletionRequest,
    "/apply-template": ChatCompletionRequest,
    "/chat/completions/input_tokens": ChatCompletionRequest,
    "/v1/chat/completions/input_tokens": ChatCompletionRequest,
    "/v1/completions": CompletionRequest, "/completion": NativeRequest,
    "/completions": NativeRequest,
    "/v1/messages": MessagesRequest, "/v1/messages/count_tokens": MessagesRequest,
}


# What the structs' defaults allow but the routes refuse (an empty chat, no prompt), so generated
# bodies that follow the document reach the engine instead of stopping at the first check.
NEEDED = {"ChatCompletionRequest": ("messages", {"minItems": 1}),
          "CompletionRequest": ("prompt", {}), "NativeRequest": ("prompt", {}),
          "MessagesRequest": ("messages", {"minItems": 1})}
# A route that needs a field its struct leaves optional (the struct is shared with another route):
# POST /v1/messages requires max_tokens, count_tokens takes none.
REQUIRED = {"/v1/messages": ["max_tokens"]}


def document(litestar_schema: dict[str, Any]) -> dict[str, Any]:
    """Litestar's document (`app.openapi_schema.to_schema()`) with every POST route's request body
    added."""
    structs = sorted(set(STRUCTS.values()) | {Message}, key=lambda s: s.__name__)
    refs, components = msgspec.json.schema_components(structs, ref_template=REF + "{name}")
    by_struct = dict(zip(structs, refs))
    for name, (field, bounds) in NEEDED.items():
        components[name]["required"] = sorted({*components[name].get("required", ()), field})
        components[name]["properties"][field].update(bounds)
    doc = {**litestar_schema, "info": {**litestar_schema.get("info", {}), "title": "strata-jax"}}
    doc["components"] = {**doc.get("components", {}),
                         "schemas": {**doc.get("components", {}).get("schemas", {}), **components}}
    for path, item in doc.get("paths", {}).items():
        for method, operation in item.items():
            if method != "post":
                continue
            schema = by_struct[STRUCTS[path]] if path in STRUCTS else HAND_WRITTEN.get(path)
            if path in REQUIRED:
                schema = {"allOf": [schema, {"required": REQUIRED[path]}]}
            if schema:
                operation["requestBody"] = {"required": True,
                                            "content": {"application/json": {"schema": schema}}}
            if path == "/slots/{slot_id}":
                operation.setdefault("parameters", [])
                operation["parameters"] = [p for p in operation["parameters"]
                                           if p.get("name") != "action"] + [
                    {"name": "action", "in": "query", "required": False,
                     "schema": {"enum": ["save", "restore", "erase"]}}]
    return doc
