"""When the periodic loops run: APScheduler, one instance at a time, coalesced, jittered.

This is the timing of the loops only. What a run means (its outcome recorded on its
component, in the metrics and the alerts; an outage told apart from a crash) is the
supervision module's: it hands each loop here as a run that never raises.

APScheduler 3 keeps its next run times on the wall clock: set back ten minutes, every
loop would wait ten minutes. While the scheduler runs, its clock watch compares the wall
clock with the boot-time clock each second and moves every next run by a jump it sees, so
the loops keep their cadence whatever the wall clock does (tests/services/test_scheduling.py
sets the clock back and ahead). `run_again` moves one loop's next run: the supervisor's
retry after a failure, or the time an outcome asked for; `set_interval` changes a loop's
interval (one the backend asked for) from now on.

A tick that finds its loop's last run still going is skipped (one instance at a time): a
normal turn for a run longer than its interval, said at DEBUG rather than with
APScheduler's WARNING.

On shutdown no new run starts, a run in progress (a sync in the middle of its writes)
gets a bounded time to finish, and what is still running after it is cancelled, awaited
and logged once, before the clients it uses are closed.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.interval import IntervalTrigger

log = logging.getLogger(__name__)

Run = Callable[[], Awaitable[object]]
Clock = Callable[[], float]

# a wall clock that moved this much more (or less) than the boot-time clock jumped
CLOCK_JUMP_SECONDS = 2.0


class _OverlapsAtDebug(logging.Filter):
    """APScheduler's "skipped: maximum number of running instances reached" WARNING,
    said at DEBUG by this module instead (its other records pass)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "maximum number of running instances" not in str(record.msg):
            return True
        job = record.args[0] if isinstance(record.args, tuple) and record.args else "a loop"
        log.debug("%s: a tick came while its last run was still running; skipped", job)
        return False


_scheduler_log = logging.getLogger("apscheduler.scheduler")
_scheduler_log.addFilter(_OverlapsAtDebug())


def _boot_clock() -> float:
    """Seconds since boot, suspend included (CLOCK_BOOTTIME), where there is one."""
    if hasattr(time, "CLOCK_BOOTTIME"):
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    return time.monotonic()


class Scheduler:
    def __init__(
        self,
        *,
        jitter_fraction: float = 0.0,
        wall: Clock = time.time,
        steady: Clock = _boot_clock,
    ) -> None:
        self._jitter_fraction = jitter_fraction
        self._wall = wall
        self._steady = steady
        self._running: dict[str, asyncio.Task[object]] = {}
        self._stopping = False
        self._watch_stop = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None
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

    def add(self, name: str, run: Run, *, every: float, first_after: float = 1.0) -> None:
        """Call `run` every `every` seconds (plus up to `jitter_fraction` of it), first
        after `first_after`; `run` must not raise (the supervisor's guard does not)."""
        jitter = every * self._jitter_fraction
        self._scheduler.add_job(
            self._tracked(name, run),
            trigger=IntervalTrigger(seconds=every, jitter=jitter or None, timezone=UTC),
            id=name,
            name=name,
            next_run_time=self._now() + timedelta(seconds=first_after),
            replace_existing=True,
        )

    def run_again(self, name: str, *, after: float) -> None:
        """The loop `name` runs next `after` seconds from now (then at its interval)."""
        job = self._scheduler.get_job(name)
        if job is not None and not self._stopping:
            job.modify(next_run_time=self._now() + timedelta(seconds=after))

    def set_interval(self, name: str, *, every: float) -> None:
        """The loop `name` runs every `every` seconds from now on, the next one `every`
        (plus its jitter) from now: an interval the backend asked for, applied at once."""
        job = self._scheduler.get_job(name)
        if job is None or self._stopping:
            return
        jitter = every * self._jitter_fraction
        job.modify(
            trigger=IntervalTrigger(seconds=every, jitter=jitter or None, timezone=UTC),
            next_run_time=self._now() + timedelta(seconds=every + random.uniform(0, jitter)),
        )

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self._wall(), UTC)

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

    def _tracked(self, name: str, run: Run) -> Run:
        """`run`, known while it runs (so `stop` can wait for it), and never started
        once stopping; a cancel by `stop` ends it here, not as an executor error."""

        async def tracked() -> None:
            if self._is_stopping():
                return
            task = asyncio.current_task()
            if task is not None:
                self._running[name] = task
            try:
                await run()
            except asyncio.CancelledError:
                if not self._is_stopping():
                    raise
                # cancelled by `stop`, which awaits it and has logged why
            finally:
                self._running.pop(name, None)

        tracked.__name__ = f"loop_{name}"
        return tracked

    def start(self, *, watch_every: float = 1.0) -> None:
        self._scheduler.start()
        self._watch = asyncio.create_task(
            self.watch_clock(self._watch_stop, every=watch_every), name="clock-watch"
        )

    async def stop(self, *, within: float) -> None:
        """Start no new run; give runs in progress `within` seconds, then cancel them."""
        self._stopping = True
        self._watch_stop.set()
        if self._watch is not None:
            await self._watch
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
