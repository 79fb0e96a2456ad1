"""A fault-injecting HTTP proxy in front of a real kube-apiserver.

The real server does not fail on demand; this proxy does: the next matching requests
get a Kubernetes `Status` with a chosen code (5xx, 409, 429 with Retry-After), or are
held for a while before being forwarded (a slow or hanging API server, which a client
timeout turns into a dropped request). Everything else is forwarded as it is, the
caller's bearer token included, so RBAC still decides. Every request is recorded (method,
path, status), which is how tests count what a sync cost.

The manager talks plain HTTP to the proxy (on loopback), the proxy TLS to the server.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from standins.servers import ThreadedServer
from tests.support.kube.faults import Control, RecordedRequest, Rule

# hop-by-hop headers (RFC 9110 7.6.1) and those httpx sets itself
_DROPPED = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "host",
            "content-length", "content-encoding"}  # fmt: skip


class FaultProxy:
    def __init__(self, upstream: str, *, ca: Path) -> None:
        self.upstream = upstream
        self._tls = ssl.create_default_context(cafile=str(ca))
        self._control = Control()
        self.app = Starlette(
            routes=[Route("/{path:path}", self._forward, methods=[
                "GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])]
        )  # fmt: skip

    # -- what tests call ---------------------------------------------------------------

    def fail_next(
        self, method: str | None = None, path_contains: str = "", *, status: int = 500,
        times: int = 1, message: str = "", retry_after: int | None = None,
    ) -> None:  # fmt: skip
        """Answer the next `times` matching requests with a Status of code `status`."""
        self._control.add_fault(Rule(method, path_contains, times, status, message, retry_after))

    def delay_next(
        self, method: str | None = None, path_contains: str = "", *, seconds: float, times: int = 1
    ) -> None:
        """Hold the next `times` matching requests for `seconds`, then forward them."""
        self._control.add_delay(Rule(method, path_contains, times, seconds=seconds))

    def release_held(self) -> None:
        """Forward every request held by a delay now (the hold was a gate, not a time)."""
        self._control.release()

    @property
    def delays_waiting(self) -> int:
        return self._control.delays_waiting

    def clear_faults(self) -> None:
        self._control.clear_faults()

    def reset(self) -> None:
        """No faults, no records, and requests held by a delay are abandoned, never sent."""
        self._control.reset()

    @property
    def requests(self) -> list[RecordedRequest]:
        return self._control.requests

    def clear_requests(self) -> None:
        self._control.clear_requests()

    # -- serving -----------------------------------------------------------------------

    async def _forward(self, request: Request) -> Response:
        method, path = request.method, request.url.path
        epoch, interrupt, release = self._control.begin()
        query = dict(request.query_params)
        content_type = (request.headers.get("content-type") or "").split(";")[0] or None
        body = await request.body()
        delay = self._control.take_delay(method, path)
        if delay and not await asyncio.to_thread(_held, interrupt, release, delay):
            # reset while held: a request of an earlier test never reaches the server
            return Response(status_code=503)
        fault = self._control.take_fault(method, path)
        if fault is not None:
            response = _status(fault)
        else:
            response = await self._send(request, body)
        self._control.record(
            RecordedRequest(method, path, query, content_type, response.status_code,
                            _parsed(body)), epoch
        )  # fmt: skip
        return response

    async def _send(self, request: Request, body: bytes) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED}
        # a client per request: the proxy's loop lives in a server thread, and a client
        # kept across requests could not be closed from the test's side
        async with httpx.AsyncClient(verify=self._tls, timeout=60.0) as client:
            upstream = await client.request(
                request.method,
                f"{self.upstream}{request.url.path}",
                params=list(request.query_params.multi_items()),
                headers=headers,
                content=body,
            )
        kept = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROPPED}
        return Response(upstream.content, status_code=upstream.status_code, headers=kept)

    @contextmanager
    def serving(self) -> Iterator[ThreadedServer]:
        server = ThreadedServer(self.app).start()
        try:
            yield server
        finally:
            server.stop()


def _held(interrupt: threading.Event, release: threading.Event, seconds: float) -> bool:
    """Hold a request (the fault: a slow API server) for `seconds` or until released;
    False when a reset ended the hold (the request is then abandoned)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if interrupt.wait(min(left, 0.01)):
            return False
        if release.is_set():
            return True
    return not interrupt.is_set()


def _parsed(body: bytes) -> Any:
    """A request body as tests read it: JSON parsed, other text as it is, None if empty."""
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")


def _status(rule: Rule) -> Response:
    reasons = {409: "Conflict", 429: "TooManyRequests", 500: "InternalError",
               503: "ServiceUnavailable", 504: "Timeout"}  # fmt: skip
    body: dict[str, Any] = {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": rule.message or f"injected fault: HTTP {rule.status}",
        "reason": reasons.get(rule.status, "Unknown"), "code": rule.status,
    }  # fmt: skip
    headers = {"retry-after": str(rule.retry_after)} if rule.retry_after is not None else None
    return Response(json.dumps(body), status_code=rule.status, headers=headers,
                    media_type="application/json")  # fmt: skip
