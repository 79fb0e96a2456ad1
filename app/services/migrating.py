"""Schema migrations from the `migrations/` folder: linted, applied through the registry
adapter, and compared with what the database has applied (readiness)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import app
from app.adapters.registry import AsyncpgRegistry, RegistryUnavailable
from app.domain.components import Outcome
from app.domain.migrations import (
    Migration,
    MigrationError,
    check_kind,
    parse_files,
    schema_behind,
)

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


def lint(directory: Path) -> list[str]:
    """Every problem of the folder's migrations, each naming its file (`make lint`): a
    misnamed or duplicate file, a missing or unknown kind, an expand migration that
    contracts, a contract without the release it waits for. Empty: fine."""
    try:
        migrations = parse_files(_read(directory))
    except MigrationError as exc:
        return [str(exc)]
    return [problem for m in migrations for problem in check_kind(m)]


async def load(directory: Path) -> list[Migration]:
    return parse_files(await asyncio.to_thread(_read, directory))


async def migrate(registry: AsyncpgRegistry, directory: Path) -> list[Migration]:
    """Apply what is pending; returns the migrations applied now (empty: up to date)."""
    return await registry.migrate(await load(directory))


async def with_schema_state(
    outcome: Outcome, registry: AsyncpgRegistry, shipped: list[Migration]
) -> Outcome:
    """A heartbeat's outcome, failed when the schema is behind the migrations this release
    ships (one small query; a database that does not answer leaves the outcome as it
    is, the heartbeat has said so). The heartbeat's own error, if any, is kept after."""
    try:
        behind = schema_behind(shipped, await registry.applied_versions())
    except RegistryUnavailable:
        return outcome
    if not behind:
        return outcome
    error = (
        f"schema behind: {', '.join(behind)} not applied (this release's code may use what "
        "they add; run `workload-manager migrate`)"
    )
    if not outcome.succeeded and outcome.error:
        error += f"; {outcome.error}"
    return Outcome.failed(error, schema_behind=behind).with_detail(**outcome.detail)
