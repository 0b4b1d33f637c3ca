"""One writer for each piece of state (docs/DESIGN.md, "Owners"): the code read for writes outside
the owner.

Three rules over strata_jax/engine and strata_jax/serve, read from the code's syntax (ast):
- no module touches another object's private attribute (`x._y` where x is not self, a class or a
  module);
- an object writes its own attributes only: never `self.a.b = ...`, `self.a[k] += ...` or
  `self.a.b.append(...)` (the state of the object held in `self.a`: call a method of it instead),
  except the counters records an object keeps of itself (`self.counts.x += 1`);
- a slot's sequence, position and text change only in engine/schedule/slots.py (Slot's methods), and
  the KV cache's arrays only in engine/execute/kv_cache.py (KVCache's methods).
Each rule is shown to fail on a probe written the wrong way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = [ROOT / "strata_jax" / "engine", ROOT / "strata_jax" / "serve"]
# records of an object's own counts, written only by it
OWN_RECORDS = {"counts", "counters", "stats"}
MUTATORS = {"append", "extend", "insert", "pop", "popleft", "appendleft", "remove", "clear",
            "update", "add", "discard", "setdefault"}
SLOT_STATE = {"n_past", "tokens", "text", "emitted", "stopping_word", "salt"}
SLOT_OWNER = "strata_jax/engine/schedule/slots.py"
KV_STATE = {"arrays"}
KV_OWNER = "strata_jax/engine/execute/kv_cache.py"


def chain(node: ast.AST) -> tuple[ast.AST, list[str]]:
    """self.a.b[k].c -> (Name self, ["a", "b", "c"])."""
    attrs = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            attrs.append(node.attr)
        node = node.value
    return node, attrs[::-1]


def written(tree: ast.AST):
    """(line, target) for every assignment target and every mutating call's object."""
    for n in ast.walk(tree):
        targets = []
        if isinstance(n, ast.Assign):
            targets = n.targets
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
            targets = [n.target]
        for t in targets:
            for one in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                if isinstance(one, (ast.Attribute, ast.Subscript)):
                    yield n.lineno, one
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr in MUTATORS):
            yield n.lineno, n.func.value


def is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def problems(path: Path, text: str) -> list[str]:
    tree = ast.parse(text)
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    modules = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
               if isinstance(n, ast.Import)
               for a in n.names}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
            base = n.value
            if not (isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in modules
                                                    or base.id[:1].isupper())):
                out.append(f"{rel}:{n.lineno}: {ast.unparse(n)}: another object's private "
                           "attribute")
    for line, target in written(tree):
        root, attrs = chain(target)
        shown = ast.unparse(target)
        if is_self(root) and len(attrs) >= 2 and attrs[0] not in OWN_RECORDS:
            out.append(f"{rel}:{line}: {shown}: writes the state of the object in self.{attrs[0]}")
        if attrs and not is_self(root) or len(attrs) >= 2:
            last = attrs[-1] if attrs else ""
            if last in SLOT_STATE and rel != SLOT_OWNER and rel.startswith("strata_jax/engine"):
                out.append(f"{rel}:{line}: {shown}: a slot's state outside {SLOT_OWNER}")
            if last in KV_STATE and rel != KV_OWNER and rel.startswith("strata_jax/engine"):
                out.append(f"{rel}:{line}: {shown}: the KV cache's arrays outside {KV_OWNER}")
    return out


def test_every_piece_of_state_is_written_by_its_owner_alone():
    found = [p for pkg in PACKAGES for path in sorted(pkg.rglob("*.py"))
             for p in problems(path, path.read_text())]
    assert found == []


@pytest.mark.parametrize("code, says", [
    ("def f(prefix):\n    return prefix._read_kv(0, 0, 1)\n", "private attribute"),
    ("class A:\n    def f(self):\n        self.output.counters['failed'] += 1\n", "self.output"),
    ("class A:\n    def f(self, t):\n        self.seats.queue.append(t)\n", "self.seats"),
    ("def f(s):\n    s.n_past += 1\n", "a slot's state"),
    ("def f(slot, ids):\n    slot.tokens, slot.n_past = list(ids), len(ids)\n", "a slot's state"),
    ("def f(s, t):\n    s.tokens.append(t)\n", "a slot's state"),
    ("def f(kv, a):\n    kv.arrays = a\n", "the KV cache's arrays"),
])
def test_the_owner_check_sees_a_write_outside_the_owner(code, says):
    probe = ROOT / "strata_jax" / "engine" / "schedule" / "_owner_probe.py"
    found = problems(probe, code)
    assert found and all(says in p for p in found[:1]), found


def test_the_owner_check_lets_an_object_write_itself():
    code = ("class A:\n    def f(self, t):\n        self.n_past += 1\n        self.counts.windows "
            "+= 1\n        self.queue.append(t)\n        self._x = 1\n")
    assert problems(ROOT / "strata_jax" / "engine" / "schedule" / "_owner_probe.py", code) == []
