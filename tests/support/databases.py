"""A fresh database per test on the session's PostgreSQL server."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import asyncpg

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"


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
