"""Pure ASGI middleware: API-key check and request body size limit.

Both run before FastAPI reads or parses anything, so a request without the key is refused with a
401 whatever its body, and an oversized body is refused without buffering it.
"""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ninfer_serve.errors import APIError, error_response

OPEN_PATHS = frozenset({"/health", "/metrics"})


class APIKeyMiddleware:
    """Every route except /health and /metrics needs `Authorization: Bearer KEY`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(401, "invalid or missing API key (send Authorization: "
                                  "Bearer <key>)", code="invalid_api_key")
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self._key)


class BodyLimitMiddleware:
    """Refuse bodies over `max_bytes` (413): by Content-Length up front, and by counting while
    reading for bodies sent without one (chunked)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self._max = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await error_response(400, "invalid Content-Length")(scope, receive, send)
                return
            if int(length) > self._max:
                response = error_response(413, self._message(), code="request_too_large")
                await response(scope, receive, send)
                return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self._max:
                    # An HTTPException: FastAPI re-raises it from body parsing, and the app's
                    # handler answers 413 in the OpenAI shape.
                    raise APIError(413, self._message(), code="request_too_large")
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"request body is larger than the limit of {self._max} bytes"
