"""Shared fixtures: tiny synthetic GGUF models, made once per session."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from strata_jax.testing.make_model import make_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_model(**make_model_options) -> path of part 1; the same options give the same (cached) file."""
    made: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("models")

    def make(**options) -> Path:
        key = json.dumps(options, sort_keys=True, default=str)
        if key not in made:
            made[key] = make_model(root / f"m{len(made)}" / "model.gguf", **options)[0]
        return made[key]

    return make
