"""What the router checks before it reads a request's body (docs/architecture.md, "Serving",
"Security and bad input"): the admin token of ``/admin/*`` requests, then the body's size.

An ASGI middleware, so that both checks run before FastAPI reads and parses the body: an
unauthenticated upsert is answered 401 without parsing its megabytes, and a body over
``max_body_bytes`` is answered 413 from its ``Content-Length`` or, for a chunked body, as soon
as the bytes received pass the limit (the rest is not read).
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException

__all__ = ["RequestGuard", "BodyTooLarge"]


class BodyTooLarge(HTTPException):
    """A chunked request body passed the limit while it was being received (an HTTP 413, so
    that FastAPI, which reads the body, passes it on to the JSON error handler)."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body exceeds the limit of {limit:,} bytes")


def _json(status: int, message: str, field: str, headers: dict[str, str] | None = None):
    body = json.dumps({"error": message, "problems": [{"field": field, "message": message}]})
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return body.encode(), raw


async def _reply(send, status: int, message: str, field: str, headers=None) -> None:
    body, raw = _json(status, message, field, headers)
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """ASGI middleware: 401 for an ``/admin/`` request without the token, 413 for a body over
    ``max_body_bytes``, both before the body is parsed."""

    def __init__(self, app, *, max_body_bytes: int, admin):
        self.app = app
        self.max_body_bytes = int(max_body_bytes)
        self.admin = admin  # raycompat.serving.auth.AdminToken

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if "/admin/" in scope.get("path", ""):
            auth = headers.get(b"authorization")
            why = self.admin.check(None if auth is None else auth.decode("latin-1"))
            if why is not None:
                return await _reply(send, 401, why, "header.authorization",
                                    {"WWW-Authenticate": "Bearer"})  # fmt: skip
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await _reply(send, 413, self._too_large(int(declared)), "body")
        return await self._counted(scope, receive, send)

    def _too_large(self, size: int | None) -> str:
        got = "more" if size is None else f"{size:,} bytes"
        return f"request body of {got} exceeds the limit of {self.max_body_bytes:,} bytes"

    async def _counted(self, scope, receive, send):
        """Pass the request on, counting its body's bytes; past the limit, answer 413 (when no
        response has started) instead of reading the rest."""
        seen, started = 0, False

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await _reply(send, 413, self._too_large(None), "body")
