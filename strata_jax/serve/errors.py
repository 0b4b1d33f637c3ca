"""Errors in OpenAI's shape, `{"error": {"message", "type", "code"}}`, with llama.cpp's numeric code
(the HTTP status) and its extra fields where it has them (n_prompt_tokens, n_ctx)."""

from __future__ import annotations

from typing import Any

# HTTP status -> OpenAI error type
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
         413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
         500: "server_error", 501: "not_supported_error", 503: "unavailable_error",
         504: "timeout_error"}


class ApiError(Exception):
    """An answer that is an error: raised anywhere in a request, turned into a response by the
    app."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(message)
        self.headers = headers                  # e.g. Retry-After on a 503
        self.status = status
        self.message = message
        self.type = (type or TYPES.get(status, "server_error" if status >= 500
                                               else "invalid_request_error"))
        self.param = param
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.type, self.param, **self.extra)


def error_body(status: int, message: str, type: str | None = None, param: str | None = None,
               **extra: Any) -> dict[str, Any]:
    err: dict[str, Any] = {"message": message, "type": type or TYPES.get(status, "server_error"),
                           "code": status}
    if param is not None:
        err["param"] = param
    err.update(extra)
    return {"error": err}


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


def context_overflow(n_prompt_tokens: int, max_tokens: int, n_ctx: int) -> ApiError:
    return ApiError(400, f"the request exceeds the available context size: {n_prompt_tokens} "
                         f"prompt tokens + {max_tokens} to generate (max_tokens) = "
                         f"{n_prompt_tokens + max_tokens} tokens, but a slot holds {n_ctx} "
                         "(--max-context); shorten the prompt, lower max_tokens or raise "
                         "--max-context",
                    "exceed_context_size_error", None, n_prompt_tokens=n_prompt_tokens, n_ctx=n_ctx)
