"""strata-jax: a JAX/XLA inference server for mixture-of-experts language models stored as GGUF
files."""

from ._version import __version__
from .config import ConfigError, EngineConfig, ServerConfig

__all__ = ["ConfigError", "Engine", "EngineConfig", "ServerConfig", "__version__"]


def __getattr__(name: str):
    # The engine pulls in JAX; `import strata_jax` for the config alone stays light.
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
