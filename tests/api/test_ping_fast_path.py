"""The server's ping fast path answers valid pings itself and hands everything else to the
application intact: raw HTTP against a real uvicorn server with the bounded protocol, an
application that answers 418 (so a hand-over shows) and records the bodies it got."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from app.api.fastping import PingAnswers
from app.domain.tokens import ping_token
from app.services.runtime import Runtime, build_runtime
from tests.conftest import SettingsFactory
from tests.support.served import serving

GOOD = b'{"status":"healthy"}'
SECRET = "s3"


class Downstream:
    """Answers 418 with the body it read; records (path, body)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.calls.append((scope["path"], body))
        await self.release.wait()
        await send({"type": "http.response.start", "status": 418,
                    "headers": [(b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


def request(
    name: str = "api",
    body: bytes = GOOD,
    *,
    token: str | None = None,
    extra: str = "",
    method: str = "POST",
    target: str | None = None,
    version: str = "HTTP/1.1",
) -> bytes:
    token = ping_token(SECRET, name) if token is None else token
    auth = f"authorization: Bearer {token}\r\n" if token else ""
    target = target or f"/v1/workloads/{name}/health"
    return (
        f"{method} {target} {version}\r\nhost: manager\r\n{auth}{extra}"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """The next final response (an interim `100 Continue` is read past)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
    while head.startswith(b"HTTP/1.1 1"):
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
    lines = head.decode("latin-1").split("\r\n")
    headers = {
        k.strip().lower(): v.strip()
        for k, _, v in (line.partition(":") for line in lines[1:] if line)
    }
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(lines[0].split(" ")[1]), headers, body


@pytest.fixture
def runtime(make_settings: SettingsFactory) -> Runtime:
    return build_runtime(make_settings(ping_token_secret=SECRET, max_tracked_workloads=3))


@pytest.fixture
async def server(runtime: Runtime) -> AsyncIterator[tuple[int, Downstream]]:
    downstream = Downstream()
    async with serving(downstream, pings=PingAnswers(runtime=runtime, limit=64)) as port:
        yield port, downstream


async def exchange(port: int, *payloads: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Send each payload (as one write each) on one connection; one response per payload."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        answers = []
        for payload in payloads:
            writer.write(payload)
            await writer.drain()
            answers.append(await response(reader))
        return answers
    finally:
        writer.close()


async def test_a_valid_ping_is_answered_by_the_server(
    server: tuple[int, Downstream], runtime: Runtime
) -> None:
    port, downstream = server
    [(status, headers, body)] = await exchange(port, request())
    assert (status, body, downstream.calls) == (204, b"", [])
    view = runtime.book.view("api")
    assert view is not None and view.status == "healthy"
    assert len(headers["x-request-id"]) == 16
    assert "date" in headers
    [(status, headers, _)] = await exchange(port, request(extra="x-request-id: abc\r\n"))
    assert (status, headers["x-request-id"]) == (204, "abc")
    assert runtime.metrics.pings.labels("api", "healthy")._value.get() == 2


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(request("Bad_Name"), id="bad-name"),
        pytest.param(request(token=""), id="no-token"),
        pytest.param(request(token="nope"), id="wrong-token"),
        pytest.param(request(token=ping_token(SECRET, "other")), id="other-workload-token"),
        pytest.param(request(body=b'{"status":"fine"}'), id="invalid-body"),
        pytest.param(request(body=b"x" * 65), id="over-the-limit"),
        pytest.param(request(method="PUT"), id="put"),
        pytest.param(request(target="/v1/workloads/api/health?x=1"), id="query"),
        pytest.param(request(target="/v1/workloads/a%70i/health"), id="escaped"),
        pytest.param(request(extra="connection: close\r\n"), id="connection-close"),
        pytest.param(request(version="HTTP/1.0"), id="http-1.0"),
        pytest.param(request(extra="expect: 100-continue\r\n"), id="expect-continue"),
    ],
)
async def test_everything_else_is_handed_over_with_its_body(
    server: tuple[int, Downstream], runtime: Runtime, payload: bytes
) -> None:
    port, downstream = server
    [(status, _, body)] = await exchange(port, payload)
    sent_body = payload.partition(b"\r\n\r\n")[2]
    assert (status, body) == (418, sent_body)
    assert [b for _, b in downstream.calls] == [sent_body]
    assert runtime.book.names() == []


async def test_a_chunked_ping_is_handed_over(server: tuple[int, Downstream]) -> None:
    port, downstream = server
    head = request().partition(b"content-length")[0]
    chunked = (
        head
        + b"transfer-encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n"
        % (
            len(GOOD),
            GOOD,
        )
    )
    [(status, _, body)] = await exchange(port, chunked)
    assert (status, body, downstream.calls) == (418, GOOD, [("/v1/workloads/api/health", GOOD)])


async def test_a_full_book_is_handed_over(server: tuple[int, Downstream]) -> None:
    port, downstream = server
    answers = await exchange(port, *(request(name) for name in ("a", "b", "c", "d")))
    assert [status for status, _, _ in answers] == [204, 204, 204, 418]
    assert downstream.calls == [("/v1/workloads/d/health", GOOD)]


async def test_a_ping_split_across_reads_and_after_a_hand_over(
    server: tuple[int, Downstream], runtime: Runtime
) -> None:
    """The body sent after its head (the server feeds its parser a head and a body
    separately either way), then a hand-over, then a fast ping again on the same
    connection: the parser's state survives each path."""
    port, downstream = server
    head, _, body = request().partition(b"\r\n\r\n")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + b"\r\n\r\n")
        await writer.drain()
        writer.write(body)
        assert (await response(reader))[0] == 204
        writer.write(request(token="nope"))
        assert (await response(reader))[0] == 418
        writer.write(request("b"))
        assert (await response(reader))[0] == 204
    finally:
        writer.close()
    assert len(downstream.calls) == 1 and sorted(runtime.book.names()) == ["api", "b"]


async def test_pipelined_pings_are_answered_in_order(server: tuple[int, Downstream]) -> None:
    """Pings pipelined behind a request the application still holds wait for its answer."""
    port, downstream = server
    downstream.release.clear()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            request(token="nope") + request("a") + request("b", token="bad") + request("c")
        )
        await writer.drain()
        downstream.release.set()
        statuses = [(await response(reader))[0] for _ in range(4)]
    finally:
        writer.close()
    assert statuses == [418, 204, 418, 204]
