"""The periodic loops: robust to a wall clock that jumps, and a dependency that is down is
an outage (a warning and a state), not an error with a traceback at every tick.

APScheduler reads the wall clock through `datetime.now`; the tests move that clock (and
the scheduler's own) by an offset, never the machine's."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from datetime import datetime, timedelta, tzinfo

import apscheduler.executors.base
import apscheduler.schedulers.base
import pytest

from app.metrics import Metrics
from app.services.scheduling import Scheduler
from app.services.supervision import Supervisor
from tests.support.polling import eventually


class WallClock:
    offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


class _Shifted(datetime):
    clock = WallClock()

    @classmethod
    def now(cls, tz: tzinfo | None = None) -> _Shifted:
        real = datetime.now(tz) + timedelta(seconds=cls.clock.offset)
        return cls.fromtimestamp(real.timestamp(), tz)


@pytest.fixture
def wall(monkeypatch: pytest.MonkeyPatch) -> Iterator[WallClock]:
    clock = WallClock()
    monkeypatch.setattr(_Shifted, "clock", clock)
    monkeypatch.setattr(apscheduler.schedulers.base, "datetime", _Shifted)
    monkeypatch.setattr(apscheduler.executors.base, "datetime", _Shifted)
    yield clock


@pytest.fixture
async def scheduler(wall: WallClock) -> AsyncIterator[Supervisor]:
    made = Supervisor(scheduler=Scheduler(jitter_fraction=0.0, wall=wall), metrics=Metrics())
    yield made
    await made.stop_loops(within=1.0)


class Counting:
    def __init__(self) -> None:
        self.runs = 0
        self.fail: Exception | None = None

    async def __call__(self) -> None:
        self.runs += 1
        if self.fail is not None:
            raise self.fail


@pytest.mark.parametrize("jump", [-600.0, 3_600.0])
async def test_a_wall_clock_jump_keeps_every_loop_on_its_cadence(
    scheduler: Supervisor, wall: WallClock, jump: float
) -> None:
    body = Counting()
    scheduler.add_loop("beat", body, every=0.3, first_after=0.05)
    stopping = asyncio.Event()
    watch = asyncio.create_task(scheduler.scheduler.watch_clock(stopping, every=0.1))
    scheduler.start_loops()
    try:
        await eventually(lambda: _at_least(body, 2), within=10)
        wall.offset += jump  # set back ten minutes, or an hour ahead
        seen = body.runs
        await eventually(lambda: _at_least(body, seen + 3), within=10)
        if jump > 0:  # ahead: the loop did not run all the hour's ticks at once either
            assert body.runs < seen + 10
    finally:
        stopping.set()
        await watch


async def _at_least(body: Counting, runs: int) -> bool:
    return body.runs >= runs


async def test_an_outage_warns_once_and_says_when_it_is_over(
    scheduler: Supervisor, caplog: pytest.LogCaptureFixture
) -> None:
    body = Counting()
    body.fail = ConnectionError("kube-apiserver: connection refused")
    scheduler.add_loop("view", body, every=0.05, first_after=0.01, outage=(ConnectionError,))
    with caplog.at_level(logging.INFO, logger="app.services.supervision"):
        scheduler.start_loops()
        await eventually(lambda: _at_least(body, 5), within=10)
        loop = scheduler.loops()["view"]
        assert (loop["state"], loop["last_error"]) == (
            "unavailable", "kube-apiserver: connection refused"
        )  # fmt: skip
        assert loop["failures_in_a_row"] >= 5
        body.fail = None
        seen = body.runs

        async def recovered() -> bool:
            return body.runs > seen and scheduler.loops()["view"]["state"] == "ok"

        await eventually(recovered, within=10)
    records = [r for r in caplog.records if r.name == "app.services.supervision"]
    assert [r.levelno for r in records if "unavailable" in r.getMessage()] == [logging.WARNING]
    assert not any(r.levelno >= logging.ERROR or r.exc_info for r in records)
    assert any("ran again after" in r.getMessage() for r in records)
    assert scheduler.loops()["view"]["failures_in_a_row"] == 0


async def test_any_other_error_is_a_failure_with_its_traceback(
    scheduler: Supervisor, caplog: pytest.LogCaptureFixture
) -> None:
    body = Counting()
    body.fail = KeyError("a bug")
    scheduler.add_loop("view", body, every=0.05, first_after=0.01, outage=(ConnectionError,))
    with caplog.at_level(logging.INFO, logger="app.services.supervision"):
        scheduler.start_loops()
        await eventually(lambda: _at_least(body, 2), within=10)
    assert scheduler.loops()["view"]["state"] == "failing"
    assert any(r.levelno == logging.ERROR and r.exc_info for r in caplog.records)
