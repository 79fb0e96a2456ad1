"""Capability registration and the heartbeat: the node tells the fleet what it can do.

At start the node registers (upsert, `online`); every HEARTBEAT_INTERVAL_SECONDS it
moves `last_heartbeat` with a one-row UPDATE, and rewrites hardware and capabilities
only when the fingerprint changed (or the row vanished). PostgreSQL being down never
stops the manager: a failed beat is retried with jittered backoff within the tick,
then simply again at the next one. On shutdown the node is `draining`, then `offline`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import stamina

from app.adapters.registry import AsyncpgRegistry, NodeHeldElsewhere, RegistryUnavailable
from app.domain.components import Outcome
from app.domain.migrations import MigrationError
from app.domain.requirements import NodeProfile
from app.services.profile import LocalProfile

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(
        self,
        *,
        registry: AsyncpgRegistry,
        profile: LocalProfile,
        interval_seconds: float,
        prepare: Callable[[], Awaitable[object]] | None = None,
        on_registered: Callable[[], None] | None = None,
        retry_attempts: int = 3,
        retry_max_wait: float = 5.0,
    ) -> None:
        self.registry = registry
        self._local = profile
        self._node_id = profile.node_id
        self._tier = profile.tier
        self._interval = max(1, round(interval_seconds))
        self._attempts = retry_attempts
        self._max_wait = retry_max_wait
        self._prepare = prepare
        self._written: NodeProfile | None = None
        self.status = "online"
        self._marked: str | None = None  # the last status `mark` wrote
        # one write at a time, each with the status as it is when the write begins: a beat
        # in flight at SIGTERM cannot put `online` back over `draining`
        self._writing = asyncio.Lock()
        # told each time the registry has this instance's row (the schema migrated first,
        # in development); the composition root passes it on to whoever waits for that
        self._on_registered = on_registered
        self.last: Outcome | None = None  # the last beat's outcome

    async def beat(self) -> Outcome:
        """One heartbeat (registering when needed): OK when the registry has it."""
        self.last = await self._beat()
        return self.last

    async def profile(self) -> NodeProfile:
        """The node's profile, with the hardware fingerprint refreshed every 10 minutes."""
        return await self._local()

    async def _beat(self) -> Outcome:
        try:
            async for attempt in stamina.retry_context(
                on=RegistryUnavailable,
                attempts=self._attempts,
                wait_initial=min(0.2, self._max_wait),
                wait_max=self._max_wait,
                timeout=None,
            ):
                with attempt:
                    await self._write()
        except NodeHeldElsewhere as exc:
            # a second manager for a node one already serves: it stays out of the way, on
            # standby, not failing (the new pod of a self-update waits so until the old one
            # has gone, and must be ready meanwhile, or the old one never goes)
            self._written = None
            return Outcome.skipped(str(exc), standby=str(exc))
        except RegistryUnavailable as exc:  # the database is down: a state, not a failure
            self._written = None  # re-register in full once the database is back
            return Outcome.unavailable(f"{type(exc).__name__}: {exc}")
        except MigrationError as exc:
            self._written = None
            return Outcome.failed(f"{type(exc).__name__}: {exc}")
        if self._on_registered is not None:
            self._on_registered()
        return Outcome.ok(status=self.status)

    async def _write(self) -> None:
        if self._prepare is not None:
            # e.g. migrations in development: done once, as soon as the database answers
            await self._prepare()
            self._prepare = None
        profile = await self.profile()
        async with self._writing:
            status = self.status  # read now: `mark` may have changed it meanwhile
            if self._written == profile and await self.registry.heartbeat(
                self._node_id, status=status
            ):
                return
            await self.registry.upsert(profile, status=status, interval_seconds=self._interval)
        if self._written is None:
            log.info("registered node %s (tier %s) as %s", self._node_id, self._tier, status)
        self._written = profile

    async def mark(self, status: str, *, within: float) -> None:
        """Set the node's status now (draining, offline), within `within` s; never raises.
        Marking the status already written is a no-op (the worker's drain and the
        registry's own shutdown step both mark `draining`)."""
        if self._marked == status:
            return
        self.status = status
        try:
            await asyncio.wait_for(self._write(), timeout=within)
        except NodeHeldElsewhere as exc:
            log.warning("node %s not marked %s: %s", self._node_id, status, exc)
            return
        except (*RegistryUnavailable, MigrationError) as exc:
            log.warning("could not mark node %s %s in the registry: %s", self._node_id, status, exc)
            return
        self._marked = status
        log.info("node %s is %s in the registry", self._node_id, status)
