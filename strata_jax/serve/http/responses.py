"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id} (issue 38)."""

from __future__ import annotations

from .routes import RouteContext


def handlers(routes: RouteContext) -> list:
    return []
