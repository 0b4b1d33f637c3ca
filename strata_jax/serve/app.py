"""The HTTP routes (Litestar), run by uvicorn.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models      (also without /v1, as
                                                       llama.cpp)
    GET /health   GET /metrics   GET /slots   GET /faults
    POST /tokenize   POST /detokenize   GET /props   POST /props   POST /apply-template   POST
                                                                   /slots/N?action=
    POST /completion, /completions   (llama.cpp's native routes: llama_routes.py, native.py)
    POST /expert-profile {"name": NAME}   (writes NAME.json in --expert-profile-dir: see
                                          experts/profile.py)

Every answer that is an error has OpenAI's shape, from whatever raised it (our ApiError, Litestar's
HTTPException for 404/405/413, or a bug: 500), so no input can take the server down. With an API key
every route but /health needs `Authorization: Bearer KEY` or `X-Api-Key: KEY`; a CORS preflight
(OPTIONS) never does. CORS (cors.py): llama.cpp's default (any origin) or the --cors-origins list.
No request names a file: /expert-profile takes a name and writes into the server's own directory;
POST bodies must be `Content-Type: application/json` (415 otherwise); /v1/models shows the model's
file name, not its path; a 500 says where the log has the details (a reference to its log line),
never the exception's text.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import secrets
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from litestar import Litestar, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException, NotAuthorizedException
from litestar.handlers import BaseRouteHandler
from litestar.response import Stream

from ..config import ServerConfig
from ..engine import slot_files
from ..fetch import cache_dir
from . import openapi
from .errors import ApiError, error_body
from .http import cors, cors_proxy, embeddings, generate, messages, responses, webui
from .http.generate import Job, ModelNames
from .http.messages_answer import error_body as messages_error
from .http.metrics import Metrics
from .http.routes import RouteContext
from .llama import llama_routes, native
from .supervisor.supervisor import Supervisor

log = logging.getLogger("strata_jax.serve")

JSON = "application/json"
# An expert profile's name: a file name of our choosing in the server's directory, never a path.
PROFILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")


def create_app(sup: Supervisor, cfg: ServerConfig) -> Litestar:
    path = Path(sup.model)
    aliases, tags = _names(cfg.model_name), _names(cfg.model_tags)
    # several names (llama.cpp's --alias a,b,c): the id is the first in alphabetical order, as
    # llama.cpp's (a std::set), and a request may use any of them
    names = ModelNames(min(aliases) if aliases else path.name, *aliases, path.name, path.stem,
                       str(path), sup.model, strict=cfg.strict_model_name)
    metrics = Metrics(lambda: _snapshot(sup))
    started = int(time.time())
    # the server's sampling defaults (POST /props may change them)
    defaults = dict(cfg.sampling)
    parse_chat = functools.partial(generate.parse_chat,
                                   trust_template=cfg.trust_request_chat_template,
                                   defaults=defaults, prefill=cfg.prefill_assistant)
    parse_completion = functools.partial(generate.parse_completion, defaults=defaults)
    if cfg.slot_save_path is not None:     # made private now, or refused if others may write there
        slot_files.folder(cfg.slot_save_path)
    profile_dir = (Path(cfg.expert_profile_dir).expanduser().absolute() if cfg.expert_profile_dir
                   else cache_dir().absolute() / "expert-profiles")

    def served_as(job: Job) -> None:
        """The server's flags a job answers by: --verbose-responses, and --llama-conventions (whose
        ignore_eos bans the end-of-generation tokens, llama.cpp's -inf biases, where vLLM's
        generates past them)."""
        job.verbose = job.verbose or cfg.verbose_responses
        job.llama = cfg.llama_conventions
        if job.llama and job.params.ignore_eos:
            bans = [(t, -100.0) for t in sup.info.get("eos_ids", ())]
            job.params.logit_bias = [*(job.params.logit_bias or []), *bans]

    def done(job: Job, ticket, outcome: str, stats: dict | None, seconds: float) -> None:
        metrics.finished(job.endpoint, outcome, stats, seconds)
        metrics.latency.finished(job.arrived, ticket, stats)

    async def run(request: Request, job: Job) -> Response:
        try:
            prepared, ticket = await generate.start(sup, job)
        except ApiError:
            metrics.requests.labels(job.endpoint, "rejected").inc()
            raise
        if job.stream:
            return Stream(generate.stream(sup, job, prepared, ticket, done),
                          media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.create_task(_cancel_on_disconnect(request, sup, ticket))
        try:
            body = await generate.whole(sup, job, prepared, ticket, done)
        finally:
            watcher.cancel()
        return Response(body, media_type=JSON)

    @post(["/v1/chat/completions", "/chat/completions"], status_code=200, guards=[_json_body])
    async def chat_completions(request: Request) -> Response:
        job = _parsed(metrics, "chat", parse_chat, await request.body(), names)
        served_as(job)
        if sup.info and not sup.info.get("chat_template", True):
            metrics.requests.labels("chat", "rejected").inc()
            raise ApiError(400, "this model has no chat template (tokenizer.chat_template is not "
                                "in its GGUF), so it cannot format chat messages: send plain text "
                                "to /v1/completions instead",
                           "invalid_request_error", "messages")
        return await run(request, job)

    @post("/v1/completions", status_code=200, guards=[_json_body])
    async def completions(request: Request) -> Response:
        job = _parsed(metrics, "completions", parse_completion, await request.body(), names)
        served_as(job)
        return await run(request, job)

    @post(["/completion", "/completions"], status_code=200, guards=[_json_body])
    async def completion(request: Request) -> Response:
        """llama.cpp's native /completion (serve/llama/native.py); /completions is llama.cpp's name
        for it too."""
        try:
            jobs, req = native.parse(await request.body(), names.served, names.served, defaults,
                                     sup.config.seed)
            for job in jobs:
                served_as(job)
            out = await native.answer(sup, jobs, req, sup.config.seed, done, req.stream,
                                      watch=lambda tickets: _cancel_on_disconnect(request, sup,
                                                                                  *tickets))
        except ApiError:
            metrics.requests.labels("completion", "rejected").inc()
            raise
        if req.stream:
            return Stream(out, media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return Response(out, media_type=JSON)

    @get(["/v1/models", "/models"])
    async def models() -> dict[str, Any]:
        info = sup.info
        meta = {"n_ctx": sup.config.max_context, "parallel": sup.config.parallel, "path": path.name,
                **{k: info[k] for k in ("architecture", "vocab_size", "n_experts", "name")
                   if k in info}}
        return {"object": "list", "data": [{"id": names.served, "object": "model",
                "created": int(path.stat().st_mtime)
                if path.exists() else 0, "owned_by": "strata-jax", "aliases": aliases, "tags": tags,
                "meta": meta}]}

    @get(["/health", "/v1/health"], opt={"public": True})
    async def health() -> Response:
        ok, body = sup.health()
        return Response(body, status_code=200 if ok else 503, media_type=JSON)

    @get("/metrics")
    async def prometheus() -> Response:
        if not cfg.metrics_endpoint:
            raise ApiError(501, "this server does not serve /metrics: start it with --metrics",
                           "not_supported_error")
        await sup.stats(timeout=1.0)
        # Litestar adds "; charset=utf-8" to a text/ type itself
        return Response(metrics.render(), media_type="text/plain; version=0.0.4",
                        headers={"Process-Start-Time-Unix": str(started)})

    @get("/slots")
    async def slots() -> list[dict[str, Any]]:
        if not cfg.slots_endpoint:
            raise ApiError(501, "this server does not show its slots: start it without --no-slots",
                           "not_supported_error")
        return sup.slots()

    @get("/faults")
    async def faults() -> dict[str, Any]:
        return {"state": sup.state, "reason": sup.reason, "generation": sup.generation,
                "restarts": sup.restarts, **sup.ledger.to_json()}

    @post("/expert-profile", status_code=200, guards=[_json_body])
    async def expert_profile(request: Request) -> dict[str, Any]:
        """Write how often live traffic routed to each (layer, expert) to NAME.json in the server's
        --expert-profile-dir, for `--expert-profile FILE` at a later start."""
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001 - any unreadable body is the caller's error
            body = None
        name, file = _profile_file(body)
        saved = await sup.save_expert_profile(str(profile_dir / file))
        log.info("expert profile %r written to %s", name, saved.path)
        return {"name": name, "path": file, "routed": saved.routed}

    @get("/openapi.json", include_in_schema=False)
    async def openapi_document(request: Request) -> dict[str, Any]:
        """The routes with their request bodies (openapi.py): for client generators and the
        fuzzer."""
        return openapi.document(request.app.openapi_schema.to_schema())

    sup.on_fault = lambda fault: metrics.restarts.inc()
    routes = RouteContext(sup, cfg, names, metrics, _json_body, parse_chat, served_as, done,
                          lambda request, *tickets: _cancel_on_disconnect(request, sup, *tickets))

    def api_error(request: Request, exc: ApiError) -> Response:
        body = (messages_error(exc.status, exc.message) if _anthropic(request) else exc.body())
        return Response(body, status_code=exc.status, media_type=JSON, headers=exc.headers)

    def http_error(request: Request, exc: HTTPException) -> Response:
        status = exc.status_code
        message = exc.detail or "error"
        if status == 413:
            message = (f"the request body is larger than {cfg.max_body_bytes} bytes (the server's "
                       "max_body_bytes)")
        elif status == 404:
            message = (f"{message}: no such route (the API is under /v1: chat/completions, "
                       "completions, models)")
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        body = messages_error(status, message) if _anthropic(request) else error_body(status,
                                                                                       message)
        return Response(body, status_code=status, media_type=JSON, headers=headers)

    def internal_error(request: Request, exc: Exception) -> Response:
        # The exception's text can hold paths, keys, a prompt: it goes to the log only, under a
        # reference the answer gives, so an operator finds the traceback from a client's report.
        ref, now = f"err-{secrets.token_hex(4)}", datetime.now(UTC).isoformat(timespec="seconds")
        log.error("%s %s failed [%s]", request.method, request.url.path, ref, exc_info=exc)
        message = (f"internal error [{ref}] at {now}: the server's log has the details under that "
                   "reference")
        body = messages_error(500, message) if _anthropic(request) else error_body(500, message)
        return Response(body, status_code=500, media_type=JSON)

    app = Litestar(
        route_handlers=[chat_completions, completions, completion, models, health, prometheus,
                        slots, faults, expert_profile, openapi_document,
                        *llama_routes.handlers(sup, names.served, path.name, _json_body, cfg,
                                               defaults),
                        *(webui.handlers() if cfg.webui else []),
                        *cors_proxy.handlers(cfg.cors_proxy, cfg.cors_proxy_max_bytes),
                        *embeddings.handlers(sup, names, _json_body, metrics, cfg.pooling),
                        *messages.handlers(routes), *responses.handlers(routes)],
        guards=[_api_key_guard(cfg.api_key)] if cfg.api_key else [],
        exception_handlers={ApiError: api_error, HTTPException: http_error,
                            Exception: internal_error},
        on_startup=[_hook(sup.start)], on_shutdown=[_hook(sup.stop)],
        request_max_body_size=cfg.max_body_bytes, debug=False, logging_config=None,
    )
    # as Litestar wraps its own CORS; a /cors-proxy answer cut at its cap ends quietly
    # (cors_proxy.quiet)
    app.asgi_handler = cors.wrap(cors_proxy.quiet(app.asgi_handler), cfg.cors_origins)
    return app


def _anthropic(request: Request) -> bool:
    """Anthropic's Messages routes answer errors in Anthropic's shape (http/messages_answer.py)."""
    return request.url.path.startswith("/v1/messages")


def _hook(fn):
    # Litestar passes the app; the supervisor needs nothing
    async def hook(_app: Litestar) -> None:
        await fn()

    return hook


def _parsed(metrics: Metrics, endpoint: str, parse, body: bytes, names: ModelNames) -> Job:
    try:
        return parse(body, names)
    except ApiError:
        metrics.requests.labels(endpoint, "rejected").inc()
        raise


async def _cancel_on_disconnect(request: Request, sup: Supervisor, *tickets) -> None:
    """A whole (not streamed) answer: if the client goes away first, its request stops and frees its
    slot. (Streams: Litestar cancels the stream on disconnect, and the stream's `finally` cancels
    the request.)"""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                for ticket in tickets:
                    if ticket.state != "done":
                        log.info("%s: the client went away; cancelling", ticket.id)
                        sup.cancel(ticket)
                return
    except (asyncio.CancelledError, RuntimeError, OSError):
        return


def _json_body(connection: ASGIConnection, _handler: BaseRouteHandler) -> None:
    """POST routes read JSON only: another Content-Type (a form, text) is a 415, not a guess."""
    given = connection.headers.get("content-type")
    if (given or "").split(";", 1)[0].strip().lower() != JSON:
        what = f"Content-Type {given!r}" if given else "no Content-Type header"
        raise ApiError(415, f"{what}: this route reads a JSON body; send it with 'Content-Type: "
                            "application/json'",
                       "invalid_request_error", "Content-Type")


def _profile_file(body: Any) -> tuple[str, str]:
    """{"name": NAME} -> (NAME, its file name in the profile directory); anything else is a 400."""
    where = "into the server's --expert-profile-dir (default: the cache folder's expert-profiles/)"
    if not isinstance(body, dict):
        raise ApiError(400, 'a JSON body {"name": "NAME"} is needed: the profile is written as '
                            f'NAME.json {where}',
                       "invalid_request_error", "name")
    if "path" in body:
        raise ApiError(400, "path: a request cannot choose where the server writes; send "
                            "{\"name\": \"NAME\"} instead: the profile is written as NAME.json "
                            f"{where}", "invalid_request_error", "path")
    unknown = sorted(set(body) - {"name"})
    if unknown:
        raise ApiError(400,
                       f"unknown field {unknown[0]!r}: the body is {{\"name\": \"NAME\"}} only",
                       "invalid_request_error", unknown[0])
    name = body.get("name")
    if not isinstance(name, str) or not PROFILE_NAME.fullmatch(name) or ".." in name:
        shown = (repr(name) if not isinstance(name, str) or len(name) <= 120
                 else repr(name[:120]) + "...")
        raise ApiError(400, f"name = {shown}: a profile name is 1 to 100 letters, digits, '.', '_' "
                            "or '-', not starting with '.', with no '/' and no '..' (e.g. "
                            "\"hot-2026\")",
                       "invalid_request_error", "name")
    return name, name if name.endswith(".json") else name + ".json"


def _names(listed: str | None) -> list[str]:
    """A comma list of names (--model-name, --tags) -> the names, in the order given."""
    return [n.strip() for n in (listed or "").split(",") if n.strip()]


def _api_key_guard(key: str):
    def guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
        # a CORS preflight
        if handler.opt.get("public") or connection.scope.get("method") == "OPTIONS":
            return
        scheme, _, given = connection.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":                  # llama.cpp's (and Anthropic's) other header
            given = connection.headers.get("x-api-key", "")
        if not secrets.compare_digest(given.strip().encode(), key.encode()):
            raise NotAuthorizedException("invalid or missing API key: send the header "
                                         "'Authorization: Bearer KEY' (or 'X-Api-Key: KEY') with "
                                         "the key given to --api-key or --api-key-file")

    return guard


def _snapshot(sup: Supervisor) -> dict[str, Any]:
    return {"up": sup.ready, "generation": sup.generation, "slots": sup.config.parallel,
            "busy_slots": len(sup.running), "n_ctx": sup.config.max_context,
            "queued": sup.queued + (sup.last_stats.get("queued") or 0), "stats": sup.last_stats}
