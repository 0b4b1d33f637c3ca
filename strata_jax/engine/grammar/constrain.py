"""Constrained decoding (structured output): a request's JSON schema or grammar, as llguidance
matchers.

A request's `grammar` is (kind, text, field): kind one of GRAMMAR_KINDS, text the schema (JSON text)
or the grammar, field the request field it came from (error messages name it). `Grammars` (one an
engine) holds the llguidance tokenizer of the engine's vocabulary, made once, when the first
constrained request comes, and the compiler (grammar_compile.py): each grammar is compiled once, on
threads of its own with a large stack, checked at prepare by walking its first tokens, and kept;
each request gets its own `Constraint` at submit, a copy of the compiled matcher.

Each window, the runner asks `fill_masks` for the allowed-token bitmask of every constrained row
after it has dispatched the model program, so on the device the program runs while llguidance (off
the GIL, on its own threads) computes the masks; the sampler then sets every forbidden token's logit
to -inf (controls.allow_only). The engine advances a row's matcher by each token it commits
(`advance`) and ends the request with finish_reason "stop" when the grammar is complete (`done`).

Library choice (docs/BENCHMARKS.md, "Constrained decoding"): llguidance. Measured here at a
151,936-token vocabulary (Qwen2's) its mask a token takes ~40 us against xgrammar's ~29, both far
below a window's cost; it compiles a schema ~20x faster (1.3 against 25 ms: each new schema is
compiled), and it needs no torch (xgrammar imports torch and its bitmasks are torch tensors).
"""

from __future__ import annotations

import threading

import llguidance as llg
import llguidance.numpy as llnp
import numpy as np

from ..request import MAX_GRAMMAR_CHARS, RequestError
from ..request import _shown as shown
from .gbnf import MAX_DEPTH, MAX_RULES

# the package's names for them
from .grammar_compile import JSON_LAYOUT, Compiler, grammar_source  # noqa: F401

# json_object: any JSON object (OpenAI's JSON mode); json_schema: a JSON schema's text; gbnf:
# llama.cpp's grammar format; lark and regex: llguidance's own (Python callers)
GRAMMAR_KINDS = ("json_object", "json_schema", "gbnf", "lark", "regex")


def check_shape(grammar) -> tuple[str, str, str]:
    """A request's grammar as (kind, text, field); RequestError for anything else (Python
    callers)."""
    if not (isinstance(grammar, (tuple, list)) and len(grammar) in (2, 3)
            and all(isinstance(x, str) for x in grammar) and grammar[0] in GRAMMAR_KINDS):
        raise RequestError(f"grammar = {shown(grammar)}: must be (kind, text) with kind one of "
                           f"{', '.join(GRAMMAR_KINDS)}")
    kind, text, field = (*grammar, "grammar") if len(grammar) == 2 else grammar
    if len(text) > MAX_GRAMMAR_CHARS:
        raise RequestError(f"{field} = {shown(text)}: the {_what(kind)} is {len(text)} characters; "
                           f"at most {MAX_GRAMMAR_CHARS}")
    return kind, text, field


class _Vocabulary:
    """llguidance's view of our tokenizer (its TokenizerWrapper protocol): each token's bytes, the
    special tokens, and encoding (used for a grammar's literal text)."""

    def __init__(self, tokenizer, n_vocab: int):
        self._tk = tokenizer
        self.eos_token_id = (tokenizer.eos_id if tokenizer.eos_id is not None
                             else min(tokenizer.eos_ids, default=0))
        self.bos_token_id = tokenizer.bos_id
        n = tokenizer.vocab_size
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)] + [b""] * max(n_vocab - n, 0)
        self.lengths = np.array([len(t) for t in self.tokens], np.int32)
        self.special_token_ids = [i for i in range(n) if tokenizer.is_special(i)]

    def __call__(self, text: bytes) -> list[int]:
        return self._tk.encode(text.decode("utf-8", "replace"), add_special=False,
                               parse_special=False)


