"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens (issue 38)."""

from __future__ import annotations

from .routes import RouteContext


def handlers(routes: RouteContext) -> list:
    return []
