"""Shared fixtures: tiny synthetic GGUF models, made once per session."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from strata_jax.makers.make_model import make_model

# The slow tier: files that take most of the suite's time on 2 cores (the full suite's JUnit times,
# session 9: these are 1,290 of its 1,500 test-seconds). `pytest -m "not slow"` leaves them out (the
# everyday tier, under 5 minutes); CI runs everything. docs/TESTING.md has the figures.
SLOW_FILES = frozenset({
    "test_bench.py", "test_server_smollm2.py", "test_glm4moe.py", "test_llamacpp.py",
    "test_kv_resident.py", "test_sampling_api.py", "test_server_faults.py", "test_mtp.py",
    "test_loadtests.py", "test_tool_formats.py", "test_windows.py", "test_fuzz.py",
    "test_prefix_cache.py", "test_server_limits.py", "test_model_logits.py", "test_kernels.py",
    "test_structured.py", "test_spec.py", "test_cpu_kernels.py", "test_experts.py",
    "test_smollm2.py", "test_replicas.py", "test_devices.py", "test_hardening_peers.py",
    "test_hardening_engine.py", "test_openapi_fuzz.py",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def private_compile_cache(tmp_path_factory: pytest.TempPathFactory):
    """JAX's compilation cache (strata_jax/compile_cache.py) in a folder of this session, not the
    user's ~/.cache: for the engines made here and the servers started from here (they inherit the
    variable). Only the compile cache moves: the default model is still fetched into the real cache
    folder."""
    from strata_jax.compile_cache import ENV

    if ENV in os.environ:               # the developer chose one (a warm cache, or "off"): keep it
        yield os.environ[ENV]
        return
    os.environ[ENV] = str(tmp_path_factory.mktemp("jax-compile"))
    try:
        yield os.environ[ENV]
    finally:
        os.environ.pop(ENV, None)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_model(**make_model_options) -> path of part 1; the same options give the same (cached)
    file."""
    made: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("models")

    def make(**options) -> Path:
        key = json.dumps(options, sort_keys=True, default=str)
        if key not in made:
            made[key] = make_model(root / f"m{len(made)}" / "model.gguf", **options)[0]
        return made[key]

    return make


@pytest.fixture(scope="session")
def think_model(tiny_model, tmp_path_factory) -> Path:
    """A tiny qwen3 whose chat template opens <think> in the generation prompt, as Qwen3's does
    (testing/templates.py THINK_TEMPLATE): the server tests of reasoning, budgets and templates."""
    from strata_jax.testing.edit_gguf import rewrite_gguf
    from strata_jax.testing.templates import THINK_TEMPLATE

    plain = tiny_model(arch="qwen3", layers=2, hidden=64)
    return rewrite_gguf(plain, tmp_path_factory.mktemp("think") / "think.gguf",
                        set_metadata={"tokenizer.chat_template": THINK_TEMPLATE})


@pytest.fixture(scope="session")
def bos_model(tiny_model, tmp_path_factory) -> Path:
    """A tiny qwen3 whose tokenizer adds BOS (the llama.cpp-route tests: test_llama_extras,
    test_llama_native)."""
    from strata_jax.testing.edit_gguf import rewrite_gguf

    plain = tiny_model(arch="qwen3", layers=2, hidden=64)
    return rewrite_gguf(plain, tmp_path_factory.mktemp("bos") / "bos.gguf",
                        set_metadata={"tokenizer.ggml.add_bos_token": True})
