"""Status routes, probes and the operator token; secrets never shown."""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi import FastAPI

from app.main import create_app
from tests.conftest import SettingsFactory, running
from tests.support.polling import eventually


async def test_status_shows_a_pinged_workload_with_its_age(
    make_settings: SettingsFactory,
) -> None:
    now = [1000.0]
    app = create_app(make_settings(), clock=lambda: now[0])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://m") as client:
        await client.post(
            "/v1/workloads/api/health", json={"status": "healthy", "version": "1.2.0"}
        )
        assert (await client.get("/v1/status")).json()["workloads"][0]["ping_age_seconds"] == 0
        now[0] += 2.5
        status = (await client.get("/v1/status")).json()
    (api,) = status["workloads"]
    assert api["name"] == "api"
    assert api["status"] == "healthy"
    assert api["version"] == "1.2.0"
    assert api["ping_age_seconds"] == 2.5
    assert api["last_ping_at"].endswith("Z")


async def test_workload_goes_stale_without_pings(make_settings: SettingsFactory) -> None:
    now = [1000.0]
    app = create_app(make_settings(ping_stale_seconds=1.0), clock=lambda: now[0])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://m") as c:
        await c.post("/v1/workloads/api/health", json={"status": "healthy"})
        now[0] += 0.5
        fresh = (await c.get("/v1/workloads/api")).json()
        assert (fresh["status"], fresh["ping_age_seconds"]) == ("healthy", 0.5)
        now[0] += 0.6
        stale = (await c.get("/v1/workloads/api")).json()
        assert stale["status"] == "stale"
        assert stale["ping_age_seconds"] > 1.0


async def test_status_says_which_components_are_on_and_why_not(
    client: httpx.AsyncClient,
) -> None:
    components = (await client.get("/v1/status")).json()["components"]
    assert components["api"]["enabled"] is True
    assert components["report"]["enabled"] is True
    assert "NODE_SYSTEM_ENDPOINT" in components["report"]["reason"]
    assert components["postgres"]["enabled"] is False
    assert "DATABASE_URL" in components["postgres"]["reason"]
    assert components["sync"] == components["sync"] | {"enabled": False, "state": "off"}


async def test_workload_list_and_404(client: httpx.AsyncClient) -> None:
    await client.post("/v1/workloads/b/health", json={"status": "healthy"})
    await client.post("/v1/workloads/a/health", json={"status": "degraded"})
    names = [w["name"] for w in (await client.get("/v1/workloads")).json()["workloads"]]
    assert names == ["a", "b"]
    assert (await client.get("/v1/workloads/zzz")).status_code == 404
    assert (await client.get("/v1/workloads/Not_A_Name")).status_code == 404


@pytest.fixture
async def guarded(make_settings: SettingsFactory) -> FastAPI:
    return create_app(make_settings(api_token="operator-token-1"))


@pytest.mark.parametrize("path", ["/v1/status", "/v1/workloads", "/v1/workloads/api"])
@pytest.mark.parametrize(
    ("header", "expected"),
    [(None, 401), ("Bearer nope", 401), ("Bearer operator-token-1", None)],
)
async def test_api_token_guards_status_routes(
    guarded: FastAPI, path: str, header: str | None, expected: int | None
) -> None:
    transport = httpx.ASGITransport(app=guarded)
    async with httpx.AsyncClient(transport=transport, base_url="http://m") as c:
        await c.post("/v1/workloads/api/health", json={"status": "healthy"})
        headers = {"authorization": header} if header else {}
        response = await c.get(path, headers=headers)
        if expected is None:
            assert response.status_code == 200
        else:
            assert response.status_code == expected


@pytest.mark.parametrize("path", ["/healthz", "/metrics", "/readyz"])
async def test_probes_and_metrics_stay_open(guarded: FastAPI, path: str) -> None:
    transport = httpx.ASGITransport(app=guarded)
    async with httpx.AsyncClient(transport=transport, base_url="http://m") as c:
        assert (await c.get(path)).status_code in (200, 503)


