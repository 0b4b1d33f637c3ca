"""Submitting a batch of requests to an engine at once and collecting each one's result (tests,
benches)."""

from __future__ import annotations


def run_all(engine, prompts, **kwargs) -> list[tuple[list[int], dict]]:
    """Submit every prompt at once (so they share windows) -> each request's (tokens, final stats).
    Fails loudly when a request does not end with its final event."""
    handles = [engine.submit(p, **kwargs) for p in prompts]
    out = []
    for h in handles:
        events = list(h)
        assert events[-1].kind == "final", events[-1]
        out.append(([e.token for e in events if e.kind == "token"], events[-1].stats))
    return out
