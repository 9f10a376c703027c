"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Why one module: every failure — a bad field, an unknown model, a full queue, a worker's
StreamError, a passed deadline — must reach the client in the same shape the ``openai``
client parses, as an HTTP status before streaming starts and as an SSE ``error`` event
after (``gateway.responses.sse`` of :meth:`OpenAIError.body`). ``Retry-After`` travels with 429 and 503.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("tandem.gateway")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

# Worker (bus) error codes whose HTTP status carries a Retry-After.
RETRY_STATUSES = (429, 503)


class OpenAIError(Exception):
    """An error the API reports: HTTP ``status`` plus the OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        if retry_after is None and status in RETRY_STATUSES:
            retry_after = 1.0
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """``Retry-After`` (whole seconds, at least 1) when the client should come back later."""
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, int(round(self.retry_after))))}

    def response(self) -> JSONResponse:
        """The HTTP response of this error."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _loc_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """``("body", "messages", 0, "role")`` → ``"messages[0].role"``; union member tags
    (``"str"``, ``"list[int]"``) are pydantic's, not the client's, and are left out."""
    parts = [
        p for p in loc
        if p not in ("body", "query", "header", "path")
        and not (isinstance(p, str) and (p in _UNION_TAGS or "[" in p))
    ]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out or None


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """Pydantic's 422 list → one OpenAI 400 naming the first offending field."""
    errors = exc.errors()
    if not errors:
        return OpenAIError(400, "invalid request")
    first = errors[0]
    param = _loc_param(first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "json_invalid":
        return OpenAIError(400, f"request body is not valid JSON: {first.get('msg', '')}", code="invalid_json")
    if param is None:  # the body itself: absent, or not a JSON object
        return OpenAIError(400, "the request body must be a JSON object", code="invalid_request_body")
    if kind == "missing":
        return OpenAIError(400, f"missing required parameter: {param!r}", param=param, code="missing_required_parameter")
    msg = first.get("msg", "invalid value")
    extra = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return OpenAIError(400, f"invalid value for {param!r}: {msg}{extra}", param=param, code="invalid_value")


def install_handlers(app: FastAPI) -> None:
    """Make every error the app raises (ours, FastAPI's, Starlette's) OpenAI-shaped."""

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return OpenAIError(500, f"internal error ({type(exc).__name__}); see the gateway log",
                           code="internal_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = OpenAIError(exc.status_code, str(exc.detail), code=code)
        resp = err.response()
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp
