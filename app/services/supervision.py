"""How every long-lived task of the manager starts and stops.

Two things live here, and nothing else starts a background task or decides how long a
shutdown step may take:

- `Deadline`: the one shutdown deadline. It is set once, when shutdown begins (SIGTERM,
  before uvicorn closes its connections), and every step of the shutdown gets what is
  left of it, so the steps together never outlast `SHUTDOWN_GRACE_SECONDS`.
- `Supervisor`: starts named tasks, restarts a task that fails (when asked to) with
  jittered exponential backoff, counts its failures (reset once it has run for a while
  without failing), shows them in `/v1/status`, and stops every task within a budget:
  first asking it to finish (its `stopping` event), then cancelling and awaiting it.

The shape follows kopf's `aiotasks` (guarded tasks, stop with a timeout, then cancel),
kept to what this process needs.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from app.domain.components import Component

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class Deadline:
    """The shutdown deadline: `grace` seconds from the moment shutdown begins."""

    def __init__(self, grace: float, *, clock: Clock = time.monotonic) -> None:
        self.grace = grace
        self._clock = clock
        self._ends_at: float | None = None

    def begin(self) -> None:
        """Start the countdown; later calls change nothing (SIGTERM first, lifespan after)."""
        if self._ends_at is None:
            self._ends_at = self._clock() + self.grace

    @property
    def began(self) -> bool:
        return self._ends_at is not None

    def remaining(self) -> float:
        if self._ends_at is None:
            return self.grace
        return max(0.0, self._ends_at - self._clock())

    def budget(self, *, cap: float | None = None, reserve: float = 0.0) -> float:
        """What a step may take: what is left, less `reserve` kept for the steps after it,
        at most `cap`."""
        left = max(0.0, self.remaining() - reserve)
        return left if cap is None else min(cap, left)


async def within(name: str, budget: float, step: Callable[[], Awaitable[Any]]) -> bool:
    """Run one shutdown step for at most `budget` seconds; False (logged) if cut off."""
    if budget <= 0:
        log.warning("shutdown: no time left for %s; skipped", name)
        return False
    try:
        async with asyncio.timeout(budget):
            await step()
    except TimeoutError:
        log.warning("shutdown: %s cut off after %.1f s", name, budget)
        return False
    return True


@dataclass
class Supervised:
    """One supervised task, as `/v1/status` shows it."""

    name: str
    restart: bool
    component: Component | None
    state: str = "starting"  # starting | running | restarting | finished | failed | stopped
    started_at: datetime | None = None
    failures: int = 0  # in a row; reset after `healthy_after` seconds without one
    restarts: int = 0
    last_error: str | None = None
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "restart": self.restart,
            "started_at": self.started_at,
            "failures_in_a_row": self.failures,
            "restarts": self.restarts,
            "last_error": self.last_error,
        }


Body = Callable[[asyncio.Event], Awaitable[None]]


class Supervisor:
    """Starts, restarts and stops the manager's long-lived tasks."""

    def __init__(
        self,
        *,
        backoff_initial: float = 1.0,
        backoff_max: float = 60.0,
        healthy_after: float = 60.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._healthy_after = healthy_after
        self._clock = clock
        self._tasks: dict[str, Supervised] = {}

    def start(
        self, name: str, body: Body, *, restart: bool, component: Component | None = None
    ) -> Supervised:
        """Run `body(stopping)` as the task `name`.

        `body` should return soon after `stopping` is set; it is cancelled when it does not
        within its stop budget. With `restart`, a body that raises is started again after
        a jittered, growing delay; without, its failure is recorded and it stays down.
        A body that returns on its own is finished (not restarted).
        """
        if name in self._tasks and self._tasks[name].state not in ("finished", "failed"):
            raise RuntimeError(f"task {name} is already running")
        entry = Supervised(name=name, restart=restart, component=component)
        entry.task = asyncio.create_task(self._guard(entry, body), name=name)
        self._tasks[name] = entry
        return entry

    async def _guard(self, entry: Supervised, body: Body) -> None:
        while True:
            entry.state = "running"
            entry.started_at = datetime.now(UTC)
            began = self._clock()
            try:
                await body(entry.stopping)
            except asyncio.CancelledError:
                entry.state = "stopped"
                raise
            except Exception as exc:
                if self._clock() - began >= self._healthy_after:
                    entry.failures = 0  # it ran well for a while: this is a new episode
                entry.failures += 1
                entry.last_error = f"{type(exc).__name__}: {exc}"
                if entry.component is not None:
                    entry.component.failed(datetime.now(UTC), entry.last_error)
                if not entry.restart or entry.stopping.is_set():
                    entry.state = "failed"
                    log.error("task %s failed and stays down", entry.name, exc_info=exc)
                    return
                delay = self.backoff(entry.failures)
                entry.state = "restarting"
                log.error(
                    "task %s failed (%d in a row); restarting in %.1f s",
                    entry.name, entry.failures, delay, exc_info=exc,
                )  # fmt: skip
                try:
                    await asyncio.wait_for(entry.stopping.wait(), timeout=delay)
                except TimeoutError:
                    entry.restarts += 1
                    continue
                entry.state = "stopped"
                return
            else:
                entry.state = "stopped" if entry.stopping.is_set() else "finished"
                return

    def backoff(self, failures: int) -> float:
        """Full jitter on an exponential step: spreads restarts of many nodes apart."""
        step = min(self._backoff_max, self._backoff_initial * 2 ** min(failures - 1, 16))
        return random.uniform(step / 2, step)

    async def stop(self, name: str, *, budget: float) -> None:
        """Ask one task to finish, give it `budget` seconds, then cancel and await it."""
        entry = self._tasks.get(name)
        if entry is None or entry.task is None:
            return
        await self._stop([entry], budget)

    async def stop_all(self, *, budget: float) -> None:
        """Stop every task still running, together, within `budget` seconds."""
        await self._stop(list(self._tasks.values()), budget)

    async def _stop(self, entries: list[Supervised], budget: float) -> None:
        tasks = {e.task: e for e in entries if e.task is not None and not e.task.done()}
        for entry in tasks.values():
            entry.stopping.set()
        if not tasks:
            return
        _done, late = await asyncio.wait(tasks, timeout=max(budget, 0.0))
        for task in late:
            log.warning("task %s did not stop within %.1f s; cancelled", tasks[task].name, budget)
            task.cancel()
        if late:
            await asyncio.gather(*late, return_exceptions=True)

    def status(self) -> dict[str, dict[str, Any]]:
        return {name: entry.as_dict() for name, entry in sorted(self._tasks.items())}
