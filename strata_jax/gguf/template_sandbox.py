"""The jinja environment chat templates compile and render in: transformers' helpers, sized
operations, a clock."""

from __future__ import annotations

import functools
import json
import time
import types
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.runtime
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from strata_jax.gguf.template_bounds import (
    MAX_RENDER_CHARS,
    RENDER_TIMEOUT_S,
    ChatTemplateError,
    check_binop,
    check_size,
    check_str_format,
    checked,
    over_bound,
    printed_size,
    sized_filter_call,
    sized_str_call,
)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | str | None = None, separators=None,
    sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters and cannot indent; templates expect json.dumps.
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                               sort_keys=sort_keys)
    if indent is None:
        # no longer than a few times the value's text, sized before the filter ran
        return encoder.encode(value)
    # Indenting repeats `indent` once a level on every line: count the text as it is made.
    chunks, n = [], 0
    for chunk in encoder.iterencode(value):
        n += len(chunk)
        if n > MAX_RENDER_CHARS:
            raise over_bound(f"tojson text of {n:,} characters")
        chunks.append(chunk)
    return "".join(chunks)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _bounded_filter(name: str, f: Any) -> Any:
    # Filters are called straight from the compiled template, not through the environment: wrap each
    # one. jinja passes the context or environment first to filters marked so (kept on the wrapper
    # by `wraps`).
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        if len(args) > skip:
            value = sized_filter_call(name, args[skip], args[skip + 1:], kwargs)
            args = (*args[:skip], value, *args[skip + 1:])
        return checked(f(*args, **kwargs))

    return bounded


def _finalize(value: Any) -> Any:
    printed_size(value)   # `{{ value }}` prints it with str(): size a nested value first
    return value


class _ClockedContext(jinja2.runtime.Context):
    # time.monotonic() past which the render stops; render_bounded sets both
    deadline = float("inf")
    timeout_s = RENDER_TIMEOUT_S


def _check_clock(context: Any) -> None:
    if time.monotonic() > context.deadline:
        raise ChatTemplateError(f"the chat template ran for more than {context.timeout_s:g} s "
                                "(RENDER_TIMEOUT_S in strata_jax/gguf/template_bounds.py): it "
                                "loops too long; fix the template")


@jinja2.pass_context
def _clocked(context: Any, iterable: Any) -> Any:
    for item in iterable:
        _check_clock(context)
        yield item


class _BoundedCodeGenerator(CodeGenerator):
    # A template spends time only in loops and calls (jinja has no while; recursion is a macro
    # calling itself): every call goes through the environment's `call`, which reads the clock, and
    # here every loop iterates through `environment.clocked`, which reads it at each pass. Cheaper
    # than tracing each line.
    def visit_For(self, node: jinja2.nodes.For, frame: Any) -> None:
        node.iter = jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("clocked"), [node.iter], [],
                                      None, None, lineno=node.lineno)
        super().visit_For(node, frame)

    # `a ~ b` joins its operands' text inside the compiled code: route it through the environment,
    # which sizes them first. (Constant folding is lost for `~`; it saved nothing measurable.)
    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _nothing(value: Any) -> int:
    return int(value is None or isinstance(value, jinja2.Undefined))


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox, with every operation that can make a large value sized, and a
    clock (see template_bounds.py)."""

    code_generator_class = _BoundedCodeGenerator
    context_class = _ClockedContext
    intercepted_binops = frozenset({"*", "**", "%", "+"})
    clocked = staticmethod(_clocked)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        # most of a chat template's work
        if operator == "+" and type(left) is str and type(right) is str:
            check_size("a + of strings", len(left) + len(right))
            return left + right
        if (operator == "+" and _nothing(left) + _nothing(right) == 1
                and str in (type(left), type(right))):
            # None or an undefined name + a string: the string, as llama.cpp's jinja does (its
            # runtime.cpp, "treating null/undefined as empty string"): firefunction v2's template
            # adds `functions`, which only llama.cpp's own code defines. Python's jinja
            # (transformers') raises instead.
            return left if type(left) is str else right
        check_binop(operator, left, right)
        return checked(super().call_binop(context, operator, left, right))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _check_clock(context)
        # the sandbox wraps str.format; its method is inside
        method = getattr(obj, "__wrapped__", obj)
        if isinstance(method, types.BuiltinMethodType) and isinstance(method.__self__, str):
            if method.__name__ in ("format", "format_map"):
                check_str_format(method.__self__, args if method.__name__ == "format" else (),
                                 kwargs if method.__name__ == "format" else dict(args[0]) if args
                                 else {})
            else:
                args = sized_str_call(method.__self__, method.__name__, args, kwargs)
        return checked(super().call(context, obj, *args, **kwargs))

    def concat(self, parts: tuple) -> str:
        check_size("joined text", sum(printed_size(p) for p in parts))
        return "".join(map(str, parts))


def render_bounded(template: jinja2.Template, variables: Mapping[str, Any],
                   max_chars: int = MAX_RENDER_CHARS, timeout_s: float = RENDER_TIMEOUT_S) -> str:
    """`template.render(**variables)` in at most max_chars characters of output and, for a template
    compiled here, timeout_s seconds and the value bounds (template_bounds.py); raises
    ChatTemplateError past any of them."""
    context = template.new_context(dict(variables))
    context.deadline, context.timeout_s = time.monotonic() + timeout_s, timeout_s
    chunks, n = [], 0
    parts = template.root_render_func(context)
    try:
        for chunk in parts:
            n += len(chunk)
            if n > max_chars:
                raise over_bound(f"{n:,} characters of output", max_chars,
                                 "MAX_RENDER_CHARS" if max_chars == MAX_RENDER_CHARS
                                 else "max_chars")
            chunks.append(chunk)
    finally:
        parts.close()
    return "".join(chunks)


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """`source` compiled in the bounded sandbox, with the helpers transformers gives templates."""
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                          extensions=[jinja2.ext.loopcontrols], finalize=_finalize)
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    del env.globals["lipsum"]   # words by the thousand, and no chat template writes lorem ipsum
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e.message} (template line "
                                f"{e.lineno})") from e
