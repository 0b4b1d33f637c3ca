"""Compiling a request's grammar: once, when the request reaches the engine (the worker's submit,
off the engine process's command thread), on threads with a large stack, the result kept so that the
same grammar again (a request's other choices, the next request) is not compiled again.

Why each part (issue 32):
- llguidance compiles by recursion on the calling thread's stack, about 2 KB a level of a chain of
  rules: a 4,000-rule GBNF chain overflowed the 8 MiB of the engine's main thread (SIGSEGV: every
  request in flight failed). Here the compile threads have STACK_BYTES, room for any chain a 128
  Ki-character grammar can write (a Lark chain of 10,000 rules, ~20 MB, was tried); GBNF's rules and
  depth are bounded too (gbnf.py).
- A grammar was converted and compiled three times a request (prepare, submit, the matcher); now
  once: each request gets a deep copy of the one fresh matcher kept by (kind, text) in a small LRU,
  errors kept too. The server does not compile it (issue 35: serve/prompts.py checks everything
  else); a grammar the engine cannot compile is refused at submit, and the server answers 400.
- A schema can compile and still fail its first tokens (`{"type": "string", "pattern":
  "^(a{1000}){1000}$"}`: the lexer runs out of fuel deriving the pattern after the opening quote,
  "too many expressions constructed"). The check builds the real matcher and walks PROBE_TOKENS of
  it, each time taking the allowed token of most bytes, and does the same for each of a schema's
  patterns alone (one behind an alternative the walk does not take): what fails there is a 400 at
  submit, not a 500 mid-answer.
"""

from __future__ import annotations

import json
import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

import llguidance as llg
import llguidance.numpy as llnp
import numpy as np

from .gbnf import MAX_DEPTH, MAX_RULES, GrammarTooLarge, gbnf_to_lark

# a compile thread's stack (virtual: only what a grammar's recursion touches is used)
STACK_BYTES = 256 << 20
# grammars compiled at once: one huge grammar leaves room for another request's
THREADS = 2
# compiled grammars kept (a request's n choices and repeated schemas come moments apart)
CACHE_ENTRIES = 64
PROBE_TOKENS = 8            # tokens of the real matcher walked at the check

# json_object / json_schema: JSON as json.dumps writes it: one space after ", " and ": ", no other
# whitespace. llguidance's default allows any run of whitespace between tokens, which a weak model
# can fill until max_tokens (llama.cpp bounds it too); a schema's own "x-guidance" options override
# this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# threading.stack_size is the process's: set and restored around one start at a time
_lock = threading.Lock()


def grammar_source(kind: str, text: str, max_rules: int = MAX_RULES,
                   max_depth: int = MAX_DEPTH) -> str:
    """The llguidance grammar of a (kind, text); ValueError (GrammarTooLarge for a bound) when the
    text cannot be read as that kind. GBNF goes through gbnf.py's linear converter with its
    bounds."""
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(json.loads(text), defaults=JSON_LAYOUT)
    if kind == "gbnf":
        return llg.LLMatcher.grammar_from_lark(gbnf_to_lark(text, max_rules, max_depth))
    if kind == "lark":
        return llg.LLMatcher.grammar_from_lark(text)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(text)
    raise ValueError(f"unknown grammar kind {kind!r}")


@dataclass(frozen=True)
class Compiled:
    """One grammar's result: a fresh matcher (never advanced: requests take deep copies), or what is
    wrong with it, as the words after "the <kind> " in the request's error ("cannot be compiled:
    ...")."""

    matcher: llg.LLMatcher | None
    problem: str | None


