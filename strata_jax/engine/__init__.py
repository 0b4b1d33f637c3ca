"""The engine: slots, KV cache, scheduler (windows), program cache, sampler, Engine.

`Engine` (and `Completion`) import JAX: they are loaded at their first use (PEP 562), so that the
light modules (request.py, prompt.py) can be imported by the server's processes that run no model
(the mock engine, the supervisor's frame decoders) in a fraction of a second."""

from typing import Any

from .request import ContextOverflowError, Event, Handle, RequestError, SamplingParams

__all__ = ["Completion", "ContextOverflowError", "Engine", "Event", "Handle", "RequestError",
           "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "Completion"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
