"""Registration and heartbeats through the manager's lifespan, PostgreSQL faults included."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import asyncpg
import httpx
from prometheus_client.parser import text_string_to_metric_families

from app import __version__
from app.adapters.embedded import EmbeddedPostgres, free_port
from app.adapters.registry import AsyncpgRegistry
from app.domain.requirements import Tier
from app.main import create_app
from app.services import migrating
from app.services.heartbeating import Heartbeat
from app.services.profile import LocalProfile
from standins.databases import MIGRATIONS
from standins.pgbouncer import PgBouncer
from tests.conftest import SettingsFactory, running
from tests.support.polling import eventually

NODE = "node-hb"


async def fetch_row(url: str) -> asyncpg.Record | None:
    try:
        conn = await asyncpg.connect(url, timeout=2)
    except (OSError, asyncpg.PostgresError):
        return None
    try:
        return await conn.fetchrow("SELECT * FROM worker_capabilities WHERE node_id = $1", NODE)
    except asyncpg.UndefinedTableError:
        return None
    finally:
        await conn.close()


def registry_settings(
    make_settings: SettingsFactory, url: str, **extra: object
) -> dict[str, object]:
    return {
        "database_url": url,
        "node_id": NODE,
        "node_tier": "B",
        "node_region": "eu",
        "node_capabilities": ["embeddings"],
        "heartbeat_interval_seconds": 0.5,
        **extra,
    }


async def test_registers_migrates_heartbeats_then_drains_and_goes_offline(
    make_settings: SettingsFactory, database: str
) -> None:
    app = create_app(make_settings(**registry_settings(make_settings, database)))
    async with running(app) as client:
        await eventually(lambda: _has_row(database))
        first = await fetch_row(database)
        assert first is not None
        assert (first["tier"], first["region"], first["status"]) == ("B", "eu", "online")
        assert first["capabilities"] == '["embeddings"]'
        assert '"cpu_count"' in first["hardware"]
        # a heartbeat moves the timestamp and leaves hardware alone when nothing changed
        conn = await asyncpg.connect(database)
        await conn.execute(
            "UPDATE worker_capabilities SET hardware = '{\"marker\": 1}' WHERE node_id = $1", NODE
        )
        await conn.close()
        await eventually(lambda: _moved(database, first["last_heartbeat"]))
        later = await fetch_row(database)
        assert later is not None and later["hardware"] == '{"marker": 1}'
        status = (await client.get("/v1/status")).json()["components"]["registry"]
        assert status["state"] == "ok"
        assert "0001_worker_capabilities.sql" in status["detail"]["migrations_applied_at_start"]
        fleet = (await client.get("/v1/fleet/nodes?tier=B")).json()
        assert [n["node_id"] for n in fleet["nodes"]] == [NODE]
        assert fleet["nodes"][0]["liveness"] == "online"
        metrics = (await client.get("/metrics")).text
        assert 'workload_manager_scheduled_runs_total{loop="heartbeat",outcome="ok"}' in metrics
    final = await fetch_row(database)
    assert final is not None and final["status"] == "offline"


async def test_through_pgbouncer_the_manager_migrates_past_it_and_heartbeats_through_it(
    make_settings: SettingsFactory, database: str, pgbouncer: PgBouncer
) -> None:
    """DATABASE_POOLER=pgbouncer-transaction: the migrations at start go to
    DATABASE_MIGRATE_URL, the registry's statements (the start-up probe, registration,
    heartbeats, the fleet listing, the shutdown's marks) through PgBouncer."""
    database_name = database.rpartition("/")[2]
    settings = registry_settings(
        make_settings, pgbouncer.url(database),
        database_pooler="pgbouncer-transaction", database_migrate_url=database,
    )  # fmt: skip
    app = create_app(make_settings(**settings))
    async with running(app) as client:
        await eventually(lambda: _has_row(database))
        first = await fetch_row(database)
        assert first is not None
        await eventually(lambda: _moved(database, first["last_heartbeat"]))
        status = (await client.get("/v1/status")).json()["components"]
        assert status["registry"]["state"] == "ok"
        assert (
            "0001_worker_capabilities.sql"
            in (status["registry"]["detail"]["migrations_applied_at_start"])
        )
        assert "server_version" in status["postgres"]["detail"]
        fleet = (await client.get("/v1/fleet/nodes?tier=B")).json()
        assert [n["node_id"] for n in fleet["nodes"]] == [NODE]
        pools = [p for p in pgbouncer.admin("SHOW POOLS") if p["database"] == database_name]
        assert [p["pool_mode"] for p in pools] == ["transaction"]
    final = await fetch_row(database)
    assert final is not None and final["status"] == "offline"


