"""The data services: PostgreSQL (the registry's, and the job ledger's) and nats-server (the
jobs'). Each is the configured URL, or in development an embedded server started here from
the pip wheels; each is probed once at the start. Afterwards its health is what its user
sees now: the registry's last heartbeat for PostgreSQL, the job bus's connection for NATS.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from app.adapters.embedded import EmbeddedError, EmbeddedNats, EmbeddedPostgres
from app.domain.components import Outcome, Result
from app.domain.redaction import redact_text, redact_url
from app.services.features.base import Decision, Off, On, Running, Spec
from app.services.features.deps import Decisions, Deps, Shared
from app.settings import Settings

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 5.0


@dataclass(frozen=True)
class DataServiceConfig:
    """A data server: the configured URL, or an embedded server in `embedded_dir`."""

    url: SecretStr | None
    embedded_dir: Path | None


@dataclass(kw_only=True)
class DataService(Running):
    """A data service's URL (None: its embedded server did not start), and who tells its
    health after the start (None: the probe's record stands)."""

    url: str | None
    watched_by: Callable[[], Outcome | None] | None = None

    def health(self) -> Outcome | None:
        return self.watched_by() if self.watched_by is not None else None


class _DataSpec(Spec[DataServiceConfig, DataService]):
    critical = True
    variable: str
    directory: str
    label: str
    server: Callable[[Path], EmbeddedPostgres | EmbeddedNats]

    def configured(self, settings: Settings) -> SecretStr | None:
        raise NotImplementedError

    def decide(
        self, settings: Settings, shared: Shared, earlier: Decisions
    ) -> Decision[DataServiceConfig]:
        configured = self.configured(settings)
        if configured is not None:
            return On(DataServiceConfig(configured, None), f"{self.variable} is set")
        if shared.embedded:
            return On(
                DataServiceConfig(None, settings.data_dir / self.directory),
                f"embedded server (no {self.variable} set)",
            )
        return Off(f"no {self.variable} set and embedded servers are off")

    async def open(self, config: DataServiceConfig, deps: Deps) -> DataService:
        """The URL, the embedded server's started here when none is configured; a server
        that does not start fails the component and leaves the URL None."""
        component = deps.component(self)
        if config.url is not None:
            return DataService(url=config.url.get_secret_value())
        assert config.embedded_dir is not None  # decided: a URL or an embedded server
        embedded = self.server(config.embedded_dir.resolve())
        try:
            await asyncio.to_thread(embedded.start)
        except (EmbeddedError, OSError) as exc:
            component.failed(datetime.now(UTC), f"embedded {self.label}: {exc}")
            return DataService(url=None)
        deps.stack.callback(embedded.stop)
        component.facts.update(embedded=True, pid=embedded.pid)
        return DataService(url=embedded.url)

    async def probe(self, running: DataService, deps: Deps) -> None:
        """Record whether the server answers; never raises."""
        if running.url is None:
            return
        component = deps.component(self)
        shown = component.facts["url"] = redact_url(running.url)
        try:
            info = await self.check(running.url, deps)
        except Exception as exc:  # any failure to connect is reported, not raised
            # drivers may quote the URL they were given in their errors
            error = redact_text(f"{type(exc).__name__}: {exc}")
            component.failed(datetime.now(UTC), error)
            log.warning("%s at %s is not reachable: %s", self.name, shown, error)
        else:
            component.succeeded(datetime.now(UTC), **info)

    def check(self, url: str, deps: Deps) -> Awaitable[dict[str, Any]]:
        raise NotImplementedError


class _Postgres(_DataSpec):
    name = "postgres"
    variable, directory, label = "DATABASE_URL", "postgres", "PostgreSQL"
    server = EmbeddedPostgres

    def configured(self, settings: Settings) -> SecretStr | None:
        return settings.database_url

    async def check(self, url: str, deps: Deps) -> dict[str, Any]:
        from app.adapters import registry

        return {"server_version": await registry.server_version(url, connect_timeout=PROBE_TIMEOUT)}


class _Nats(_DataSpec):
    name = "nats"
    variable, directory, label = "NATS_URL", "nats", "nats-server"
    server = EmbeddedNats

    def configured(self, settings: Settings) -> SecretStr | None:
        return SecretStr(settings.nats_url) if settings.nats_url else None

    async def check(self, url: str, deps: Deps) -> dict[str, Any]:
        from app.adapters import bus

        auth = deps.shared.nats_auth
        return await bus.server_info(url, connect_timeout=PROBE_TIMEOUT, auth=auth)


POSTGRES = _Postgres()
NATS = _Nats()


def answered(outcome: Outcome | None) -> Outcome | None:
    """PostgreSQL's health from a heartbeat's outcome: it answered, or it did not."""
    if outcome is None:
        return None
    if outcome.result is Result.UNAVAILABLE:
        return Outcome.unavailable(outcome.error or "no answer")
    return Outcome.ok()
