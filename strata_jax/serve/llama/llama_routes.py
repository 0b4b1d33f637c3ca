"""llama.cpp's server extras, in its request and response shapes (tools/server/README.md of
llama.cpp):

    POST /tokenize    {"content": text | [text | id, ...], "add_special": false, "parse_special":
                      true,
                       "with_pieces": false}  -> {"tokens": [id, ...]} or {"tokens": [{"id",
                                              "piece"}, ...]}
    POST /detokenize  {"tokens": [id, ...]}   -> {"content": text}
    GET  /props       the server's settings: default_generation_settings (n_ctx, params),
                      total_slots, chat_template, model_path, ... (only what this server knows: no
                      invented fields)
    POST /props       {"temperature": 0.5, ...} or {"default_generation_settings": {"params":
                      {...}}}: new server-wide sampling defaults (with --props only, else 501 as
                      llama.cpp's)
    POST /completion, /completions   llama.cpp's native generation (serve/llama/native.py)
    POST /apply-template  {"messages", "tools", "chat_template_kwargs"} -> {"prompt": the rendered
                          text}
    POST /chat/completions/input_tokens  a chat request -> {"input_tokens": the prompt tokens it
                                         would read}
    POST /slots/N?action=save|restore|erase  {"filename": NAME}: a slot's kept KV to / from NAME in
                      --slot-save-path (a file name, never a path: 400); without --slot-save-path a
                          501

Tokenizing runs in the engine process with the engine's own tokenizer (serve/tokens.py). A body
without `content` (`tokens`) gets an empty answer, as llama.cpp gives; a field of the wrong type, or
an id outside the vocabulary, is a 400 naming the field and the value; text beyond
--max-tokenize-bytes or ids beyond --max-tokenize-ids (read, or to be answered) a 413 naming the
bound and the size (serve/tokens.py). Every question to the engine takes a --max-queue place
(Supervisor.ask). /props is a 503 until the first engine has loaded.
"""

from __future__ import annotations

import re
import time
from typing import Any

from litestar import Request, get, post
from litestar.params import FromPath, FromQuery

from ..._version import __version__
from ...config import ServerConfig, default_problem
from ...engine import slot_files
from ..errors import ApiError, invalid
from ..http.fields import MAX_SHOWN, check_token_id, control_params, json_object, shown
from ..http.parse import DEFAULTS, parse_chat
from ..protocol import Detokenize, SlotAction, Tokenize
from ..tokens import check_sizes

SLOT_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")
SLOT_ID = re.compile(r"[0-9]{1,6}")          # a slot's number (--parallel is at most 256)


