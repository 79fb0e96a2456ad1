"""The capability registry against a real PostgreSQL: schema, migrations, lifecycle, queries.

Every test that takes `route` (the `registry` fixture does) runs twice: straight to
PostgreSQL, and through a real PgBouncer in transaction mode (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path

import asyncpg
import pytest

from app.adapters.embedded import EmbeddedPostgres
from app.adapters.registry import AsyncpgRegistry, NodeHeldElsewhere, RegistryUnavailable
from app.domain.migrations import ContractHeldBack, MigrationError
from app.domain.requirements import Mismatch, NodeProfile, Requirements
from app.services import migrating
from standins.databases import MIGRATIONS
from standins.pgbouncer import PgBouncer
from tests.support.database_routes import (
    DatabaseRoute,
    assert_route_taken,
    assert_statement_cache_breaks,
)
from tests.support.requirement_cases import CASES, NODES

SEED_COLUMNS = [
    # (name, data_type, character_maximum_length, is_nullable, has_default)
    ("node_id", "character varying", 255, "NO", False),
    ("tier", "character varying", 10, "NO", False),
    ("region", "character varying", 50, "YES", False),
    ("trust_zone", "character varying", 50, "YES", False),
    ("hardware", "jsonb", None, "NO", False),
    ("capabilities", "jsonb", None, "NO", False),
    ("status", "character varying", 20, "NO", False),
    ("last_heartbeat", "timestamp with time zone", None, "NO", False),
    ("created_at", "timestamp with time zone", None, "YES", True),
    ("updated_at", "timestamp with time zone", None, "YES", True),
]
SEED_INDEXES = {
    name: f"CREATE {unique}INDEX {name} ON public.worker_capabilities USING btree ({column})"
    for name, unique, column in [
        ("worker_capabilities_pkey", "UNIQUE ", "node_id"),
        ("idx_worker_capabilities_tier", "", "tier"),
        ("idx_worker_capabilities_status", "", "status"),
        ("idx_worker_capabilities_heartbeat", "", "last_heartbeat"),
    ]
}


@pytest.fixture
async def registry(database: str, route: DatabaseRoute) -> AsyncIterator[AsyncpgRegistry]:
    reg = route.registry(database)
    await reg.open()
    await migrating.migrate(reg, MIGRATIONS)
    yield reg
    await reg.close()


async def test_schema_keeps_the_seed_ddl(registry: AsyncpgRegistry) -> None:
    async with registry.pool.acquire() as conn:
        columns = await conn.fetch(
            """SELECT column_name, data_type, character_maximum_length, is_nullable,
                      column_default IS NOT NULL AS has_default
               FROM information_schema.columns
               WHERE table_name = 'worker_capabilities' ORDER BY ordinal_position"""
        )
        index_rows = await conn.fetch(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'worker_capabilities'"
        )
        indexes: dict[str, str] = {r["indexname"]: r["indexdef"] for r in index_rows}
        defaults = await conn.fetch(
            """SELECT column_default FROM information_schema.columns
               WHERE table_name = 'worker_capabilities'
                 AND column_name IN ('created_at', 'updated_at')"""
        )
    seed = [tuple(c) for c in columns][: len(SEED_COLUMNS)]
    assert seed == SEED_COLUMNS
    assert all(d["column_default"] == "CURRENT_TIMESTAMP" for d in defaults)
    for name, definition in SEED_INDEXES.items():
        assert indexes[name] == definition
    # later migrations only add: two columns, one GIN index (and, when this file runs as
    # the previous release's against the newest schema, tests/compat, whatever a newer
    # release's expand migrations add after them)
    assert [c["column_name"] for c in columns][len(SEED_COLUMNS) : len(SEED_COLUMNS) + 2] == [
        "heartbeat_interval_seconds",
        "instance_id",
    ]
    assert "idx_worker_capabilities_capabilities" in set(indexes) - set(SEED_INDEXES)


async def test_migrations_are_recorded_and_run_once(registry: AsyncpgRegistry) -> None:
    assert await migrating.migrate(registry, MIGRATIONS) == []
    async with registry.pool.acquire() as conn:
        rows = await conn.fetch("SELECT version, name FROM schema_migrations ORDER BY version")
    # a newer release's expand migrations may follow (tests/compat)
    assert [(r["version"], r["name"]) for r in rows][:6] == [
        (1, "worker_capabilities"),
        (2, "liveness_and_matching"),
        (3, "job_ledger"),
        (4, "job_ledger_claimant"),
        (5, "job_ledger_fingerprint"),
        (6, "worker_instance"),
    ]


async def test_a_changed_applied_migration_is_refused(
    registry: AsyncpgRegistry, tmp_path: Path
) -> None:
    copy = tmp_path / "migrations"
    shutil.copytree(MIGRATIONS, copy)
    first = copy / "0001_worker_capabilities.sql"
    first.write_text(first.read_text() + "\n-- edited\n")
    with pytest.raises(MigrationError, match=r"0001_worker_capabilities\.sql changed"):
        await migrating.migrate(registry, copy)


async def test_concurrent_migrators_apply_each_file_once(
    database: str, route: DatabaseRoute
) -> None:
    registries = [route.registry(database) for _ in range(4)]
    for reg in registries:
        await reg.open()
    try:
        results = await asyncio.gather(*(migrating.migrate(r, MIGRATIONS) for r in registries))
    finally:
        for reg in registries:
            await reg.close()
    assert sorted(len(r) for r in results) == [0, 0, 0, len(list(MIGRATIONS.glob("*.sql")))]


async def test_failed_migration_leaves_nothing_half_applied(
    database: str, route: DatabaseRoute, tmp_path: Path
) -> None:
    copy = tmp_path / "migrations"
    shutil.copytree(MIGRATIONS, copy)
    (copy / "0099_broken.sql").write_text("CREATE TABLE ok_part (x int);\nSELECT no_such_column;")
    reg = route.registry(database)
    await reg.open()
    try:
        with pytest.raises(asyncpg.PostgresError):
            await migrating.migrate(reg, copy)
        async with reg.pool.acquire() as conn:
            tables = await conn.fetchval(
                "SELECT count(*) FROM information_schema.tables WHERE table_name IN "
                "('ok_part', 'worker_capabilities', 'schema_migrations')"
            )
        assert tables == 0
    finally:
        await reg.close()


PROFILE = NODES[0]


async def db_now(reg: AsyncpgRegistry) -> datetime:
    now: datetime = await reg.pool.fetchval("SELECT now()")
    return now


async def row(reg: AsyncpgRegistry, node_id: str) -> asyncpg.Record:
    record = await reg.pool.fetchrow(
        "SELECT *, worker_liveness(status, last_heartbeat, heartbeat_interval_seconds) AS live "
        "FROM worker_capabilities WHERE node_id = $1",
        node_id,
    )
    assert record is not None
    return record


async def test_register_heartbeat_drain_offline(registry: AsyncpgRegistry) -> None:
    await registry.upsert(PROFILE, status="online", interval_seconds=30)
    first = await row(registry, PROFILE.node_id)
    assert (first["status"], first["live"], first["tier"]) == ("online", "online", "A")
    assert first["hardware"] == PROFILE.hardware
    assert first["capabilities"] == PROFILE.capabilities
    # an hour-old heartbeat, rather than a sleep to let the database clock move on
    await registry.pool.execute(
        "UPDATE worker_capabilities SET last_heartbeat = last_heartbeat - interval '1 hour' "
        "WHERE node_id = $1",
        PROFILE.node_id,
    )
    old = await row(registry, PROFILE.node_id)
    assert await registry.heartbeat(PROFILE.node_id, status="online") is True
    second = await row(registry, PROFILE.node_id)
    assert second["last_heartbeat"] > old["last_heartbeat"]
    assert second["last_heartbeat"] >= first["last_heartbeat"]
    assert second["created_at"] == first["created_at"]
    assert await registry.heartbeat(PROFILE.node_id, status="draining") is True
    assert (await row(registry, PROFILE.node_id))["live"] == "draining"
    assert await registry.heartbeat(PROFILE.node_id, status="offline") is True
    assert (await row(registry, PROFILE.node_id))["live"] == "offline"
    assert await registry.heartbeat("never-registered", status="online") is False


@pytest.mark.parametrize(
    ("age_seconds", "status", "liveness"),
    [
        (0, "online", "online"),
        (59, "online", "online"),       # < 2 missed heartbeats at 30 s
        (61, "online", "suspect"),
        (89, "online", "suspect"),
        (91, "online", "offline"),
        (10, "draining", "draining"),
        (70, "draining", "suspect"),
        (0, "offline", "offline"),
    ],
)  # fmt: skip
async def test_liveness_by_the_database_clock(
    registry: AsyncpgRegistry, age_seconds: int, status: str, liveness: str
) -> None:
    await registry.upsert(PROFILE, status=status, interval_seconds=30)
    current = await row(registry, PROFILE.node_id)
    at = current["last_heartbeat"] + timedelta(seconds=age_seconds)
    computed = await registry.pool.fetchval(
        "SELECT worker_liveness($1, $2, $3, $4)", status, current["last_heartbeat"], 30, at
    )
    assert computed == liveness


@pytest.fixture
async def fleet(registry: AsyncpgRegistry) -> AsyncpgRegistry:
    for node in NODES:
        await registry.upsert(node, status="online", interval_seconds=30)
    return registry


@pytest.mark.parametrize(("title", "requirements", "expected"), CASES, ids=[c[0] for c in CASES])
async def test_eligible_nodes_match_the_python_matcher(
    fleet: AsyncpgRegistry,
    title: str,
    requirements: Requirements,
    expected: dict[str, list[Mismatch]],
) -> None:
    eligible = [n.node_id for n in await fleet.eligible(requirements)]
    assert eligible == sorted(n.node_id for n in NODES if n.node_id not in expected)


async def test_only_live_nodes_are_eligible(fleet: AsyncpgRegistry) -> None:
    later = await db_now(fleet) + timedelta(seconds=75)
    await fleet.heartbeat("b-us", status="draining")
    assert [n.node_id for n in await fleet.eligible(Requirements())] == [
        "a-eu-cpu",
        "a-eu-gpu",
        "c-none",
    ]
    assert await fleet.eligible(Requirements(), at=later) == []


async def test_node_listing_filters(fleet: AsyncpgRegistry) -> None:
    assert [n["node_id"] for n in await fleet.nodes(tier="A")] == ["a-eu-cpu", "a-eu-gpu"]
    assert [n["node_id"] for n in await fleet.nodes(capability="embeddings")] == [
        "a-eu-cpu",
        "a-eu-gpu",
    ]
    await fleet.heartbeat("c-none", status="draining")
    assert [n["node_id"] for n in await fleet.nodes(liveness="draining")] == ["c-none"]
    assert len(await fleet.nodes(limit=2)) == 2
    one = (await fleet.nodes(tier="B"))[0]
    # the age is by the database clock: at most what that clock says it is afterwards
    age_after = (await db_now(fleet) - one["last_heartbeat"]).total_seconds()
    assert one["liveness"] == "online"
    assert 0 <= one["heartbeat_age_seconds"] <= age_after + 1e-6


async def test_profile_round_trips(fleet: AsyncpgRegistry) -> None:
    (node,) = await fleet.eligible(Requirements(region="us"))
    assert node == NodeProfile.model_validate(NODES[2].model_dump())


async def test_a_live_instance_keeps_its_row_and_a_leaving_one_hands_it_over(
    database: str, route: DatabaseRoute
) -> None:
    """Two manager processes for one node: the second is refused while the first is live,
    can write neither `draining` nor `offline` over it, and takes the row once the first
    is leaving."""
    first = route.registry(database)
    second = route.registry(database)
    await first.open()
    await second.open()
    try:
        await migrating.migrate(first, MIGRATIONS)
        await first.upsert(PROFILE, status="online", interval_seconds=30)
        with pytest.raises(NodeHeldElsewhere, match=first.instance):
            await second.upsert(PROFILE, status="online", interval_seconds=30)
        assert await second.heartbeat(PROFILE.node_id, status="offline") is False
        with pytest.raises(NodeHeldElsewhere):
            await second.upsert(PROFILE, status="offline", interval_seconds=30)
        (row,) = await first.nodes()
        assert row["status"] == "online"
        assert await first.heartbeat(PROFILE.node_id, status="draining") is True
        await second.upsert(PROFILE, status="online", interval_seconds=30)
        assert await first.heartbeat(PROFILE.node_id, status="offline") is False
        (row,) = await first.nodes()
        assert row["status"] == "online"
    finally:
        await first.close()
        await second.close()


async def test_a_schema_ahead_by_expand_migrations_lets_this_release_migrate(
    registry: AsyncpgRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    """As a newer release leaves it: its expand migrations applied, recorded as such."""
    await migrating.migrate(registry, MIGRATIONS)
    async with registry.pool.acquire() as conn:
        rows = await conn.fetch("SELECT kind FROM schema_migrations ORDER BY version")
        assert {r["kind"] for r in rows} == {"expand"}
        await conn.execute("ALTER TABLE job_ledger ADD COLUMN later_field TEXT")
        await conn.execute(
            "INSERT INTO schema_migrations (version, name, checksum, kind) "
            "VALUES (9998, 'later_field', 'x', 'expand')"
        )
    with caplog.at_level("WARNING"):
        assert await migrating.migrate(registry, MIGRATIONS) == []
    assert "schema ahead by 1 expand migration (9998_later_field)" in caplog.text
    async with registry.pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO schema_migrations (version, name, checksum, kind) "
            "VALUES (9999, 'drop_claimant', 'x', 'contract')"
        )
    with pytest.raises(
        MigrationError, match="ahead of this release by 9999_drop_claimant, a contract"
    ):
        await migrating.migrate(registry, MIGRATIONS)


async def test_registration_records_the_managers_release(
    database: str, route: DatabaseRoute
) -> None:
    reg = route.registry(database, manager_version="1.4.0")
    await reg.open()
    try:
        await migrating.migrate(reg, MIGRATIONS)
        await reg.upsert(PROFILE, status="online", interval_seconds=30)
        hardware = (await row(reg, PROFILE.node_id))["hardware"]
        assert hardware == {**PROFILE.hardware, "manager_version": "1.4.0"}
    finally:
        await reg.close()


DROP_FINGERPRINT = (
    "-- kind: contract\n"
    "-- requires-nodes-at-least: 1.4.0\n"
    "-- 1.4.0 and later no longer read the ledger's fingerprint\n"
    "ALTER TABLE job_ledger DROP COLUMN fingerprint;\n"
)


async def columns_of(reg: AsyncpgRegistry, table: str) -> set[str]:
    rows = await reg.pool.fetch(
        "SELECT column_name FROM information_schema.columns WHERE table_name = $1", table
    )
    return {r["column_name"] for r in rows}


async def test_a_contract_waits_for_the_live_nodes_below_its_release(
    database: str, route: DatabaseRoute, tmp_path: Path
) -> None:
    """A live node of 1.3.0 holds back a contract for 1.4.0 and later: it is refused naming
    that node, the expand migration before it is applied, nothing from it on; once the node
    runs 1.4.0 it is applied."""
    base = route.registry(database)
    old = route.registry(database, manager_version="1.3.0")
    new = route.registry(database, manager_version="1.4.0", instance=old.instance)
    for reg in (base, old, new):
        await reg.open()
    try:
        await migrating.migrate(base, MIGRATIONS)
        await old.upsert(PROFILE, status="online", interval_seconds=30)
        await new.upsert(NODES[1], status="online", interval_seconds=30)
        later = tmp_path / "migrations"
        shutil.copytree(MIGRATIONS, later)
        (later / "0097_later_table.sql").write_text(
            "-- kind: expand\nCREATE TABLE later_table (id int);\n"
        )
        (later / "0098_drop_fingerprint.sql").write_text(DROP_FINGERPRINT)
        (later / "0099_after.sql").write_text("-- kind: expand\nCREATE TABLE after (id int);\n")

        with pytest.raises(ContractHeldBack) as refused:
            await migrating.migrate(base, later)
        assert str(refused.value).startswith(
            "0098_drop_fingerprint.sql is a contract migration for nodes at 1.4.0 or later, "
            f"and 1 live node below it still uses what it drops: {PROFILE.node_id} (1.3.0, "
            "online). Nothing from 0098_drop_fingerprint.sql on was applied (1 before it were)"
        )
        assert [m.filename for m in refused.value.applied] == ["0097_later_table.sql"]
        assert await base.applied_versions() == [1, 2, 3, 4, 5, 6, 97]
        assert "fingerprint" in await columns_of(base, "job_ledger")

        # the node upgraded: its new manager registers it with 1.4.0
        await new.upsert(PROFILE, status="online", interval_seconds=30)
        assert [m.filename for m in await migrating.migrate(base, later)] == [
            "0098_drop_fingerprint.sql",
            "0099_after.sql",
        ]
        assert "fingerprint" not in await columns_of(base, "job_ledger")
    finally:
        for reg in (base, old, new):
            await reg.close()


@pytest.mark.parametrize(
    ("status", "heartbeat_age", "holds_back"),
    [
        ("online", 0, True),
        ("draining", 0, True),  # shutting down, still running its code
        ("online", 75, True),  # suspect: two missed heartbeats, may come back
        ("online", 95, False),  # three missed: offline
        ("offline", 0, False),
    ],
)
async def test_which_older_nodes_hold_a_contract_back(
    database: str,
    route: DatabaseRoute,
    tmp_path: Path,
    status: str,
    heartbeat_age: int,
    holds_back: bool,
) -> None:
    reg = route.registry(database)
    unrecorded = route.registry(database)  # a release that recorded none
    await reg.open()
    await unrecorded.open()
    try:
        await migrating.migrate(reg, MIGRATIONS)
        await unrecorded.upsert(PROFILE, status=status, interval_seconds=30)
        await reg.pool.execute(
            "UPDATE worker_capabilities SET last_heartbeat = now() - $1::interval",
            timedelta(seconds=heartbeat_age),
        )
        later = tmp_path / "migrations"
        shutil.copytree(MIGRATIONS, later)
        (later / "0098_drop_fingerprint.sql").write_text(DROP_FINGERPRINT)
        if holds_back:
            with pytest.raises(ContractHeldBack, match=rf"{PROFILE.node_id} \(release not rec"):
                await migrating.migrate(reg, later)
            assert 98 not in await reg.applied_versions()
        else:
            assert [m.version for m in await migrating.migrate(reg, later)] == [98]
    finally:
        await reg.close()
        await unrecorded.close()


async def test_a_fresh_database_takes_a_contract_at_once(
    database: str, route: DatabaseRoute, tmp_path: Path
) -> None:
    later = tmp_path / "migrations"
    shutil.copytree(MIGRATIONS, later)
    (later / "0098_drop_fingerprint.sql").write_text(DROP_FINGERPRINT)
    reg = route.registry(database)
    await reg.open()
    try:
        assert (await migrating.migrate(reg, later))[-1].version == 98
        assert await reg.applied_versions() == [1, 2, 3, 4, 5, 6, 98]
    finally:
        await reg.close()


async def test_a_contract_without_its_release_is_not_applied(
    registry: AsyncpgRegistry, tmp_path: Path
) -> None:
    later = tmp_path / "migrations"
    shutil.copytree(MIGRATIONS, later)
    (later / "0098_drop.sql").write_text("-- kind: contract\nDROP TABLE job_ledger;\n")
    with pytest.raises(MigrationError, match=r"0098_drop\.sql is a contract migration without"):
        await migrating.migrate(registry, later)
    assert 98 not in await registry.applied_versions()
    assert await registry.applied_versions() != []


async def test_the_route_is_taken(
    registry: AsyncpgRegistry, route: DatabaseRoute, database: str
) -> None:
    """Guard: the run through PgBouncer really goes through it (its console sees this
    test's pool, clients and backends; one connection's transactions land on different
    backends), and the direct run does not."""
    await assert_route_taken(route, registry, route.url(database))
    if route.pooler is not None:
        await assert_statement_cache_breaks(route.url(database))
    # and the registry works on it, heartbeat included
    await registry.upsert(PROFILE, status="online", interval_seconds=30)
    assert await registry.heartbeat(PROFILE.node_id, status="online") is True


async def test_a_saturated_pgbouncer_fails_a_heartbeat_instead_of_queueing_it(
    postgres_server: EmbeddedPostgres, pgbouncer: PgBouncer, database: str, tmp_path: Path
) -> None:
    """Through the central configuration with one server connection, held by another
    client's transaction: the heartbeat fails within query_wait_timeout, before its own
    deadline (DATABASE_TIMEOUT_SECONDS), and is not written once the connection is free."""
    bouncer = PgBouncer.before(
        postgres_server, tmp_path / "pgbouncer",
        default_pool_size=1, reserve_pool_size=0, max_db_connections=1,
    ).start()  # fmt: skip
    route = DatabaseRoute(bouncer)
    wait = float(bouncer.settings["query_wait_timeout"])
    assert wait == float(pgbouncer.settings["query_wait_timeout"])  # the central file's
    deadline = 5.0
    assert wait < deadline
    reg = route.registry(database, timeout=deadline)
    holder = await asyncpg.connect(route.url(database), statement_cache_size=0)
    try:
        await reg.open()
        await migrating.migrate(reg, MIGRATIONS)
        await reg.upsert(PROFILE, status="online", interval_seconds=30)
        await reg.pool.execute(
            "UPDATE worker_capabilities SET last_heartbeat = now() - interval '1 hour'"
        )
        before = (await row(reg, PROFILE.node_id))["last_heartbeat"]
        async with holder.transaction():
            await holder.fetchval("SELECT 1")  # the pool's one server connection, held
            started = time.monotonic()
            with pytest.raises(RegistryUnavailable) as caught:
                await reg.heartbeat(PROFILE.node_id, status="online")
            waited = time.monotonic() - started
        assert "query_wait_timeout" in str(caught.value)
        assert wait - 0.5 <= waited < deadline, waited
        assert (await row(reg, PROFILE.node_id))["last_heartbeat"] == before
        # the pool serves again: the next beat goes through
        assert await reg.heartbeat(PROFILE.node_id, status="online") is True
    finally:
        await holder.close()
        await reg.close()
        bouncer.stop()
