"""Embeddings over HTTP: OpenAI's `POST /v1/embeddings` and llama.cpp's `POST /embeddings`
(`/embedding`).

    POST /v1/embeddings  {"input": text | [text, ...] | [id, ...] | [[id, ...], ...], "model",
                         "encoding_format":
                          "float" | "base64", "dimensions", "embd_normalize"}
        -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
            "usage"}
    POST /embeddings     {"input" or "content": the same} -> [{"index", "embedding": [[...], ...]}]

An input may also be llama.cpp's mix of texts and token ids (`[12, "text", 34]`, one prompt) or its
object, {"prompt_string": text} or {"content": [{"type": "text", "text"}, ...]} (the parts joined as
they are). Texts are tokenized with the model's special tokens (its BOS), as llama.cpp does. The
engine pools the last hidden states with the server's `--pooling` (last, mean, cls; none: every
token's vector, which only /embeddings can return) and normalizes them (`embd_normalize`, 2 =
Euclidean by default; engine/execute/embeddings.py). An input longer than a slot's context is a 400
naming it (one that cannot fit, told from its length, before the engine reads it). A request is
admitted as a prompt is (a place in --max-queue, the pipe's byte bound: Supervisor.ask) and read by
the engine a piece a step between generation windows, so a long one delays streams a little and
stops nothing.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

from litestar import Request, post

from ..errors import ApiError, invalid
from ..prompt_size import string_bytes
from ..protocol import Embed
from .fields import check_token_id, json_object, shown

MAX_INPUTS = 2048                   # OpenAI's bound on inputs a request


def handlers(sup: Any, names: Any, json_body: Any, metrics: Any, pooling_flag: str) -> list:
    def pooling() -> str:                       # --pooling auto: the model's (its file, else last)
        return pooling_flag if pooling_flag != "auto" else sup.info.get("pooling", "last")

    async def run(body: dict[str, Any], key: str) -> tuple[list, list[int], int]:
        inputs = parse_inputs(body.get(key), key)
        # (the server's tokenizer's bound: serve/prompts.py; none before the first engine is ready)
        _refuse_if_too_long(inputs, key, sup.config.max_context,
                            getattr(sup.prompts, "max_token_bytes", None))
        how = body.get("embd_normalize", 2)
        if isinstance(how, bool) or not isinstance(how, int) or not -1 <= how <= 1000:
            raise invalid(f"embd_normalize = {shown(how)}: -1 (none), 0 (max abs), 1 (taxicab), 2 "
                          "(Euclidean) or p > 2", "embd_normalize")
        try:
            reply = await sup.ask(Embed, timeout=sup.config.request_timeout_s, inputs=inputs,
                                  pooling=pooling(), normalize=how)
        except ApiError as e:
            if e.type == "exceed_context_size_error":
                raise invalid(f"{key}: an input is too large to embed: "
                              f"{e.extra.get('n_prompt_tokens')} tokens, but a slot holds "
                              f"{e.extra.get('n_ctx')} (--max-context)", key) from None
            raise
        metrics.requests.labels("embeddings", "ok").inc()
        metrics.prompt_tokens.inc(sum(reply.n_tokens))
        metrics.llamacpp.prompt_tokens.inc(sum(reply.n_tokens))
        return reply.embeddings, reply.n_tokens, len(inputs)

    @post(["/v1/embeddings"], status_code=200, guards=[json_body])
    async def openai_embeddings(request: Request) -> dict[str, Any]:
        body = json_object(await request.body())
        model = names.check(body.get("model"))
        if pooling() == "none":
            raise invalid("the server pools no embeddings (--pooling none): /v1/embeddings returns "
                          "one vector an input; use /embeddings for every token's, or start the "
                          "server with --pooling last|mean|cls")
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise invalid(f"encoding_format = {shown(encoding)}: float or base64",
                          "encoding_format")
        vectors, counts, _ = await run(body, "input")
        dims = body.get("dimensions")
        if dims is not None and dims != len(vectors[0]):
            raise invalid(f"dimensions = {shown(dims)}: this model's embeddings have "
                          f"{len(vectors[0])} (they are not shortened)", "dimensions")
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, encoding)}
                for i, v in enumerate(vectors)]
        n = sum(counts)
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    @post(["/embeddings", "/embedding"], status_code=200, guards=[json_body])
    async def llama_embeddings(request: Request) -> list[dict[str, Any]]:
        body = json_object(await request.body())
        key = "input" if "input" in body else "content"
        vectors, _, _ = await run(body, key)
        every = pooling() == "none"
        return [{"index": i, "embedding": v if every else [v]} for i, v in enumerate(vectors)]

    return [openai_embeddings, llama_embeddings]


def parse_inputs(value: Any, key: str) -> list[str | list[int | str]]:
    """The request's input -> a text or token list a prompt."""
    if isinstance(value, (str, dict)):
        return [_one(value, key)]
    if not isinstance(value, list) or not value:
        raise invalid(f"{key} = {shown(value)}: give a text, a list of texts, a list of token ids "
                      "or a list of lists of them", key)
    flat = all(isinstance(x, (int, str)) and not isinstance(x, bool) for x in value)
    if flat and any(isinstance(x, int) for x in value):
        # one prompt: token ids, or llama.cpp's mix of texts and ids
        return [_one(value, key)]
    if len(value) > MAX_INPUTS:
        raise invalid(f"{key}: {len(value)} inputs; at most {MAX_INPUTS} a request", key)
    return [_one(x, f"{key}[{i}]") for i, x in enumerate(value)]


