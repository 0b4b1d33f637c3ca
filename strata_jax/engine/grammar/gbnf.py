"""GBNF (llama.cpp's grammar format) to llguidance's Lark, in time linear in the grammar's size,
with its rule count and nesting depth bounded.

llguidance's own converter (llguidance/gbnf_to_lark.py, pinned at 1.9.1 in pyproject.toml) parses
linearly but then finds the rules that can be lexer terminals by sweeping every rule until nothing
changes: one rule a sweep along a chain, so a 3,000-rule chain took a minute (issue 32, finding 2).
Its parser is kept; the rest is done here with a work list (each rule is marked once, each reference
looked at once), and the AST is walked with explicit stacks, not recursive generators.

The bounds: llguidance inlines a chain of terminal rules into one lexeme by recursion on its own
stack (a 4,000-rule chain overflowed the engine's stack: finding 1), so a grammar's rules and the
depth of its terminal chains and groups are bounded; `GrammarTooLarge` says which bound and the
grammar's count.
"""

from __future__ import annotations

import re
from collections import deque

from llguidance.gbnf_to_lark import (
    ASTNode,
    GrammarParser,
    RuleNode,
    RuleRefNode,
    is_lark_syntax,
)

MAX_RULES = 2048        # llama.cpp's own JSON-schema grammars have tens to hundreds of rules
# a chain of terminal rules, or of nested groups: what llguidance's stack is sized for
MAX_DEPTH = 256


class GrammarTooLarge(ValueError):
    """A grammar over a bound: `bound` names it (its flag), `count` is the grammar's figure."""

    def __init__(self, what: str, count: int, bound: int, flag: str):
        self.what, self.count, self.bound, self.flag = what, count, bound, flag
        super().__init__(f"it has {count} {what}; at most {bound} (the server's {flag})")


def gbnf_to_lark(text: str, max_rules: int = MAX_RULES, max_depth: int = MAX_DEPTH) -> str:
    """A GBNF grammar (or one already in Lark, returned as is) -> Lark text for llguidance;
    ValueError (with GrammarTooLarge for the bounds) when it cannot be converted."""
    if is_lark_syntax(text):
        return text
    _check_nesting(text, max_depth)
    rules = GrammarParser().parse(text)
    if len(rules) > max_rules:
        raise GrammarTooLarge("rules", len(rules), max_rules, "--max-grammar-rules")
    _resolve(rules, max_depth)
    out = ["%llguidance {}\n\n"]
    prev_nl = True
    for r in sorted(rules.values(), key=lambda r: r.order):
        s = str(r)
        if not prev_nl and "\n" in s:
            out.append("\n")
        out.append(s + "\n")
        prev_nl = "\n" in s
        if prev_nl:
            out.append("\n")
    return "".join(out)


def _check_nesting(text: str, max_depth: int) -> None:
    """Groups nested deeper than max_depth: refused before the (recursive) parser sees them.
    Parentheses inside literals and classes are not groups; a rough count that errs only towards
    refusing is enough."""
    depth = deepest = 0
    quoted = bracket = escaped = False
    for c in text:
        if escaped:
            escaped = False
        elif c == "\\" and (quoted or bracket):
            escaped = True
        elif quoted:
            quoted = c != '"'
        elif bracket:
            bracket = c != "]"
        elif c == '"':
            quoted = True
        elif c == "[":
            bracket = True
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
    if deepest > max_depth:
        raise GrammarTooLarge("levels of nested groups", deepest, max_depth, "--max-grammar-depth")


def _nodes(node: ASTNode):
    """Every node under `node` (not itself), without recursion."""
    stack = list(node.children())
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children())


def _resolve(rules: dict[str, RuleNode], max_depth: int) -> None:
    """llguidance's resolve(), linear: link references, mark terminal rules, rename for Lark."""
    for i, r in enumerate(rules.values()):
        r.order = i
        r.alternatives = r.alternatives.simplify()
    uses: dict[str, set[str]] = {}                  # rule -> the rules it names
    for r in rules.values():
        uses[r.name] = set()
        for node in _nodes(r):
            if isinstance(node, RuleRefNode):
                if node.name not in rules:
                    raise ValueError(f"Rule '{node.name}' not found")
                node.target = rules[node.name]
                uses[r.name].add(node.name)
    if "root" not in rules:
        raise ValueError("No 'root' rule found")
    _mark_terminals(rules, uses, max_depth)
    _rename(rules, "root", "start")
    for r in list(rules.values()):
        # fooBar -> foo_bar
        new_name = re.sub(r"([a-z])([A-Z])", r"\1_\2", r.name.replace("-", "_")).lower()
        new_name = new_name.upper() if r.rule_is_terminal else new_name
        if r.name != new_name:
            _rename(rules, r.name, new_name)


def _mark_terminals(rules: dict[str, RuleNode], uses: dict[str, set[str]], max_depth: int) -> None:
    """The least fixed point llguidance's sweeps reach: a rule (not root) is terminal when every
    rule it names is. A rule's terminal depth (1 + the deepest it names) bounds llguidance's
    recursion inlining it."""
    waiting = {name: len(named) for name, named in uses.items()}
    used_by: dict[str, list[str]] = {name: [] for name in uses}
    for name, named in uses.items():
        for n in named:
            used_by[n].append(name)
    depth = {name: 1 for name in uses}
    ready = deque(name for name, k in waiting.items() if k == 0 and name != "root")
    while ready:
        name = ready.popleft()
        rules[name].rule_is_terminal = True
        if depth[name] > max_depth:
            raise GrammarTooLarge("rules in a chain of terminal rules", depth[name], max_depth,
                                  "--max-grammar-depth")
        for user in used_by[name]:
            depth[user] = max(depth[user], depth[name] + 1)
            waiting[user] -= 1
            if waiting[user] == 0 and user != "root":
                ready.append(user)


def _rename(rules: dict[str, RuleNode], old: str, new: str) -> None:
    if new in rules:
        raise ValueError(f"Rule '{new}' already exists")
    r = rules.pop(old)
    r.name = new
    rules[new] = r
