"""The Matrix alert sender against a local homeserver that hangs, floods, redirects or
rate-limits: every send ends within its deadline, reads a bounded answer, never follows a
redirect, and waits as long as a 429 asks (or gives up at once when that is too long)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

import pytest

from app.adapters.matrix import MatrixError, MatrixRoom
from standins.servers import ThreadedServer, serve

ROOM = "!ops:matrix.example"
TOKEN = "syt_alerts_token"
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
OK = json.dumps({"event_id": "$evt1"}).encode()
Step = str | tuple[str, int]
# between two bytes of a "trickle": under the client's per-read timeout (1 s), and the
# whole answer (21 bytes) takes over 10 s
TRICKLE_GAP = 0.5


class Homeserver:
    """Answers each PUT by the next of `script` (then 200): "trickle", "huge", "redirect",
    or ("429", retry_after_ms) for M_LIMIT_EXCEEDED; records when each PUT arrived."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.script: list[Step] = []
        self.arrivals: list[float] = []
        self.delivered: list[str] = []

    def reset(self, *script: Step) -> None:
        with self.lock:
            self.script = list(script)
            self.arrivals.clear()
            self.delivered.clear()

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        with self.lock:
            self.arrivals.append(time.monotonic())
            step: Step = self.script.pop(0) if self.script else "ok"
        if step == "ok":
            with self.lock:
                self.delivered.append(json.loads(body)["body"])
            await _answer(send, 200, OK)
        elif step == "trickle":
            await _start(send, 200, [(b"content-length", str(len(OK)).encode())])
            for index in range(len(OK)):
                await asyncio.sleep(TRICKLE_GAP)
                more = index < len(OK) - 1
                await send(
                    {"type": "http.response.body", "body": OK[index : index + 1], "more_body": more}
                )
        elif step == "huge":
            await _start(send, 200, [])  # chunked: no Content-Length
            for _ in range(64):
                await send({"type": "http.response.body", "body": b" " * 65536, "more_body": True})
            await send({"type": "http.response.body", "body": OK})
        elif step == "redirect":
            port = scope["server"][1]
            location = f"http://localhost:{port}{scope['path']}".encode()
            await _answer(send, 307, b"{}", [(b"location", location)])
        elif isinstance(step, tuple):
            _, retry_after_ms = step
            error = {"errcode": "M_LIMIT_EXCEEDED", "retry_after_ms": retry_after_ms}
            await _answer(send, 429, json.dumps(error).encode())


async def _start(send: Send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
    headers = [(b"content-type", b"application/json"), *headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})


async def _answer(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    extra = [(b"content-length", str(len(body)).encode()), *(headers or [])]
    await _start(send, status, extra)
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Homeserver, ThreadedServer]]:
    homeserver = Homeserver()
    with serve(homeserver) as server:
        yield homeserver, server


def room_for(server: ThreadedServer, *, deadline: float = 30.0) -> MatrixRoom:
    return MatrixRoom(
        homeserver=server.url, room_id=ROOM, token=TOKEN, timeout=1.0, deadline=deadline
    )


async def test_a_trickled_answer_ends_at_the_deadline(
    served: tuple[Homeserver, ThreadedServer],
) -> None:
    homeserver, server = served
    homeserver.reset("trickle", "trickle", "trickle")
    room = room_for(server, deadline=1.0)
    started = time.monotonic()
    try:
        with pytest.raises(MatrixError, match=r"deadline of 1 s"):
            await room.send("x", txn_id="t1")
    finally:
        await room.aclose()
    # half of one trickled answer's time: room for a busy machine, ended by the deadline
    assert time.monotonic() - started < len(OK) * TRICKLE_GAP / 2


async def test_a_huge_answer_is_refused(served: tuple[Homeserver, ThreadedServer]) -> None:
    homeserver, server = served
    homeserver.reset("huge", "huge", "huge")
    room = room_for(server)
    try:
        with pytest.raises(MatrixError, match=r"answer larger than 65536 bytes"):
            await room.send("x", txn_id="t2")
    finally:
        await room.aclose()
    assert len(homeserver.arrivals) == 1  # not retried


async def test_a_redirect_is_an_error_and_never_followed(
    served: tuple[Homeserver, ThreadedServer],
) -> None:
    homeserver, server = served
    homeserver.reset("redirect")
    room = room_for(server)
    try:
        with pytest.raises(MatrixError, match=r"HTTP 307: redirects are refused"):
            await room.send("x", txn_id="t3")
    finally:
        await room.aclose()
    assert homeserver.delivered == [] and len(homeserver.arrivals) == 1


async def test_retry_after_ms_is_honoured(served: tuple[Homeserver, ThreadedServer]) -> None:
    homeserver, server = served
    # longer than the sender's own backoff (at most 2 s)
    homeserver.reset(("429", 2500))
    room = room_for(server, deadline=10.0)
    try:
        await room.send("hello", txn_id="t4")
    finally:
        await room.aclose()
    assert homeserver.delivered == ["hello"]
    first, second = homeserver.arrivals
    assert second - first >= 2.5


async def test_a_retry_after_ms_past_the_deadline_gives_up_at_once(
    served: tuple[Homeserver, ThreadedServer],
) -> None:
    homeserver, server = served
    homeserver.reset(("429", 60_000))
    room = room_for(server, deadline=30.0)
    started = time.monotonic()
    try:
        with pytest.raises(MatrixError, match=r"Retry-After 60 s is past the 30 s left"):
            await room.send("x", txn_id="t5")
    finally:
        await room.aclose()
    # asked once, and ended long before either the asked wait or the deadline
    assert len(homeserver.arrivals) == 1
    assert time.monotonic() - started < 15.0
