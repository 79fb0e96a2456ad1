"""In production a node without API_TOKEN (a worker-only node) keeps its protected routes
closed, and one without PING_TOKEN_SECRET refuses pings; development leaves both open."""

from __future__ import annotations

import pytest

from app.main import create_app
from tests.conftest import SettingsFactory, running


@pytest.mark.parametrize("path", ["/v1/status", "/v1/workloads", "/"])
async def test_production_without_a_token_closes_the_protected_routes(
    make_settings: SettingsFactory, path: str
) -> None:
    app = create_app(make_settings(app_env="production"))
    async with running(app) as client:
        answer = await client.get(path, headers={"Authorization": "Bearer guess"})
        assert answer.status_code == 401
        assert "no API_TOKEN is set" in answer.json()["detail"]
        assert (await client.get("/healthz")).status_code == 200


async def test_development_without_a_token_leaves_them_open(make_settings: SettingsFactory) -> None:
    app = create_app(make_settings())
    async with running(app) as client:
        assert (await client.get("/v1/status")).status_code == 200


@pytest.mark.parametrize("fast_path", [True, False])
async def test_production_without_a_ping_secret_refuses_pings(
    make_settings: SettingsFactory, fast_path: bool
) -> None:
    app = create_app(make_settings(app_env="production", ping_fast_path=fast_path))
    async with running(app) as client:
        answer = await client.post("/v1/workloads/api/health", json={"status": "healthy"})
        assert answer.status_code == 401
        assert "no PING_TOKEN_SECRET is set" in answer.json()["detail"]
