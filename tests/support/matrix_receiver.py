"""A Matrix homeserver's one route the manager uses (send a message to a room), checking
the Client-Server API request's shape and keeping one message per transaction."""

from __future__ import annotations

import threading
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

ROOM = "!ops:matrix.example"
TOKEN = "syt_alerts_token"


class MatrixReceiver:
    """Checks the Client-Server API request shape and keeps one message per transaction."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.messages: dict[str, str] = {}
        self.puts = 0
        self.fail_next = 0
        self.app = Starlette(
            routes=[
                Route(
                    "/_matrix/client/v3/rooms/{room}/send/m.room.message/{txn}",
                    self.send,
                    methods=["PUT"],
                )
            ]
        )

    async def send(self, request: Request) -> JSONResponse:
        with self.lock:
            self.puts += 1
            if self.fail_next:
                self.fail_next -= 1
                return JSONResponse({"errcode": "M_UNKNOWN"}, status_code=502)
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            return JSONResponse({"errcode": "M_UNKNOWN_TOKEN"}, status_code=401)
        if request.path_params["room"] != ROOM:
            return JSONResponse({"errcode": "M_FORBIDDEN"}, status_code=403)
        body: dict[str, Any] = await request.json()
        if body.get("msgtype") != "m.text" or not isinstance(body.get("body"), str):
            return JSONResponse({"errcode": "M_BAD_JSON"}, status_code=400)
        with self.lock:
            self.messages.setdefault(request.path_params["txn"], body["body"])
        return JSONResponse({"event_id": f"$evt{len(self.messages)}"})
