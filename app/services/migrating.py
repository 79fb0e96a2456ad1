"""Schema migrations from the `migrations/` folder, applied through the registry adapter."""

from __future__ import annotations

import asyncio
from pathlib import Path

import app
from app.adapters.registry import AsyncpgRegistry
from app.domain.migrations import Migration, MigrationError, parse_files

CONTAINER_MIGRATIONS = Path("/app/migrations")


def migrations_dir(configured: Path | None) -> Path:
    """MIGRATIONS_DIR, else the source tree's `migrations/`, else the image's /app/migrations."""
    if configured is not None:
        return configured
    beside_source = Path(app.__file__).resolve().parent.parent / "migrations"
    return beside_source if beside_source.is_dir() else CONTAINER_MIGRATIONS


def _read(directory: Path) -> dict[str, str]:
    if not directory.is_dir():
        raise MigrationError(f"no migrations folder at {directory} (set MIGRATIONS_DIR)")
    return {p.name: p.read_text() for p in sorted(directory.glob("*.sql"))}


async def load(directory: Path) -> list[Migration]:
    return parse_files(await asyncio.to_thread(_read, directory))


async def migrate(registry: AsyncpgRegistry, directory: Path) -> list[Migration]:
    """Apply what is pending; returns the migrations applied now (empty: up to date)."""
    return await registry.migrate(await load(directory))
