"""A generation request's parameters, as the HTTP edge decodes and checks them
(serve/http/parse.py): typed once, read by the server's prompt maker (serve/prompts.py), which turns
them into the prompt's ids and the engine's SamplingParams. They do not cross the pipe: the engine
gets what prompts.py made of them (protocol.Submit)."""

from __future__ import annotations

from typing import Any

import msgspec


class RequestParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A generation request's parameters as the HTTP edge decoded and checked them
    (serve/http/parse.py), read by serve/prompts.py. The defaults are the engine's
    (engine/request.py make_params); the routes set every sampling field from the request and the
    server's defaults."""
    max_tokens: int | None = None               # None: to the end of the context (prompts.py)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    logprobs: int | None = None
    # (token id, or a text: llama.cpp's; bias)
    logit_bias: list[tuple[int | str, float]] | None = None
    # [kind, text, the request's field] (engine/grammar/constrain.py)
    grammar: list[str] | None = None
    # [tools, tool_choice, parallel_tool_calls] (parse.py, tools.py)
    tools: list[Any] | None = None
    # [add_generation_prompt, continue_final_message] (render_chat)
    render: list[bool] | None = None
    progress: bool = False                      # prompt progress events (return_progress)
    # the most reasoning tokens (thinking_token_budget): -1 no limit, 0 none; None: the server's
    reasoning_budget: int | None = None
    # max_tokens is a ceiling, cut to the room the prompt leaves in a slot instead of refused
    # (Anthropic's route: Claude Code asks 32,000 whatever the context; llama.cpp's way too)
    fit_max_tokens: bool = False
    cache_salt: str | None = None
