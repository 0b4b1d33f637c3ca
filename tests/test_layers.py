"""The code's shape against docs/DESIGN.md: the layers and the direction of imports, every
environment variable read in one module, EngineConfig()'s defaults the same in every shell, no file
too long."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "strata_jax"


def layers(marker: str = "<!-- layers:", end: str = "<!-- /layers -->") -> dict[str, int]:
    """docs/DESIGN.md's layer table -> {unit: layer}; a unit is a module or package right under
    strata_jax (or, for a package's floor table, right under that package)."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    table = text.split(marker, 1)[1].split(end, 1)[0]
    out: dict[str, int] = {}
    for row in table.splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", row)
        if m:
            for unit in re.findall(r"`([\w.]+)`", m.group(2)):
                out[unit] = int(m.group(1))
    return out


def unit_of(module: str) -> str:
    """strata_jax.engine.core -> engine; strata_jax (the package itself) -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(path: Path) -> list[tuple[str, int]]:
    """The strata_jax modules `path` imports (relative imports resolved), with their line
    numbers."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from strata_jax import envs` imports the module envs
            for a in node.names:
                sub = f"{module}.{a.name}"
                out.append((sub if is_module(sub) else module, node.lineno))
    return [(m, line) for m, line in out if m == "strata_jax" or m.startswith("strata_jax.")]


def test_the_layer_table_names_every_unit():
    table = layers()
    units = {p.stem if p.is_file() else p.name for p in PKG.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert units - set(table) == set(), "units missing from docs/DESIGN.md's layer table"
    assert set(table) - units == set(), "docs/DESIGN.md's layer table names units that do not exist"


def test_no_import_runs_up_the_layers():
    table = layers()
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        mine = unit_of(module_name(path))
        for module, line in imports(path):
            theirs = unit_of(module)
            if theirs != mine and table[theirs] >= table[mine]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({mine}, layer {table[mine]}) "
                             f"imports {module} ({theirs}, layer {table[theirs]})")
    assert wrong == []


# the packages whose folders are floors of their own (docs/DESIGN.md)
FLOORED = ("engine", "serve")


def floors(package: str) -> dict[str, int]:
    return layers(f"<!-- floors {package}:", "<!-- /floors -->")


def units_under(package: Path) -> set[str]:
    return {p.stem if p.is_file() else p.name for p in package.iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").exists())}


def floor_unit(module: str, package: str) -> str | None:
    """strata_jax.engine.execute.kv_cache -> execute (for package engine); None outside the
    package."""
    parts = module.split(".")
    if parts[:2] != ["strata_jax", package]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


@pytest.mark.parametrize("package", FLOORED)
def test_each_floor_table_names_every_unit_of_its_package(package):
    assert units_under(PKG / package) == set(floors(package))


@pytest.mark.parametrize("package", FLOORED)
def test_no_import_runs_up_or_across_the_floors_of_a_package(package):
    table, wrong = floors(package), []
    for path in sorted((PKG / package).rglob("*.py")):
        mine = floor_unit(module_name(path), package)
        for module, line in imports(path):
            theirs = floor_unit(module, package)
            if theirs is not None and theirs != mine and table[theirs] >= table[mine]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({mine}, floor {table[mine]}) "
                             f"imports {module} ({theirs}, floor {table[theirs]})")
    assert wrong == []


def test_the_floor_checker_sees_an_import_across(tmp_path):
    """The floor check can fail: a module of execute importing the scheduler is one it reports."""
    fake = PKG / "engine" / "execute" / "_floor_probe.py"
    fake.write_text("from ..schedule import scheduler\n")
    try:
        found = imports(fake)
    finally:
        fake.unlink()
    assert found == [("strata_jax.engine.schedule.scheduler", 1)]
    table = floors("engine")
    assert table[floor_unit(found[0][0], "engine")] > table[floor_unit(module_name(fake), "engine")]


def test_the_kernels_import_nothing_of_strata_jax():
    wrong = [f"{p.relative_to(ROOT)}:{line} {m}"
             for p in sorted((ROOT / "pallas_kernels").rglob("*.py"))
             for m, line in imports(p)]
    assert wrong == []
    above = [f"{p.relative_to(ROOT)}" for p in sorted((ROOT / "quant_types").rglob("*.py"))
             if "pallas_kernels" in p.read_text()]
    assert above == [], "quant_types sits beneath the kernels"


def test_quant_types_sit_beneath_the_kernels_and_gguf_reading_needs_no_jax():
    wrong = [f"{p.relative_to(ROOT)}:{line} "
             f"{m}" for p in sorted((ROOT / "quant_types").rglob("*.py")) for m, line in imports(p)]
    assert wrong == []
    code = ("import sys, strata_jax.gguf, quant_types; "
            "print(sorted(m for m in ('jax', 'pallas_kernels') if m in sys.modules))")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=False, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "[]"


def test_the_checker_sees_an_upward_import(tmp_path):
    """The check above can fail: an engine module importing serve is one it reports."""
    fake = PKG / "engine" / "_layer_probe.py"
    fake.write_text("from ..serve import app\nfrom strata_jax import envs\n")
    try:
        found = imports(fake)
    finally:
        fake.unlink()
    assert ("strata_jax.serve.app", 1) in found and ("strata_jax.envs", 2) in found
    table = layers()
    assert (table[unit_of("strata_jax.serve.app")] > table["engine"]
            > table[unit_of("strata_jax.envs")])


def test_every_environment_variable_is_read_in_envs_py():
    reads = []
    for path in sorted(PKG.rglob("*.py")):
        if path.name == "envs.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"os\.environ|os\.getenv|getenv\(", line):
                reads.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert reads == []


def test_engine_config_defaults_are_the_same_in_every_shell():
    """STRATA_BATCH_GRAPHS is the default of the CLI's --max-programs, not of EngineConfig()."""
    code = ("from strata_jax.config import EngineConfig; import argparse; "
            "from strata_jax.cli_flags import add_engine_flags, engine_config; "
            "p = argparse.ArgumentParser(); add_engine_flags(p); "
            "print(EngineConfig().max_programs, engine_config(p.parse_args([])).max_programs, "
            "engine_config(p.parse_args(['--max-programs', '3'])).max_programs)")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "STRATA_BATCH_GRAPHS": "7"}
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, check=False)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["64", "7", "3"]
    env["STRATA_BATCH_GRAPHS"] = "many"
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, check=False)
    assert bad.returncode != 0 and "STRATA_BATCH_GRAPHS='many' is not a whole number" in bad.stderr


