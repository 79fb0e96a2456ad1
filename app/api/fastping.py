"""The hot path for valid health pings, in raw ASGI, in front of the framework.

Every workload pings every 5-10 s, so a valid ping is the request the manager serves
most. It is answered here with the same checks as the FastAPI route (DNS-1123 name,
body limit, ping token, `Ping` model, bounded book) and the same effects (book, metrics,
request id), at a fraction of the framework's per-request cost. Anything else — a bad
name, a missing token, an invalid body, a full book — is replayed, body included, to
the FastAPI app, so every error keeps its one implementation and its 4xx shape; the
route also keeps the OpenAPI document honest.
"""

from __future__ import annotations

import hmac
import itertools
import os

from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.middleware import safe_request_id
from app.domain.health import Ping, is_workload_name
from app.domain.tokens import ping_token
from app.services.runtime import Runtime
from app.services.workloads import BookFull

_PREFIX = "/v1/workloads/"
_SUFFIX = "/health"


class PingFastPath:
    def __init__(self, app: ASGIApp, *, runtime: Runtime, limit: int) -> None:
        self.app = app
        self._rt = runtime
        self._limit = limit
        secret = runtime.settings.ping_token_secret
        self._secret = secret.get_secret_value() if secret else None
        # production without a secret refuses pings: the framework route says why (401)
        self._closed = secret is None and runtime.settings.is_production
        self._tokens: dict[str, bytes] = {}
        self._cache_bound = 4 * runtime.settings.max_tracked_workloads
        self._ids = itertools.count()
        self._id_prefix = os.urandom(3).hex()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or not path.startswith(_PREFIX)
            or not path.endswith(_SUFFIX)
        ):
            await self.app(scope, receive, send)
            return
        name = path[len(_PREFIX) : -len(_SUFFIX)]
        declared = authorization = request_id = None
        for key, value in scope["headers"]:
            if key == b"content-length":
                declared = value
            elif key == b"authorization":
                authorization = value
            elif key == b"x-request-id":
                request_id = value
        if not is_workload_name(name) or (declared is not None and _too_big(declared, self._limit)):
            await self.app(scope, receive, send)
            return
        body, complete = await _read(receive, self._limit)
        if not complete or not self._authorised(name, authorization):
            await self.app(scope, _replay(body, complete, receive), send)
            return
        try:
            ping = Ping.model_validate_json(body)
            self._rt.book.record(name, ping)
        except (ValidationError, BookFull):
            await self.app(scope, _replay(body, True, receive), send)
            return
        self._count(name, ping.status.value)
        rid = safe_request_id(request_id) or f"{self._id_prefix}{next(self._ids):010x}"
        await send(
            {
                "type": "http.response.start",
                "status": 204,
                "headers": [(b"x-request-id", rid.encode())],
            }
        )
        await send({"type": "http.response.body", "body": b""})

    def _authorised(self, name: str, header: bytes | None) -> bool:
        if self._secret is None:
            return not self._closed
        if header is None or not header[:7].lower() == b"bearer ":
            return False
        expected = self._tokens.get(name)
        if expected is None:
            if len(self._tokens) > self._cache_bound:
                self._tokens.clear()
            expected = self._tokens[name] = ping_token(self._secret, name).encode()
        return hmac.compare_digest(header[7:].strip(), expected)

    def _count(self, name: str, status: str) -> None:
        self._rt.metrics.count_ping(name, status)


def _too_big(declared: bytes, limit: int) -> bool:
    try:
        return int(declared) > limit
    except ValueError:
        return True


async def _read(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """The body, and whether it was read whole within the limit (else: hand it over)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message: Message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), False
        chunk = message.get("body", b"")
        size += len(chunk)
        chunks.append(chunk)
        if size > limit:
            return b"".join(chunks), False
        if not message.get("more_body", False):
            return b"".join(chunks), True


def _replay(body: bytes, complete: bool, receive: Receive) -> Receive:
    """A receive that gives back what was read, then continues from the client."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": not complete}
        message: Message = await receive()
        return message

    return replay