async def _has_row(url: str) -> bool:
    return await fetch_row(url) is not None


async def _moved(url: str, since: object) -> bool:
    current = await fetch_row(url)
    return current is not None and current["last_heartbeat"] > since


async def test_shutdown_marks_draining_before_offline(
    make_settings: SettingsFactory, database: str
) -> None:
    app = create_app(make_settings(**registry_settings(make_settings, database)))
    async with running(app):
        await eventually(lambda: _has_row(database))
        # record every status the row takes from now on, from inside the database
        conn = await asyncpg.connect(database)
        await conn.execute(
            """CREATE TABLE status_log (id serial PRIMARY KEY, status text);
               CREATE FUNCTION log_status() RETURNS trigger LANGUAGE plpgsql AS $$
               BEGIN INSERT INTO status_log (status) VALUES (NEW.status); RETURN NEW; END $$;
               CREATE TRIGGER status_log AFTER UPDATE ON worker_capabilities
               FOR EACH ROW EXECUTE FUNCTION log_status();"""
        )
        await conn.close()
    conn = await asyncpg.connect(database)
    statuses = [r["status"] for r in await conn.fetch("SELECT status FROM status_log ORDER BY id")]
    await conn.close()
    assert statuses[-2:] == ["draining", "offline"]
    assert set(statuses[:-2]) <= {"online"}


async def test_postgres_down_at_start_then_back(
    make_settings: SettingsFactory, tmp_path: Path
) -> None:
    server = EmbeddedPostgres(tmp_path / "pg", port=free_port())
    app = create_app(make_settings(**registry_settings(make_settings, server.url)))
    try:
        async with running(app) as client:
            # the manager is up and serving while the database is down, and says it is
            # not ready: the registry and its PostgreSQL are what the settings require
            assert (await client.get("/healthz")).status_code == 200
            await eventually(lambda: _registry_failing(client), within=15)
            components = (await client.get("/v1/status")).json()["components"]
            assert components["registry"]["consecutive_failures"] >= 1
            assert components["postgres"]["state"] == "failing"
            readiness = await client.get("/readyz")
            assert readiness.status_code == 503
            assert {r.split(" ")[0] for r in readiness.json()["reasons"]} == {
                "postgres",
                "registry",
            }
            await asyncio.to_thread(server.start)
            await eventually(lambda: _has_row(server.url), within=15)
            await eventually(lambda: _registry_ok(client), within=10)
            components = (await client.get("/v1/status")).json()["components"]
            assert components["postgres"]["state"] == "ok"
            assert (await client.get("/readyz")).status_code == 200
    finally:
        server.stop()


async def _registry_ok(client: httpx.AsyncClient) -> bool:
    component = (await client.get("/v1/status")).json()["components"]["registry"]
    return bool(component["state"] == "ok")


async def test_postgres_restarted_mid_run_heartbeats_resume(
    make_settings: SettingsFactory, tmp_path: Path
) -> None:
    server = EmbeddedPostgres(tmp_path / "pg").start()
    app = create_app(make_settings(**registry_settings(make_settings, server.url)))
    try:
        async with running(app) as client:
            await eventually(lambda: _has_row(server.url))
            await asyncio.to_thread(server.stop)
            await eventually(lambda: _registry_failing(client), within=10)
            await asyncio.to_thread(server.start)
            failed_before = await _failed_heartbeats(client)
            restarted = await fetch_row(server.url)
            assert restarted is not None
            await eventually(lambda: _moved(server.url, restarted["last_heartbeat"]), within=15)
            # resumed at once, counted in beats rather than seconds: once the server is
            # back, at most the beat already under way can still end as a failure
            assert await _failed_heartbeats(client) - failed_before <= 1
            await eventually(lambda: _registry_ok(client), within=10)
    finally:
        server.stop()


