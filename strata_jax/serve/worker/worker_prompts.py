"""What the engine process makes of a request before the engine sees it: `prepare` (tokenized and
checked, so the server answers 4xx at once), the chat's prompt text (with the server's template
variables and the ways a final assistant message is continued; `apply_template`), the sampling
keywords, logit biases by text, and the bound on bytes a token can stand for."""

from __future__ import annotations

from typing import Any

import msgspec

from ..protocol import (
    Answer,
    ApplyTemplate,
    Prepare,
    Prepared,
    Rejected,
    RequestParams,
    Tokenize,
)
from ..tools import tool_prompt

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "seed", "stop", "ignore_eos",
                 "presence_penalty",
                 # make_params'
                 "frequency_penalty", "repeat_penalty", "repeat_last_n", "logprobs", "grammar")


def prepare(engine: Any, cmd: Prepare) -> Prepared | Rejected:
    """Tokenize and check a request without queueing it: the server answers 4xx at once, and holds
    the queue itself (so a request that waits for a slot survives an engine restart)."""
    from strata_jax.engine import ContextOverflowError, RequestError
    from strata_jax.engine.request import make_params
    from strata_jax.gguf.chat_template import NoChatTemplateError

    rid, prompt, p = cmd.id, cmd.prompt, cmd.params
    kwargs = template_kwargs(cmd)
    n_ctx = engine.config.max_context
    chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
    tooling: dict[str, Any] = {}
    checkpoint_at = None
    try:
        think = False
        if p.tools and chat:
            prompt, kwargs, tooling = tool_prompt(engine.tokenizer, prompt, kwargs, *p.tools)
            if tooling.get("grammar"):
                p = msgspec.structs.replace(p, grammar=tooling["grammar"])
        if chat:
            # Rendered once: the text is tokenized and says whether the template opened the
            # reasoning part. kwargs go over the defaults: the server lets them name messages or
            # add_generation_prompt only with --trust-request-chat-template.
            text = render_chat(engine.tokenizer, prompt, kwargs, *render_options(cmd, p))
            think = text.rstrip().endswith("<think>")
            ids = engine.chat_text_ids(text)
            checkpoint_at = engine.turn_end(prompt, kwargs, ids)
        # llama.cpp's mixed prompt
        elif isinstance(prompt, list) and any(isinstance(x, str) for x in prompt):
            from ..tokens import answer as tokenize

            got = tokenize(engine.tokenizer, Tokenize(rid, prompt, add_special=True))
            if isinstance(got, Rejected):
                return got
            ids = got.tokens
        else:
            ids = engine.prompt_ids(prompt)
        if any(isinstance(k, str) for k, _ in p.logit_bias or ()):    # llama.cpp's: a text's tokens
            tooling["logit_bias"] = bias_ids(engine.tokenizer, p.logit_bias)
            p = msgspec.structs.replace(p, logit_bias=tooling["logit_bias"])
        max_tokens = p.max_tokens or max(n_ctx - len(ids), 1)
        params = make_params(**sampling(p, max_tokens))
        params.validate(engine.spec.vocab_size)
        # compiled here too: a schema it cannot compile is a 400
        if params.grammar is not None:
            engine.grammars.check(params.grammar)
        if len(ids) + max_tokens > n_ctx:
            raise ContextOverflowError(len(ids), max_tokens, n_ctx)
    except ContextOverflowError as e:
        return Rejected(rid, "context", str(e), n_prompt_tokens=e.prompt_tokens,
                        max_tokens=e.max_tokens, n_ctx=e.n_ctx)
    except NoChatTemplateError as e:
        return Rejected(rid, "template", str(e))
    except RequestError as e:
        field = str(e).split(" = ", 1)[0]
        return Rejected(rid, "invalid", str(e), param=field if field.isidentifier() else None)
    except ValueError as e:   # ChatMessageError, ChatTemplateError, TokenizerError
        return Rejected(rid, "invalid", str(e), param="messages" if chat else "prompt")
    # (cmd.text: llama.cpp's "__verbose", the prompt as the model reads it)
    return Prepared(ids, max_tokens, think, tooling.get("tool_format"), tooling.get("grammar"),
                    tooling.get("logit_bias"), engine.tokenizer.decode(ids) if cmd.text else None,
                    checkpoint_at, id=rid)


