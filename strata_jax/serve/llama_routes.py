"""llama.cpp's server extras, in its request and response shapes (tools/server/README.md of llama.cpp):

    POST /tokenize    {"content": text | [text | id, ...], "add_special": false, "parse_special": true,
                       "with_pieces": false}  -> {"tokens": [id, ...]} or {"tokens": [{"id", "piece"}, ...]}
    POST /detokenize  {"tokens": [id, ...]}   -> {"content": text}
    GET  /props       the server's settings: default_generation_settings (n_ctx, params), total_slots,
                      chat_template, model_path, ... (only what this server knows: no invented fields)

Tokenizing runs in the engine process with the engine's own tokenizer (serve/tokens.py). A body without
`content` (`tokens`) gets an empty answer, as llama.cpp gives; a field of the wrong type, or an id outside the
vocabulary, is a 400 naming the field and the value. /props is a 503 until the first engine has loaded.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, get, post

from .. import __version__
from .errors import ApiError, invalid
from .fields import control_params
from .parse import DEFAULTS

MAX_SHOWN = 60


def handlers(sup: Any, served: str, file_name: str, json_body: Any) -> list:
    """The route handlers, over the supervisor, the model's served name and its file's name (see app.py)."""

    @post("/tokenize", status_code=200, guards=[json_body])
    async def tokenize(request: Request) -> dict[str, Any]:
        body = _object(await request.body())
        if "content" not in body:
            return {"tokens": []}
        content = _content(body["content"])
        flags = {k: _flag(body, k, default) for k, default in
                 (("add_special", False), ("parse_special", True), ("with_pieces", False))}
        reply = await sup.ask("tokenize", content=content, **flags)
        return {"tokens": reply["tokens"]}

    @post("/detokenize", status_code=200, guards=[json_body])
    async def detokenize(request: Request) -> dict[str, Any]:
        body = _object(await request.body())
        if "tokens" not in body:
            return {"content": ""}
        tokens = body["tokens"]
        if not isinstance(tokens, list):
            raise invalid(f"tokens = {_shown(tokens)}: give a list of token ids (whole numbers)", "tokens")
        for i, t in enumerate(tokens):
            _token_id(t, f"tokens[{i}]", "tokens")
        reply = await sup.ask("detokenize", tokens=tokens)
        return {"content": reply["content"]}

    @get("/props")
    async def props() -> dict[str, Any]:
        info = sup.info
        if not info:        # llama.cpp too answers 503 while its model loads
            raise ApiError(503, f"the engine is not ready ({sup.state}: {sup.reason})", "unavailable_error")
        cfg = sup.config
        out: dict[str, Any] = {
            "default_generation_settings": {"n_ctx": cfg.max_context, "speculative": cfg.spec > 0,
                                            "params": default_params()},
            "total_slots": cfg.parallel,
            "model_alias": served,
            # the file's name: the server shows no paths (nor does /v1/models); llama.cpp shows its -m argument
            "model_path": file_name,
            "modalities": {"vision": False, "audio": False},    # text only
            "build_info": f"strata-jax {__version__}",
            "is_sleeping": False,
            "endpoint_slots": True, "endpoint_metrics": True, "endpoint_props": False,   # no POST /props
        }
        if info.get("chat_template_source") is not None:
            out["chat_template"] = info["chat_template_source"]
        for key in ("bos_token", "eos_token"):
            if info.get(key) is not None:
                out[key] = info[key]
        return out

    return [tokenize, detokenize, props]


def default_params() -> dict[str, Any]:
    """What a request that sets nothing gets (parse.py and fields.py decide it), in llama.cpp's names."""
    controls = control_params(_NoFields(), chat=False)
    return {**DEFAULTS, "n_predict": -1, "max_tokens": -1,     # -1: up to the end of the slot's context
            **{k: controls[k] for k in ("repeat_last_n", "repeat_penalty", "presence_penalty", "frequency_penalty")},
            "stop": [], "ignore_eos": False, "n_probs": 0}


class _NoFields:
    """A request body that sets no field (for control_params' defaults)."""

    def __getattr__(self, name: str) -> None:
        return None


def _object(raw: bytes) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise invalid(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise invalid("the request body nests arrays or objects too deeply to read") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body is {_shown(body)}: send a JSON object")
    return body


def _content(content: Any) -> str | list[str | int]:
    """A text, or a list of texts and token ids (llama.cpp's mixed prompt)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"content = {_shown(content)}: give a text, or a list of texts and token ids", "content")
    for i, part in enumerate(content):
        if not isinstance(part, str):
            _token_id(part, f"content[{i}]", "content")
    return content


def _token_id(value: Any, where: str, param: str) -> None:
    # JSON true is not a token; an id is range-checked by the engine, but one beyond 64 bits cannot cross the pipe
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{where} = {_shown(value)}: a token id is a whole number", param)
    if not 0 <= value < 1 << 62:
        raise invalid(f"{where} = {_shown(value)}: not a token id of this model's vocabulary", param)


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:               # left out or null: llama.cpp's default
        return default
    if not isinstance(value, bool):
        raise invalid(f"{key} = {_shown(value)}: give true or false", key)
    return value


def _shown(value: Any) -> str:
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."
