"""The mock engine's prompt maker (mock_worker.py), for the server's side of the supervisor tests:
a prompt's characters are its token ids (a chat's: its messages' contents, joined), no template,
no tokenizer, so those tests need no model file.

    Supervisor("mock.gguf", config, command=MOCK, prompts=MockPrompts(config.max_context))
"""

from __future__ import annotations

from typing import Any

from ...engine.prompt import fit_context
from ...engine.request import ContextOverflowError, make_params
from ..errors import context_overflow
from ..params import RequestParams
from ..prompts import Prepared


class MockPrompts:
    def __init__(self, n_ctx: int):
        self.n_ctx = n_ctx

    def prepare(self, prompt: str | list[Any], params: RequestParams,
                chat_template_kwargs: dict | None = None, text: bool = False) -> Prepared:
        if isinstance(prompt, str):
            chars = prompt
        elif prompt and isinstance(prompt[0], dict):
            chars = "".join(m.get("content", "") for m in prompt)
        else:
            chars = "".join(map(chr, prompt))
        ids = [ord(c) for c in chars]
        max_tokens = params.max_tokens or self.n_ctx - len(ids)
        try:
            fit_context(len(ids), max_tokens, self.n_ctx)
        except ContextOverflowError as e:
            raise context_overflow(e.prompt_tokens, e.max_tokens, e.n_ctx) from None
        return Prepared(ids, make_params(max_tokens), text=chars if text else None)

    def apply_template(self, messages: list, params: RequestParams,
                       chat_template_kwargs: dict | None = None) -> str:
        return "".join(m.get("content", "") for m in messages)