class Grammars:
    """The engine's llguidance tokenizer (made when first needed), its grammar compiler
    (grammar_compile.py: each grammar compiled once, on threads with a large stack) and the executor
    that fills masks."""

    def __init__(self, tokenizer, n_vocab: int, max_rules: int = MAX_RULES,
                 max_depth: int = MAX_DEPTH):
        self._tokenizer, self.n_vocab = tokenizer, n_vocab
        self._ll: llg.LLTokenizer | None = None
        self._vocabulary: _Vocabulary | None = None
        self._lock = threading.Lock()
        self._executor: llg.LLExecutor | None = None
        self.compiler = Compiler(lambda: self.ll_tokenizer, lambda: self._vocabulary.lengths,
                                 max_rules, max_depth)

    @property
    def executor(self) -> llg.LLExecutor:
        """llguidance's thread pool for filling masks, started with the first constrained window."""
        with self._lock:
            if self._executor is None:
                self._executor = llg.LLExecutor()
            return self._executor

    @property
    def ll_tokenizer(self) -> llg.LLTokenizer:
        with self._lock:
            if self._ll is None:      # ~1-2 s at a 150K vocabulary: once an engine
                eos = sorted(self._tokenizer.eos_ids) or None
                self._vocabulary = _Vocabulary(self._tokenizer, self.n_vocab)
                self._ll = llg.LLTokenizer(llg.TokenizerWrapper(self._vocabulary),
                                           n_vocab=self.n_vocab, eos_token=eos)
            return self._ll

    def check(self, grammar) -> tuple[str, str, str]:
        """RequestError naming the field when the schema or grammar cannot be compiled -> (kind,
        text, field). Waits for the compiler (the first time for this grammar; then its kept
        result)."""
        return self._compiled(grammar)[0]

    def constraint(self, grammar) -> Constraint:
        """The request's own matcher: a copy of the grammar's compiled one."""
        _, compiled = self._compiled(grammar)
        return Constraint(compiled.matcher.deep_copy(), self)

    def _compiled(self, grammar):
        kind, text, field = check_shape(grammar)
        compiled = self.compiler.compile(kind, text)
        if compiled.problem is not None:
            raise RequestError(f"{field} = {shown(text)}: the {_what(kind)} {compiled.problem}")
        return (kind, text, field), compiled


class Constraint:
    """One request's matcher: the tokens its grammar allows next, advanced by each committed
    token."""

    def __init__(self, matcher: llg.LLMatcher, grammars: Grammars):
        self.matcher, self.grammars = matcher, grammars

    def advance(self, token: int) -> str | None:
        """Commit a sampled token -> None, or why the grammar cannot go on (the request then
        fails)."""
        if self.matcher.is_stopped():
            return None
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            return self.matcher.get_error() or f"token {token} is not allowed by the grammar"
        return None

    @property
    def done(self) -> bool:
        """The grammar is complete: no token can follow (the request ends with finish_reason
        "stop")."""
        return self.matcher.is_stopped()


def mask_width(n_vocab: int) -> int:
    return (n_vocab + 31) // 32


def fill_masks(rows: list[Constraint | None], n_rows: int, n_vocab: int) -> np.ndarray:
    """rows: a Constraint or None per group row -> the bitmask [n_rows, ceil(V / 32)] int32 (bit t
    of word t // 32 set: token t allowed); rows without a constraint allow every token. llguidance
    fills the constrained rows on its own threads, without the GIL."""
    mask = np.full((n_rows, mask_width(n_vocab)), -1, np.int32)
    pairs = [(c.matcher, i) for i, c in enumerate(rows)
             if c is not None and not c.matcher.is_stopped()]
    if pairs:
        llnp.fill_next_token_bitmask_par(_executor_of(rows), pairs, mask)
    return mask


def _executor_of(rows: list[Constraint | None]) -> llg.LLExecutor:
    return next(c.grammars.executor for c in rows if c is not None)


def _what(kind: str) -> str:
    return {"json_object": "JSON object grammar", "json_schema": "JSON schema",
            "gbnf": "GBNF grammar",
            "lark": "Lark grammar", "regex": "regular expression"}.get(kind, "grammar")
