"""The hot path for valid health pings, answered by the HTTP server's protocol itself.

Every workload pings every 5-10 s, so a valid ping is the request the manager serves
most. `BoundedHttpProtocol` (app/server.py) asks `PingAnswers` whether a request target
is one it may answer (`target_of`: `/v1/workloads/<DNS-1123 name>/health`, no query); for
a `POST` with such a target on a kept-alive HTTP/1.1 connection it reads the body
(declared by Content-Length, within the ping body limit) and lets `answer` check it with
the same rules as the FastAPI route (ping token, `Ping` model, bounded book) and record
it with the same effects (book, metrics, request id). A valid ping is answered 204
without an ASGI task, a scope or the framework. Anything else — a bad name, a missing
token, an invalid body, a full book — is handed to the FastAPI app, body included, as if
it had just arrived, so every error keeps its one implementation and its 4xx shape; the
route also keeps the OpenAPI document honest.
"""

from __future__ import annotations

import hmac
import itertools
import os
from typing import NamedTuple

from pydantic import ValidationError

from app.api.middleware import safe_request_id
from app.domain.health import Ping, is_workload_name
from app.domain.tokens import ping_token
from app.services.runtime import Runtime
from app.services.workloads import BookFull

_PREFIX = b"/v1/workloads/"
_SUFFIX = b"/health"


class PingTarget(NamedTuple):
    """A workload's ping target: its name, and the ping token it must present (None: no
    token is asked for)."""

    name: str
    token: bytes | None


class PingAnswers:
    """Valid pings, checked and recorded; `limit` is the ping body limit in bytes."""

    def __init__(self, *, runtime: Runtime, limit: int) -> None:
        self.limit = limit
        self._book = runtime.book
        self._count = runtime.metrics.count_ping
        # the `x-workload-update` value of each workload with an update pending
        self.notices = runtime.book.notices
        secret = runtime.settings.ping_token_secret
        self._secret = secret.get_secret_value() if secret else None
        # production without a secret refuses pings: the framework route says why (401)
        self._closed = secret is None and runtime.settings.is_production
        # targets seen, with their workload's token: a ping's target is one look-up
        self._targets: dict[bytes, PingTarget] = {}
        self._cache_bound = 4 * runtime.settings.max_tracked_workloads
        self._ids = itertools.count()
        self._id_prefix = os.urandom(3).hex()

    def target_of(self, target: bytes) -> PingTarget | None:
        """The workload a request target pings, when it is one this path answers."""
        known = self._targets.get(target)
        if known is not None:
            return known
        if self._closed or not (target.startswith(_PREFIX) and target.endswith(_SUFFIX)):
            return None
        name = target[len(_PREFIX) : -len(_SUFFIX)].decode("latin-1")
        if not is_workload_name(name):
            return None
        if len(self._targets) >= self._cache_bound:
            self._targets.clear()
        token = None if self._secret is None else ping_token(self._secret, name).encode()
        known = self._targets[target] = PingTarget(name, token)
        return known

    def answer(
        self, target: PingTarget, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> bytes | None:
        """The request id to answer 204 with, the ping recorded; None: the framework answers."""
        authorization = request_id = None
        for key, value in headers:
            if key == b"authorization":
                authorization = value
            elif key == b"x-request-id":
                request_id = value
        if target.token is not None and not _bearer(authorization, target.token):
            return None
        try:
            ping = Ping.model_validate_json(body)
            self._book.record(target.name, ping)
        except (ValidationError, BookFull):
            return None
        self._count(target.name, ping.status)
        rid = safe_request_id(request_id)
        if rid is None:
            return f"{self._id_prefix}{next(self._ids):010x}".encode()
        return rid.encode()


def _bearer(header: bytes | None, token: bytes) -> bool:
    if header is None or header[:7].lower() != b"bearer ":
        return False
    return hmac.compare_digest(header[7:].strip(), token)
