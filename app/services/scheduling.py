"""Periodic loops on APScheduler: one instance at a time, coalesced, with jitter.

Each loop body is wrapped so that an exception is logged (and so reaches Sentry
through its logging integration) and counted, and the loop simply runs again at
its next tick: a failing loop never takes the process or the API down.

A loop may name the errors that mean a dependency is down (`outage`): those are an
outage, not a crash — one WARNING when it begins, one INFO when it ends, its state in
`/v1/status` (`loops`) and the `unavailable` outcome — instead of an ERROR with a
traceback (a Sentry event) at every tick.

APScheduler 3 keeps its next run times on the wall clock: set back ten minutes, every
loop would wait ten minutes. `watch_clock` (a supervised task) compares the wall clock
with the boot-time clock each second and moves every next run by a jump it sees, so the
loops keep their cadence whatever the wall clock does.

On shutdown no new run starts, a run in progress (a sync in the middle of its writes)
gets a bounded time to finish, and what is still running after it is cancelled, awaited
and logged once, before the clients it uses are closed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.interval import IntervalTrigger

from app.metrics import Metrics

log = logging.getLogger(__name__)

LoopBody = Callable[[], Awaitable[object]]
Clock = Callable[[], float]

# a wall clock that moved this much more (or less) than the boot-time clock jumped
CLOCK_JUMP_SECONDS = 2.0


def _boot_clock() -> float:
    """Seconds since boot, suspend included (CLOCK_BOOTTIME), where there is one."""
    if hasattr(time, "CLOCK_BOOTTIME"):
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    return time.monotonic()


@dataclass
class LoopState:
    """A loop's last runs, as `/v1/status` shows it."""

    state: str = "waiting"  # waiting | ok | failing | unavailable
    since: datetime | None = None  # when the state began
    failures_in_a_row: int = 0
    last_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "since": self.since,
            "failures_in_a_row": self.failures_in_a_row,
            "last_error": self.last_error,
        }


class Scheduler:
    def __init__(
        self,
        *,
        metrics: Metrics,
        jitter_fraction: float,
        wall: Clock = time.time,
        steady: Clock = _boot_clock,
    ) -> None:
        self._metrics = metrics
        self._jitter_fraction = jitter_fraction
        self._wall = wall
        self._steady = steady
        self._running: dict[str, asyncio.Task[object]] = {}
        self._loops: dict[str, LoopState] = {}
        self._stopping = False
        self._scheduler = AsyncIOScheduler(
            timezone=UTC,
            job_defaults={"max_instances": 1, "coalesce": True, "misfire_grace_time": None},
        )

    @property
    def running(self) -> bool:
        return bool(self._scheduler.running)

    def _is_stopping(self) -> bool:
        # a call, not the attribute: the flag changes while a run awaits its body
        return self._stopping

    def add_loop(
        self,
        name: str,
        body: LoopBody,
        *,
        every: float,
        first_after: float = 1.0,
        outage: tuple[type[Exception], ...] = (),
    ) -> None:
        """Run `body` every `every` seconds (plus up to `jitter_fraction` of it), first soon.
        An exception of an `outage` type is a dependency down, not a crash (see above)."""
        jitter = every * self._jitter_fraction
        self._loops[name] = LoopState()
        self._scheduler.add_job(
            self._guarded(name, body, outage),
            trigger=IntervalTrigger(seconds=every, jitter=jitter or None, timezone=UTC),
            id=name,
            name=name,
            next_run_time=self._now() + timedelta(seconds=first_after),
            replace_existing=True,
        )

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self._wall(), UTC)

    def loops(self) -> dict[str, dict[str, Any]]:
        return {name: state.as_dict() for name, state in sorted(self._loops.items())}

    async def watch_clock(self, stopping: asyncio.Event, *, every: float = 1.0) -> None:
        """Until `stopping`: move every loop's next run by a jump of the wall clock."""
        wall, steady = self._wall(), self._steady()
        while not stopping.is_set():
            try:
                await asyncio.wait_for(stopping.wait(), timeout=every)
            except TimeoutError:
                pass
            now_wall, now_steady = self._wall(), self._steady()
            jump = (now_wall - wall) - (now_steady - steady)
            wall, steady = now_wall, now_steady
            if abs(jump) >= CLOCK_JUMP_SECONDS and self._scheduler.running:
                log.warning("the wall clock jumped %+.0f s; the loops keep their cadence", jump)
                self._shift(timedelta(seconds=jump))

    def _shift(self, by: timedelta) -> None:
        for job in self._scheduler.get_jobs():
            if job.next_run_time is not None:  # None: paused
                job.modify(next_run_time=job.next_run_time + by)

    def next_run(self, name: str) -> datetime | None:
        job = self._scheduler.get_job(name)
        return None if job is None else job.next_run_time

    def _guarded(
        self, name: str, body: LoopBody, outage: tuple[type[Exception], ...]
    ) -> Callable[[], Awaitable[None]]:
        state = self._loops[name]

        def became(now_state: str, error: str | None) -> None:
            if state.state != now_state:
                state.state, state.since = now_state, datetime.now(UTC)
            state.last_error = error

        async def run() -> None:
            if self._is_stopping():
                return
            started = time.monotonic()
            task = asyncio.current_task()
            if task is not None:
                self._running[name] = task
            try:
                await body()
            except asyncio.CancelledError:
                if not self._is_stopping():
                    raise
                # cancelled by `stop`, which awaits it and has logged why: the run ends
                # here instead of surfacing as an executor error with a traceback
                self._metrics.job_runs.labels(name, "cancelled").inc()
            except outage as exc:
                self._metrics.job_runs.labels(name, "unavailable").inc()
                state.failures_in_a_row += 1
                text = str(exc) or type(exc).__name__
                if state.state != "unavailable":
                    log.warning("loop %s: a dependency is unavailable: %s; it runs again at "
                                "each tick, and says when it is back", name, text)  # fmt: skip
                became("unavailable", text)
            except Exception as exc:
                self._metrics.job_runs.labels(name, "error").inc()
                state.failures_in_a_row += 1
                became("failing", str(exc) or type(exc).__name__)
                log.exception("loop %s failed; it runs again at its next tick", name)
            else:
                self._metrics.job_runs.labels(name, "ok").inc()
                if state.state in ("unavailable", "failing"):
                    log.info("loop %s ran again after %d failed runs", name,
                             state.failures_in_a_row)  # fmt: skip
                state.failures_in_a_row = 0
                became("ok", None)
            finally:
                self._running.pop(name, None)
                log.debug("loop %s took %.3f s", name, time.monotonic() - started)

        run.__name__ = f"loop_{name}"
        return run

    def start(self) -> None:
        self._scheduler.start()

    async def stop(self, *, within: float) -> None:
        """Start no new run; give runs in progress `within` seconds, then cancel them."""
        self._stopping = True
        if not self._scheduler.running:
            return
        # paused, not shut down yet: APScheduler's shutdown cancels running jobs at once
        self._scheduler.pause()
        running = dict(self._running)
        if running:
            log.info("waiting up to %.1f s for %s to finish", within, ", ".join(sorted(running)))
            _, pending = await asyncio.wait(running.values(), timeout=max(within, 0.0))
            late = sorted(name for name, task in running.items() if task in pending)
            if late:
                log.warning(
                    "cancelling %s: still running %.1f s after shutdown began", late, within
                )
                for name in late:
                    running[name].cancel()
                await asyncio.gather(*(running[n] for n in late), return_exceptions=True)
        self._scheduler.shutdown(wait=False)
