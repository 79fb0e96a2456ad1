"""The data services restarted under load: PostgreSQL and nats-server.

Each server here is the test's own (not the session's), so it can be stopped and started
on the same port while the manager keeps running.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path

import asyncpg
import httpx
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from app.adapters.embedded import EmbeddedNats, EmbeddedPostgres
from app.main import create_app
from tests.conftest import SettingsFactory, bus_of, running, runtime_of
from tests.support.jobs_world import at_least_completed, ledger, manager_env, publish, publisher
from tests.support.polling import eventually
from tests.support.process import ManagerProcess

JOBS = 400


async def _last_heartbeat(url: str, node: str) -> datetime | None:
    try:
        conn = await asyncpg.connect(url, timeout=2)
    except (OSError, asyncpg.PostgresError):
        return None
    try:
        value: datetime | None = await conn.fetchval(
            "SELECT last_heartbeat FROM worker_capabilities WHERE node_id = $1", node
        )
        return value
    finally:
        await conn.close()


async def _component(url: str, name: str) -> str:
    async with httpx.AsyncClient(timeout=5) as client:
        status = (await client.get(f"{url}/v1/status")).json()
    return str(status["components"][name]["state"])


async def test_a_postgres_restart_under_load_loses_no_job_and_heartbeats_resume(
    tmp_path: Path,
) -> None:
    postgres = EmbeddedPostgres(tmp_path / "pg").start()
    nats = EmbeddedNats(tmp_path / "nats").start()
    env = manager_env(postgres.url, nats.url, "node-pg-restart", "A") | {
        "HEARTBEAT_INTERVAL_SECONDS": "0.5",
        "JOB_BACKOFF_SECONDS": "0.5,1",
        "JOB_MAX_ATTEMPTS": "20",
        "JOB_ACK_WAIT_SECONDS": "5",
    }
    (tmp_path / "m").mkdir()
    manager = ManagerProcess(env=env, workdir=tmp_path / "m")
    try:
        manager.start()
        # the worker has made the streams: a job published before would have nowhere to go
        await eventually(lambda: _ok(manager.url, "worker"), within=60, step=0.1)
        async with publisher(nats.url) as bus:

            async def feed() -> None:
                for i in range(JOBS):
                    await publish(bus, idempotency_key=f"pg-{i:04d}", payload={"i": i})
                    await asyncio.sleep(0.01)  # a steady trickle, not one burst

            feeding = asyncio.create_task(feed())
            try:
                await eventually(lambda: at_least_completed(postgres.url, 50), within=30)
                await asyncio.to_thread(postgres.stop)  # jobs keep arriving while it is down
                await eventually(lambda: _failing(manager.url, "registry"), within=15)
                # the outage has bitten: jobs were delivered and handed back unclaimed
                await eventually(lambda: _ledger_errors(manager.url), within=15, step=0.1)
                await asyncio.to_thread(postgres.start)
                restarted_at = await _last_heartbeat(postgres.url, "node-pg-restart")
                assert restarted_at is not None
                await feeding
            finally:
                feeding.cancel()
        await eventually(lambda: at_least_completed(postgres.url, JOBS), within=90, step=0.2)
        # heartbeats resumed by themselves, and the registry component says so
        await eventually(lambda: _moved(postgres.url, restarted_at), within=10, step=0.1)
        await eventually(lambda: _ok(manager.url, "registry"), within=10, step=0.1)
        assert manager.running, manager.log()
    finally:
        manager.stop()
        rows = await ledger(postgres.url) if postgres.running else {}
        postgres.stop()
        nats.stop()
    assert len(rows) == JOBS, "every job is in the ledger"
    assert {r["status"] for r in rows.values()} == {"completed"}
    assert "Traceback" not in manager.log(), manager.log()


async def _failing(url: str, name: str) -> bool:
    return await _component(url, name) == "failing"


async def _ok(url: str, name: str) -> bool:
    return await _component(url, name) == "ok"


async def _ledger_errors(url: str) -> bool:
    """True once the manager handed back a job because the ledger was unreachable."""
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(f"{url}/metrics")).text
    return any(
        sample.name == "workload_manager_jobs_total"
        and sample.labels.get("outcome") == "ledger-error"
        and sample.value > 0
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    )


async def _moved(url: str, since: datetime) -> bool:
    current = await _last_heartbeat(url, "node-pg-restart")
    return current is not None and current > since


async def test_a_thousand_jobs_survive_a_nats_server_restart(
    make_settings: SettingsFactory, database: str, tmp_path: Path
) -> None:
    nats = EmbeddedNats(tmp_path / "nats").start()
    settings = make_settings(
        database_url=database, nats_url=nats.url, node_id="node-restart", node_tier="A",
        worker_concurrency=16, job_ack_wait_seconds=5.0, heartbeat_interval_seconds=1.0,
        job_backoff_seconds=[0.5, 1.0], job_max_attempts=10,
    )  # fmt: skip
    app = create_app(settings)
    try:
        async with running(app):
            await eventually(lambda: _worker_ok(app))
            async with publisher(nats.url) as bus:
                for i in range(1000):
                    await publish(bus, idempotency_key=f"bulk-{i:04d}", payload={"i": i})
            # kill the server while jobs are in flight, then bring it back on the same port
            await eventually(lambda: at_least_completed(database, 150), within=60, step=0.02)
            await asyncio.to_thread(nats.stop, graceful=False)
            # the manager noticed the loss before the server comes back on the same port
            await eventually(lambda: _bus_lost(app), within=30)
            await asyncio.to_thread(nats.start)
            await eventually(lambda: _bus_reconnected(app), within=60, step=0.1)
            await eventually(lambda: at_least_completed(database, 1000), within=120, step=0.2)
    finally:
        nats.stop()
    rows = await ledger(database)
    assert len(rows) == 1000
    assert {r["status"] for r in rows.values()} == {"completed"}
    runs = {k: r["attempts"] for k, r in rows.items() if r["attempts"] != 1}
    assert runs == {}, f"jobs claimed more than once: {runs}"
    connection = bus_of(app)
    assert connection is not None and connection.reconnects >= 1, "the restart was noticed"


async def _worker_ok(app: FastAPI) -> bool:
    return runtime_of(app).components["worker"].state == "ok"


async def _bus_lost(app: FastAPI) -> bool:
    bus = bus_of(app)
    return bus is not None and not bus.connected


async def _bus_reconnected(app: FastAPI) -> bool:
    bus = bus_of(app)
    return bus is not None and bus.connected and bus.reconnects >= 1
