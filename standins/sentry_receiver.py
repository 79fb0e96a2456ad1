"""A local Sentry ingestion endpoint: accepts envelopes and keeps the events in them."""

from __future__ import annotations

import gzip
import json
import threading
import zlib
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


class SentryReceiver:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self.app = Starlette(
            routes=[Route("/api/{project}/envelope/", self._envelope, methods=["POST"])]
        )

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)

    def exception_types(self) -> set[str]:
        found = set()
        for event in self.events:
            for value in event.get("exception", {}).get("values", []):
                found.add(value.get("type", ""))
        return found

    async def _envelope(self, request: Request) -> JSONResponse:
        raw = await request.body()
        encoding = request.headers.get("content-encoding", "")
        if encoding == "gzip":
            raw = gzip.decompress(raw)
        elif encoding == "deflate":
            raw = zlib.decompress(raw)
        elif encoding:
            return JSONResponse({"error": f"unsupported encoding {encoding}"}, status_code=415)
        lines = raw.split(b"\n")
        items: list[dict[str, Any]] = []
        # envelope: header line, then (item header, payload) pairs
        i = 1
        while i + 1 < len(lines):
            header = json.loads(lines[i])
            payload = lines[i + 1]
            if header.get("type") == "event":
                items.append(json.loads(payload))
            i += 2
        with self._lock:
            self._events.extend(items)
        return JSONResponse({"id": "0" * 32})
