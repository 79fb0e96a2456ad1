"""A fresh database per test (or benchmark run) on a running PostgreSQL server."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import asyncpg

MIGRATIONS = Path(__file__).resolve().parents[1] / "migrations"


@asynccontextmanager
async def fresh_database(server_url: str) -> AsyncIterator[str]:
    """Create an empty database, yield its URL, drop it afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(server_url, timeout=10)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    base, _, _ = server_url.rpartition("/")
    try:
        yield f"{base}/{name}"
    finally:
        admin = await asyncpg.connect(server_url, timeout=10)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


@contextmanager
def fresh_database_sync(server_url: str) -> Iterator[str]:
    """`fresh_database` for synchronous (e.g. module-scoped) fixtures outside any loop."""

    async def run(sql: str) -> None:
        admin = await asyncpg.connect(server_url, timeout=10)
        try:
            await admin.execute(sql)
        finally:
            await admin.close()

    name = f"t_{uuid.uuid4().hex[:12]}"
    asyncio.run(run(f'CREATE DATABASE "{name}"'))
    try:
        yield f"{server_url.rpartition('/')[0]}/{name}"
    finally:
        asyncio.run(run(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