async def test_readyz_only_after_start_and_while_the_scheduler_runs(app: FastAPI) -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://m") as c:
        before = await c.get("/readyz")
        assert before.status_code == 503
        assert "start-up has not finished" in before.json()["reasons"]
    async with running(app) as c:
        ready = await c.get("/readyz")
        assert ready.status_code == 200, ready.json()
        assert ready.json() == {"ready": True, "reasons": []}
        assert (await c.get("/healthz")).json() == {"status": "ok"}


SECRETS = {
    "node_private_key": "Zm9vYmFyYmF6cXV4cXV1eGZvb2JhcmJhenF1eHF1dXg=",
    "api_token": "api-token-value-123",
    "ping_token_secret": "ping-secret-value-456",
    "matrix_access_token": "syt_matrix_token_789",
    "database_url": "postgresql://reg:db-password-000@127.0.0.1:1/reg",
}


async def test_secrets_never_reach_status_or_logs(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    app = create_app(make_settings(**SECRETS, report_interval_seconds=0.2))
    async with running(app) as c:
        headers = {"authorization": f"Bearer {SECRETS['api_token']}"}

        async def reported_and_refused() -> bool:
            # a report went to the log and the database was tried (and refused): the
            # status and the log now carry what might leak
            status = (await c.get("/v1/status", headers=headers)).json()
            return (
                status["report"]["last_reported_at"] is not None
                and status["components"]["postgres"]["state"] == "failing"
            )

        await eventually(reported_and_refused)
        body = (await c.get("/v1/status", headers=headers)).text
        body += (await c.get("/", headers=headers)).text
    assert "db-password-000" not in body
    assert "reg:***@127.0.0.1:1/reg" in body
    logged = "\n".join(r.getMessage() + repr(r.__dict__) for r in caplog.records)
    assert "started as node" in logged
    for value in SECRETS.values():
        assert value not in body
        assert value not in logged
    assert "db-password-000" not in logged


async def test_sync_endpoint_says_why_sync_is_off(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/sync")
    assert response.status_code == 503
    assert "sync is off" in response.json()["detail"]
    assert "DESIRED_STATE_DIR" in response.json()["detail"]


@pytest.mark.parametrize(
    "capability", ["gpu\x00", "\x04\x00", "a b", "x" * 65, "", "3\u00c7_", "gp\u0443"]
)
async def test_a_fleet_query_with_a_bad_capability_is_a_422_naming_it(
    client: httpx.AsyncClient, capability: str
) -> None:
    response = await client.get("/v1/fleet/nodes", params={"capability": capability})
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["query", "capability"]


@pytest.mark.parametrize(
    ("path", "query", "name"),
    [
        ("/v1/fleet/nodes", "capability=gpu&capability=ssd", "capability"),
        ("/v1/fleet/nodes", "tier=A&tier=B", "tier"),
        ("/v1/fleet/nodes", "limit=1&limit=2", "limit"),
        ("/v1/sync", "dry_run=true&dry_run=false", "dry_run"),
    ],
)
async def test_a_single_valued_query_parameter_given_twice_is_a_422_naming_it(
    client: httpx.AsyncClient, path: str, query: str, name: str
) -> None:
    """Which of two values was meant cannot be known: neither is taken (schemathesis found
    the last one taken silently)."""
    method = client.post if path == "/v1/sync" else client.get
    response = await method(f"{path}?{query}")
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    assert error["loc"] == ["query", name] and "more than once" in error["msg"]


@pytest.mark.parametrize("limit", ["1\u00a0", "1_0", "+1", " 1", "1.0", "1e2", "٣"])
async def test_a_limit_that_is_not_written_as_a_plain_integer_is_a_422(
    client: httpx.AsyncClient, limit: str
) -> None:
    """The schema says integer; Python's and pydantic's lenient parsing (underscores, a
    sign, spaces, a zero fraction, other scripts' digits) is not what it promises."""
    response = await client.get("/v1/fleet/nodes", params={"limit": limit})
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["query", "limit"]
