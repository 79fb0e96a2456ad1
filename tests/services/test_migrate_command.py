"""`workload-manager migrate` as the init container runs it, a process against a real
PostgreSQL: where it connects (DATABASE_MIGRATE_URL past a pooler), a schema ahead of it
by expand migrations (exit 0, said), and a contract held back by a live older node (exit
1, naming it, the migrations before it applied)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import asyncpg

from app.adapters.embedded import EmbeddedPostgres
from app.adapters.registry import AsyncpgRegistry
from standins.databases import MIGRATIONS, fresh_database
from standins.pgbouncer import PgBouncer
from tests.support.requirement_cases import NODES

ROOT = Path(__file__).resolve().parents[2]


def migrate(cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The command in a process of its own, with only these settings (no `.env`: it runs
    in `cwd`, a temporary directory)."""
    keep = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    return subprocess.run(
        [sys.executable, "-m", "app", "migrate"],
        cwd=cwd,
        env={**keep, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


async def applied(url: str) -> list[int]:
    conn = await asyncpg.connect(url, timeout=5)
    try:
        if await conn.fetchval("SELECT to_regclass('schema_migrations')") is None:
            return []
        return [
            r["version"]
            for r in await conn.fetch("SELECT version FROM schema_migrations ORDER BY 1")
        ]
    finally:
        await conn.close()


async def test_database_migrate_url_is_where_migrate_connects(
    postgres_server: EmbeddedPostgres, database: str, tmp_path: Path
) -> None:
    async with fresh_database(postgres_server.url) as through_the_pooler:
        done = migrate(tmp_path, DATABASE_URL=through_the_pooler, DATABASE_MIGRATE_URL=database)
        assert done.returncode == 0, done.stderr
        assert "applied 0001_worker_capabilities.sql" in done.stdout
        assert await applied(database) == [1, 2, 3, 4, 5, 6]
        assert await applied(through_the_pooler) == []
        # unset, it is DATABASE_URL
        done = migrate(tmp_path, DATABASE_URL=through_the_pooler)
        assert done.returncode == 0, done.stderr
        assert await applied(through_the_pooler) == [1, 2, 3, 4, 5, 6]


async def test_through_a_transaction_pooler_migrate_needs_a_direct_url(
    pgbouncer: PgBouncer, database: str, tmp_path: Path
) -> None:
    """With DATABASE_POOLER=pgbouncer-transaction, `migrate` refuses to go through the
    pooler (exit 2, naming DATABASE_MIGRATE_URL, nothing applied), and with
    DATABASE_MIGRATE_URL it goes straight to PostgreSQL."""
    pooled = {
        "APP_ENV": "production", "NATS_URL": "nats://127.0.0.1:9", "NODE_TIER": "A",
        "DATABASE_POOLER": "pgbouncer-transaction", "DATABASE_URL": pgbouncer.url(database),
    }  # fmt: skip
    refused = migrate(tmp_path, **pooled)
    assert refused.returncode == 2, refused.stderr
    assert "set DATABASE_MIGRATE_URL straight to PostgreSQL" in refused.stderr
    assert await applied(database) == []
    done = migrate(tmp_path, **pooled, DATABASE_MIGRATE_URL=database)
    assert done.returncode == 0, done.stderr
    assert await applied(database) == [1, 2, 3, 4, 5, 6]


async def test_an_older_release_over_a_schema_ahead_by_expand_migrations_exits_0(
    database: str, tmp_path: Path
) -> None:
    newer = tmp_path / "newer"
    shutil.copytree(MIGRATIONS, newer)
    (newer / "0007_later_table.sql").write_text("-- kind: expand\nCREATE TABLE later (id int);\n")
    assert migrate(tmp_path, DATABASE_URL=database, MIGRATIONS_DIR=str(newer)).returncode == 0
    older = migrate(tmp_path, DATABASE_URL=database, MIGRATIONS_DIR=str(MIGRATIONS))
    assert older.returncode == 0, older.stderr
    assert "schema ahead by 1 expand migration (0007_later_table)" in older.stderr
    assert "schema up to date (0 applied now)" in older.stdout


async def test_a_contract_held_back_by_a_live_older_node_exits_1_naming_it(
    database: str, tmp_path: Path
) -> None:
    assert migrate(tmp_path, DATABASE_URL=database).returncode == 0
    node = AsyncpgRegistry(database, timeout=5, manager_version="1.3.0")
    await node.open()
    try:
        await node.upsert(NODES[0], status="online", interval_seconds=30)
    finally:
        await node.close()
    newer = tmp_path / "newer"
    shutil.copytree(MIGRATIONS, newer)
    (newer / "0007_later_table.sql").write_text("-- kind: expand\nCREATE TABLE later (id int);\n")
    (newer / "0008_drop_fingerprint.sql").write_text(
        "-- kind: contract\n-- requires-nodes-at-least: 1.4.0\n"
        "ALTER TABLE job_ledger DROP COLUMN fingerprint;\n"
    )
    held = migrate(tmp_path, DATABASE_URL=database, MIGRATIONS_DIR=str(newer))
    assert held.returncode == 1
    assert held.stdout == "applied 0007_later_table.sql\n"
    assert held.stderr.startswith(
        "workload-manager: migrations held back: 0008_drop_fingerprint.sql is a contract "
        f"migration for nodes at 1.4.0 or later, and 1 live node below it still uses what it "
        f"drops: {NODES[0].node_id} (1.3.0, online)."
    )
    assert await applied(database) == [1, 2, 3, 4, 5, 6, 7]
