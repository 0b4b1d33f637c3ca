"""What the server makes of a request before the engine sees it: the one-way request path's middle
(docs/DESIGN.md, "The request path, hop by hop").

The server has its own tokenizer and chat template, loaded from the model's file as the engine loads
its own (gguf/tokenizer.py; --chat-template(-file) over the file's), so it renders and tokenizes a
request itself, checks it, and hands the engine one `Submit` of token ids and sampling parameters
the engine runs as they are. Here, once a request:
- the context check: the early refusal from the prompt's bytes (prompt_size.py), then the exact one
  (engine/prompt.py fit_context);
- the chat rendered (the server's template variables, a final assistant message continued), tools
  put into it (tools.py), tokenized; a hybrid family's turn end found;
- logit biases by text turned into ids, max_tokens set, the engine's SamplingParams built and
  checked against the vocabulary.
A grammar is not compiled here: the engine compiles it once, when the request reaches it
(engine/grammar/grammar_compile.py), and refuses the Submit when it cannot (generate.start waits
for that answer before it answers the client).

`prepare` runs off the event loop (Supervisor.prepare: a thread), so a megabyte of prompt holds up
no other request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..engine.prompt import chat_text_ids, fit_context, prompt_ids, turn_end
from ..engine.request import (
    ContextOverflowError,
    RequestError,
    SamplingParams,
    make_params,
)
from ..gguf.chat_template import NoChatTemplateError, llama_cpp_dates
from .errors import ApiError, context_overflow
from .params import RequestParams
from .prompt_size import is_chat, refuse_if_too_long
from .tokens import tokenize_mixed
from .tool_formats import call_mark, detect, harmony_structured
from .tools import special_marks, tool_prompt

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "seed", "stop", "ignore_eos",
                 "presence_penalty", "frequency_penalty", "repeat_penalty", "repeat_last_n",
                 "logprobs", "grammar")


@dataclass(frozen=True)
class Prepared:
    """A request made ready for the engine: its prompt's ids and its checked sampling parameters
    (max_tokens set), with what the routes read of it."""
    ids: list[int]
    sampling: SamplingParams
    think: bool = False                         # the prompt opened a reasoning part (<think>)
    tool_format: str | None = None              # tools in play: one of tool_formats.FORMATS
    text: str | None = None                     # the prompt as text, when asked ("__verbose")
    checkpoint_at: int | None = None            # a hybrid family's chat: its turn's end
    harmony: bool = False                       # a chat in gpt-oss's harmony (http/harmony.py)

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens


class Prompts:
    """The server's prompt maker over its own tokenizer (one a server, kept across engine
    restarts)."""

    def __init__(self, tokenizer: Any, n_ctx: int, hybrid: bool = False,
                 template_vars: dict | None = None, prefill: bool = False, dates: bool = False,
                 reasoning_budget: int = -1):
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        # a family with a slot state (families.keeps_state: hybrid, gpt-oss) keeps it at a chat's
        # turn end (state_checkpoints.py)
        self.hybrid = hybrid
        # the template's variables a request does not set (--reasoning)
        self.template_vars = template_vars or {}
        # a final assistant message is continued (--prefill-assistant)
        self.prefill = prefill
        # today's date for the templates, as llama.cpp's (--llama-conventions)
        self.dates = dates
        self.max_token_bytes = max_token_bytes(tokenizer)
        # --reasoning-budget: a request's when it sets none; and the reasoning marks as the engine
        # follows them (engine/schedule/thinking.py), when the vocabulary has them as tokens
        self.reasoning_budget = reasoning_budget
        self.marks = reasoning_marks(tokenizer)

    @classmethod
    def load(cls, model: str, n_ctx: int, chat_template: str | None = None,
             **options: Any) -> Prompts:
        """From the model's file (its header only: the tokenizer is metadata), as the engine loads
        it; options: Prompts' template_vars, prefill, dates, reasoning_budget."""
        from ..engine.families import keeps_state
        from ..gguf import GGUFModel, load_tokenizer

        model_file = GGUFModel.open(model)
        tokenizer = load_tokenizer(model_file.metadata)
        if chat_template:
            tokenizer.use_chat_template(chat_template)
        return cls(tokenizer, n_ctx, keeps_state(model_file.spec), **options)

    def prepare(self, prompt: str | list[Any], params: RequestParams,
                chat_template_kwargs: dict | None = None, text: bool = False) -> Prepared:
        """A request's prompt rendered, tokenized and checked -> Prepared; ApiError (400) naming
        what is wrong. text: the prompt's text too (llama.cpp's "__verbose")."""
        refuse_if_too_long(prompt, params, chat_template_kwargs, self.n_ctx, self.max_token_bytes)
        tk, p = self.tokenizer, params
        kwargs = self.template_kwargs(chat_template_kwargs)
        chat = is_chat(prompt)
        budget = p.reasoning_budget if p.reasoning_budget is not None else self.reasoning_budget
        if budget == 0 and "enable_thinking" not in (chat_template_kwargs or {}):
            kwargs["enable_thinking"] = False       # no reasoning: the templates that can, say so
        tool_format = grammar = checkpoint_at = None
        think = False
        try:
            if chat:
                if p.tools:
                    prompt, kwargs, tooling = tool_prompt(tk, prompt, kwargs, *p.tools)
                    tool_format, grammar = tooling["tool_format"], tooling["grammar"]
                if grammar is None and p.grammar and detect(tk.chat_template) == "harmony":
                    # gpt-oss reasons first, then writes the JSON as its final message
                    grammar = harmony_structured(p.grammar, special_marks(tk))
                # Rendered once: the text is tokenized and says whether the template opened the
                # reasoning part. kwargs go over the defaults: the server lets them name messages
                # or add_generation_prompt only with --trust-request-chat-template.
                rendered = render_chat(tk, prompt, kwargs, *self.render_options(p))
                think = rendered.rstrip().endswith("<think>")
                ids = chat_text_ids(tk, rendered)
                if self.hybrid:
                    checkpoint_at = turn_end(tk, prompt, kwargs, ids)
            # llama.cpp's mixed prompt
            elif isinstance(prompt, list) and any(isinstance(x, str) for x in prompt):
                ids = tokenize_mixed(tk, prompt, True, True)
            else:
                ids = prompt_ids(tk, prompt)
            if not chat and self.marks:             # a text that ends inside the reasoning
                think = tk.decode(ids[-8:]).rstrip().endswith("<think>")
            sampling = self.sampling(p, len(ids), grammar, think, budget, tool_format)
            fit_context(len(ids), sampling.max_tokens, self.n_ctx)
        except ContextOverflowError as e:
            raise context_overflow(e.prompt_tokens, e.max_tokens, e.n_ctx) from None
        except NoChatTemplateError as e:
            raise ApiError(400, str(e), "invalid_request_error", "messages") from None
        except RequestError as e:
            field = str(e).split(" = ", 1)[0]
            raise ApiError(400, str(e), "invalid_request_error",
                           field if field.isidentifier() else None) from None
        # ChatMessageError, ChatTemplateError, TokenizerError, an id outside the vocabulary
        except ValueError as e:
            raise ApiError(400, str(e), "invalid_request_error",
                           getattr(e, "param", "messages" if chat else "prompt")) from None
        return Prepared(ids, sampling, think, tool_format, tk.decode(ids) if text else None,
                        checkpoint_at, harmony=chat and detect(tk.chat_template) == "harmony")

    def sampling(self, p: RequestParams, n_prompt: int, grammar: list | None,
                 think: bool = False, budget: int = -1,
                 tool_format: str | None = None) -> SamplingParams:
        """The engine's SamplingParams from a request's, checked: texts in logit_bias as their
        tokens, max_tokens to the end of the context when unset, a forced tool call's grammar, the
        reasoning marks and budget (think: the prompt opened the reasoning)."""
        fields = {k: getattr(p, k) for k in SAMPLING_KEYS}
        if grammar is not None:
            fields["grammar"] = grammar
        if self.marks:
            # A grammar decides the whole answer (a forced call, a schema): it is no reasoning,
            # and no mark is forced into it. A call's mark ends the reasoning (as the server's
            # parser reads it: http/reasoning.py).
            constrained = fields["grammar"] is not None
            text = call_mark(tool_format) if tool_format else None
            mark = self.tokenizer.token_to_id(text) if text else None
            fields.update(reasoning_open=self.marks[0], reasoning_close=self.marks[1],
                          reasoning_inside=think and not constrained,
                          reasoning_budget=-1 if constrained else budget,
                          reasoning_ends=() if mark is None else (mark,))
        bias = p.logit_bias or ()
        if any(isinstance(k, str) for k, _ in bias):       # llama.cpp's: a text's tokens
            bias = bias_ids(self.tokenizer, bias)
        room = max(self.n_ctx - n_prompt, 1)
        max_tokens = (min(p.max_tokens, room) if p.max_tokens and p.fit_max_tokens
                      else p.max_tokens or room)
        out = make_params(max_tokens, logit_bias={int(t): b for t, b in bias}, **fields)
        out.validate(self.tokenizer.vocab_size)
        return out

    def apply_template(self, messages: list, params: RequestParams,
                       chat_template_kwargs: dict | None = None) -> str:
        """llama.cpp's /apply-template: the prompt text a chat renders to, as prepare renders it;
        ApiError (400) when it cannot be rendered."""
        kwargs = self.template_kwargs(chat_template_kwargs)
        try:
            if params.tools:
                messages, kwargs, _ = tool_prompt(self.tokenizer, messages, kwargs, *params.tools)
            return render_chat(self.tokenizer, messages, kwargs, *self.render_options(params))
        except ValueError as e:         # NoChatTemplateError too
            raise ApiError(400, str(e), "invalid_request_error", "messages") from None

    def template_kwargs(self, chat_template_kwargs: dict | None) -> dict[str, Any]:
        """The server's template variables (today's date with --llama-conventions, read each
        request; --reasoning) under the request's own chat_template_kwargs."""
        dates = llama_cpp_dates() if self.dates else {}
        return {**dates, **self.template_vars, **(chat_template_kwargs or {})}

    def render_options(self, p: RequestParams) -> tuple[bool, bool, bool]:
        """(add_generation_prompt, continue_final_message, prefill) for render_chat: the request's
        and the server's."""
        add, cont = p.render or (True, False)
        return add, cont, self.prefill


