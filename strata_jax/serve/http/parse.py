"""Request bodies to jobs: msgspec decoding (schemas.py) and the checks msgspec cannot express
(ApiError naming the field), for OpenAI chat and text completions.

Sampling defaults when a request leaves them out are the server's (`--temp`, `--top-k`, ..., `-n`:
ServerConfig. sampling), else llama.cpp's server's (temperature 0.8, top_k 40, top_p 0.95, min_p
0.05); `temperature: 0` is greedy. The server's `-n` is also the most a request may ask for, as
llama.cpp's is.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ...gguf.chat_template import reserved_kwargs
from ..errors import ApiError, invalid
from ..params import RequestParams
from ..tools import forced, tool_request
from .fields import control_params, value_at
from .schemas import ChatCompletionRequest, CompletionRequest, Message, decode

DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


@dataclass
class Job:
    kind: str                                    # "chat" | "text"
    id: str
    model: str
    prompt: Any                                  # messages (dicts), text, or token ids
    params: RequestParams
    stream: bool
    include_usage: bool
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning: bool = True                       # split <think> into reasoning_content
    echo: str = ""
    n: int = 1                                   # choices (serve/http/choices.py)
    # tools in play (serve/tools.py), and the choice among them
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True             # false: one call at most
    # llama.cpp's "__verbose" in the answer (generate.py)
    verbose: bool = False
    # llama.cpp's conventions (--llama-conventions: serve/app.py)
    llama: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    arrived: float = field(default_factory=time.monotonic)
    # the route that made it, when it is not chat or completions' own (/metrics' endpoint label):
    # "messages" (Anthropic's), "responses" (OpenAI's)
    route: str | None = None

    @property
    def endpoint(self) -> str:
        return self.route or ("chat" if self.kind == "chat" else "completions")


# ---- parsing -------------------------------------------------------------------------------------


def parse_chat(body: bytes, names: ModelNames, trust_template: bool = False,
               defaults: dict | None = None, prefill: bool = False) -> Job:
    """prefill: --prefill-assistant (llama.cpp's rules for a final assistant message it continues:
    its text parts joined by a blank line, and no second assistant message before it)."""
    req = _decode(body, ChatCompletionRequest)
    if not req.messages:
        raise invalid("messages is empty: a chat needs at least one message", "messages")
    reserved = [] if trust_template else reserved_kwargs(req.chat_template_kwargs or {})
    if reserved:   # a template is code the server runs: see RESERVED_TEMPLATE_KWARGS
        raise invalid(f"chat_template_kwargs.{reserved[0]}: chat_template_kwargs may set the "
                      f"template's variables only, and {', '.join(reserved)} would replace the "
                      "template or its inputs; leave them out, or start the server with "
                      "--trust-request-chat-template", f"chat_template_kwargs.{reserved[0]}")
    continued = prefill and req.add_generation_prompt and req.messages[-1].role == "assistant"
    if continued and len(req.messages) > 1 and req.messages[-2].role == "assistant":
        raise invalid("messages: the last two are the assistant's; with --prefill-assistant the "
                      "final one is continued, so the one before it must not be the assistant's "
                      "too", "messages")
    messages = [_message(m, i, "\n\n" if continued and i == len(req.messages) - 1 else "\n")
                for i, m in enumerate(req.messages)]
    _check_carried(messages=messages, chat_template_kwargs=req.chat_template_kwargs)
    if req.add_generation_prompt and req.continue_final_message:
        raise invalid("add_generation_prompt and continue_final_message are both true: a chat "
                      "either starts a new assistant turn or continues its final message; set "
                      "add_generation_prompt to false", "continue_final_message")
    max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                  else req.max_tokens)
    params = _params(req, max_tokens, chat=True, defaults=defaults)
    tooling = tool_request(req.tools, req.tool_choice)
    _check_carried(tools=req.tools)
    if tooling is not None:
        if forced(tooling[1]) and params.grammar:
            raise invalid("tool_choice: a forced tool call is its own grammar; leave out "
                          f"{params.grammar[2]} or set tool_choice to auto", "tool_choice")
        # the engine process renders them (tools.tool_prompt)
        params.tools = [*tooling, req.parallel_tool_calls is not False]
    # prompts.render_chat; else its defaults
    if not req.add_generation_prompt or req.continue_final_message:
        params.render = [req.add_generation_prompt, req.continue_final_message]
    kwargs = req.chat_template_kwargs
    if req.reasoning_effort is not None:            # the request's chat_template_kwargs win
        kwargs = {"reasoning_effort": req.reasoning_effort, **(kwargs or {})}
    return Job("chat", f"chatcmpl-{uuid.uuid4().hex[:24]}", names.check(req.model), messages,
               params, req.stream, _include_usage(req), kwargs,
               req.reasoning_format != "none", n=req.n or 1,
               tools=tooling[0] if tooling and tooling[1] != "none" else None,
               tool_choice=tooling[1] if tooling else None,
               parallel_tool_calls=req.parallel_tool_calls is not False, verbose=req.verbose)


def parse_completion(body: bytes, names: ModelNames, defaults: dict | None = None) -> Job:
    req = _decode(body, CompletionRequest)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise invalid(f"prompt holds {len(prompt)} prompts; this server answers one prompt a "
                          "request", "prompt")
        prompt = prompt[0]
    elif isinstance(prompt, list) and not all(isinstance(p, int) for p in prompt):
        raise invalid("prompt must be a string, a list of token ids, or a list of one string",
                      "prompt")
    if prompt is None or prompt == "" or prompt == []:
        raise invalid("prompt is empty: send the text (or token ids) to continue", "prompt")
    echo = prompt if req.echo and isinstance(prompt, str) else ""
    return Job("text", f"cmpl-{uuid.uuid4().hex[:24]}", names.check(req.model), prompt,
               _params(req, req.max_tokens, chat=False, defaults=defaults), req.stream,
               _include_usage(req), echo=echo, n=req.n or 1, verbose=req.verbose)


def _decode(body: bytes, kind: type) -> Any:
    if not body.strip():
        raise invalid("the request body is empty: send a JSON object")
    try:
        return decode(body, kind)
    except msgspec.ValidationError as e:
        text = str(e)
        param = text.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in text else None
        if param:
            text += f" (got {value_at(body, param)})"
        if param and param.endswith(".role"):
            text += " (a role is one of system, developer, user, assistant, tool)"
        raise invalid(f"invalid request: {text}", param) from None
    except msgspec.DecodeError as e:
        raise invalid(f"the request body is not valid JSON: {e}") from None
    # msgspec's answer to arrays or objects nested ~1000 deep, in any field
    except RecursionError:
        raise invalid("the request body nests arrays or objects too deeply to read") from None


def _check_carried(**values: Any) -> None:
    """Free-form values (tool_calls, chat_template_kwargs) go to the engine as msgpack, whose
    integers are 64-bit: a larger one is the client's error, not the pipe's."""
    for param, value in values.items():
        try:
            msgspec.msgpack.encode(value)
        except (OverflowError, RecursionError):
            raise invalid(f"{param} holds an integer beyond 64 bits (or nests too deeply): the "
                          "server passes integers from -2**63 to 2**64 - 1", param) from None


def _message(m: Message, i: int, joiner: str = "\n") -> dict[str, Any]:
    """A message as the engine renders it; text parts joined by `joiner` (a newline, vLLM's way)."""
    content = m.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise invalid(f"messages[{i}].content[{j}] is a {part.type!r} part; this server "
                              "reads text parts only ({\"type\": \"text\", \"text\": ...})",
                              f"messages[{i}].content[{j}]")
            texts.append(part.text)
        content = joiner.join(texts)
    if content is None and not (m.role == "assistant" and m.tool_calls):
        raise invalid(f"messages[{i}].content is missing: a {m.role} message needs content",
                      f"messages[{i}].content")
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
    if content is not None:
        out["content"] = content
    for key in ("reasoning_content", "name", "tool_calls", "tool_call_id"):
        value = getattr(m, key)
        if value is not None:
            out[key] = value
    return out


def _params(req: Any, max_tokens: int | None, chat: bool,
            defaults: dict | None = None) -> RequestParams:
    defaults = defaults or {}
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    seed = None if req.seed is None or req.seed == -1 else req.seed % 2**32
    params = {k: (getattr(req, k) if getattr(req, k) is not None else defaults.get(k, v))
              for k, v in DEFAULTS.items()}
    params["top_k"] = max(params["top_k"], 0)       # -1 is vLLM's "off", 0 ours and llama.cpp's
    params["temperature"] = float(params["temperature"])
    controls = control_params(req, chat)
    for key in ("repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty"):
        asked = (getattr(req, key) is not None
                 or (key.startswith("repeat") and req.repetition_penalty is not None))
        if not asked and key in defaults:
            controls[key] = defaults[key]
    salt = getattr(req, "cache_salt", None)            # (llama.cpp's native route has none)
    return RequestParams(max_tokens=limit_tokens(max_tokens, defaults), **params, seed=seed,
                         stop=stop,
                         ignore_eos=bool(req.ignore_eos),
                         progress=bool(req.stream and req.return_progress),
                         cache_salt=salt, reasoning_budget=getattr(req, "thinking_token_budget",
                                                                   None), **controls)


def limit_tokens(asked: int | None, defaults: dict) -> int | None:
    """The tokens to generate: the request's, else the server's -n (llama.cpp's rule: its
    server-context.cpp takes `task.params.n_predict != -1 ? task.params.n_predict :
    params_base.n_predict`, so a request may ask for more than -n). None: up to the end of the
    slot's context."""
    n = defaults.get("n_predict", -1)
    if asked is not None or n is None or n <= 0:       # -n 0 or -1: no default
        return asked
    return n


def _include_usage(req: Any) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


class ModelNames:
    """The name /v1/models shows, and the names a request may use for it (its file name, its path).
    An unknown name is served by the one model (llama.cpp's way), or a 404 when `strict`
    (--strict-model-name, vLLM's)."""

    def __init__(self, served: str, *aliases: str, strict: bool = False):
        self.served = served
        self.accepted = {served, *filter(None, aliases)}
        self.strict = strict

    def check(self, model: str | None) -> str:
        # routes that read a body field by field
        if model is not None and not isinstance(model, str):
            raise invalid(f"model = {str(model)[:80]}: give the model's name as a string (see GET "
                          "/v1/models)", "model")
        if model and model not in self.accepted and self.strict:
            raise ApiError(404, f"model = {model!r}: this server serves {self.served!r} (see GET "
                                "/v1/models)",
                           "invalid_request_error", "model")
        return self.served