def apply_template(engine: Any, cmd: ApplyTemplate) -> Answer | Rejected:
    """llama.cpp's /apply-template: the prompt text a chat renders to, as prepare renders it."""
    from strata_jax.gguf.chat_template import NoChatTemplateError

    messages, p = cmd.prompt, cmd.params
    kwargs = template_kwargs(cmd)
    try:
        if p.tools:
            messages, kwargs, _ = tool_prompt(engine.tokenizer, messages, kwargs, *p.tools)
        text = render_chat(engine.tokenizer, messages, kwargs, *render_options(cmd, p))
    except NoChatTemplateError as e:
        return Rejected(cmd.id, "template", str(e))
    except ValueError as e:
        return Rejected(cmd.id, "invalid", str(e), param="messages")
    return Answer(cmd.id, prompt=text)


def template_kwargs(cmd: Prepare | ApplyTemplate) -> dict[str, Any]:
    """The server's template variables (--reasoning) under the request's own
    chat_template_kwargs."""
    return {**cmd.template_vars, **(cmd.chat_template_kwargs or {})}


def render_options(cmd: Prepare | ApplyTemplate, p: RequestParams) -> tuple[bool, bool, bool]:
    """(add_generation_prompt, continue_final_message, prefill) for render_chat: the request's and
    the server's."""
    add, cont = p.render or (True, False)
    return add, cont, cmd.prefill


def render_chat(tk, messages: list, kwargs: dict, add_generation_prompt: bool = True,
                continue_final_message: bool = False, prefill: bool = False) -> str:
    """A chat's prompt text. A final assistant message with text content is continued, not answered,
    with continue_final_message (vLLM's and transformers' way: the chat rendered whole, cut after
    that content) or, with prefill (--prefill-assistant, llama.cpp's default), as llama.cpp does:
    the chat before it with the generation prompt, then its content."""
    last = messages[-1] if messages else None
    content = (last.get("content") if isinstance(last, dict) and last.get("role") == "assistant"
               else None)
    if not isinstance(content, str) or not content.strip() or not (continue_final_message or
                                                                    (prefill
                                                                     and add_generation_prompt)):
        if continue_final_message:
            raise ValueError("continue_final_message: the last message must be the assistant's, "
                             "with text content")
        return tk.apply_chat_template(**{"messages": messages,
                                         "add_generation_prompt": add_generation_prompt, **kwargs})
    if continue_final_message:
        text = tk.apply_chat_template(**{"messages": messages, "add_generation_prompt": False,
                                         **kwargs})
        at = text.rfind(content.strip())
        if at < 0:
            raise ValueError("continue_final_message: the chat template does not write the final "
                             "message's content as given, so it cannot be continued")
        return text[:at + len(content.strip())]
    return (tk.apply_chat_template(**{"messages": messages[:-1], "add_generation_prompt": True,
                                      **kwargs}) + content)


def sampling(p: RequestParams, max_tokens: int) -> dict[str, Any]:
    """Engine.submit's keywords from a request's params (logit_bias comes as (id, bias) pairs)."""
    out = {k: getattr(p, k) for k in SAMPLING_KEYS}
    return {**out, "max_tokens": max_tokens,
            "logit_bias": {int(t): b for t, b in p.logit_bias or ()}}


def bias_ids(tokenizer, pairs: list) -> list[list]:
    """[[id | text, bias]] -> [[id, bias]]: a text's bias goes to each of its tokens (llama.cpp's
    logit_bias)."""
    out = []
    for key, bias in pairs:
        ids = (tokenizer.encode(key, add_special=False, parse_special=False) if isinstance(key, str)
               else [key])
        out += [[t, bias] for t in ids]
    return out


def max_token_bytes(tokenizer) -> int:
    """The most bytes of text one token stands for, bounded above by its vocabulary string's UTF-8
    length (byte-level BPE spells a byte in 1-2 bytes, SentencePiece a space as 3, a special token
    as itself): a text of B bytes needs at least B / this many tokens, which lets the server refuse
    a prompt that cannot fit the context before anything tokenizes it."""
    return max((len(t.encode("utf-8", "replace")) for t in tokenizer.tokens), default=1) or 1
