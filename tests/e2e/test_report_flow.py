"""The whole process: pings in over HTTP, signed reports out to a backend that verifies them."""

from __future__ import annotations

import base64
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from standins.backend import LocalBackend
from tests.support.process import manager

pytestmark = pytest.mark.e2e

NODE = "node-e2e"


def seed_of(key: Ed25519PrivateKey) -> str:
    raw = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    return base64.b64encode(raw).decode()


def env_for(backend_url: str, key: Ed25519PrivateKey) -> dict[str, str]:
    return {
        "NODE_ID": NODE,
        "NODE_SYSTEM_ENDPOINT": backend_url,
        "NODE_PRIVATE_KEY": seed_of(key),
        "REPORT_INTERVAL_SECONDS": "1",
        "SCHEDULER_JITTER_FRACTION": "0",
        "BACKEND_TIMEOUT_SECONDS": "2",
        "BACKEND_RETRY_ATTEMPTS": "1",
    }


def report_component(url: str) -> dict[str, Any]:
    """The manager's `report` component, from its /v1/status."""
    component: dict[str, Any] = httpx.get(f"{url}/v1/status", timeout=5).json()["components"][
        "report"
    ]
    return component


def test_pings_reach_the_backend_in_signed_reports(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    backend = LocalBackend(NODE, key.public_key())
    with backend.serve() as server, manager(env=env_for(server.url, key), workdir=tmp_path) as m:
        pinged_at = time.monotonic()
        for name, status in (("api", "healthy"), ("db", "degraded")):
            response = httpx.post(
                f"{m.url}/v1/workloads/{name}/health",
                json={"status": status, "version": "1.2.0", "message": f"{name} here"},
            )
            assert response.status_code == 204
        backend.wait_for(lambda: any(len(r["workloads"]) == 2 for r in backend.reports), timeout=15)
        waited = time.monotonic() - pinged_at
    assert backend.rejected == [], [r.rejected_reason for r in backend.rejected]
    report = next(r for r in backend.reports if len(r["workloads"]) == 2)
    assert report["node_id"] == NODE
    assert report["manager_version"]
    assert report["system"]["cpu_count"] >= 1
    assert report["system"]["memory_total_bytes"] > 0
    by_name = {w["name"]: w for w in report["workloads"]}
    assert by_name["api"]["status"] == "healthy"
    assert by_name["db"] == by_name["db"] | {"status": "degraded", "message": "db here"}
    # no older than the time the test waited for it (plus the report's rounding to 1 ms)
    assert 0 <= by_name["api"]["ping_age_seconds"] <= waited + 0.001
    # every request the manager made was signed and verified by the backend
    assert all(r.verified for r in backend.requests)


def test_backend_outage_changes_nothing_and_reports_resume(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    backend = LocalBackend(NODE, key.public_key())
    with backend.serve() as server, manager(env=env_for(server.url, key), workdir=tmp_path) as m:
        backend.wait_for_reports(1, timeout=15)
        backend.fail("health", "500", times=None)
        # the manager saw the failure: its report component says so
        backend.wait_for(lambda: report_component(m.url)["state"] == "failing", timeout=15)
        # the service keeps serving while the backend is down
        assert httpx.get(f"{m.url}/healthz").status_code == 200
        ping = httpx.post(f"{m.url}/v1/workloads/api/health", json={"status": "healthy"})
        assert ping.status_code == 204
        report = report_component(m.url)
        assert report["state"] == "failing"
        assert "HTTP 500" in report["last_error"]
        assert report["consecutive_failures"] >= 1
        assert any(r.injected_failure == "500" for r in backend.requests)
        delivered = len(backend.reports)
        backend.clear_failures()
        backend.wait_for(lambda: len(backend.reports) > delivered, timeout=15)
        backend.wait_for(lambda: report_component(m.url)["state"] == "ok", timeout=15)
        report = report_component(m.url)
        assert report["state"] == "ok"
        assert report["consecutive_failures"] == 0
        assert any(w["name"] == "api" for w in backend.reports[-1]["workloads"])
        assert "node report failed (1 in a row): not delivered" in m.log()


def test_sigterm_flushes_a_last_report_and_exits_cleanly(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    backend = LocalBackend(NODE, key.public_key())
    env = env_for("", key) | {"REPORT_INTERVAL_SECONDS": "3600"}
    with backend.serve() as server:
        env["NODE_SYSTEM_ENDPOINT"] = server.url
        with manager(env=env, workdir=tmp_path) as m:
            httpx.post(f"{m.url}/v1/workloads/api/health", json={"status": "healthy"})
            backend.wait_for_reports(1, timeout=15)  # the first one, shortly after start
            before = len(backend.reports)
            # uvicorn re-raises SIGTERM after a graceful shutdown, so "killed by SIGTERM"
            # is the clean exit here; the log proves the shutdown ran to the end.
            assert m.stop() in (0, -signal.SIGTERM)
            assert "Application shutdown complete" in m.log()
        assert len(backend.reports) == before + 1
        assert backend.reports[-1]["workloads"][0]["name"] == "api"


def test_production_without_required_settings_exits_with_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "app", "serve"],
        env={"PATH": "", "APP_ENV": "production", "HOME": str(tmp_path)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "workload-manager: configuration error: nothing to run when APP_ENV=production: "
        "set NODE_SYSTEM_ENDPOINT (or DESIRED_STATE_DIR) to sync and report, or NATS_URL "
        "for a worker-only node"
    ]
