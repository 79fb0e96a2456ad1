"""How a test reaches PostgreSQL: straight, or through a real PgBouncer in transaction
mode (`standins/pgbouncer.py`), as a fleet's managers reach the central database. The
registry and ledger suites run once each way (the `route` fixture, tests/conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest
from asyncpg.pool import PoolConnectionProxy

from app.adapters.registry import AsyncpgRegistry
from standins.pgbouncer import PgBouncer


@dataclass(frozen=True)
class DatabaseRoute:
    """Straight to the server (`pooler` None), or through the pooler."""

    pooler: PgBouncer | None = None

    @property
    def name(self) -> str:
        return "direct" if self.pooler is None else "pgbouncer"

    @property
    def transaction_pooler(self) -> bool:
        """DATABASE_POOLER=pgbouncer-transaction on this route."""
        return self.pooler is not None

    def url(self, database_url: str) -> str:
        """A URL of the server's (a test's fresh database) as this route reaches it."""
        return database_url if self.pooler is None else self.pooler.url(database_url)

    def registry(self, database_url: str, **options: Any) -> AsyncpgRegistry:
        """A registry on `database_url` by this route, configured as the manager is for it."""
        options.setdefault("timeout", 5)
        return AsyncpgRegistry(
            self.url(database_url), transaction_pooler=self.transaction_pooler, **options
        )


async def _pid(conn: asyncpg.Connection | PoolConnectionProxy) -> int:
    pid: int = await conn.fetchval("SELECT pg_backend_pid()")
    return pid


async def backends_of_one_client(registry: AsyncpgRegistry, url: str) -> list[int]:
    """The server backends two transactions of one of `registry`'s client connections run
    on, while two other clients on `url` hold transactions in between. Straight to
    PostgreSQL a connection is one backend. Through a transaction pooler, the first
    transaction's server connection is free when it commits, and goes to the next client
    that asks (a pooler reuses an idle server connection before it opens another); the
    second transaction gets another one."""
    holder = await asyncpg.connect(url, statement_cache_size=0)
    taker = await asyncpg.connect(url, statement_cache_size=0)
    try:
        async with registry.pool.acquire() as client:
            first = client.transaction()
            await first.start()
            before = await _pid(client)
            held = holder.transaction()
            await held.start()
            await _pid(holder)
            await first.commit()  # the client's server connection is free now
            async with taker.transaction():
                await _pid(taker)  # a pooler gives it the one just freed
                await held.commit()
                after = await _pid(client)  # not the taker's: the holder's, or a new one
        return [before, after]
    finally:
        await holder.close()
        await taker.close()


async def assert_route_taken(route: DatabaseRoute, registry: AsyncpgRegistry, url: str) -> None:
    """`registry`, opened on `url`, reaches PostgreSQL the way `route` says: straight, one
    backend per connection; or through the route's PgBouncer, whose console lists the
    test database's pool with its clients and, among its server connections, the
    backends the client's transactions ran on. Fails when a pooled route's traffic
    bypasses the pooler."""
    before, after = await backends_of_one_client(registry, url)
    if route.pooler is None:
        assert before == after, "straight to PostgreSQL, a connection keeps its backend"
        return
    assert before != after, (
        "one client connection's transactions ran on one backend: no transaction pooler on the way"
    )
    database = urlsplit(url).path.lstrip("/")
    pools = [p for p in route.pooler.admin("SHOW POOLS") if p["database"] == database]
    assert len(pools) == 1, f"PgBouncer has no pool for {database}: it was bypassed"
    assert pools[0]["pool_mode"] == "transaction"
    servers = {
        int(s["remote_pid"])
        for s in route.pooler.admin("SHOW SERVERS")
        if s["database"] == database
    }
    assert {before, after} <= servers, (before, after, servers)
    clients = [c for c in route.pooler.admin("SHOW CLIENTS") if c["database"] == database]
    assert clients, f"PgBouncer lists no client of {database}"


async def assert_statement_cache_breaks(url: str) -> None:
    """Through a transaction pooler on `url`, a connection with asyncpg's statement cache
    on (what DATABASE_POOLER=pgbouncer-transaction turns off) fails the second use of a
    statement once another client holds the server connection it was prepared on."""
    cached = await asyncpg.connect(url)  # asyncpg's default cache
    holder = await asyncpg.connect(url, statement_cache_size=0)
    try:
        assert await cached.fetchval("SELECT $1::int + 1", 1) == 2
        async with holder.transaction():
            await _pid(holder)  # the server the statement was prepared on, freed last
            with pytest.raises(asyncpg.InvalidSQLStatementNameError):
                await cached.fetchval("SELECT $1::int + 1", 2)
    finally:
        await holder.close()
        await cached.close()
