"""STARTUP_SPREAD_SECONDS on the real scheduler: a timer that calls a shared service
(`Timer.spread`) runs first a draw of the spread later than its own first delay, the
others when they always did; later runs keep their interval."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from datetime import UTC, datetime

from app.domain.spreading import StartupSpread
from app.services.features.base import LoopBody, Running, Timer
from app.services.features.registry import REGISTRY
from app.services.runtime import _hand_over, build_runtime
from app.settings import Settings


async def test_spread_timers_run_first_a_draw_later_on_the_real_scheduler() -> None:
    rt = build_runtime(Settings(_env_file=None))
    draws: Iterator[float] = iter([0.5, 0.9])
    shared = dataclasses.replace(rt.plan.shared, startup=StartupSpread(0.6, lambda: next(draws)))
    rt.plan = dataclasses.replace(rt.plan, shared=shared)
    runs: dict[str, list[float]] = {"beat": [], "report": [], "local": []}

    all_ran = asyncio.Event()

    def body(name: str) -> LoopBody:
        async def run() -> None:
            runs[name].append(time.monotonic())
            if all(runs.values()):
                all_ran.set()

        return run

    rt.running = {
        REGISTRY: Running(
            timers=[
                Timer("beat", body("beat"), 60.0, 0.1, spread=True),  # 0.1 + 0.5 x 0.6
                Timer("report", body("report"), 60.0, 0.1, spread=True),  # 0.1 + 0.9 x 0.6
                Timer("local", body("local"), 60.0, 0.1),  # no spread
            ]
        )
    }
    started, wall = time.monotonic(), datetime.now(UTC)
    _hand_over(rt)
    scheduler = rt.supervisor.scheduler
    due = {
        name: (when - wall).total_seconds()
        for name in runs
        if (when := scheduler.next_run(name)) is not None
    }
    assert abs(due["beat"] - 0.4) < 0.05 and abs(due["report"] - 0.64) < 0.05, due
    assert abs(due["local"] - 0.1) < 0.05, due
    rt.supervisor.start_loops()
    try:
        await asyncio.wait_for(all_ran.wait(), timeout=10)
    finally:
        await rt.supervisor.stop_loops(within=1.0)
    first = {name: times[0] - started for name, times in runs.items()}
    assert first["local"] < first["beat"] < first["report"], first
    assert first["beat"] >= 0.38 and first["report"] >= 0.62, first
    # the next runs keep the interval from the first (plus the scheduler's own jitter)
    beat = scheduler.next_run("beat")
    assert beat is not None and (beat - wall).total_seconds() >= 60.0
