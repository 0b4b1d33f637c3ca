"""A prompt's token ids, as the engine's Python API (EngineCore.make_request) and the server
(serve/prompts.py) both make them, from one tokenizer loaded from the model's file: so a prompt is
tokenized one way wherever it is tokenized, and only once for a request (the server's requests reach
the engine as ids).

Plain functions of a tokenizer (gguf/tokenizer.py): no engine, no JAX.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .request import ContextOverflowError, RequestError


def prompt_ids(tokenizer: Any, prompt: Any, chat_template_kwargs: dict | None = None) -> list[int]:
    """The ids of a text (BOS added as the model asks), of token ids (checked against the
    vocabulary), or of chat messages (rendered with the generation prompt); RequestError names
    what is wrong."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special=True)
    elif (isinstance(prompt, list) and prompt
          and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt)):
        ids = [int(t) for t in prompt]
        n = tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < n]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                               f"(0..{n - 1})")
    elif isinstance(prompt, list) and prompt:
        return chat_text_ids(tokenizer, tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, **(chat_template_kwargs or {})))
    else:
        raise RequestError("prompt must be a non-empty string, list of chat messages, or list "
                           "of token ids")
    if not ids:
        raise RequestError("the prompt is empty after tokenization")
    return ids


def chat_text_ids(tokenizer: Any, text: str) -> list[int]:
    """The ids of a chat already rendered to `text`: BOS is added unless the template wrote it."""
    bos = tokenizer.bos_token
    ids = tokenizer.encode(text, add_special=not (bos and text.startswith(bos)))
    if not ids:
        raise RequestError("the prompt is empty after tokenization")
    return ids


def turn_end(tokenizer: Any, messages: list[dict], kwargs: dict, ids: list[int]) -> int | None:
    """A hybrid family's chat: the tokens of its messages without the generation prompt, where they
    are the prompt's first tokens, else None. The next turn of the conversation starts with exactly
    these (its template renders the history the same way, but this turn's answer after them may be
    written otherwise: without its reasoning, say), so a state kept here is the one it can resume
    from (engine/schedule/state_checkpoints.py; llama.cpp takes its checkpoints near a turn's start
    too). Only a hybrid family's callers ask: it costs a second render."""
    try:
        head = chat_text_ids(tokenizer, tokenizer.apply_chat_template(
            messages=messages, add_generation_prompt=False, **kwargs))
    except (ValueError, RequestError):
        return None
    n = len(head)
    return n if 0 < n < len(ids) and ids[:n] == head else None


def fit_context(n_prompt: int, max_tokens: int, n_ctx: int) -> None:
    """The context check: ContextOverflowError when the prompt and max_tokens do not fit a slot.
    A request is checked once: by the server (serve/prompts.py) for its requests, by make_request
    for the Python API's."""
    if n_prompt + max_tokens > n_ctx:
        raise ContextOverflowError(n_prompt, max_tokens, n_ctx)