class Compiler:
    """Compiles (kind, text) on its own threads and keeps the results; `compile` waits for one (from
    any thread). `tokenizer()` gives the LLTokenizer, `token_bytes` each token's length in bytes
    (for the probe)."""

    def __init__(self, tokenizer, token_bytes, max_rules: int = MAX_RULES,
                 max_depth: int = MAX_DEPTH):
        self._tokenizer, self._token_bytes = tokenizer, token_bytes
        self.max_rules, self.max_depth = max_rules, max_depth
        self._results: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._guard = threading.Lock()
        self._threads: list[threading.Thread] = []

    def compile(self, kind: str, text: str) -> Compiled:
        key = (kind, text)
        with self._guard:
            future = self._results.get(key)
            if future is None:
                future = self._results[key] = Future()
                while len(self._results) > CACHE_ENTRIES:
                    self._results.popitem(last=False)
                self._jobs.put((key, future))
                self._start()
            else:
                self._results.move_to_end(key)
        return future.result()

    def _start(self) -> None:
        """The compile threads, at the first grammar (the lock held)."""
        if self._threads:
            return
        with _lock:
            before = threading.stack_size(STACK_BYTES)
            try:
                for i in range(THREADS):
                    t = threading.Thread(target=self._work, name=f"grammar-compile-{i}",
                                         daemon=True)
                    t.start()
                    self._threads.append(t)
            finally:
                threading.stack_size(before)

    def _work(self) -> None:
        while True:
            (kind, text), future = self._jobs.get()
            try:
                future.set_result(self._compile(kind, text))
            # a grammar must not end the thread; its caller hears
            except BaseException as e:  # noqa: BLE001
                future.set_result(Compiled(None, f"cannot be compiled: {_one_line(e)}"))

    def _compile(self, kind: str, text: str) -> Compiled:
        try:
            source = grammar_source(kind, text, self.max_rules, self.max_depth)
        except GrammarTooLarge as e:
            return Compiled(None, f"is too large: {e}")
        except (ValueError, TypeError, RecursionError) as e:
            return Compiled(None, f"cannot be read: {_one_line(e)}")
        matcher, error = self._matcher(source)
        # a pattern behind an alternative the walk did not take
        if kind == "json_schema" and not error:
            for pattern in _patterns(json.loads(text)):
                alone = grammar_source("json_schema",
                                       json.dumps({"type": "string", "pattern": pattern}))
                if (error := self._matcher(alone)[1]) is not None:
                    error = f"{_one_line(error)} (its pattern {json.dumps(pattern)[:80]})"
                    break
        if error:
            return Compiled(None, f"cannot be compiled: {_one_line(error)}")
        return Compiled(matcher, None)

    def _matcher(self, source: str) -> tuple[llg.LLMatcher, str | None]:
        """The grammar's matcher and its error, or the error its first tokens meet (the probe)."""
        # its errors are validate_grammar's
        matcher = llg.LLMatcher(self._tokenizer(), source, log_level=0)
        return (matcher,
                matcher.get_error() if matcher.is_error() else self._probe(matcher.deep_copy()))

    def _probe(self, matcher: llg.LLMatcher) -> str | None:
        """Walk the matcher's first tokens (each step the allowed one of most bytes): its error, or
        None."""
        lengths = self._token_bytes()
        mask = llnp.allocate_token_bitmask(1, len(lengths))
        for _ in range(PROBE_TOKENS):
            llnp.fill_next_token_bitmask(matcher, mask, 0)
            if matcher.is_error():
                return matcher.get_error()
            if matcher.is_stopped():
                return None
            allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8),
                                                   bitorder="little")[:len(lengths)])
            if allowed.size == 0:
                return None
            token = int(allowed[np.argmax(lengths[allowed])])
            if not matcher.consume_token(token) or matcher.is_error():
                return matcher.get_error() or None
        return None


def _patterns(schema) -> list[str]:
    """Every regular expression a JSON schema holds ("pattern"s, "patternProperties"' keys), each
    once."""
    found: dict[str, None] = {}
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found[node["pattern"]] = None
            if isinstance(node.get("patternProperties"), dict):
                found.update(dict.fromkeys(node["patternProperties"]))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return list(found)


def _one_line(e) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]
