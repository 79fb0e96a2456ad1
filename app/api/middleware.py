"""Pure ASGI middleware: request ids and request body limits.

Written against raw ASGI rather than BaseHTTPMiddleware, which would add a task and a
stream copy to every ping.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.logs import request_id

_SAFE_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def safe_request_id(value: bytes | None) -> str | None:
    """The caller's X-Request-ID when it is short and plain (it goes into logs), else None."""
    if value is None:
        return None
    candidate = value.decode("latin-1")
    return candidate if _SAFE_ID.fullmatch(candidate) else None


class RequestIdMiddleware:
    """Take a sane `X-Request-ID` from the caller or make one; echo it; expose it to logs."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        rid = safe_request_id(given) or uuid.uuid4().hex[:16]
        token = request_id.set(rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id.reset(token)


class _TooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Answer 413 when a request body exceeds the limit for its path.

    A declared Content-Length over the limit is refused before reading; a chunked
    body is counted as it is read and refused the moment it crosses the limit.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        default_limit: int,
        limits: list[tuple[re.Pattern[str], int]],
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.app = app
        self.default_limit = default_limit
        self.limits = limits
        self.on_refused = on_refused  # called with the path of every 413, for metrics

    def _limit_for(self, path: str) -> int:
        for pattern, limit in self.limits:
            if pattern.fullmatch(path):
                return limit
        return self.default_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limit = self._limit_for(scope["path"])
        for key, value in scope["headers"]:
            if key == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = limit + 1
                if declared > limit:
                    self._refused(scope["path"])
                    await _send_413(send, limit)
                    return
                break

        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message: Message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _TooLarge:
            self._refused(scope["path"])
            if not started:
                await _send_413(send, limit)

    def _refused(self, path: str) -> None:
        if self.on_refused is not None:
            self.on_refused(path)


async def _send_413(send: Send, limit: int) -> None:
    body = json.dumps({"detail": f"request body larger than {limit} bytes"}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
