"""A version file server for the self-update tests: /version with a settable status, body
and delay, and an ETag."""

from __future__ import annotations

import asyncio
import threading

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


class VersionFileServer:
    """Serves /version with a settable status, body and delay (for garbage and timeouts)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.status = 200
        self.body = b"0.1.0"
        self.delay = 0.0
        self.app = Starlette(routes=[Route("/version", self._version)])

    def set(self, *, status: int = 200, body: bytes = b"", delay: float = 0.0) -> None:
        with self.lock:
            self.status, self.body, self.delay = status, body, delay

    async def _version(self, request: Request) -> Response:
        with self.lock:
            status, body, delay = self.status, self.body, self.delay
        if delay:
            await asyncio.sleep(delay)
        etag = f'"{hash(body)}"'
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304)
        return Response(body, status_code=status, headers={"ETag": etag})