def handlers(sup: Any, served: str, file_name: str, json_body: Any, cfg: ServerConfig | None = None,
             defaults: dict[str, Any] | None = None) -> list:
    """The route handlers, over the supervisor, the model's served name and its file's name (see
    app.py), the server's config and its sampling defaults (a dict POST /props may change)."""
    cfg = cfg or ServerConfig()
    defaults = defaults if defaults is not None else {}

    @post("/tokenize", status_code=200, guards=[json_body])
    async def tokenize(request: Request) -> dict[str, Any]:
        body = json_object(await request.body())
        if "content" not in body:
            return {"tokens": []}
        # 413s
        check_sizes(body["content"], "content", cfg.max_tokenize_bytes, cfg.max_tokenize_ids)
        content = _content(body["content"])
        flags = {k: _flag(body, k, default) for k, default in
                 (("add_special", False), ("parse_special", True), ("with_pieces", False))}
        reply = await sup.ask(Tokenize, content=content, max_ids=cfg.max_tokenize_ids, **flags)
        return {"tokens": reply.tokens}

    @post("/detokenize", status_code=200, guards=[json_body])
    async def detokenize(request: Request) -> dict[str, Any]:
        body = json_object(await request.body())
        if "tokens" not in body:
            return {"content": ""}
        tokens = body["tokens"]
        if not isinstance(tokens, list):
            raise invalid(f"tokens = {shown(tokens)}: give a list of token ids (whole numbers)",
                          "tokens")
        check_sizes(tokens, "tokens", cfg.max_tokenize_bytes, cfg.max_tokenize_ids)
        for i, t in enumerate(tokens):
            check_token_id(t, f"tokens[{i}]", "tokens")
        reply = await sup.ask(Detokenize, tokens=tokens, max_bytes=cfg.max_tokenize_bytes)
        return {"content": reply.content}

    @get("/props")
    async def props() -> dict[str, Any]:
        info = sup.info
        if not info:        # llama.cpp too answers 503 while its model loads
            raise ApiError(503, f"the engine is not ready ({sup.state}: {sup.reason})",
                           "unavailable_error")
        cfg, server_cfg = sup.config, server
        out: dict[str, Any] = {
            "default_generation_settings": {"n_ctx": cfg.max_context, "speculative": cfg.spec > 0,
                                            "params": {**default_params(defaults),
                                                       "seed": cfg.seed}},
            "total_slots": cfg.parallel,
            "model_alias": served,
            # the file's name: the server shows no paths (nor does /v1/models); llama.cpp shows its
            # -m argument
            "model_path": file_name,
            "modalities": {"vision": False, "audio": False},    # text only
            "build_info": f"strata-jax {__version__}",
            "is_sleeping": False,
            "endpoint_slots": server_cfg.slots_endpoint, "endpoint_metrics": True,
            "endpoint_props": server_cfg.props_writable,
        }
        if info.get("chat_template_source") is not None:
            out["chat_template"] = info["chat_template_source"]
        # strata's own: the kernel backend the engine resolved (cpu, cpu-exact with --cpu-math
        # exact, pallas, xla)
        out["backend"] = (info.get("choices") or {}).get("backend")
        for key in ("bos_token", "eos_token"):
            if info.get(key) is not None:
                out[key] = info[key]
        return out

    server = cfg

    @post("/props", status_code=200, guards=[json_body])
    async def change_props(request: Request) -> dict[str, Any]:
        if not cfg.props_writable:
            raise ApiError(501, "this server does not let POST /props change its settings: start "
                                "it with --props",
                           "not_supported_error")
        body = json_object(await request.body())
        given = ((body.get("default_generation_settings") or {}).get("params") or {}) \
            if isinstance(body.get("default_generation_settings"), dict) else {}
        given = {**given, **{k: v for k, v in body.items() if k != "default_generation_settings"}}
        given = {"temperature" if k == "temp" else k: v for k, v in given.items()}
        if "max_tokens" in given:
            given["n_predict"] = given.pop("max_tokens")
        unknown = sorted(set(given) - set(ServerConfig.SAMPLING_KEYS))
        if unknown:
            raise invalid(f"{unknown[0]}: POST /props may change "
                          f"{', '.join(ServerConfig.SAMPLING_KEYS)}", unknown[0])
        vocab = (sup.info or {}).get("vocab_size")     # top_k's bound, as a request's
        # what a request would be refused for (config.default_problem)
        for key, value in given.items():
            what = default_problem(key, value, vocab)
            if what:
                raise invalid(f"{key} = {shown(value)}: {what} (a server-wide default every "
                              f"request that sets no {key} would get)", key)
        defaults.update(given)
        return {"success": True, "params": default_params(defaults)}

    @post("/apply-template", status_code=200, guards=[json_body])
    async def apply_template(request: Request) -> dict[str, Any]:
        job = parse_chat(await request.body(), _AnyModel(served),
                         trust_template=cfg.trust_request_chat_template)
        text = await sup.apply_template(job.prompt, job.params, job.chat_template_kwargs,
                                        time.monotonic() + 30.0)
        return {"prompt": text}

    @post(["/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"], status_code=200,
          guards=[json_body])
    async def input_tokens(request: Request) -> dict[str, Any]:
        """The prompt tokens a chat would read ({"input_tokens": n}), rendered and tokenized as a
        request is."""
        job = parse_chat(await request.body(), _AnyModel(served),
                         trust_template=cfg.trust_request_chat_template)
        prepared = await sup.prepare(f"count-{id(job)}", job.prompt, job.params,
                                     job.chat_template_kwargs, time.monotonic() + 30.0)
        return {"input_tokens": len(prepared.ids)}

    # guarded like every POST that reads JSON: a form or text/plain POST (a cross-site request a
    # browser sends without a preflight) is a 415, erase included; the id is text, bounded here
    # (beyond 64 bits: no 500)
    @post("/slots/{slot_id:str}", status_code=200, guards=[json_body])
    async def slot_action(request: Request, slot_id: FromPath[str],
                          action: FromQuery[str | None] = None
                          ) -> dict[str, Any]:
        n = sup.config.parallel
        if not SLOT_ID.fullmatch(slot_id) or int(slot_id) >= n:
            raise invalid(f"id_slot = {slot_id[:MAX_SHOWN]}: give a slot of this server, "
                          f"0..{n - 1} (--parallel)", "id_slot")
        if cfg.slot_save_path is None and action != "erase":
            raise ApiError(501,
                           "this server keeps no slot files: start it with --slot-save-path DIR",
                           "not_supported_error")
        if action not in ("save", "restore", "erase"):
            raise invalid(f"action = {action!r}: give ?action=save, restore or erase", "action")
        path = None
        if action != "erase":
            body = json_object(await request.body())
            name = body.get("filename")
            if not isinstance(name, str) or not SLOT_FILE.fullmatch(name) or ".." in name:
                raise invalid(f"filename = {shown(name)}: a slot file's name is 1 to 100 letters, "
                              "digits, '.', '_' or '-' (no '/', no '..', not starting with '.'), "
                              "kept in the server's --slot-save-path", "filename")
            try:
                # made private, or checked still so
                path = str(slot_files.folder(cfg.slot_save_path) / name)
            except slot_files.SlotFileError as e:
                raise ApiError(500, str(e), "server_error") from None
        reply = await sup.ask(SlotAction, action=action, slot=int(slot_id), path=path, timeout=60.0)
        return reply.slot or {}

    return [tokenize, detokenize, props, change_props, apply_template, input_tokens, slot_action]


