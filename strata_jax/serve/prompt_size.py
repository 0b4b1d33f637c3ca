"""The early prompt-size refusal, the first half of the context check (serve/prompts.py makes the
second, exact one): a prompt that cannot fit the context, told from the text it is made from,
before anything renders or tokenizes it (a megabyte of tools would cost seconds to render and
tokenize, only to be refused).

A token stands for at most `max_token_bytes` bytes of text (prompts.max_token_bytes), and a
chat template only adds to the text it writes, so B bytes of text make at least B / max_token_bytes
tokens. For a chat, the text counted is every string rendered into its prompt: the messages' content
(joined parts), name, reasoning_content, tool_calls and tool_call_id, the tools (their keys too:
property names are written), and chat_template_kwargs' values. A template may leave some of them out
(older turns' reasoning, tools with tool_choice none); they are counted all the same, since the
server renders them to find out.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import ApiError
from .params import RequestParams


def refuse_if_too_long(prompt: Any, params: RequestParams, chat_template_kwargs: dict | None,
                       n_ctx: int, max_token_bytes: int | None) -> None:
    """ApiError 400 (exceed_context_size_error) when the prompt (a text, token ids, chat messages or
    llama.cpp's mix) is at least n_ctx tokens."""
    # token ids
    ids = sum(isinstance(p, int) for p in prompt) if isinstance(prompt, list) else 0
    chat = is_chat(prompt)
    if ids and ids == len(prompt):
        at_least = ids
    elif max_token_bytes:
        at_least = ids + math.ceil(text_bytes(prompt, params, chat_template_kwargs)
                                   / max_token_bytes)
    else:
        return
    # (a prompt that fits, with too many max_tokens, gets the exact count later)
    if at_least >= n_ctx:
        what = ("text" if not chat else "messages, tools and chat_template_kwargs"
                if params.tools or chat_template_kwargs else "messages")
        raise ApiError(400, "the request exceeds the available context size: its prompt is at "
                            f"least {at_least} tokens (told from the length of its {what}, "
                            f"before tokenizing), but a slot holds {n_ctx} (--max-context) with "
                            "room for at least one generated token; shorten the prompt or raise "
                            "--max-context",
                       "exceed_context_size_error", None, n_prompt_tokens=at_least, n_ctx=n_ctx)


def is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


def text_bytes(prompt: Any, params: RequestParams, chat_template_kwargs: dict | None) -> int:
    """UTF-8 bytes of the strings the prompt is rendered from."""
    total = string_bytes(prompt)                        # text, messages, or llama.cpp's mixed list
    if is_chat(prompt):
        tools = params.tools                            # [tools, choice, parallel] (parse.py)
        total += string_bytes(tools[0], keys=True) if tools else 0
        total += string_bytes(chat_template_kwargs or {})
    return total


def string_bytes(value: Any, keys: bool = False) -> int:
    """Bytes of every string in a JSON value (and of its objects' keys when `keys`); a stack, not
    recursion: the value may nest as deep as the request's JSON does."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v.encode("utf-8", "surrogatepass"))
        elif isinstance(v, dict):
            if keys:
                total += sum(len(k.encode("utf-8", "surrogatepass")) for k in v
                             if isinstance(k, str))
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total
