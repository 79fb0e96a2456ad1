"""PostgreSQL access through asyncpg (the capability registry lives here).

For now: a connectivity check that says which server answered, used by start-up and
`/v1/status` to show whether the configured or embedded database is reachable.
"""

from __future__ import annotations

import asyncpg


async def server_version(url: str, *, connect_timeout: float) -> str:
    """Connect, ask the server's version and disconnect; raises on failure or timeout."""
    conn = await asyncpg.connect(url, timeout=connect_timeout)
    try:
        version: str = await conn.fetchval("SHOW server_version", timeout=connect_timeout)
        return version
    finally:
        await conn.close(timeout=connect_timeout)
