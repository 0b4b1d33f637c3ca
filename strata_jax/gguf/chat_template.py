"""Chat templates: the model's Jinja template (`tokenizer.chat_template`) turned into prompt text.

Rendered the way Hugging Face transformers renders them, since that is what the templates are written
for: jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loop-controls
extension (`{% break %}`, `{% continue %}`), and the helpers templates call: `raise_exception(msg)`,
`strftime_now(fmt)`, and a `tojson` filter that keeps non-ASCII text and takes `indent`, `separators`
and `sort_keys`. The variables are `messages`, `add_generation_prompt`, `tools`, `documents`, the special
token strings (`bos_token`, `eos_token`, ...) and whatever else the caller passes (`enable_thinking`, ...).

A template is a program, and the model file's template (or, with --trust-request-chat-template, a request's)
may be hostile or broken: the sandbox keeps it from Python's internals, and the bounds below keep one render
from taking the process's memory or time (see "Bounds on rendering").
"""

from __future__ import annotations

import functools
import json
import re
import string
import time
import types
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.runtime
import jinja2.utils
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")

# The names this module and Tokenizer.apply_chat_template fill in: the template itself, its inputs, the
# special tokens and the helpers. A request's chat_template_kwargs that named one would replace the template
# or what it is given, not set one of its variables, so the server refuses them unless it was started with
# --trust-request-chat-template (vLLM's flag, made for GHSA-6fvq-23cw-5628: a template is code the server runs).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "messages", "add_generation_prompt", "continue_final_message", "tools", "documents",
    "bos_token", "eos_token", "unk_token", "pad_token", "raise_exception", "strftime_now",
})


def reserved_kwargs(kwargs: Mapping[str, Any]) -> list[str]:
    """The keys of `kwargs` (a request's chat_template_kwargs) that are RESERVED_TEMPLATE_KWARGS, sorted."""
    return sorted(k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS)


class NoChatTemplateError(ValueError):
    """A chat was asked of a model whose GGUF has no chat template."""

    def __init__(self, message: str | None = None):
        super().__init__(
            message
            or "this model has no chat template (tokenizer.chat_template is not in its GGUF), so it cannot format "
            "chat messages: send plain text to a completions endpoint (/v1/completions, Engine.generate(\"text\")), "
            "or pass a Jinja chat template (chat_template=... / --chat-template-file)"
        )


class ChatMessageError(ValueError):
    """The messages of a chat request are not well formed: says which message and field, and what it holds."""


