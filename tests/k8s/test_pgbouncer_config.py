"""The central PgBouncer configuration (k8s/central/pgbouncer.ini) against the manager's
defaults: transaction mode, a wait for a server connection that gives up before the
heartbeat's deadline, and the same file under the tests' own PgBouncer."""

from __future__ import annotations

import pytest

from app.settings import Settings
from standins.pgbouncer import CENTRAL_CONFIG, PgBouncer, central_settings

CENTRAL = central_settings(CENTRAL_CONFIG)


def seconds(name: str) -> float:
    return float(CENTRAL[name])


def test_transaction_mode_without_a_session_reset() -> None:
    assert CENTRAL["pool_mode"] == "transaction"
    assert CENTRAL.get("server_reset_query_always", "0") == "0"


def test_a_saturated_pool_fails_a_heartbeat_before_its_deadline() -> None:
    """A client waits at most query_wait_timeout for a server connection, then gets an
    error: below DATABASE_TIMEOUT_SECONDS (each heartbeat statement's deadline), a
    heartbeat the pool cannot serve fails instead of waiting in the queue and being
    written after the manager gave it up. The reserve comes before that."""
    deadline = Settings(_env_file=None).database_timeout_seconds
    assert 0 < seconds("query_wait_timeout") < deadline
    assert seconds("reserve_pool_timeout") < seconds("query_wait_timeout")


def test_the_pools_fit_the_fleet_and_the_server() -> None:
    """Clients: the default DATABASE_POOL_SIZE for each of 1,500 nodes; servers: the pool
    and its reserve within the per-database cap."""
    pool_size = Settings(_env_file=None).database_pool_size
    assert int(CENTRAL["max_client_conn"]) >= 1_500 * pool_size
    pool = int(CENTRAL["default_pool_size"]) + int(CENTRAL["reserve_pool_size"])
    assert pool <= int(CENTRAL["max_db_connections"])


def test_nothing_that_needs_a_newer_pgbouncer() -> None:
    """1.18 (Debian's) has no max_prepared_statements (1.21+): the statement cache is off
    on the manager's side instead (DATABASE_POOLER)."""
    assert "max_prepared_statements" not in CENTRAL


def test_the_tests_pgbouncer_runs_the_central_pool_mode_and_timeouts(pgbouncer: PgBouncer) -> None:
    running = {row["key"]: row["value"] for row in pgbouncer.admin("SHOW CONFIG")}
    assert running["pool_mode"] == CENTRAL["pool_mode"] == "transaction"
    for name in ("query_wait_timeout", "default_pool_size", "reserve_pool_size", "max_client_conn"):
        assert float(running[name]) == pytest.approx(float(CENTRAL[name])), name