def render_chat(tk, messages: list, kwargs: dict, add_generation_prompt: bool = True,
                continue_final_message: bool = False, prefill: bool = False) -> str:
    """A chat's prompt text. A final assistant message with text content is continued, not answered,
    with continue_final_message (vLLM's and transformers' way: the chat rendered whole, cut after
    that content) or, with prefill (--prefill-assistant, llama.cpp's default), as llama.cpp does:
    the chat before it with the generation prompt, then its content."""
    last = messages[-1] if messages else None
    content = (last.get("content") if isinstance(last, dict) and last.get("role") == "assistant"
               else None)
    continued = continue_final_message or (prefill and add_generation_prompt)
    if not isinstance(content, str) or not content.strip() or not continued:
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


def bias_ids(tokenizer, pairs: Any) -> list[tuple[int, float]]:
    """[(id | text, bias)] -> [(id, bias)]: a text's bias goes to each of its tokens (llama.cpp's
    logit_bias)."""
    out = []
    for key, bias in pairs:
        ids = (tokenizer.encode(key, add_special=False, parse_special=False) if isinstance(key, str)
               else [key])
        out += [(t, bias) for t in ids]
    return out


def reasoning_marks(tokenizer) -> tuple[tuple[int], tuple[int]] | None:
    """(<think>'s id, </think>'s id) when the vocabulary has both as tokens of their own (Qwen3,
    DeepSeek-R1, GLM, our made models), else None: the engine then follows no reasoning."""
    ids = [tokenizer.token_to_id(mark) for mark in ("<think>", "</think>")]
    return None if None in ids else ((ids[0],), (ids[1],))


def max_token_bytes(tokenizer) -> int:
    """The most bytes of text one token stands for, bounded above by its vocabulary string's UTF-8
    length (byte-level BPE spells a byte in 1-2 bytes, SentencePiece a space as 3, a special token
    as itself): a text of B bytes needs at least B / this many tokens, which lets the server refuse
    a prompt that cannot fit the context before it tokenizes it (prompt_size.py)."""
    return max((len(t.encode("utf-8", "replace")) for t in tokenizer.tokens), default=1) or 1


__all__ = ["Prepared", "Prompts", "RequestParams", "bias_ids", "max_token_bytes", "render_chat"]