class ChatTemplateError(ValueError):
    """The template could not be compiled or raised while rendering (e.g. `raise_exception` in the template)."""


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a chat's messages and return them as plain dicts, ready for a template.

    Each message is a mapping with `role` in system/user/assistant/tool and `content` a string or a list
    of text parts (`{"type": "text", "text": "..."}`), which are joined with newlines, as llama.cpp does for
    templates. An assistant message may leave content out (or null) when it has `tool_calls`. Keys whose
    value is None are dropped, as transformers does, so templates see them as undefined; reasoning text
    (`reasoning_content`, `thinking` or `reasoning`) is offered as both `reasoning_content` and `thinking`.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatMessageError(f"messages must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ChatMessageError("messages is empty: a chat needs at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatMessageError(
                f"messages[{i}] must be an object with 'role' and 'content', got {type(message).__name__}"
            )
        message = {k: v for k, v in message.items() if v is not None}
        role = message.get("role")
        if role is None:
            raise ChatMessageError(f"messages[{i}] has no 'role' (one of {', '.join(ROLES)})")
        if role not in ROLES:
            raise ChatMessageError(f"messages[{i}].role is {role!r}; it must be one of {', '.join(ROLES)}")
        if "content" not in message:
            if role == "assistant" and message.get("tool_calls"):
                out.append(_alias_reasoning(message))
                continue
            raise ChatMessageError(f"messages[{i}] ({role}) has no 'content'")
        message["content"] = _content_text(message["content"], f"messages[{i}].content")
        out.append(_alias_reasoning(message))
    return out


# Names a message's reasoning (thinking) text goes by; templates read `reasoning_content` (Qwen3, DeepSeek)
# or `thinking` (gpt-oss). As transformers does, whichever is given is offered under both.
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
                raise ChatMessageError(f"{where}[{j}] must be a content part object, got {type(part).__name__}")
            kind = part.get("type", "text")
            if kind != "text":
                raise ChatMessageError(f"{where}[{j}].type is {kind!r}; only 'text' parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatMessageError(f"{where}[{j}].text must be a string, got {type(text).__name__}")
            texts.append(text)
        return "\n".join(texts)
    raise ChatMessageError(f"{where} must be a string or a list of text parts, got {type(content).__name__}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | str | None = None, separators=None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters and cannot indent; templates expect json.dumps.
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    if indent is None:
        return encoder.encode(value)   # no longer than a few times the value's text, sized before the filter ran
    # Indenting repeats `indent` once a level on every line: count the text as it is made.
    chunks, n = [], 0
    for chunk in encoder.iterencode(value):
        n += len(chunk)
        if n > MAX_RENDER_CHARS:
            raise _over(f"tojson text of {n:,} characters")
        chunks.append(chunk)
    return "".join(chunks)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# ---- bounds on rendering -----------------------------------------------------------------------------------
#
# The sandbox stops a template from reaching Python's internals, not from using all the memory or all the
# time: `{{ 'x' * 10**10 }}`, a list that holds itself twice at each of 40 levels (a few kilobytes that print
# as 2**40 items), or three nested loops over range(100000). So a render is bounded three ways:
#   output  at most MAX_RENDER_CHARS characters, counted as the render yields them;
#   values  no string, list or printed value a template makes is longer than that either: the operations
#           whose result can be far larger than their inputs (`*` and `**`, `%` and format widths, `join`,
#           `replace`, `indent`, ..., printing a nested value) are sized before they run, and every result
#           after, so a value that doubles in a loop stops at the bound;
#   time    RENDER_TIMEOUT_S, checked at every pass of a loop and every call (where a template spends time).

# 16 Mi characters: twice the largest request body by default (ServerConfig.max_body_bytes, 8 MiB), so a
# template that writes every message, even twice, fits; and some four million tokens, past any context the
# engine takes (max_context <= 1 Mi). Anything longer is a template gone wrong.
MAX_RENDER_CHARS = 16 << 20
# SmolLM2's template renders a chat of 100 messages in about a millisecond: two seconds is a loop that
# will not end.
RENDER_TIMEOUT_S = 2.0
# A width or count a template passes to a filter or string method (center(n), batch(n), '%*d'): the bound
# jinja's sandbox puts on range().
MAX_COUNT = MAX_RANGE
# Integers a template computes: 64 Ki bits (about 20,000 digits) is more than any template needs, and keeps
# each `*` and `**` on integers to microseconds (Python cannot interrupt one multiplication).
MAX_INT_BITS = 1 << 16
# Items (counted each time they appear) in a value a template prints: counting them costs time outside the
# template's code, where the clock does not see it (256 Ki items: about 0.4 s on a 2-core CI machine). A
# request's messages and tools are a few thousand.
MAX_PRINTED_ITEMS = 1 << 18


def _over(what: str, bound: int = MAX_RENDER_CHARS, name: str = "MAX_RENDER_CHARS") -> ChatTemplateError:
    return ChatTemplateError(f"the chat template made {what}, more than a render may ({bound:,}: {name} in "
                             "strata_jax/gguf/chat_template.py): fix the template")


def _checked(value: Any) -> Any:
    """`value`, if a template may hold it: a string or list no longer than MAX_RENDER_CHARS, an int of at most
    MAX_INT_BITS bits."""
    if isinstance(value, (str, bytes, list, tuple)) and len(value) > MAX_RENDER_CHARS:
        raise _over(f"a {type(value).__name__} of length {len(value):,}")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise _over(f"an integer of {value.bit_length():,} bits", MAX_INT_BITS, "MAX_INT_BITS")
    return value


def _printed_size(value: Any) -> int:
    """About how many characters `str(value)` (or its JSON) has, counting a nested item each time it appears;
    raises past MAX_PRINTED_ITEMS items or MAX_RENDER_CHARS characters."""
    if isinstance(value, str):
        return len(value)
    total, items, stack = 0, 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) + 2
        elif isinstance(v, (list, tuple, set, frozenset)):
            items += len(v)
            total += 2 + 2 * len(v)
            stack.extend(v)
        elif isinstance(v, (dict, Mapping)):
            items += len(v)
            total += 2 + 4 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 2
        elif isinstance(v, jinja2.utils.Namespace):
            stack.append(v._Namespace__attrs)   # `{{ ns }}` prints its attributes; jinja keeps them there
        else:
            total += 24   # floats, None, macros, loops: short reprs
        if items > MAX_PRINTED_ITEMS:
            raise _over(f"a value of {items:,} nested items (counted each time they appear)", MAX_PRINTED_ITEMS,
                        "MAX_PRINTED_ITEMS")
    if total > MAX_RENDER_CHARS:
        raise _over(f"a value whose text has {total:,} characters")
    return total


def _check_count(name: str, n: Any) -> None:
    if isinstance(n, int) and not isinstance(n, bool) and abs(n) > MAX_COUNT:
        raise ChatTemplateError(f"the chat template passed {n:,} to {name}; a width or count may be at most "
                                f"{MAX_COUNT:,} (MAX_COUNT in strata_jax/gguf/chat_template.py): fix the template")


def _check_size(what: str, n: int) -> None:
    if n > MAX_RENDER_CHARS:
        raise _over(f"{what} of about {n:,} characters")


_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z%]")


def _check_printf(fmt: str, args: Any) -> None:
    """`fmt % args` is at most its text plus, for each conversion, the widest width and the longest argument."""
    specs = _PRINTF_SPEC.findall(fmt)
    values = list(args.values()) if isinstance(args, Mapping) else list(args) if isinstance(args, tuple) else [args]
    widths = [int(n) for spec in specs for n in spec if n.isdigit()]
    _check_formatted(("a % width", "a % format's text"), fmt, len(specs), widths, values,
                     any("*" in spec for spec in specs))


def _check_str_format(fmt: str, args: tuple, kwargs: dict) -> None:
    """The same for `fmt.format(...)`: widths are the numbers in each field's format spec."""
    try:
        fields = [spec for _, name, spec, _ in string.Formatter().parse(fmt) if name is not None]
    except ValueError:
        return   # not a format string: format() itself says so
    values = [*args, *kwargs.values()]
    widths = [int(n) for spec in fields for n in re.findall(r"\d+", spec or "")]
    nested = any("{" in (spec or "") for spec in fields)   # a nested field takes its width from the arguments
    _check_formatted(("a format width", "a format's text"), fmt, len(fields), widths, values, nested)


def _check_formatted(what: tuple[str, str], fmt: str, n_fields: int, widths: list[int], values: list,
                     widths_from_args: bool) -> None:
    """A formatted text is at most its template plus, for each field, the widest width and the longest value;
    every width is bounded (those the arguments give too, when the template takes them from there)."""
    if widths_from_args:
        widths = widths + [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    for w in widths:
        _check_count(what[0], w)
    longest = max((_printed_size(v) for v in values), default=0)
    _check_size(what[1], len(fmt) + n_fields * (max(widths, default=0) + longest))


def _check_binop(op: str, left: Any, right: Any) -> None:
    ints = isinstance(left, int) and isinstance(right, int)
    if op == "*" and ints:
        bits = left.bit_length() + right.bit_length()
        if bits > MAX_INT_BITS:
            raise _over(f"a product of {bits:,} bits", MAX_INT_BITS, "MAX_INT_BITS")
    elif op == "*":
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
            _check_size(f"a repeated {type(seq).__name__}", len(seq) * max(n, 0))
    elif op == "**" and ints and right > 0:
        bits = max(abs(left).bit_length(), 1) * right
        if bits > MAX_INT_BITS:
            raise _over(f"a power of {bits:,} bits", MAX_INT_BITS, "MAX_INT_BITS")
    elif op == "%" and isinstance(left, str):
        _check_printf(left, right)


def _arg(args: Sequence[Any], kwargs: Mapping[str, Any], i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _text_len(items: Sequence[Any]) -> int:
    return sum(_printed_size(x) for x in items)


def _replace_size(s: str, old: Any, new: Any, count: Any) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(len(new) - len(old), 0)


def _sized_str_call(s: str, name: str, args: tuple, kwargs: dict) -> tuple:
    """Size a call of a string method whose result can be far longer than the string; returns the arguments
    to call it with (`join` gets its items as a list, counted once)."""
    if name in ("center", "ljust", "rjust", "zfill", "expandtabs"):
        for a in (*args, *kwargs.values()):
            _check_count(f"str.{name}", a)
    if name == "expandtabs":
        tab = _arg(args, kwargs, 0, "tabsize", 8)
        _check_size("expandtabs' text", len(s) + s.count("\t") * (tab if isinstance(tab, int) else 0))
    elif name == "replace":
        _check_size("replace's text", _replace_size(s, _arg(args, kwargs, 0, "old"), _arg(args, kwargs, 1, "new"),
                                                           _arg(args, kwargs, 2, "count", -1)))
    elif name == "join" and args:
        items = list(args[0])
        _check_size("join's text", len(s) * len(items) + _text_len(items))
        args = (items, *args[1:])
    return args


# Filters whose numbers are widths or counts (jinja's own; `format` is sized as `%` is).
_COUNT_FILTERS = frozenset({"center", "indent", "wordwrap", "truncate", "batch", "slice"})
# Filters that never turn their value into text: the others (string, tojson, trim, upper, escape, ...) print
# it, so a nested value is sized first. Not sizing these keeps `messages | length` in a loop over the
# messages from costing the square of a long chat.
_STRUCTURAL_FILTERS = frozenset({
    "length", "count", "first", "last", "reverse", "sort", "map", "select", "reject", "selectattr", "rejectattr",
    "dictsort", "groupby", "unique", "min", "max", "sum", "batch", "slice", "items", "attr", "default", "d", "list",
    "random", "abs", "int", "float", "round",
})


def _sized_filter_call(name: str, value: Any, args: tuple, kwargs: dict) -> Any:
    """Size a filter's call before it runs; returns the value to call it with (`join` gets a list)."""
    if name in _COUNT_FILTERS:
        for a in (*args, *kwargs.values()):
            _check_count(f"the {name} filter", a)
    if name == "join":
        value = list(value) if not isinstance(value, (str, Mapping)) else value
        sep = _arg(args, kwargs, 0, "d", "")
        n = len(value) if isinstance(value, (list, str)) else 0
        _check_size("join's text", (len(sep) if isinstance(sep, str) else 0) * n + _printed_size(value))
        return value
    if name not in _STRUCTURAL_FILTERS:
        _printed_size(value)
    if name == "replace" and isinstance(value, str):
        size = _replace_size(value, _arg(args, kwargs, 0, "old"), _arg(args, kwargs, 1, "new"),
                             _arg(args, kwargs, 2, "count"))
        _check_size("replace's text", size)
    elif name == "indent" and isinstance(value, str):
        width = _arg(args, kwargs, 0, "width", 4)
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        _check_size("indent's text", len(value) + width * (value.count("\n") + 1))
    elif name == "wordwrap" and isinstance(value, str):
        width, wrap = _arg(args, kwargs, 0, "width", 79), _arg(args, kwargs, 2, "wrapstring")
        lines = len(value) // max(width if isinstance(width, int) else 1, 1) + value.count("\n") + 1
        _check_size("wordwrap's text", len(value) + lines * len(wrap if isinstance(wrap, str) else "\n"))
    elif name == "format" and isinstance(value, str):
        _check_printf(value, kwargs or args)
    return value


def _bounded_filter(name: str, f: Any) -> Any:
    # Filters are called straight from the compiled template, not through the environment: wrap each one.
    # jinja passes the context or environment first to filters marked so (kept on the wrapper by `wraps`).
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        if len(args) > skip:
            value = _sized_filter_call(name, args[skip], args[skip + 1:], kwargs)
            args = (*args[:skip], value, *args[skip + 1:])
        return _checked(f(*args, **kwargs))

    return bounded


def _finalize(value: Any) -> Any:
    _printed_size(value)   # `{{ value }}` prints it with str(): size a nested value first
    return value


class _ClockedContext(jinja2.runtime.Context):
    deadline = float("inf")   # time.monotonic() past which the render stops; render_bounded sets both
    timeout_s = RENDER_TIMEOUT_S


def _check_clock(context: Any) -> None:
    if time.monotonic() > context.deadline:
        raise ChatTemplateError(f"the chat template ran for more than {context.timeout_s:g} s (RENDER_TIMEOUT_S "
                                "in strata_jax/gguf/chat_template.py): it loops too long; fix the template")


@jinja2.pass_context
def _clocked(context: Any, iterable: Any) -> Any:
    for item in iterable:
        _check_clock(context)
        yield item


class _BoundedCodeGenerator(CodeGenerator):
    # A template spends time only in loops and calls (jinja has no while; recursion is a macro calling
    # itself): every call goes through the environment's `call`, which reads the clock, and here every loop
    # iterates through `environment.clocked`, which reads it at each pass. Cheaper than tracing each line.
    def visit_For(self, node: jinja2.nodes.For, frame: Any) -> None:
        node.iter = jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("clocked"), [node.iter], [], None, None,
                                      lineno=node.lineno)
        super().visit_For(node, frame)

    # `a ~ b` joins its operands' text inside the compiled code: route it through the environment, which
    # sizes them first. (Constant folding is lost for `~`; it saved nothing measurable.)
    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox, with every operation that can make a large value sized, and a clock (see
    "Bounds on rendering")."""

    code_generator_class = _BoundedCodeGenerator
    context_class = _ClockedContext
    intercepted_binops = frozenset({"*", "**", "%", "+"})
    clocked = staticmethod(_clocked)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+" and type(left) is str and type(right) is str:   # most of a chat template's work
            _check_size("a + of strings", len(left) + len(right))
            return left + right
        _check_binop(operator, left, right)
        return _checked(super().call_binop(context, operator, left, right))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _check_clock(context)
        method = getattr(obj, "__wrapped__", obj)   # the sandbox wraps str.format; its method is inside
        if isinstance(method, types.BuiltinMethodType) and isinstance(method.__self__, str):
            if method.__name__ in ("format", "format_map"):
                _check_str_format(method.__self__, args if method.__name__ == "format" else (),
                                  kwargs if method.__name__ == "format" else dict(args[0]) if args else {})
            else:
                args = _sized_str_call(method.__self__, method.__name__, args, kwargs)
        return _checked(super().call(context, obj, *args, **kwargs))

    def concat(self, parts: tuple) -> str:
        _check_size("joined text", sum(_printed_size(p) for p in parts))
        return "".join(map(str, parts))


def render_bounded(template: jinja2.Template, variables: Mapping[str, Any], max_chars: int = MAX_RENDER_CHARS,
                   timeout_s: float = RENDER_TIMEOUT_S) -> str:
    """`template.render(**variables)` in at most max_chars characters of output and, for a template compiled
    here, timeout_s seconds and the value bounds above; raises ChatTemplateError past any of them."""
    context = template.new_context(dict(variables))
    context.deadline, context.timeout_s = time.monotonic() + timeout_s, timeout_s
    chunks, n = [], 0
    parts = template.root_render_func(context)
    try:
        for chunk in parts:
            n += len(chunk)
            if n > max_chars:
                raise _over(f"{n:,} characters of output", max_chars,
                            "MAX_RENDER_CHARS" if max_chars == MAX_RENDER_CHARS else "max_chars")
            chunks.append(chunk)
    finally:
        parts.close()
    return "".join(chunks)


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
                          finalize=_finalize)
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    del env.globals["lipsum"]   # words by the thousand, and no chat template writes lorem ipsum
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e.message} (template line {e.lineno})") from e


class ChatTemplate:
    """A compiled chat template. `render(messages, add_generation_prompt=True, **variables) -> str`."""

    def __init__(self, source: str):
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("a chat template must be a non-empty string of Jinja")
        self.source = source
        self._template = _compile(source)

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


def render_chat_template(
    source: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **variables: Any
) -> str:
    """Render `source` (a Jinja chat template) for `messages`; see `ChatTemplate.render`."""
    return ChatTemplate(source).render(messages, add_generation_prompt=add_generation_prompt, **variables)
