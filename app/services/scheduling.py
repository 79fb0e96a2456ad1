"""Periodic loops on APScheduler: one instance at a time, coalesced, with jitter.

Each loop body is wrapped so that an exception is logged (and so reaches Sentry
through its logging integration) and counted, and the loop simply runs again at
its next tick: a failing loop never takes the process or the API down.

On shutdown no new run starts, a run in progress (a sync in the middle of its writes)
gets a bounded time to finish, and what is still running after it is cancelled, awaited
and logged once, before the clients it uses are closed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.interval import IntervalTrigger

from app.metrics import Metrics

log = logging.getLogger(__name__)

LoopBody = Callable[[], Awaitable[object]]


class Scheduler:
    def __init__(self, *, metrics: Metrics, jitter_fraction: float) -> None:
        self._metrics = metrics
        self._jitter_fraction = jitter_fraction
        self._running: dict[str, asyncio.Task[object]] = {}
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
        self, name: str, body: LoopBody, *, every: float, first_after: float = 1.0
    ) -> None:
        """Run `body` every `every` seconds (plus up to `jitter_fraction` of it), first soon."""
        jitter = every * self._jitter_fraction
        self._scheduler.add_job(
            self._guarded(name, body),
            trigger=IntervalTrigger(seconds=every, jitter=jitter or None, timezone=UTC),
            id=name,
            name=name,
            next_run_time=datetime.now(UTC) + timedelta(seconds=first_after),
            replace_existing=True,
        )

    def next_run(self, name: str) -> datetime | None:
        job = self._scheduler.get_job(name)
        return None if job is None else job.next_run_time

    def _guarded(self, name: str, body: LoopBody) -> Callable[[], Awaitable[None]]:
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
            except Exception:
                self._metrics.job_runs.labels(name, "error").inc()
                log.exception("loop %s failed; it runs again at its next tick", name)
            else:
                self._metrics.job_runs.labels(name, "ok").inc()
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
