"""The capability registry: the node's row in PostgreSQL (tier, region, trust zone,
hardware, capabilities, and the manager's release), written at the start and kept alive by
a heartbeat every 30 s; `draining` when the shutdown begins, `offline` at its end.

Each heartbeat also compares the schema with the migrations this release ships: while an
expand migration of them is not applied, the code may use what is not there yet, so the
component fails (readiness with it) with "schema behind: <file> not applied"."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import SecretStr

from app import __version__
from app.domain.components import Outcome
from app.services.features.base import Decision, Off, On, Phase, Running, Spec, Step, Timer
from app.services.features.deps import Decisions, Deps, Shared
from app.settings import Settings

if TYPE_CHECKING:
    from app.adapters.registry import AsyncpgRegistry
    from app.domain.migrations import Migration
    from app.services.heartbeating import Heartbeat

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegistryConfig:
    timeout: float
    pool_size: int
    migrations_dir: Path | None  # None: no migrations at start (production's init container)
    migrate_on_start: bool
    heartbeat_interval: float
    # DATABASE_URL goes through PgBouncer in transaction mode; migrations at start then go
    # to `migrate_url`, straight to PostgreSQL (the settings refuse a pooler without one)
    transaction_pooler: bool = False
    migrate_url: SecretStr | None = None


@dataclass(kw_only=True)
class Registering(Running):
    registry: AsyncpgRegistry
    heartbeat: Heartbeat


class _Registry(Spec[RegistryConfig, Registering]):
    name = "registry"
    critical = True

    def decide(
        self, settings: Settings, shared: Shared, earlier: Decisions
    ) -> Decision[RegistryConfig]:
        if not settings.registry_enabled:
            return Off("switched off by REGISTRY_ENABLED=false")
        if settings.database_url is None and not shared.embedded:
            return Off(
                "no DATABASE_URL (or CAPABILITY_REGISTRY) set: capabilities are not "
                "registered; jobs are matched against this node's own profile"
            )
        reason = f"tier {settings.tier.value} in worker_capabilities, heartbeat every "
        reason += f"{settings.heartbeat_interval_seconds:g} s"
        if settings.node_tier is None:
            reason += " (NODE_TIER unset: tier C for development)"
        config = RegistryConfig(
            timeout=settings.database_timeout_seconds,
            pool_size=settings.database_pool_size,
            migrations_dir=settings.migrations_dir,
            migrate_on_start=settings.migrates_on_start,
            heartbeat_interval=settings.heartbeat_interval_seconds,
            transaction_pooler=settings.transaction_pooler,
            migrate_url=settings.database_migrate_url if settings.transaction_pooler else None,
        )
        if settings.transaction_pooler:
            reason += " (through PgBouncer in transaction mode)"
        return On(config, reason)

    async def open(self, config: RegistryConfig, deps: Deps) -> Registering | Off:
        """The registry pool, pending migrations (development), and the heartbeat, which
        sets `deps.registered` each time the registry has this instance's row (what
        PostgreSQL's job ledger waits for)."""
        if deps.database_url is None:
            return Off("PostgreSQL is not running (see the postgres component)")
        from app.adapters.registry import AsyncpgRegistry
        from app.domain.migrations import MigrationError
        from app.services import migrating
        from app.services.heartbeating import Heartbeat

        component = deps.component(self)
        registry = AsyncpgRegistry(
            deps.database_url,
            timeout=config.timeout,
            max_connections=config.pool_size,
            manager_version=__version__,
            transaction_pooler=config.transaction_pooler,
        )
        await registry.open()
        deps.stack.push_async_callback(registry.close)
        directory = migrating.migrations_dir(config.migrations_dir)
        shipped: list[Migration] | None
        try:
            shipped = await migrating.load(directory)
        except MigrationError as exc:
            shipped = None  # not this process's to refuse: `migrate` and its lint do
            component.facts["schema_not_checked"] = str(exc)
            log.warning("the schema is not checked against this release's migrations: %s", exc)
        prepare = None
        if config.migrate_on_start:

            async def prepare() -> None:
                try:
                    applied = await _migrate(registry, directory, config)
                except MigrationError as exc:
                    log.error("migrations from %s refused: %s", directory, exc)
                    raise
                component.facts["migrations_applied_at_start"] = [m.filename for m in applied]

        every = config.heartbeat_interval
        heartbeat = Heartbeat(
            registry=registry,
            profile=deps.profile(),
            interval_seconds=every,
            retry_max_wait=min(5.0, every / 4),
            prepare=prepare,
            on_registered=deps.registered.set,
        )
        deps.registry, deps.heartbeat = registry, heartbeat

        async def mark(status: str, budget: float) -> None:
            await heartbeat.mark(status, within=budget)

        async def beat() -> Outcome:
            outcome = await heartbeat.beat()
            if shipped is None:
                return outcome
            return await migrating.with_schema_state(outcome, registry, shipped)

        return Registering(
            registry=registry,
            heartbeat=heartbeat,
            timers=[Timer("heartbeat", beat, every, 0.1, "registry heartbeat", spread=True)],
            stops={
                # the fleet routes around the node from here on
                Phase.ANNOUNCE: Step("registry draining", lambda b: mark("draining", b), 2.0),
                Phase.DEPART: Step("registry offline", lambda b: mark("offline", b), 2.0),
            },
        )


async def _migrate(
    registry: AsyncpgRegistry, directory: Path, config: RegistryConfig
) -> list[Migration]:
    """The pending migrations, through the registry's own pool, or past the pooler on
    DATABASE_MIGRATE_URL: one long transaction that may wait on the other migrators' lock
    has no place in a pool the fleet's heartbeats share."""
    from app.adapters.registry import AsyncpgRegistry
    from app.services import migrating

    if config.migrate_url is None:
        return await migrating.migrate(registry, directory)
    direct = AsyncpgRegistry(
        config.migrate_url.get_secret_value(), timeout=config.timeout, max_connections=1
    )
    await direct.open()
    try:
        return await migrating.migrate(direct, directory)
    finally:
        await direct.close()


REGISTRY = _Registry()
