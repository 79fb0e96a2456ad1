"""How every long-lived task and every periodic loop of the manager starts, ends and
stops, and where the outcome of each run is recorded.

Nothing else starts a background task, records a run's outcome, or decides how long a
shutdown step may take:

- `Deadline`: the one shutdown deadline. It is set once, when shutdown begins (SIGTERM,
  before uvicorn closes its connections), and every step of the shutdown gets what is
  left of it, so the steps together never outlast `SHUTDOWN_GRACE_SECONDS`.
- `Supervisor`: starts named tasks, restarts a task that fails (when asked to) with
  jittered exponential backoff, counts its failures (reset once it has run for a while
  without failing), shows them in `/v1/status`, and stops every task within a budget:
  first asking it to finish (its `stopping` event), then cancelling and awaiting it.
  Its periodic loops are timed by APScheduler (`scheduling`), and each run goes through
  one guard: the body returns an `Outcome` (OK, FAILED, UNAVAILABLE, SKIPPED), or raises,
  and the guard records it — the loop's state under `/v1/status` `loops`, its component,
  `scheduled_runs_total{loop,outcome}`, `loop_duration_seconds{loop}`, the outcome's
  alerts, and one log line in a shape shared by every loop — and decides the next run:
  the time the outcome asks for (`retry_in`: a backend's Retry-After, shown as
  "Retry-After until …"; after a failure no sooner than its backoff), else after a
  failure the same jittered backoff as a task's restart (from `LOOP_BACKOFF_INITIAL`,
  capped at the loop's interval), else the interval, which an answer may change within
  the loop's bounds (`cadence`). A loop
  may name the errors that mean a dependency is down (`outage`): an outage is one
  WARNING when it begins and one INFO when it ends, not an ERROR with a traceback (a
  Sentry event) at every tick. Any other exception is a
  crash: logged with its traceback, and tried again like any failure. A failing
  component alerts through the outage watch, once after a grace and once on recovery.

The shape follows kopf's `aiotasks` (guarded tasks, stop with a timeout, then cancel)
and controller-runtime's reconcile result (the reconciler says how it went; the
controller counts, logs and requeues), kept to what this process needs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from app.domain.components import Cadence, Component, Outcome, Result
from app.domain.retrying import RETRY_AFTER_CEILING, jitter_room
from app.domain.steering import clamp_interval
from app.services.scheduling import Scheduler

if TYPE_CHECKING:
    from app.metrics import Metrics
    from app.services.alerting import Alerter

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


Body = Callable[[asyncio.Event], Awaitable[object]]
LoopBody = Callable[[], Awaitable[object]]


def _failing(outcome: Outcome) -> bool:
    return outcome.result in (Result.FAILED, Result.UNAVAILABLE)


# a failed loop's first retry comes after about this long, then twice as long each time,
# up to the loop's interval
LOOP_BACKOFF_INITIAL = 10.0
# the latest a run may ask to be put off to (a Retry-After of a day is not kept), unless
# the loop's own interval is longer: the longest RETRY_AFTER_MAX_SECONDS and its jitter
# (the clients cap and jitter a Retry-After; this bounds whatever a body returns)
LONGEST_RETRY_IN = RETRY_AFTER_CEILING + jitter_room(RETRY_AFTER_CEILING)

_LOOP_STATE = {
    Result.OK: "ok",
    Result.FAILED: "failing",
    Result.UNAVAILABLE: "unavailable",
}


@dataclass
class Loop:
    """One periodic loop and its last runs, as `/v1/status` shows it."""

    name: str
    body: LoopBody
    what: str  # how logs and alerts name it ("deployment sync")
    outage: tuple[type[Exception], ...]
    component: Component | None
    every: float  # its interval: a retry after a failure comes sooner, never later
    # the bounds of an interval the backend may ask for (None: it may not; the loop keeps
    # `configured`, its interval from the settings)
    bounds: tuple[float, float] | None = None
    configured: float = 0.0
    state: str = "waiting"  # waiting | ok | failing | unavailable (a skip keeps it)
    since: datetime | None = None  # when the state began
    failures_in_a_row: int = 0
    last_error: str | None = None
    # until when the backend's Retry-After puts the loop off (its next run), if it does
    retry_after_until: datetime | None = None

    def as_dict(self) -> dict[str, Any]:
        until = self.retry_after_until
        return {
            "state": self.state,
            "since": self.since,
            "failures_in_a_row": self.failures_in_a_row,
            "last_error": self.last_error,
            "interval_seconds": self.every,
            "interval_from": "settings" if self.every == self.configured else "backend",
            "retry_after_until": until,
            "waiting": None if until is None else f"Retry-After until {_iso(until)}",
        }


def _iso(at: datetime) -> str:
    return at.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


class Supervisor:
    """Starts, restarts and stops the manager's long-lived tasks."""

    def __init__(
        self,
        *,
        scheduler: Scheduler | None = None,
        metrics: Metrics | None = None,
        alerts: Alerter | None = None,
        backoff_initial: float = 1.0,
        backoff_max: float = 60.0,
        loop_backoff_initial: float = LOOP_BACKOFF_INITIAL,
        healthy_after: float = 60.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.scheduler = scheduler if scheduler is not None else Scheduler()
        self._metrics = metrics
        self._alerts = alerts
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._loop_backoff_initial = loop_backoff_initial
        self._healthy_after = healthy_after
        self._clock = clock
        self._tasks: dict[str, Supervised] = {}
        self._loops: dict[str, Loop] = {}

    # --- periodic loops --------------------------------------------------------------

    def add_loop(
        self,
        name: str,
        body: LoopBody,
        *,
        every: float,
        first_after: float = 1.0,
        what: str | None = None,
        outage: tuple[type[Exception], ...] = (),
        component: Component | None = None,
        bounds: tuple[float, float] | None = None,
    ) -> None:
        """Run `body` every `every` seconds (first after `first_after`) through the guard.

        `body` returns an `Outcome` (anything else counts as OK). The guard records it on
        `component` and decides the next run: the one the outcome asks for (`retry_in`),
        else a jittered backoff after a failure (sooner than `every`, growing to it), else
        the interval. With `bounds`, an outcome's `cadence` (the interval the backend's
        answer asked for) sets the interval within them, at once; back to `every` when
        an answer asks for none."""
        loop = Loop(name, body, what or f"loop {name}", outage, component, every, bounds, every)
        self._loops[name] = loop
        self.scheduler.add(
            name, functools.partial(self._run, loop, True), every=every, first_after=first_after
        )

    async def run_now(self, name: str) -> Outcome:
        """One run of the loop `name` now, outside its schedule, recorded like any other
        (the final report at shutdown); its schedule stays as it was."""
        return await self._run(self._loops[name])

    async def _run(self, loop: Loop, scheduled: bool = False) -> Outcome:
        started = self._clock()
        crashed = False
        try:
            returned = await loop.body()
        except asyncio.CancelledError:
            self._count(loop.name, "cancelled")
            raise
        except loop.outage as exc:
            outcome = Outcome.unavailable(str(exc) or type(exc).__name__)
        except Exception as exc:
            outcome, crashed = Outcome.failed(str(exc) or type(exc).__name__), True
            log.exception("%s crashed", loop.what)
        else:
            outcome = returned if isinstance(returned, Outcome) else Outcome.ok()
        took = self._clock() - started
        if self._metrics is not None:
            self._metrics.loop_duration.labels(loop.name).observe(took)
        self._record(loop, outcome, crashed=crashed)
        if scheduled:
            self._schedule_next(loop, outcome, failed=crashed or _failing(outcome))
        log.debug("%s: %s in %.3f s", loop.what, outcome.result.value, took)
        return outcome

    def _schedule_next(self, loop: Loop, outcome: Outcome, *, failed: bool) -> None:
        """The run after this one: when the outcome asks (a Retry-After), else after a
        backoff when it failed, else at the loop's interval (the scheduler's own), which
        the answer may have changed (`cadence`)."""
        loop.retry_after_until = None
        self._pace(loop, outcome.cadence)  # from now: the next run moves with it
        if outcome.retry_in is not None:  # the backend's word, bounded
            after = min(outcome.retry_in, max(loop.every, LONGEST_RETRY_IN))
            if failed:  # a floor, never a shortcut past the backoff (`Retry-After: 0`)
                after = max(after, self._loop_backoff(loop))
            loop.retry_after_until = datetime.now(UTC) + timedelta(seconds=after)
            if loop.component is not None:
                loop.component.last_detail = {
                    **loop.component.last_detail,
                    "waiting": f"Retry-After until {_iso(loop.retry_after_until)}",
                }
        elif failed:
            after = self._loop_backoff(loop)
        else:
            return  # at its interval: as it was, or as `_pace` set it from now
        self.scheduler.run_again(loop.name, after=after)
        log.debug("%s runs again in %.0f s", loop.what, after)

    def _loop_backoff(self, loop: Loop) -> float:
        return self.backoff(
            loop.failures_in_a_row, initial=self._loop_backoff_initial, cap=loop.every
        )

    def _pace(self, loop: Loop, cadence: Cadence | None) -> None:
        """The interval an answer asked for, within the loop's bounds, from now on (the
        configured one when it asked for none), its next run moved with it."""
        if cadence is None or loop.bounds is None:
            return
        every = loop.configured
        if cadence.seconds is not None:
            low, high = loop.bounds
            every = clamp_interval(cadence.seconds, low=low, high=high)
        if every == loop.every:
            return
        was, loop.every = loop.every, every
        self.scheduler.set_interval(loop.name, every=every)
        log.info(
            "%s: every %g s from now (was %g s): %s", loop.what, every, was,
            "the backend asked" if cadence.seconds is not None else "back to the settings",
        )  # fmt: skip

    def record(self, name: str, outcome: Outcome) -> None:
        """The outcome of a run made outside the schedule (an operator's sync)."""
        self._record(self._loops[name], outcome)

    def _record(self, loop: Loop, outcome: Outcome, *, crashed: bool = False) -> None:
        now = datetime.now(UTC)
        self._count(loop.name, "error" if crashed else outcome.result.value)
        if loop.component is not None:
            loop.component.record(now, outcome)
        was, failing = loop.state, _failing(outcome)
        if outcome.result is Result.SKIPPED:  # a normal turn (a sync held the lock)
            log.debug("%s skipped: %s", loop.what, outcome.error)
        elif failing:
            loop.failures_in_a_row += 1
            loop.last_error = outcome.error
            if outcome.result is Result.UNAVAILABLE and was != "unavailable":
                log.warning(
                    "%s: a dependency is unavailable: %s; it is tried again with backoff, "
                    "and says when it is back", loop.what, outcome.error,
                )  # fmt: skip
            elif outcome.result is Result.FAILED and not crashed:
                n = loop.failures_in_a_row
                log.warning("%s failed (%d in a row): %s", loop.what, n, outcome.error)
        else:
            if was in ("unavailable", "failing"):
                log.info("%s ran again after %d failed runs", loop.what, loop.failures_in_a_row)
            loop.failures_in_a_row, loop.last_error = 0, None
        if outcome.result is not Result.SKIPPED:
            state = _LOOP_STATE[outcome.result]
            if state != loop.state:
                loop.state, loop.since = state, now
        if self._alerts is not None:
            for key, text in outcome.alerts:
                self._alerts.alert(key, text)

    def _count(self, loop: str, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.job_runs.labels(loop, outcome).inc()

    def loops(self) -> dict[str, dict[str, Any]]:
        return {name: loop.as_dict() for name, loop in sorted(self._loops.items())}

    def next_run(self, name: str) -> datetime | None:
        return self.scheduler.next_run(name)

    def interval(self, name: str) -> float | None:
        """The loop's interval now (the backend may have asked for another); None: no
        such loop."""
        loop = self._loops.get(name)
        return None if loop is None else loop.every

    def start_loops(self) -> None:
        self.scheduler.start()

    async def stop_loops(self, *, within: float) -> None:
        """No new run starts; runs in progress get `within` seconds, then are cancelled."""
        await self.scheduler.stop(within=within)

    # --- long-lived tasks ------------------------------------------------------------

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
                returned = await body(entry.stopping)
            except asyncio.CancelledError:
                entry.state = "stopped"
                raise
            except Exception as exc:
                if self._clock() - began >= self._healthy_after:
                    entry.failures = 0  # it ran well for a while: this is a new episode
                entry.failures += 1
                entry.last_error = f"{type(exc).__name__}: {exc}"
                if entry.component is not None:
                    entry.component.record(datetime.now(UTC), Outcome.failed(entry.last_error))
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
                if isinstance(returned, Outcome) and entry.component is not None:
                    entry.component.record(datetime.now(UTC), returned)
                return

    def backoff(
        self, failures: int, *, initial: float | None = None, cap: float | None = None
    ) -> float:
        """The one backoff of tasks and loops: an exponential step from `initial`, at most
        `cap`, with jitter over its upper half, which spreads many nodes' retries apart."""
        first = self._backoff_initial if initial is None else initial
        top = self._backoff_max if cap is None else cap
        step = min(top, first * 2 ** min(max(failures, 1) - 1, 16))
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
