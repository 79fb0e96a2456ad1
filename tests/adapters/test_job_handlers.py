"""Built-in job handlers: `http` against a local workload over real HTTP; plugin loading."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.adapters.workload_http import MAX_RESPONSE_BYTES, WorkloadHttp
from app.domain.jobs import FailureKind, Job, PermanentJobFailure, RetryableJobFailure
from app.services import handlers
from app.services.handlers import HandlerContext, load_handlers
from app.services.streams import new_job
from tests.support.polling import eventually
from tests.support.servers import ThreadedServer, serve

received: list[tuple[dict[str, Any], str | None]] = []


async def answer(request: Request) -> JSONResponse:
    received.append((await request.json(), request.headers.get("idempotency-key")))
    status = int(request.path_params["status"])
    if status == 0:
        await asyncio.sleep(5)
        status = 200
    return JSONResponse({"stored": True}, status_code=status)


async def sized(request: Request) -> Response:
    """`size` bytes of JSON (a string field padded out) or of plain text."""
    size = int(request.path_params["size"])
    if request.path_params["kind"] == "json":
        padding = "x" * (size - len(json.dumps({"data": ""})))
        return Response(json.dumps({"data": padding}), media_type="application/json")
    return Response(b"y" * size, media_type="text/plain")


class Endless:
    """A body that never ends, counting what it sent; it stops when the client goes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent = 0
        self.running = False

    async def respond(self, request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            with self.lock:
                self.running = True
            try:
                while True:
                    with self.lock:
                        self.sent += 16 * 1024
                    yield b"z" * (16 * 1024)
                    await asyncio.sleep(0)
            finally:
                with self.lock:
                    self.running = False

        return StreamingResponse(chunks(), status_code=int(request.path_params["status"]))


endless = Endless()


@pytest.fixture(scope="module")
def workload() -> Iterator[ThreadedServer]:
    app = Starlette(routes=[
        Route("/answer/{status}", answer, methods=["POST"]),
        Route("/sized/{kind}/{size}", sized, methods=["POST"]),
        Route("/endless/{status}", endless.respond, methods=["POST"]),
    ])  # fmt: skip
    with serve(app) as server:
        yield server


@pytest.fixture
async def http() -> AsyncIterator[WorkloadHttp]:
    client = WorkloadHttp(timeout=0.5, allowed_suffixes=("127.0.0.1", ".svc"))
    yield client
    await client.aclose()


def context(http: WorkloadHttp, delivered: int = 1) -> HandlerContext:
    return HandlerContext(node_id="n1", delivered=delivered, http=http)


def http_job(url: str) -> Job:
    return new_job("http", payload={"url": url, "body": {"text": "hi"}}, idempotency_key="k-9")


async def test_http_handler_posts_the_body_with_the_idempotency_key(
    workload: ThreadedServer, http: WorkloadHttp
) -> None:
    received.clear()
    result = await handlers.http(http_job(f"{workload.url}/answer/201"), context(http))
    assert result == {"status": 201, "body": {"stored": True}}
    assert received == [({"text": "hi"}, "k-9")]


@pytest.mark.parametrize(
    ("path", "failure"),
    [("/answer/503", RetryableJobFailure), ("/answer/0", RetryableJobFailure),
     ("/answer/404", PermanentJobFailure), ("/answer/422", PermanentJobFailure)],
)  # fmt: skip
async def test_http_handler_failures_are_classified(
    workload: ThreadedServer, http: WorkloadHttp, path: str, failure: type[Exception]
) -> None:
    with pytest.raises(failure):
        await handlers.http(http_job(f"{workload.url}{path}"), context(http))


@pytest.mark.parametrize(
    ("kind", "size", "body"),
    [
        ("json", 1000, {"data": "x" * (1000 - len('{"data": ""}'))}),
        ("json", MAX_RESPONSE_BYTES, {"data": "x" * (MAX_RESPONSE_BYTES - len('{"data": ""}'))}),
        ("text", 10_000, "y" * 10_000),  # more than the 4096 characters kept before, unsaid
        ("text", MAX_RESPONSE_BYTES, "y" * MAX_RESPONSE_BYTES),
    ],
)
async def test_http_handler_keeps_a_body_within_the_cap_whole(
    workload: ThreadedServer, http: WorkloadHttp, kind: str, size: int, body: Any
) -> None:
    result = await handlers.http(http_job(f"{workload.url}/sized/{kind}/{size}"), context(http))
    assert result == {"status": 200, "body": body}


@pytest.mark.parametrize("kind", ["json", "text"])
async def test_http_handler_cuts_a_larger_body_and_says_so(
    workload: ThreadedServer, http: WorkloadHttp, kind: str
) -> None:
    size = 5 * MAX_RESPONSE_BYTES
    result = await handlers.http(http_job(f"{workload.url}/sized/{kind}/{size}"), context(http))
    assert result["status"] == 200
    assert result["truncated"] is True and result["kept_bytes"] == MAX_RESPONSE_BYTES
    # a cut JSON document does not parse: its first bytes are kept as text
    assert isinstance(result["body"], str) and len(result["body"]) == MAX_RESPONSE_BYTES
    assert result["body"].startswith('{"data": "xxx' if kind == "json" else "yyy")


@pytest.mark.parametrize(
    ("status", "outcome"),
    [(200, None), (201, None), (422, PermanentJobFailure), (503, RetryableJobFailure)],
)
async def test_http_handler_stops_reading_an_endless_body(
    workload: ThreadedServer, http: WorkloadHttp, status: int, outcome: type[Exception] | None
) -> None:
    """Read whole, this body would never end (and fill the memory): the handler stops
    at the cap, and the workload sees the connection go."""
    with endless.lock:
        endless.sent = 0
    call = handlers.http(http_job(f"{workload.url}/endless/{status}"), context(http))
    if outcome is None:
        result = await asyncio.wait_for(call, timeout=20)
        assert (result["status"], result["truncated"]) == (status, True)
        assert result["kept_bytes"] == MAX_RESPONSE_BYTES == len(result["body"])
    else:
        with pytest.raises(outcome, match=f"HTTP {status}"):
            await asyncio.wait_for(call, timeout=20)

    async def workload_stopped() -> bool:
        with endless.lock:
            return not endless.running

    await eventually(workload_stopped)
    with endless.lock:
        # what the socket buffers took before the client closed, not an endless stream
        assert endless.sent < 64 * 1024 * 1024


@pytest.mark.parametrize(
    "url", ["http://example.com/x", "file:///etc/passwd", "http://evil.svc.example.com/"]
)
async def test_http_handler_only_calls_inside_the_cluster(http: WorkloadHttp, url: str) -> None:
    with pytest.raises(PermanentJobFailure, match=r"not in the cluster|not an http"):
        await handlers.http(http_job(url), context(http))


async def test_http_handler_needs_a_url(http: WorkloadHttp) -> None:
    with pytest.raises(PermanentJobFailure, match=r"payload\.url is required"):
        await handlers.http(new_job("http"), context(http))


@pytest.mark.parametrize(
    ("payload", "delivered", "outcome"),
    [
        ({}, 1, None),
        ({"fail": "permanent"}, 1, FailureKind.PERMANENT),
        ({"fail": "retryable"}, 3, FailureKind.RETRYABLE),
        ({"fail": "retryable", "fail_times": 1}, 1, FailureKind.RETRYABLE),
        ({"fail": "retryable", "fail_times": 1}, 2, None),
    ],
)
async def test_noop(
    http: WorkloadHttp, payload: dict[str, Any], delivered: int, outcome: FailureKind | None
) -> None:
    job = new_job("noop", payload=payload)
    if outcome is None:
        assert await handlers.noop(job, context(http, delivered)) == {
            "noop": True,
            "delivered": delivered,
        }
    else:
        with pytest.raises((RetryableJobFailure, PermanentJobFailure)) as caught:
            await handlers.noop(job, context(http, delivered))
        assert caught.value.kind is outcome


def test_built_ins_are_always_loaded() -> None:
    loaded = load_handlers()
    assert loaded["noop"] is handlers.noop and loaded["http"] is handlers.http