class _AnyModel:
    """/apply-template names no model: any name is this one."""

    def __init__(self, served: str):
        self.served = served

    def check(self, model: str | None) -> str:
        return self.served


def default_params(defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a request that sets nothing gets (parse.py and fields.py decide it, over the server's
    defaults), in llama.cpp's names."""
    defaults = defaults or {}
    controls = control_params(_NoFields(), chat=False)
    n = defaults.get("n_predict", -1)
    base = {**DEFAULTS, **{k: controls[k] for k in ("repeat_last_n", "repeat_penalty",
                                                    "presence_penalty", "frequency_penalty")}}
    base.update({k: v for k, v in defaults.items() if k != "n_predict"})
    return {**base, "n_predict": n, "max_tokens": n,     # -1: up to the end of the slot's context
            "stop": [], "ignore_eos": False, "n_probs": 0}


class _NoFields:
    """A request body that sets no field (for control_params' defaults)."""

    def __getattr__(self, name: str) -> None:
        return None




def _content(content: Any) -> str | list[str | int]:
    """A text, or a list of texts and token ids (llama.cpp's mixed prompt)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"content = {shown(content)}: give a text, or a list of texts and token ids",
                      "content")
    for i, part in enumerate(content):
        if not isinstance(part, str):
            check_token_id(part, f"content[{i}]", "content")
    return content




def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:               # left out or null: llama.cpp's default
        return default
    if not isinstance(value, bool):
        raise invalid(f"{key} = {shown(value)}: give true or false", key)
    return value
