"""The data services: PostgreSQL (the registry's, and the job ledger's) and nats-server (the
jobs'). Each is the configured URL, or in development an embedded server started here from
the pip wheels; each is probed once at the start. Afterwards its health is what its user
sees now: the registry's last heartbeat for PostgreSQL, the job bus's connection for NATS.
"""

from __future__ import annotations

import asyncio
import logging
from abc import abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import SecretStr

from app.adapters.embedded import EmbeddedError, EmbeddedNats, EmbeddedPostgres
from app.domain.components import Outcome, Result
from app.domain.nats_servers import NatsServers
from app.domain.redaction import redact_text, redact_url
from app.services.features.base import Decision, Off, On, Running, Spec
from app.services.features.deps import Decisions, Deps, Shared
from app.settings import Settings

log = logging.getLogger(__name__)

A = TypeVar("A")  # a service's address: a secret URL, or NATS's servers

PROBE_TIMEOUT = 5.0


@dataclass(frozen=True)
class DataServiceConfig(Generic[A]):
    """A data server: the configured address, or an embedded server in `embedded_dir`."""

    address: A | None
    embedded_dir: Path | None


@dataclass(kw_only=True)
class DataService(Running, Generic[A]):
    """A data service's address (None: its embedded server did not start), and who tells
    its health after the start (None: the probe's record stands)."""

    address: A | None
    watched_by: Callable[[], Outcome | None] | None = None

    def health(self) -> Outcome | None:
        return self.watched_by() if self.watched_by is not None else None


class _DataSpec(Spec[DataServiceConfig[A], DataService[A]]):
    critical = True
    variable: str
    directory: str
    label: str

    @abstractmethod
    def server(self, directory: Path) -> EmbeddedPostgres | EmbeddedNats:
        """The embedded server, in `directory`, for development."""

    @abstractmethod
    def configured(self, settings: Settings) -> A | None:
        """The address the settings give (None: none set)."""

    @abstractmethod
    def address(self, url: str) -> A:
        """An embedded server's URL as the configured address's type."""

    @abstractmethod
    def shown(self, address: A) -> str:
        """The address as the status shows it: no password."""

    def decide(
        self, settings: Settings, shared: Shared, earlier: Decisions
    ) -> Decision[DataServiceConfig[A]]:
        configured = self.configured(settings)
        if configured is not None:
            return On(DataServiceConfig(configured, None), f"{self.variable} is set")
        if shared.embedded:
            return On(
                DataServiceConfig(None, settings.data_dir / self.directory),
                f"embedded server (no {self.variable} set)",
            )
        return Off(f"no {self.variable} set and embedded servers are off")

    async def open(self, config: DataServiceConfig[A], deps: Deps) -> DataService[A]:
        """The address, the embedded server's started here when none is configured; a
        server that does not start fails the component and leaves the address None."""
        component = deps.component(self)
        if config.address is not None:
            return DataService(address=config.address)
        assert config.embedded_dir is not None  # decided: a URL or an embedded server
        embedded = self.server(config.embedded_dir.resolve())
        try:
            await asyncio.to_thread(embedded.start)
        except (EmbeddedError, OSError) as exc:
            component.failed(datetime.now(UTC), f"embedded {self.label}: {exc}")
            return DataService(address=None)
        deps.stack.callback(embedded.stop)
        component.facts.update(embedded=True, pid=embedded.pid)
        return DataService(address=self.address(embedded.url))

    async def probe(self, running: DataService[A], deps: Deps) -> None:
        """Record whether the server answers; never raises."""
        if running.address is None:
            return
        component = deps.component(self)
        shown = component.facts["url"] = self.shown(running.address)
        try:
            info = await self.check(running.address, deps)
        except Exception as exc:  # any failure to connect is reported, not raised
            # drivers may quote the URL they were given in their errors
            error = redact_text(f"{type(exc).__name__}: {exc}")
            component.failed(datetime.now(UTC), error)
            log.warning("%s at %s is not reachable: %s", self.name, shown, error)
        else:
            component.succeeded(datetime.now(UTC), **info)

    @abstractmethod
    def check(self, address: A, deps: Deps) -> Awaitable[dict[str, Any]]:
        """What the server says of itself (its version); raises when it does not answer."""


class _Postgres(_DataSpec[SecretStr]):
    name = "postgres"
    variable, directory, label = "DATABASE_URL", "postgres", "PostgreSQL"

    def server(self, directory: Path) -> EmbeddedPostgres:
        return EmbeddedPostgres(directory)

    def configured(self, settings: Settings) -> SecretStr | None:
        return settings.database_url

    def address(self, url: str) -> SecretStr:
        return SecretStr(url)

    def shown(self, address: SecretStr) -> str:
        return redact_url(address.get_secret_value())

    async def check(self, address: SecretStr, deps: Deps) -> dict[str, Any]:
        from app.adapters import registry

        url = address.get_secret_value()
        version = await registry.server_version(
            url, connect_timeout=PROBE_TIMEOUT, transaction_pooler=deps.shared.transaction_pooler
        )
        return {"server_version": version}


class _Nats(_DataSpec[NatsServers]):
    name = "nats"
    variable, directory, label = "NATS_URL", "nats", "nats-server"

    def server(self, directory: Path) -> EmbeddedNats:
        return EmbeddedNats(directory)

    def configured(self, settings: Settings) -> NatsServers | None:
        return settings.nats_url

    def address(self, url: str) -> NatsServers:
        return NatsServers((url,))

    def shown(self, address: NatsServers) -> str:
        return str(address)  # each server redacted

    async def check(self, address: NatsServers, deps: Deps) -> dict[str, Any]:
        from app.adapters import bus

        auth = deps.shared.nats_auth
        return await bus.server_info(address, connect_timeout=PROBE_TIMEOUT, auth=auth)


POSTGRES = _Postgres()
NATS = _Nats()


def answered(outcome: Outcome | None) -> Outcome | None:
    """PostgreSQL's health from a heartbeat's outcome: it answered, or it did not."""
    if outcome is None:
        return None
    if outcome.result is Result.UNAVAILABLE:
        return Outcome.unavailable(outcome.error or "no answer")
    return Outcome.ok()
