"""The job worker under faults: a nats-server restart mid-run, tiers, SIGTERM, the CLI."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from app.adapters.embedded import EmbeddedNats, EmbeddedPostgres
from app.main import create_app
from tests.conftest import SettingsFactory, running, runtime_of
from tests.support.databases import fresh_database
from tests.support.jobs_world import ledger, publish, publisher, watching_events
from tests.support.polling import eventually
from tests.support.process import ManagerProcess

pytestmark = pytest.mark.e2e


@pytest.fixture
async def database(postgres_server: EmbeddedPostgres) -> AsyncIterator[str]:
    async with fresh_database(postgres_server.url) as url:
        yield url


async def completed_count(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        count: int = await conn.fetchval(
            "SELECT count(*) FROM job_ledger WHERE status = 'completed'"
        )
        return count
    finally:
        await conn.close()


async def _at_least(url: str, count: int) -> bool:
    return await completed_count(url) >= count


async def _has_key(url: str, key: str) -> bool:
    return key in await ledger(url)


async def test_a_thousand_jobs_survive_a_nats_server_restart(
    make_settings: SettingsFactory, database: str, tmp_path: Path
) -> None:
    nats = EmbeddedNats(tmp_path / "nats").start()
    settings = make_settings(
        database_url=database, nats_url=nats.url, node_id="node-restart", node_tier="A",
        worker_concurrency=16, job_ack_wait_seconds=5.0, heartbeat_interval_seconds=1.0,
        job_backoff_seconds=[0.5, 1.0], job_max_deliver=10,
    )  # fmt: skip
    app = create_app(settings)
    try:
        async with running(app):
            for _ in range(200):
                if runtime_of(app).components["worker"].state == "ok":
                    break
                await asyncio.sleep(0.05)
            async with publisher(nats.url) as bus:
                for i in range(1000):
                    await publish(bus, idempotency_key=f"bulk-{i:04d}", payload={"i": i})
            # kill the server while jobs are in flight, then bring it back on the same port
            await eventually(lambda: _at_least(database, 150), within=60, step=0.02)
            await asyncio.to_thread(nats.stop, graceful=False)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(nats.start)
            await eventually(lambda: _at_least(database, 1000), within=120, step=0.2)
    finally:
        nats.stop()
    rows = await ledger(database)
    assert len(rows) == 1000
    assert {r["status"] for r in rows.values()} == {"completed"}
    runs = {k: r["attempts"] for k, r in rows.items() if r["attempts"] != 1}
    assert runs == {}, f"jobs claimed more than once: {runs}"
    connection = runtime_of(app).bus
    assert connection is not None and connection.reconnects >= 1, "the restart was noticed"


def manager_env(database: str, nats_url: str, node: str, tier: str) -> dict[str, str]:
    return {
        "DATABASE_URL": database,
        "NATS_URL": nats_url,
        "NODE_ID": node,
        "NODE_TIER": tier,
        "HEARTBEAT_INTERVAL_SECONDS": "1",
        "REPORT_ENABLED": "false",
        "SHUTDOWN_GRACE_SECONDS": "15",
    }


async def test_two_managers_of_different_tiers_each_run_only_their_jobs(
    database: str, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = ManagerProcess(
        env=manager_env(database, nats_server.url, "node-a", "A"), workdir=tmp_path / "a"
    )
    b = ManagerProcess(
        env=manager_env(database, nats_server.url, "node-b", "B"), workdir=tmp_path / "b"
    )
    a.start()
    b.start()
    try:
        async with publisher(nats_server.url) as bus:
            # both consumers exist once both workers are up; wait for them via the ledger
            await asyncio.sleep(2.0)
            for i in range(10):
                await publish(bus, tier="A", kind="online", idempotency_key=f"tier-a-{i}")
                await publish(bus, tier="B", kind="offline", idempotency_key=f"tier-b-{i}")
            await eventually(lambda: _at_least(database, 20), within=30, step=0.1)
    finally:
        a.stop()
        b.stop()
    rows = await ledger(database)
    assert {k: r["node_id"] for k, r in rows.items()} == {
        **{f"tier-a-{i}": "node-a" for i in range(10)},
        **{f"tier-b-{i}": "node-b" for i in range(10)},
    }, a.log() + b.log()


async def test_sigterm_during_a_slow_job_loses_nothing(
    database: str, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    proc = ManagerProcess(
        env=manager_env(database, nats_server.url, "node-term", "C"), workdir=tmp_path
    ).start()
    async with watching_events(nats_server.url) as events, publisher(nats_server.url) as bus:
        await asyncio.sleep(1.5)
        job = await publish(bus, tier="C", idempotency_key="slow-1", payload={"delay_seconds": 2})
        await eventually(lambda: _has_key(database, "slow-1"), within=20)
        code = await asyncio.to_thread(proc.stop)
        assert code in (0, -signal.SIGTERM), proc.log()
        await events.wait_for(lambda: "node.offline" in events.kinds(), within=5)
    row = (await ledger(database))["slow-1"]
    assert (row["status"], row["attempts"]) == ("completed", 1), proc.log()
    assert "job.completed" in events.kinds("slow-1")
    kinds = events.kinds()
    assert kinds.index("node.draining") < kinds.index("job.completed") < kinds.index("node.offline")
    assert str(job.job_id) == events.of("job.completed")[0]["job_id"]


def cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app", *args],
        env={"PATH": os.environ.get("PATH", ""), "HOME": str(cwd), **env},
        cwd=cwd, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_init_streams_is_idempotent_and_publish_reaches_the_stream(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats").start()
    try:
        env = {"NATS_URL": server.url}
        first = cli(["init-streams"], env, tmp_path)
        assert first.returncode == 0, first.stderr
        assert "created    stream MM_WRITE" in first.stdout
        assert "created    consumer MM_WRITE/wm-A" in first.stdout
        again = cli(["init-streams"], env, tmp_path)
        assert again.returncode == 0
        assert {line.split()[0] for line in again.stdout.splitlines()} == {"unchanged"}
        changed = cli(["init-streams"], env | {"JOB_MAX_DELIVER": "7"}, tmp_path)
        assert "updated    consumer MM_ONLINE/wm-B" in changed.stdout
        sent = cli(["publish", "--kind", "write", "--tier", "B", "--type", "memory.write",
                    "--payload", '{"text": "hi"}', "--key", "k-1"], env, tmp_path)  # fmt: skip
        assert sent.returncode == 0, sent.stderr
        assert "(key k-1) as stream sequence 1" in sent.stdout
        bad = cli(
            ["publish", "--kind", "write", "--tier", "B", "--type", "Bad Type"], env, tmp_path
        )
        assert bad.returncode == 2 and "invalid job" in bad.stderr
    finally:
        server.stop()
