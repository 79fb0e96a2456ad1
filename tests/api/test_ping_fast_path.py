"""The ping fast path answers valid pings itself and hands everything else over intact."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import pytest

from app.api.fastping import PingFastPath
from app.domain.tokens import ping_token
from app.services.runtime import build_runtime
from tests.conftest import SettingsFactory


class Downstream:
    def __init__(self) -> None:
        self.calls: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.calls.append(body)
        await send({"type": "http.response.start", "status": 418, "headers": []})
        await send({"type": "http.response.body", "body": b""})


async def call(
    app: PingFastPath, path: str, chunks: list[bytes], headers: list[tuple[bytes, bytes]]
) -> tuple[int, dict[bytes, bytes]]:
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    pending = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    await app(scope, receive, send)
    return sent[0]["status"], dict(sent[0]["headers"])


@pytest.fixture
def parts(make_settings: SettingsFactory) -> tuple[PingFastPath, Downstream, Any]:
    runtime = build_runtime(make_settings(ping_token_secret="s3", max_tracked_workloads=3))
    downstream = Downstream()
    return PingFastPath(downstream, runtime=runtime, limit=64), downstream, runtime


GOOD = b'{"status":"healthy"}'
AUTH = [(b"authorization", b"Bearer " + ping_token("s3", "api").encode())]


async def test_a_valid_ping_is_answered_without_the_framework(
    parts: tuple[PingFastPath, Downstream, Any],
) -> None:
    fast, downstream, runtime = parts
    status, headers = await call(fast, "/v1/workloads/api/health", [GOOD[:5], GOOD[5:]], AUTH)
    assert status == 204 and downstream.calls == []
    assert runtime.book.view("api").status == "healthy"
    assert len(headers[b"x-request-id"]) == 16
    status, headers = await call(
        fast, "/v1/workloads/api/health", [GOOD], [*AUTH, (b"x-request-id", b"abc")]
    )
    assert (status, headers[b"x-request-id"]) == (204, b"abc")


@pytest.mark.parametrize(
    ("path", "chunks", "headers"),
    [
        ("/v1/workloads/Bad_Name/health", [GOOD], AUTH),
        ("/v1/workloads/api/health", [GOOD], []),
        ("/v1/workloads/api/health", [GOOD], [(b"authorization", b"Bearer nope")]),
        ("/v1/workloads/api/health", [b'{"status":"fine"}'], AUTH),
        ("/v1/workloads/api/health", [b"x" * 40, b"y" * 40], AUTH),
        ("/v1/workloads/api/health", [GOOD], [*AUTH, (b"content-length", b"9999")]),
    ],
)
async def test_everything_else_is_handed_over_with_its_body(
    parts: tuple[PingFastPath, Downstream, Any],
    path: str,
    chunks: list[bytes],
    headers: list[tuple[bytes, bytes]],
) -> None:
    fast, downstream, runtime = parts
    status, _ = await call(fast, path, chunks, headers)
    assert status == 418
    if not any(k == b"content-length" for k, _ in headers):
        assert downstream.calls == [b"".join(chunks)]
    assert runtime.book.names() == []


async def test_a_full_book_is_handed_over(parts: tuple[PingFastPath, Downstream, Any]) -> None:
    fast, downstream, _runtime = parts
    for name in ("a", "b", "c"):
        auth = [(b"authorization", b"Bearer " + ping_token("s3", name).encode())]
        assert (await call(fast, f"/v1/workloads/{name}/health", [GOOD], auth))[0] == 204
    auth = [(b"authorization", b"Bearer " + ping_token("s3", "d").encode())]
    assert (await call(fast, "/v1/workloads/d/health", [GOOD], auth))[0] == 418
    assert downstream.calls == [GOOD]


async def test_other_routes_pass_through(parts: tuple[PingFastPath, Downstream, Any]) -> None:
    fast, downstream, _runtime = parts
    assert (await call(fast, "/v1/sync", [b""], AUTH))[0] == 418
    assert downstream.calls == [b""]
