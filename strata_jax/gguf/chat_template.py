"""Chat templates: the model's Jinja template (`tokenizer.chat_template`) turned into prompt text.

Rendered the way Hugging Face transformers renders them, since that is what the templates are
written for: jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the
loop-controls extension (`{% break %}`, `{% continue %}`), and the helpers templates call:
`raise_exception(msg)`, `strftime_now(fmt)`, and a `tojson` filter that keeps non-ASCII text and
takes `indent`, `separators` and `sort_keys`. The variables are `messages`, `add_generation_prompt`,
`tools`, `documents`, the special token strings (`bos_token`, `eos_token`, ...) and whatever else
the caller passes (`enable_thinking`, ...).

A template is a program, and the model file's template (or, with --trust-request-chat-template, a
request's) may be hostile or broken: the sandbox keeps it from Python's internals, and the bounds
keep one render from taking the process's memory or time. Templates are compiled and rendered in
`template_sandbox.py`, under the bounds of `template_bounds.py`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from strata_jax.gguf.template_bounds import ChatTemplateError
from strata_jax.gguf.template_sandbox import compile_template, render_bounded

ROLES = ("system", "user", "assistant", "tool")

# The names this module, its sandbox and Tokenizer.apply_chat_template fill in: the template itself,
# its inputs, the special tokens and the helpers. A request's chat_template_kwargs that named one
# would replace the template or what it is given, not set one of its variables, so the server
# refuses them unless it was started with --trust-request-chat-template (vLLM's flag, made for
# GHSA-6fvq-23cw-5628: a template is code the server runs).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "messages", "add_generation_prompt", "continue_final_message", "tools",
    "documents", "bos_token", "eos_token", "unk_token", "pad_token", "raise_exception",
    "strftime_now",
})


def reserved_kwargs(kwargs: Mapping[str, Any]) -> list[str]:
    """The keys of `kwargs` (a request's chat_template_kwargs) that are RESERVED_TEMPLATE_KWARGS,
    sorted."""
    return sorted(k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS)


class NoChatTemplateError(ValueError):
    """A chat was asked of a model whose GGUF has no chat template."""

    def __init__(self, message: str | None = None):
        super().__init__(
            message
            or "this model has no chat template (tokenizer.chat_template is not in its GGUF), so "
            "it cannot format chat messages: send plain text to a completions endpoint "
            "(/v1/completions, Engine.generate(\"text\")), or pass a Jinja chat template "
            "(chat_template=... / --chat-template-file)"
        )


class ChatMessageError(ValueError):
    """The messages of a chat request are not well formed: says which message and field, and what it
    holds."""


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a chat's messages and return them as plain dicts, ready for a template.

    Each message is a mapping with `role` in system/user/assistant/tool and `content` a string or a
    list of text parts (`{"type": "text", "text": "..."}`), which are joined with newlines, as
    llama.cpp does for templates. An assistant message may leave content out (or null) when it has
    `tool_calls`. Keys whose value is None are dropped, as transformers does, so templates see them
    as undefined; reasoning text (`reasoning_content`, `thinking` or `reasoning`) is offered as both
    `reasoning_content` and `thinking`.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatMessageError("messages must be a list of messages, got "
                               f"{type(messages).__name__}")
    if not messages:
        raise ChatMessageError("messages is empty: a chat needs at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatMessageError(
                f"messages[{i}] must be an object with 'role' and 'content', got "
                f"{type(message).__name__}"
            )
        message = {k: v for k, v in message.items() if v is not None}
        role = message.get("role")
        if role is None:
            raise ChatMessageError(f"messages[{i}] has no 'role' (one of {', '.join(ROLES)})")
        if role not in ROLES:
            raise ChatMessageError(f"messages[{i}].role is {role!r}; it must be one of "
                                   f"{', '.join(ROLES)}")
        if "content" not in message:
            if role == "assistant" and message.get("tool_calls"):
                out.append(_alias_reasoning(message))
                continue
            raise ChatMessageError(f"messages[{i}] ({role}) has no 'content'")
        message["content"] = _content_text(message["content"], f"messages[{i}].content")
        out.append(_alias_reasoning(message))
    return out


# Names a message's reasoning (thinking) text goes by; templates read `reasoning_content` (Qwen3,
# DeepSeek) or `thinking` (gpt-oss). As transformers does, whichever is given is offered under both.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise ChatMessageError(f"{where}[{j}] must be a content part object, got "
                                       f"{type(part).__name__}")
            kind = part.get("type", "text")
            if kind != "text":
                raise ChatMessageError(f"{where}[{j}].type is {kind!r}; only 'text' parts are "
                                       "supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatMessageError(f"{where}[{j}].text must be a string, got "
                                       f"{type(text).__name__}")
            texts.append(text)
        return "\n".join(texts)
    raise ChatMessageError(f"{where} must be a string or a list of text parts, got "
                           f"{type(content).__name__}")


class ChatTemplate:
    """A compiled chat template. `render(messages, add_generation_prompt=True, **variables) ->
    str`."""

    def __init__(self, source: str):
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("a chat template must be a non-empty string of Jinja")
        self.source = source
        self._template = compile_template(source)

    def render(
        self,
        /,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **variables: Any,
    ) -> str:
        messages = validate_messages(messages)
        if tools is not None and not _is_list_of_objects(tools):
            raise ChatMessageError("tools must be a list of JSON-schema objects")
        if documents is not None and not _is_list_of_objects(documents):
            raise ChatMessageError("documents must be a list of objects")
        variables = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "tools": None if tools is None else list(tools),
            "documents": None if documents is None else list(documents),
            **variables,
        }
        try:
            return render_bounded(self._template, variables)
        except ChatTemplateError:
            raise
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from e
        except Exception as e:
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from e


def _is_list_of_objects(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and all(
        isinstance(v, Mapping) for v in value)


def llama_cpp_dates() -> dict[str, str]:
    """Today's date as llama.cpp's server passes it to every chat template (common/chat.cpp,
    common_chat_extra_context): Llama 3.x's `date_string` and firefunction v2's `datetime`, local
    time. transformers and vLLM pass neither (Llama 3.3's template then writes its own default
    date)."""
    now = time.localtime()
    return {"date_string": time.strftime("%d %b %Y", now),
            "datetime": time.strftime("%b %d %Y", now)}


def render_chat_template(
    source: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
    **variables: Any
) -> str:
    """Render `source` (a Jinja chat template) for `messages`; see `ChatTemplate.render`."""
    return ChatTemplate(source).render(messages, add_generation_prompt=add_generation_prompt,
                                       **variables)
