"""The body deadline of `app.server`, on a real uvicorn server in the test's process with
an application that can hold a request: the application sees a stalled body as a client
disconnect, and a body the server itself is not reading (its request waits behind a
pipelined one) is not late."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from uvicorn._types import ASGIReceiveCallable, ASGISendCallable, Scope

from app.server import HttpLimits
from tests.support import served
from tests.support.polling import eventually

BODY_TIMEOUT = 1.0
LIMITS = HttpLimits(
    max_header_bytes=16 * 1024,
    header_timeout=60.0,
    body_timeout=BODY_TIMEOUT,
    keepalive_timeout=60.0,
    max_connections=100,
    max_connections_per_client=100,
)


@dataclass
class EchoApp:
    """Echoes a request's body with 200; `/held` waits for `release` first. Records the
    paths whose body ended in a disconnect."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    disconnected: list[str] = field(default_factory=list)

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        assert scope["type"] == "http"
        if scope["path"] == "/held":
            await self.release.wait()
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected.append(scope["path"])
                return
            assert message["type"] == "http.request"
            body += message["body"]
            if not message["more_body"]:
                break
        headers = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


@contextlib.asynccontextmanager
async def serving(app: EchoApp) -> AsyncIterator[int]:
    """The bounded protocol's server for `app`; a held request is released at the end."""
    async with served.serving(app, limits=LIMITS) as port:
        try:
            yield port
        finally:
            app.release.set()  # a held request must not keep the server from stopping


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
    lines = head.decode("latin-1").split("\r\n")
    length = next(
        int(value)
        for name, _, value in (line.partition(":") for line in lines[1:])
        if name.lower() == "content-length"
    )
    return int(lines[0].split(" ")[1]), await reader.readexactly(length)


async def test_a_stalled_body_is_a_disconnect_to_the_application() -> None:
    app = EchoApp()
    async with serving(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"POST /echo HTTP/1.1\r\nhost: manager\r\ncontent-length: 500\r\n\r\n{")
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), timeout=10) == b""

            async def ended() -> bool:
                return app.disconnected == ["/echo"]

            await eventually(ended, within=10)
        finally:
            writer.close()


async def test_a_body_behind_a_held_pipelined_request_is_not_late() -> None:
    app = EchoApp()
    async with serving(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                b"GET /held HTTP/1.1\r\nhost: manager\r\n\r\n"
                b"POST /echo HTTP/1.1\r\nhost: manager\r\ncontent-length: 5\r\n\r\n"
            )
            await writer.drain()
            # the server does not read the second body while the first request is held:
            # past the body timeout, the connection is still open, with nothing answered
            waiting = asyncio.create_task(reader.readuntil(b"\r\n\r\n"))
            done, _ = await asyncio.wait([waiting], timeout=2.5 * BODY_TIMEOUT)
            assert not done, f"the connection ended while the server held it: {waiting}"
            waiting.cancel()
            app.release.set()
            assert await read_response(reader) == (200, b"")
            writer.write(b"hello")
            await writer.drain()
            assert await read_response(reader) == (200, b"hello")
            assert app.disconnected == []
        finally:
            writer.close()