def _refuse_if_too_long(inputs: list, key: str, n_ctx: int, max_token_bytes: int | None) -> None:
    """An input that cannot fit a slot, told from its length before the engine tokenizes it
    (megabytes of text cost seconds to tokenize, only to be refused): a token stands for at most
    `max_token_bytes` bytes."""
    for x in inputs:
        parts = [x] if isinstance(x, str) else x
        texts = string_bytes(parts)
        # (not known yet: a text is at least a token)
        per_token = max_token_bytes or max(texts, 1)
        at_least = sum(1 for p in parts if not isinstance(p, str)) + -(-texts // per_token)
        if at_least > n_ctx:
            raise invalid(f"{key}: an input is too large to embed: at least {at_least} tokens "
                          f"(told from its length), but a slot holds {n_ctx} (--max-context)", key)


def _one(x: Any, where: str) -> str | list[int | str]:
    # (an empty one: the engine says whether tokens are left)
    if isinstance(x, str):
        return x
    if isinstance(x, list) and x:
        for i, t in enumerate(x):
            if not isinstance(t, str):
                check_token_id(t, f"{where}[{i}]", where.split("[")[0])
        return x
    # llama.cpp's {"prompt_string"} / {"content": [parts]}
    if isinstance(x, dict):
        if isinstance(x.get("prompt_string"), str):
            return _one(x["prompt_string"], where)
        parts = x.get("content")
        if isinstance(parts, list) and parts:
            texts = []
            for j, p in enumerate(parts):
                if (not isinstance(p, dict) or p.get("type") != "text"
                        or not isinstance(p.get("text"), str)):
                    kind = p.get("type") if isinstance(p, dict) else None
                    raise invalid(f"{where}.content[{j}] = {shown(p)}: " + (
                        "this model reads text only"
                        if kind in ("image_url", "input_audio", "input_video") else
                        'give {"type": "text", "text": ...}'), where.split("[")[0])
                texts.append(p["text"])
            return _one("".join(texts), where)
    raise invalid(f"{where} = {shown(x)}: give a text, a list of token ids, {{\"prompt_string\": "
                  "text} or "
                  '{"content": [{"type": "text", "text": ...}]}', where.split("[")[0])


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    """OpenAI's base64: the float32 values' little-endian bytes."""
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