async def _registry_failing(client: httpx.AsyncClient) -> bool:
    component = (await client.get("/v1/status")).json()["components"]["registry"]
    return bool(component["state"] == "failing")


async def _failed_heartbeats(client: httpx.AsyncClient) -> float:
    """The heartbeat loop's runs that did not write (failed, the database unavailable, or
    crashed), from the manager's /metrics."""
    text = (await client.get("/metrics")).text
    return sum(
        float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "workload_manager_scheduled_runs_total"
        and sample.labels.get("loop") == "heartbeat"
        and sample.labels.get("outcome") in ("failed", "unavailable", "error")
    )


async def test_a_beat_in_flight_when_draining_is_marked_does_not_write_online_over_it(
    database: str,
) -> None:
    """SIGTERM while a heartbeat is between reading the node's profile and writing it:
    the beat must not put `online` back over the `draining` the shutdown wrote."""
    registry = AsyncpgRegistry(database, timeout=5.0)
    await registry.open()
    try:
        await migrating.migrate(registry, migrating.migrations_dir(None))
        release = asyncio.Event()
        calls = 0

        async def fingerprint() -> dict[str, object]:
            nonlocal calls
            calls += 1
            if calls == 1:  # the scheduled beat: held until the shutdown has marked
                await release.wait()
            return {"cpu_count": 2}

        profile = LocalProfile(
            node_id=NODE, tier=Tier.B, region="eu", trust_zone=None, capabilities=[],
            fingerprint=fingerprint,
        )  # fmt: skip
        heartbeat = Heartbeat(
            registry=registry, profile=profile, interval_seconds=30,
        )  # fmt: skip

        async def beat_waits() -> bool:
            return calls == 1

        async def marked() -> bool:
            return mark.done()

        beat = asyncio.create_task(heartbeat.beat())
        await eventually(beat_waits)
        mark = asyncio.create_task(heartbeat.mark("draining", within=5.0))
        await eventually(marked)
        assert mark.result() is None
        release.set()
        await asyncio.wait_for(asyncio.gather(beat, mark), timeout=10)
        row = await fetch_row(database)
        assert row is not None and row["status"] == "draining"
        # and later beats keep saying draining
        assert (await heartbeat.beat()).succeeded
        row = await fetch_row(database)
        assert row is not None and row["status"] == "draining"
    finally:
        await registry.close()


async def test_readiness_fails_while_the_schema_is_behind_this_release(
    make_settings: SettingsFactory, database: str, tmp_path: Path
) -> None:
    """The database has the project's migrations; this release ships one more expand
    migration (MIGRATIONS_DIR) and does not migrate at start (production): not ready,
    naming it, until `migrate` applies it. The node's row records its release."""
    shipped = tmp_path / "migrations"
    shutil.copytree(MIGRATIONS, shipped)
    (shipped / "0007_later_table.sql").write_text(
        "-- kind: expand\nCREATE TABLE later_table (id int);\n"
    )
    migrator = AsyncpgRegistry(database, timeout=5)
    await migrator.open()
    try:
        await migrating.migrate(migrator, MIGRATIONS)
        settings = registry_settings(
            make_settings, database, migrate_on_start=False, migrations_dir=shipped
        )
        app = create_app(make_settings(**settings))
        async with running(app) as client:
            await eventually(lambda: _registry_failing(client), within=10)
            readiness = await client.get("/readyz")
            assert readiness.status_code == 503
            assert readiness.json()["reasons"] == [
                "registry is failing: schema behind: 0007_later_table.sql not applied (this "
                "release's code may use what they add; run `workload-manager migrate`)"
            ]
            registry = (await client.get("/v1/status")).json()["components"]["registry"]
            assert registry["detail"]["schema_behind"] == ["0007_later_table.sql"]
            row = await fetch_row(database)  # registered all the same: the fleet sees it
            assert row is not None
            assert json.loads(row["hardware"])["manager_version"] == __version__

            await migrating.migrate(migrator, shipped)
            await eventually(lambda: _registry_ok(client), within=10)
            assert (await client.get("/readyz")).status_code == 200
    finally:
        await migrator.close()
