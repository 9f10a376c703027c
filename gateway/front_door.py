"""The gateway's front door: pure ASGI middleware every request passes.

It echoes ``X-Request-Id`` on every response (the client's, or one made here), puts the page's
security headers on the page's files, and for the API routes (and ``/cluster``) checks the API key
and the body size, then counts the request in the metrics.

Why pure ASGI and not a route dependency: FastAPI parses the body before dependencies run, so a
client without a key would learn about its JSON before hearing 401. Pure ASGI also leaves streaming
and disconnect detection alone.
"""

from __future__ import annotations

import secrets
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import OpenAIError
from runtime.metrics import GatewayMetrics

#: routes counted by name in the metrics (any other path is "other")
ROUTES = frozenset({"/v1/models", "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"})
#: where the API key and the body size are checked
GUARDED = ("/v1/", "/tokenize", "/detokenize", "/cluster")
REQUEST_ID = b"x-request-id"
#: the page (``/`` and ``/static/``) talks only to its own origin and runs no inline script
PAGE_HEADERS = [
    (b"content-security-policy", b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                 b"connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]


def request_id(scope: Scope) -> str:
    """The id of this request: the client's ``X-Request-Id``, or the one the front door made."""
    return scope.get("state", {}).get("request_id", "")


class FrontDoor:
    """X-Request-Id on every response; API key, body size and request metrics on the API routes."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, max_body_bytes: int, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.api_keys = [k.encode() for k in api_keys]

    def _refuse(self, headers: dict[bytes, bytes]) -> OpenAIError | None:
        if self.api_keys:
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            token = token.strip()
            if scheme.lower() != "bearer" or not token:
                return OpenAIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
            if not any(secrets.compare_digest(token.encode("latin-1"), k) for k in self.api_keys):
                return OpenAIError(401, "incorrect API key provided", code="invalid_api_key")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return OpenAIError(413, f"the request body is over {self.max_body_bytes} bytes", code="request_too_large")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        rid = headers.get(REQUEST_ID, b"").decode("latin-1").strip()[:256] or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        path = scope.get("path", "")
        status = [500]
        extra = PAGE_HEADERS if path == "/" or path.startswith("/static/") else []

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                out = list(message.get("headers") or [])
                if not any(k.lower() == REQUEST_ID for k, _ in out):
                    out.append((REQUEST_ID, rid.encode("latin-1")))
                message = {**message, "headers": [*out, *extra]}
            await send(message)

        if not path.startswith(GUARDED):
            await self.app(scope, receive, send_status)
            return

        t0 = time.perf_counter()
        try:
            refused = self._refuse(headers)
            if refused is not None:
                await refused.response()(scope, receive, send_status)
                return
            await self.app(scope, receive, send_status)
        finally:
            if path.startswith("/v1/models/"):
                endpoint = "/v1/models/{id}"
            else:  # one label per route, not per path a client made up
                endpoint = path if path in ROUTES else "other"
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            self.metrics.e2e.labels(endpoint).observe(time.perf_counter() - t0)
