"""Bounds on rendering a chat template: the sizes, counts and integers a render may make, checked as
it runs."""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2.utils
from jinja2.sandbox import MAX_RANGE

# The sandbox stops a template from reaching Python's internals, not from using all the memory or
# all the time: `{{ 'x' * 10**10 }}`, a list that holds itself twice at each of 40 levels (a few
# kilobytes that print as 2**40 items), or three nested loops over range(100000). So a render is
# bounded three ways:
#   output  at most MAX_RENDER_CHARS characters, counted as the render yields them;
#   values  no string, list or printed value a template makes is longer than that either: the
#           operations whose result can be far larger than their inputs (`*` and `**`, `%` and
#           format widths, `join`, `replace`, `indent`, ..., printing a nested value) are sized
#           before they run, and every result after, so a value that doubles in a loop stops at the
#           bound;
#   time    RENDER_TIMEOUT_S, checked at every pass of a loop and every call (where a template
#           spends time).

# 16 Mi characters: twice the largest request body by default (ServerConfig.max_body_bytes, 8 MiB),
# so a template that writes every message, even twice, fits; and some four million tokens, past any
# context the engine takes (max_context <= 1 Mi). Anything longer is a template gone wrong.
MAX_RENDER_CHARS = 16 << 20
# SmolLM2's template renders a chat of 100 messages in about a millisecond: two seconds is a loop
# that will not end.
RENDER_TIMEOUT_S = 2.0
# A width or count a template passes to a filter or string method (center(n), batch(n), '%*d'): the
# bound jinja's sandbox puts on range().
MAX_COUNT = MAX_RANGE
# Integers a template computes: 64 Ki bits (about 20,000 digits) is more than any template needs,
# and keeps each `*` and `**` on integers to microseconds (Python cannot interrupt one
# multiplication).
MAX_INT_BITS = 1 << 16
# Items (counted each time they appear) in a value a template prints: counting them costs time
# outside the template's code, where the clock does not see it (256 Ki items: about 0.4 s on a
# 2-core CI machine). A request's messages and tools are a few thousand.
MAX_PRINTED_ITEMS = 1 << 18


class ChatTemplateError(ValueError):
    """The template could not be compiled or raised while rendering (e.g. `raise_exception` in the
    template)."""


def over_bound(what: str, bound: int = MAX_RENDER_CHARS,
               name: str = "MAX_RENDER_CHARS") -> ChatTemplateError:
    return ChatTemplateError(f"the chat template made {what}, more than a render may ({bound:,}: "
                             f"{name} in strata_jax/gguf/template_bounds.py): fix the template")


def checked(value: Any) -> Any:
    """`value`, if a template may hold it: a string or list no longer than MAX_RENDER_CHARS, an int
    of at most MAX_INT_BITS bits."""
    if isinstance(value, (str, bytes, list, tuple)) and len(value) > MAX_RENDER_CHARS:
        raise over_bound(f"a {type(value).__name__} of length {len(value):,}")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise over_bound(f"an integer of {value.bit_length():,} bits", MAX_INT_BITS, "MAX_INT_BITS")
    return value


def printed_size(value: Any) -> int:
    """About how many characters `str(value)` (or its JSON) has, counting a nested item each time it
    appears; raises past MAX_PRINTED_ITEMS items or MAX_RENDER_CHARS characters."""
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
            # `{{ ns }}` prints its attributes; jinja keeps them there
            stack.append(v._Namespace__attrs)
        else:
            total += 24   # floats, None, macros, loops: short reprs
        if items > MAX_PRINTED_ITEMS:
            raise over_bound(f"a value of {items:,} nested items (counted each time they appear)",
                             MAX_PRINTED_ITEMS, "MAX_PRINTED_ITEMS")
    if total > MAX_RENDER_CHARS:
        raise over_bound(f"a value whose text has {total:,} characters")
    return total


def _check_count(name: str, n: Any) -> None:
    if isinstance(n, int) and not isinstance(n, bool) and abs(n) > MAX_COUNT:
        raise ChatTemplateError(f"the chat template passed {n:,} to {name}; a width or count may "
                                f"be at most {MAX_COUNT:,} (MAX_COUNT in "
                                "strata_jax/gguf/template_bounds.py): fix the template")


def check_size(what: str, n: int) -> None:
    if n > MAX_RENDER_CHARS:
        raise over_bound(f"{what} of about {n:,} characters")


_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z%]")


def _check_printf(fmt: str, args: Any) -> None:
    """`fmt % args` is at most its text plus, for each conversion, the widest width and the longest
    argument."""
    specs = _PRINTF_SPEC.findall(fmt)
    values = (list(args.values()) if isinstance(args, Mapping) else list(args)
              if isinstance(args, tuple) else [args])
    widths = [int(n) for spec in specs for n in spec if n.isdigit()]
    _check_formatted(("a % width", "a % format's text"), fmt, len(specs), widths, values,
                     any("*" in spec for spec in specs))


def check_str_format(fmt: str, args: tuple, kwargs: dict) -> None:
    """The same for `fmt.format(...)`: widths are the numbers in each field's format spec."""
    try:
        fields = [spec for _, name, spec, _ in string.Formatter().parse(fmt) if name is not None]
    except ValueError:
        return   # not a format string: format() itself says so
    values = [*args, *kwargs.values()]
    widths = [int(n) for spec in fields for n in re.findall(r"\d+", spec or "")]
    # a nested field takes its width from the arguments
    nested = any("{" in (spec or "") for spec in fields)
    _check_formatted(("a format width", "a format's text"), fmt, len(fields), widths, values,
                     nested)


def _check_formatted(what: tuple[str, str], fmt: str, n_fields: int, widths: list[int],
                     values: list, widths_from_args: bool) -> None:
    """A formatted text is at most its template plus, for each field, the widest width and the
    longest value; every width is bounded (those the arguments give too, when the template takes
    them from there)."""
    if widths_from_args:
        widths = widths + [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    for w in widths:
        _check_count(what[0], w)
    longest = max((printed_size(v) for v in values), default=0)
    check_size(what[1], len(fmt) + n_fields * (max(widths, default=0) + longest))


def check_binop(op: str, left: Any, right: Any) -> None:
    ints = isinstance(left, int) and isinstance(right, int)
    if op == "*" and ints:
        bits = left.bit_length() + right.bit_length()
        if bits > MAX_INT_BITS:
            raise over_bound(f"a product of {bits:,} bits", MAX_INT_BITS, "MAX_INT_BITS")
    elif op == "*":
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
            check_size(f"a repeated {type(seq).__name__}", len(seq) * max(n, 0))
    elif op == "**" and ints and right > 0:
        bits = max(abs(left).bit_length(), 1) * right
        if bits > MAX_INT_BITS:
            raise over_bound(f"a power of {bits:,} bits", MAX_INT_BITS, "MAX_INT_BITS")
    elif op == "%" and isinstance(left, str):
        _check_printf(left, right)


def _arg(args: Sequence[Any], kwargs: Mapping[str, Any], i: int, name: str,
         default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _text_len(items: Sequence[Any]) -> int:
    return sum(printed_size(x) for x in items)


def _replace_size(s: str, old: Any, new: Any, count: Any) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(len(new) - len(old), 0)


def sized_str_call(s: str, name: str, args: tuple, kwargs: dict) -> tuple:
    """Size a call of a string method whose result can be far longer than the string; returns the
    arguments to call it with (`join` gets its items as a list, counted once)."""
    if name in ("center", "ljust", "rjust", "zfill", "expandtabs"):
        for a in (*args, *kwargs.values()):
            _check_count(f"str.{name}", a)
    if name == "expandtabs":
        tab = _arg(args, kwargs, 0, "tabsize", 8)
        check_size("expandtabs' text",
                   len(s) + s.count("\t") * (tab if isinstance(tab, int) else 0))
    elif name == "replace":
        check_size("replace's text",
                   _replace_size(s, _arg(args, kwargs, 0, "old"), _arg(args, kwargs, 1, "new"),
                                                          _arg(args, kwargs, 2, "count", -1)))
    elif name == "join" and args:
        items = list(args[0])
        check_size("join's text", len(s) * len(items) + _text_len(items))
        args = (items, *args[1:])
    return args


# Filters whose numbers are widths or counts (jinja's own; `format` is sized as `%` is).
_COUNT_FILTERS = frozenset({"center", "indent", "wordwrap", "truncate", "batch", "slice"})
# Filters that never turn their value into text: the others (string, tojson, trim, upper, escape,
# ...) print it, so a nested value is sized first. Not sizing these keeps `messages | length` in a
# loop over the messages from costing the square of a long chat.
_STRUCTURAL_FILTERS = frozenset({
    "length", "count", "first", "last", "reverse", "sort", "map", "select", "reject", "selectattr",
    "rejectattr", "dictsort", "groupby", "unique", "min", "max", "sum", "batch", "slice", "items",
    "attr", "default", "d", "list", "random", "abs", "int", "float", "round",
})


def sized_filter_call(name: str, value: Any, args: tuple, kwargs: dict) -> Any:
    """Size a filter's call before it runs; returns the value to call it with (`join` gets a
    list)."""
    if name in _COUNT_FILTERS:
        for a in (*args, *kwargs.values()):
            _check_count(f"the {name} filter", a)
    if name == "join":
        value = list(value) if not isinstance(value, (str, Mapping)) else value
        sep = _arg(args, kwargs, 0, "d", "")
        n = len(value) if isinstance(value, (list, str)) else 0
        check_size("join's text",
                   (len(sep) if isinstance(sep, str) else 0) * n + printed_size(value))
        return value
    if name not in _STRUCTURAL_FILTERS:
        printed_size(value)
    if name == "replace" and isinstance(value, str):
        size = _replace_size(value, _arg(args, kwargs, 0, "old"), _arg(args, kwargs, 1, "new"),
                             _arg(args, kwargs, 2, "count"))
        check_size("replace's text", size)
    elif name == "indent" and isinstance(value, str):
        width = _arg(args, kwargs, 0, "width", 4)
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        check_size("indent's text", len(value) + width * (value.count("\n") + 1))
    elif name == "wordwrap" and isinstance(value, str):
        width, wrap = _arg(args, kwargs, 0, "width", 79), _arg(args, kwargs, 2, "wrapstring")
        lines = len(value) // max(width if isinstance(width, int) else 1, 1) + value.count("\n") + 1
        check_size("wordwrap's text",
                   len(value) + lines * len(wrap if isinstance(wrap, str) else "\n"))
    elif name == "format" and isinstance(value, str):
        _check_printf(value, kwargs or args)
    return value
