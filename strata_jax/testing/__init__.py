"""Test helpers: tiny-model makers, vocabulary files, the default model from PyPI, fault injection."""

from strata_jax.testing.fetch import cache_dir, smollm2_path

__all__ = ["cache_dir", "smollm2_path"]
