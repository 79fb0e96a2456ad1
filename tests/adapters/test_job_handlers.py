"""Built-in job handlers: `http` against a local workload over real HTTP; plugin loading."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from app.adapters.workload_http import WorkloadHttp
from app.domain.jobs import FailureKind, Job, PermanentJobFailure, RetryableJobFailure
from app.services import handlers
from app.services.handlers import HandlerContext, load_handlers
from app.services.streams import new_job
from tests.support.servers import ThreadedServer, serve

received: list[tuple[dict[str, Any], str | None]] = []


async def answer(request: Request) -> JSONResponse:
    received.append((await request.json(), request.headers.get("idempotency-key")))
    status = int(request.path_params["status"])
    if status == 0:
        await asyncio.sleep(5)
        status = 200
    return JSONResponse({"stored": True}, status_code=status)


@pytest.fixture(scope="module")
def workload() -> Iterator[ThreadedServer]:
    app = Starlette(routes=[Route("/answer/{status}", answer, methods=["POST"])])
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
