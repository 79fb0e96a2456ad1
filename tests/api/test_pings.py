"""`POST /v1/workloads/{name}/health`: every validation path, and what a good ping changes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime

import httpx
import pytest
from fastapi import FastAPI

from app.domain.reports import UpdateView
from app.domain.tokens import ping_token
from app.main import create_app
from app.settings import Settings
from tests.conftest import SettingsFactory, runtime_of
from tests.support.served import served_client

GOOD = {"status": "healthy", "version": "1.2.0"}


@pytest.fixture(params=[True, False], ids=["fast-path", "framework"])
def settings(request: pytest.FixtureRequest, make_settings: SettingsFactory) -> Settings:
    """Every test here runs against both the server's ping fast path (over real HTTP) and
    the FastAPI route (in-process)."""
    return make_settings(ping_fast_path=request.param)


@pytest.fixture(params=[True, False], ids=["fast-path", "framework"])
def fast(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@asynccontextmanager
async def open_client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """Over real HTTP through the bounded protocol when the app has the fast path on."""
    if app.state.ping_answers is not None:
        async with served_client(app) as client:
            yield client
        return
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://manager") as client:
        yield client


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with open_client(app) as c:
        yield c


async def test_good_ping_is_recorded(client: httpx.AsyncClient, app: FastAPI) -> None:
    response = await client.post("/v1/workloads/api/health", json=GOOD)
    assert response.status_code == 204
    assert response.content == b""
    view = runtime_of(app).book.view("api")
    assert view is not None
    assert (view.status, view.version) == ("healthy", "1.2.0")
    assert view.ping_age_seconds is not None and view.ping_age_seconds < 5


async def test_full_body_with_message_and_details(client: httpx.AsyncClient, app: FastAPI) -> None:
    body = {"status": "degraded", "message": "queue is long", "details": {"queue": 812}}
    response = await client.post("/v1/workloads/worker-1/health", json=body)
    assert response.status_code == 204
    view = runtime_of(app).book.view("worker-1")
    assert view is not None and (view.status, view.message) == ("degraded", "queue is long")


@pytest.mark.parametrize(
    ("name", "body", "loc"),
    [
        ("Bad_Name", GOOD, ["path", "name"]),
        ("api", {"status": "fine"}, ["body", "status"]),
        ("api", {}, ["body", "status"]),
        ("api", {"status": "healthy", "version": 5}, ["body", "version"]),
        ("api", {"status": "healthy", "colour": "red"}, ["body", "colour"]),
        ("api", {"status": "healthy", "details": "x"}, ["body", "details"]),
        ("api", [1, 2], ["body"]),
    ],
)
async def test_invalid_ping_is_422_naming_the_field(
    client: httpx.AsyncClient, name: str, body: object, loc: list[str]
) -> None:
    response = await client.post(f"/v1/workloads/{name}/health", json=body)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == loc


@pytest.mark.parametrize(
    "raw", [b"not json", b"", b'{"status": "healthy"', b"\xff\xfe", b"Infinity", b'{"status": NaN}']
)
async def test_malformed_json_is_422(client: httpx.AsyncClient, raw: bytes) -> None:
    response = await client.post(
        "/v1/workloads/api/health", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"][0] == "body"


async def test_body_over_16_kib_is_413(client: httpx.AsyncClient, app: FastAPI) -> None:
    body = {"status": "healthy", "details": {"blob": "x" * (16 * 1024)}}
    response = await client.post("/v1/workloads/api/health", json=body)
    assert response.status_code == 413
    assert "16384" in response.json()["detail"]
    assert runtime_of(app).book.view("api") is None
    rejections = runtime_of(app).metrics.ping_rejections
    assert rejections.labels("too-large")._value.get() == 1


async def test_chunked_body_over_the_limit_is_413(client: httpx.AsyncClient, app: FastAPI) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"status": "healthy", "details": {"blob": "'
        for _ in range(20):
            yield b"x" * 1024
        yield b'"}}'

    response = await client.post("/v1/workloads/api/health", content=chunks())
    assert response.status_code == 413
    assert runtime_of(app).metrics.ping_rejections.labels("too-large")._value.get() == 1


async def test_body_just_under_the_limit_is_accepted(client: httpx.AsyncClient) -> None:
    filler = "x" * (16 * 1024 - 200)
    body = json.dumps({"status": "healthy", "details": {"blob": filler}}).encode()
    assert len(body) < 16 * 1024
    response = await client.post(
        "/v1/workloads/api/health", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 204


@pytest.fixture
async def token_client(
    make_settings: SettingsFactory, fast: bool
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(make_settings(ping_token_secret="node-ping-secret", ping_fast_path=fast))
    async with open_client(app) as c:
        yield c


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, 401),
        ("Bearer wrong", 401),
        ("Basic " + ping_token("node-ping-secret", "api"), 401),
        ("Bearer " + ping_token("node-ping-secret", "other"), 401),
        ("Bearer " + ping_token("other-secret", "api"), 401),
        ("Bearer " + ping_token("node-ping-secret", "api"), 204),
    ],
)
async def test_ping_token_when_a_secret_is_set(
    token_client: httpx.AsyncClient, header: str | None, expected: int
) -> None:
    headers = {"authorization": header} if header else {}
    response = await token_client.post("/v1/workloads/api/health", json=GOOD, headers=headers)
    assert response.status_code == expected
    if expected == 401:
        assert response.headers["www-authenticate"] == "Bearer"


async def test_token_is_checked_before_the_body_is_parsed(
    token_client: httpx.AsyncClient,
) -> None:
    response = await token_client.post(
        "/v1/workloads/api/health", content=b"garbage", headers={"content-type": "text/plain"}
    )
    assert response.status_code == 401


async def test_the_book_is_bounded(make_settings: SettingsFactory, fast: bool) -> None:
    app = create_app(make_settings(max_tracked_workloads=2, ping_fast_path=fast))
    async with open_client(app) as c:
        for name in ("a", "b"):
            assert (await c.post(f"/v1/workloads/{name}/health", json=GOOD)).status_code == 204
        refused = await c.post("/v1/workloads/c/health", json=GOOD)
        assert refused.status_code == 429
        # known workloads keep pinging when the book is full
        assert (await c.post("/v1/workloads/a/health", json=GOOD)).status_code == 204


async def test_request_id_is_echoed_or_made(client: httpx.AsyncClient) -> None:
    given = await client.post(
        "/v1/workloads/api/health", json=GOOD, headers={"x-request-id": "abc-123"}
    )
    assert given.headers["x-request-id"] == "abc-123"
    made = await client.post("/v1/workloads/api/health", json=GOOD)
    assert len(made.headers["x-request-id"]) == 16
    assert (
        made.headers["x-request-id"]
        != (await client.post("/v1/workloads/api/health", json=GOOD)).headers["x-request-id"]
    )
    hostile = await client.post(
        "/v1/workloads/api/health", json=GOOD, headers={"x-request-id": "a b\tc"}
    )
    assert hostile.headers["x-request-id"] != "a b\tc"


async def test_pings_are_counted_in_metrics(client: httpx.AsyncClient) -> None:
    await client.post("/v1/workloads/api/health", json=GOOD)
    await client.post("/v1/workloads/api/health", json={"status": "unhealthy"})
    await client.post("/v1/workloads/api/health", json={"status": "nope"})
    text = (await client.get("/metrics")).text
    assert 'workload_manager_pings_total{status="healthy",workload="api"} 1.0' in text
    assert 'workload_manager_pings_total{status="unhealthy",workload="api"} 1.0' in text
    assert 'workload_manager_ping_rejections_total{reason="invalid"} 1.0' in text
    assert 'workload_manager_workloads{status="unhealthy"} 1.0' in text
    assert "workload_manager_build_info{" in text


async def test_a_forgotten_workload_takes_its_metric_series_with_it(
    make_settings: SettingsFactory, fast: bool
) -> None:
    now = [1000.0]
    app = create_app(
        make_settings(ping_fast_path=fast, ping_forget_seconds=60.0), clock=lambda: now[0]
    )
    rt = runtime_of(app)
    async with open_client(app) as client:
        for name in ("gone", "stays"):
            response = await client.post(f"/v1/workloads/{name}/health", json={"status": "healthy"})
            assert response.status_code == 204
        now[0] += 30
        await client.post("/v1/workloads/stays/health", json={"status": "healthy"})
        now[0] += 45  # "gone" has been silent for 75 s, "stays" for 45 s
        assert rt.book.forget_silent() == ["gone"]
        metrics = (await client.get("/metrics")).text
        assert 'workload="gone"' not in metrics
        assert 'workload_manager_pings_total{status="healthy",workload="stays"} 2.0' in metrics
        # a workload that comes back is counted from zero in a fresh series
        await client.post("/v1/workloads/gone/health", json={"status": "healthy"})
        metrics = (await client.get("/metrics")).text
    assert 'workload_manager_pings_total{status="healthy",workload="gone"} 1.0' in metrics


async def test_a_ping_may_ask_to_defer_an_update_within_bounds(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    asking = {**GOOD, "defer_update_seconds": 120, "defer_reason": "draining a batch"}
    assert (await client.post("/v1/workloads/api/health", json=asking)).status_code == 204
    last = runtime_of(app).book.last_ping("api")
    assert last is not None
    assert (last.ping.defer_update_seconds, last.ping.defer_reason) == (120, "draining a batch")
    for bad in ({"defer_update_seconds": -1}, {"defer_update_seconds": 86_401},
                {"defer_reason": "x" * 257}, {"defer_update_seconds": "soon"}):  # fmt: skip
        response = await client.post("/v1/workloads/api/health", json={**GOOD, **bad})
        assert response.status_code == 422, bad
        assert response.json()["detail"][0]["loc"] == ["body", next(iter(bad))]


async def test_the_answer_names_a_pending_update_and_only_then(
    client: httpx.AsyncClient, app: FastAPI
) -> None:
    book = runtime_of(app).book
    response = await client.post("/v1/workloads/api/health", json=GOOD)
    assert "x-workload-update" not in response.headers
    since = datetime(2026, 1, 1, tzinfo=UTC)
    book.set_updates({
        "api": UpdateView("1.3.0", "deferred", since, "the workload asks to wait", 12.5),
        "web": UpdateView("2.0.0", "judging", since, "judging", 80.0, in_flight=True),
    })  # fmt: skip
    response = await client.post("/v1/workloads/api/health", json=GOOD)
    assert response.status_code == 204
    assert response.headers["x-workload-update"] == "version=1.3.0; state=deferred"
    response = await client.post("/v1/workloads/web/health", json=GOOD)
    assert (response.status_code, response.headers.get("x-workload-update")) == (204, None)
