"""The engine: slots, KV cache, scheduler (windows), program cache, sampler, Engine."""

from .engine import Completion, Engine
from .request import ContextOverflowError, Event, Handle, RequestError, SamplingParams

__all__ = ["Completion", "ContextOverflowError", "Engine", "Event", "Handle", "RequestError",
           "SamplingParams"]
