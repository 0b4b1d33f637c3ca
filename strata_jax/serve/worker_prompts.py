"""What the engine process makes of a request's params before the engine sees them: the chat's prompt text
(with the server's template variables and the ways a final assistant message is continued), the sampling
keywords, logit biases by text, and the bound on bytes a token can stand for."""

from __future__ import annotations

from typing import Any

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "seed", "stop", "ignore_eos", "presence_penalty",
                 "frequency_penalty", "repeat_penalty", "repeat_last_n", "logprobs", "grammar")


def template_kwargs(cmd: dict[str, Any]) -> dict[str, Any]:
    """The server's template variables (--reasoning) under the request's own chat_template_kwargs."""
    return {**(cmd.get("template_vars") or {}), **(cmd.get("chat_template_kwargs") or {})}


def render_options(cmd: dict[str, Any], p: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(add_generation_prompt, continue_final_message, prefill) for render_chat: the request's and the server's."""
    add, cont = p.get("render") or (True, False)
    return add, cont, bool(cmd.get("prefill"))


def render_chat(tk, messages: list, kwargs: dict, add_generation_prompt: bool = True,
                continue_final_message: bool = False, prefill: bool = False) -> str:
    """A chat's prompt text. A final assistant message with text content is continued, not answered, with
    continue_final_message (vLLM's and transformers' way: the chat rendered whole, cut after that content)
    or, with prefill (--prefill-assistant, llama.cpp's default), as llama.cpp does: the chat before it with
    the generation prompt, then its content."""
    last = messages[-1] if messages else None
    content = last.get("content") if isinstance(last, dict) and last.get("role") == "assistant" else None
    if not isinstance(content, str) or not content.strip() or not (continue_final_message or
                                                                    (prefill and add_generation_prompt)):
        if continue_final_message:
            raise ValueError("continue_final_message: the last message must be the assistant's, with text content")
        return tk.apply_chat_template(**{"messages": messages, "add_generation_prompt": add_generation_prompt,
                                         **kwargs})
    if continue_final_message:
        text = tk.apply_chat_template(**{"messages": messages, "add_generation_prompt": False, **kwargs})
        at = text.rfind(content.strip())
        if at < 0:
            raise ValueError("continue_final_message: the chat template does not write the final message's content "
                             "as given, so it cannot be continued")
        return text[:at + len(content.strip())]
    return tk.apply_chat_template(**{"messages": messages[:-1], "add_generation_prompt": True, **kwargs}) + content


def sampling(p: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """Engine.submit's keywords from a request's params (logit_bias comes as [id, bias] pairs)."""
    out = {k: p[k] for k in SAMPLING_KEYS if k in p}
    return {**out, "max_tokens": max_tokens, "logit_bias": {int(t): b for t, b in p.get("logit_bias") or ()}}


def bias_ids(tokenizer, pairs: list) -> list[list]:
    """[[id | text, bias]] -> [[id, bias]]: a text's bias goes to each of its tokens (llama.cpp's logit_bias)."""
    out = []
    for key, bias in pairs:
        ids = tokenizer.encode(key, add_special=False, parse_special=False) if isinstance(key, str) else [key]
        out += [[t, bias] for t in ids]
    return out


def max_token_bytes(tokenizer) -> int:
    """The most bytes of text one token stands for, bounded above by its vocabulary string's UTF-8 length
    (byte-level BPE spells a byte in 1-2 bytes, SentencePiece a space as 3, a special token as itself): a
    text of B bytes needs at least B / this many tokens, which lets the server refuse a prompt that cannot
    fit the context before anything tokenizes it."""
    return max((len(t.encode("utf-8", "replace")) for t in tokenizer.tokens), default=1) or 1