def test_flags_md_holds_the_engine_flag_table_made_from_the_fields():
    from dataclasses import fields

    from strata_jax.cli_flags import FLAGS, flag_table
    from strata_jax.config import EngineConfig

    assert set(FLAGS) == {f.name for f in fields(EngineConfig)}, ("one FLAGS entry an EngineConfig "
                                                                  "field")
    doc = (ROOT / "docs" / "FLAGS.md").read_text()
    held = doc.split("(tests/test_layers.py checks) -->\n",
                     1)[1].split("<!-- /engine flags -->", 1)[0]
    assert held == flag_table(), ("docs/FLAGS.md's engine flags are stale: python -m "
                                  "strata_jax.cli_flags makes them")


def _callers(name: str) -> set[str]:
    """'path:function' of every function in strata_jax that calls or raises `name`."""
    out = set()
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id == name):
                    out.add(f"{path.relative_to(PKG)}:{fn.name}")
    return out


def test_the_context_is_checked_in_one_place_a_path():
    """issue 35: a generation request's context check is engine/prompt.py's fit_context, called
    once a path: by the server's prompt maker for the server's requests (the engine process then
    runs them as they are: the worker and prepared_request call no check), by make_request for the
    Python API's (and by the embeddings and research logits, for their own token lists);
    ContextOverflowError is raised there alone."""
    assert _callers("fit_context") == {"serve/prompts.py:prepare", "engine/core.py:make_request",
                                       "serve/worker/mock_prompts.py:prepare",
                                       "engine/engine.py:embed",
                                       "engine/engine.py:_ask_engine_thread"}
    assert _callers("ContextOverflowError") == {"engine/prompt.py:fit_context"}
    assert _callers("refuse_if_too_long") == {"serve/prompts.py:prepare"}
