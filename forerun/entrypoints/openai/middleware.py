"""Plain ASGI middlewares (not BaseHTTPMiddleware, so streaming responses and disconnects pass through
untouched): the API key check and the request body size limit."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from forerun.entrypoints.openai.errors import error_body

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key


class ApiKeyMiddleware:
    """Every path but /health needs `Authorization: Bearer <key>`; the scheme is case-insensitive
    (RFC 7235), the key is compared in constant time.

    Unknown paths are refused too (401, not 404), so a stranger cannot map the routes.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key: must not be empty")
        self.app = app
        self.expected = api_key.encode()

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.strip().partition(b" ")
        # compare_digest on every path, so the time taken does not tell how the header was wrong.
        return hmac.compare_digest(token.strip(), self.expected) and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            if not self._authorized(dict(scope["headers"]).get(b"authorization", b"")):
                response = JSONResponse(error_body("Incorrect API key provided.", "invalid_request_error",
                                                   code="invalid_api_key"), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """A request body over `max_bytes` gets a 413 before the app reads it (with a Content-Length header)
    or as soon as the bytes received pass the limit (chunked uploads), so no route ever parses it.

    Invariant: the app sees either the whole body, or no request at all.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes: must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            # The server (h11 / httptools) already refused a malformed Content-Length.
            if int(length) > self.max_bytes:
                await self._refuse(int(length), scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        # No length given (chunked): read the body here, bounded, then hand it on.
        received: list[Message] = []
        total = 0
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request":
                break  # the client left
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                await self._refuse(total, scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(received, receive), send)

    async def _refuse(self, size: int, scope: Scope, receive: Receive, send: Send) -> None:
        message = (f"request body: {size} bytes is more than this server accepts ({self.max_bytes} bytes; "
                   "see forerun serve --max-request-body-mb)")
        response = JSONResponse(error_body(message, "invalid_request_error", code="request_too_large"),
                                status_code=413, headers={"Connection": "close"})
        await response(scope, receive, send)


def _replay(messages: Iterable[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()  # after the body: the disconnect the routes watch for

    return replayed
