"""The periodic loops: robust to a wall clock that jumps, and a dependency that is down is
an outage (a warning and a state), not an error with a traceback at every tick.

APScheduler reads the wall clock through `datetime.now`. In these tests that clock (and the
scheduler's own) advances with looptime's fake loop time and jumps by an offset, never the
machine's: the loops run at their real cadence (every minute) in a fraction of a second."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, tzinfo

import apscheduler.executors.base
import apscheduler.schedulers.base
import pytest

from app.domain.components import Cadence, Outcome
from app.metrics import Metrics
from app.services.scheduling import Scheduler
from app.services.supervision import Supervisor
from tests.support.polling import eventually

pytestmark = pytest.mark.looptime

MINUTE = 60.0


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


class WallClock:
    """Starts at the real time, advances with the loop's time, jumps by `offset`."""

    def __init__(self) -> None:
        self.offset = 0.0
        self._real_start = time.time()
        self._loop_start = _loop_time()

    def __call__(self) -> float:
        return self._real_start + (_loop_time() - self._loop_start) + self.offset


class _Shifted(datetime):
    clock: WallClock

    @classmethod
    def now(cls, tz: tzinfo | None = None) -> _Shifted:
        return cls.fromtimestamp(cls.clock(), tz)


@pytest.fixture
async def wall(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[WallClock]:
    clock = WallClock()
    monkeypatch.setattr(_Shifted, "clock", clock, raising=False)
    monkeypatch.setattr(apscheduler.schedulers.base, "datetime", _Shifted)
    monkeypatch.setattr(apscheduler.executors.base, "datetime", _Shifted)
    yield clock


@pytest.fixture
async def scheduler(wall: WallClock) -> AsyncIterator[Supervisor]:
    timing = Scheduler(jitter_fraction=0.0, wall=wall, steady=_loop_time)
    made = Supervisor(scheduler=timing, metrics=Metrics(), clock=_loop_time)
    yield made
    await made.stop_loops(within=10.0)


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    await eventually(check, step=1.0)  # one loop-time second a poll


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
    scheduler.add_loop("beat", body, every=MINUTE, first_after=5.0)
    scheduler.start_loops()  # the scheduler's clock watch with it
    await _until(lambda: _at_least(body, 2))
    wall.offset += jump  # set back ten minutes, or an hour ahead
    seen, jumped_at = body.runs, _loop_time()
    await _until(lambda: _at_least(body, seen + 3))
    # three more runs in about three minutes: not ten minutes late, and (ahead) not
    # all the hour's sixty ticks at once
    assert 2 * MINUTE <= _loop_time() - jumped_at <= 3 * MINUTE + 5
    assert body.runs == seen + 3


async def _at_least(body: Counting, runs: int) -> bool:
    return body.runs >= runs


async def test_an_outage_warns_once_and_says_when_it_is_over(
    scheduler: Supervisor, caplog: pytest.LogCaptureFixture
) -> None:
    body = Counting()
    body.fail = ConnectionError("kube-apiserver: connection refused")
    scheduler.add_loop("view", body, every=MINUTE, first_after=1.0, outage=(ConnectionError,))
    with caplog.at_level(logging.INFO, logger="app.services.supervision"):
        scheduler.start_loops()
        await _until(lambda: _at_least(body, 5))
        loop = scheduler.loops()["view"]
        assert (loop["state"], loop["last_error"]) == (
            "unavailable", "kube-apiserver: connection refused"
        )  # fmt: skip
        assert loop["failures_in_a_row"] >= 5
        body.fail = None
        seen = body.runs

        async def recovered() -> bool:
            return body.runs > seen and scheduler.loops()["view"]["state"] == "ok"

        await _until(recovered)
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
    scheduler.add_loop("view", body, every=MINUTE, first_after=1.0, outage=(ConnectionError,))
    with caplog.at_level(logging.INFO, logger="app.services.supervision"):
        scheduler.start_loops()
        await _until(lambda: _at_least(body, 2))
    assert scheduler.loops()["view"]["state"] == "failing"
    assert any(r.levelno == logging.ERROR and r.exc_info for r in caplog.records)


class Answers:
    """A loop body that returns the outcomes it is given, one a run (then OK)."""

    def __init__(self, *outcomes: Outcome) -> None:
        self.left = list(outcomes)
        self.at: list[float] = []

    async def __call__(self) -> Outcome:
        self.at.append(_loop_time())
        return self.left.pop(0) if self.left else Outcome.ok()


async def _runs(body: Answers, n: int) -> bool:
    return len(body.at) >= n


async def test_a_failed_run_is_tried_again_with_backoff_not_at_the_interval(
    scheduler: Supervisor,
) -> None:
    """A sync that fails on a 502 runs again after a jittered backoff that grows (10 s,
    20 s, 40 s: each in its upper half), not after its 10-minute interval; once it
    succeeds it is back on its interval."""
    failed = Outcome.failed("HTTP 502")
    body = Answers(failed, failed, failed)
    scheduler.add_loop("sync", body, every=10 * MINUTE, first_after=1.0)
    scheduler.start_loops()
    await _until(lambda: _runs(body, 5))
    gaps = [b - a for a, b in itertools.pairwise(body.at)]
    for gap, step in zip(gaps, (10.0, 20.0, 40.0), strict=False):
        assert step / 2 - 1 <= gap <= step + 1, gaps
    assert 10 * MINUTE - 1 <= gaps[3] <= 10 * MINUTE + 1, gaps  # back on its interval


async def test_a_run_may_ask_for_its_next_time(scheduler: Supervisor) -> None:
    """A backend's Retry-After (or an interval it asks for) sets the next run, sooner or
    later than the interval; the one after is at the interval again."""
    body = Answers(
        Outcome.failed("HTTP 503").retrying(300.0), Outcome.ok().retrying(5.0), Outcome.ok()
    )
    scheduler.add_loop("report", body, every=MINUTE, first_after=1.0)
    scheduler.start_loops()
    await _until(lambda: _runs(body, 4))
    gaps = [b - a for a, b in itertools.pairwise(body.at)]
    assert [round(g) for g in gaps[:3]] == [300, 5, 60], gaps


async def test_a_retry_after_shorter_than_the_backoff_is_a_floor_not_a_shortcut(
    scheduler: Supervisor,
) -> None:
    """A failed run told `Retry-After: 0` (a proxy's, or a date already past on the node's
    clock) still waits its backoff (10 s, then 20 s: each in its upper half): the
    backend's word can put a retry off, never bring a fleet back within a second."""
    failed = Outcome.failed("HTTP 503").retrying(0.0)
    body = Answers(failed, failed, Outcome.ok())
    scheduler.add_loop("sync", body, every=10 * MINUTE, first_after=1.0)
    scheduler.start_loops()
    await _until(lambda: _runs(body, 3))
    gaps = [b - a for a, b in itertools.pairwise(body.at)]
    for gap, step in zip(gaps, (10.0, 20.0), strict=True):
        assert step / 2 - 1 <= gap <= step + 1, gaps


async def test_a_run_cannot_put_its_loop_off_past_an_hour(scheduler: Supervisor) -> None:
    """A Retry-After of a day (or of years) is the backend's word, bounded: the clients
    cap it at RETRY_AFTER_MAX_SECONDS (an hour at most) and jitter it; whatever a body
    asks, the loop runs again within the hour and that jitter (6 minutes)."""
    body = Answers(Outcome.failed("HTTP 503").retrying(86_400.0))
    scheduler.add_loop("sync", body, every=10 * MINUTE, first_after=1.0)
    scheduler.start_loops()
    await _until(lambda: _runs(body, 2))
    assert round(body.at[1] - body.at[0]) == 3600 + 360


async def test_a_retry_after_shows_on_the_loop_until_its_next_run(scheduler: Supervisor) -> None:
    """`/v1/status` `loops`: "Retry-After until <time>" from the run that was put off to
    the run after it."""
    body = Answers(Outcome.failed("HTTP 429").retrying(30.0), Outcome.ok())
    scheduler.add_loop("report", body, every=MINUTE, first_after=1.0)
    scheduler.start_loops()
    await _until(lambda: _runs(body, 1))
    await asyncio.sleep(0.5)
    loop = scheduler.loops()["report"]
    until = loop["retry_after_until"]
    assert until is not None
    assert 29 <= (until - datetime.now(UTC)).total_seconds() <= 30
    assert loop["waiting"] == "Retry-After until " + until.isoformat(timespec="seconds").replace(
        "+00:00", "Z"
    )
    await _until(lambda: _runs(body, 2))
    await asyncio.sleep(0.5)
    after = scheduler.loops()["report"]
    assert (after["retry_after_until"], after["waiting"], after["state"]) == (None, None, "ok")
    assert round(body.at[1] - body.at[0]) == 30


async def test_an_interval_the_backend_asks_for_is_kept_within_bounds_then_dropped(
    scheduler: Supervisor,
) -> None:
    """A cadence changes the loop's interval at once, clamped to its bounds; an answer
    that asks for none puts it back on its configured interval; a run with no answer
    (a failure) changes nothing but its own retry; a loop without bounds ignores it."""
    body = Answers(
        Outcome.ok().paced(Cadence(20.0)),  # at 1: every 20 s from now
        Outcome.ok(),  # no answer said anything: still 20 s
        Outcome.ok().paced(Cadence(1.0)),  # below the bounds: 10 s
        Outcome.ok().paced(Cadence(10_000.0)),  # above: 120 s
        Outcome.ok().paced(Cadence(None)),  # none asked: back to 60 s
        Outcome.ok(),
        Outcome.ok(),
    )
    scheduler.add_loop("report", body, every=MINUTE, first_after=1.0, bounds=(10.0, 120.0))
    unbounded = Answers(Outcome.ok().paced(Cadence(5.0)), Outcome.ok())
    scheduler.add_loop("other", unbounded, every=MINUTE, first_after=1.0)
    scheduler.start_loops()
    await _until(lambda: _runs(body, 7))
    gaps = [round(b - a) for a, b in itertools.pairwise(body.at)]
    assert gaps == [20, 20, 10, 120, 60, 60], gaps
    assert [round(b - a) for a, b in itertools.pairwise(unbounded.at)][:1] == [60]
    loop = scheduler.loops()["report"]
    assert (loop["interval_seconds"], loop["interval_from"]) == (60.0, "settings")


async def test_the_interval_asked_for_shows_on_the_loop(scheduler: Supervisor) -> None:
    body = Answers(Outcome.ok().paced(Cadence(20.0)))
    scheduler.add_loop("sync", body, every=10 * MINUTE, first_after=1.0, bounds=(10.0, 60.0))
    scheduler.start_loops()
    await _until(lambda: _runs(body, 1))
    await asyncio.sleep(0.5)
    loop = scheduler.loops()["sync"]
    assert (loop["interval_seconds"], loop["interval_from"]) == (20.0, "backend")
    assert scheduler.interval("sync") == 20.0


async def test_a_run_longer_than_its_interval_skips_ticks_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One instance at a time: a tick that finds the loop's last run still going is
    skipped, a normal turn (the uptime keeper waits up to 30 s for the cluster lock on a
    15 s interval), said at DEBUG, not with APScheduler's WARNING."""
    plain = Scheduler()
    release = asyncio.Event()
    runs: list[float] = []

    async def slow() -> None:
        runs.append(time.monotonic())
        await release.wait()

    def skips() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "still running" in r.getMessage()]

    async def skipped_twice() -> bool:
        return len(skips()) >= 2

    plain.add("slow", slow, every=0.05, first_after=0.0)
    with caplog.at_level(logging.DEBUG):
        plain.start()
        try:
            await eventually(skipped_twice)
            release.set()
        finally:
            await plain.stop(within=5.0)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == []
    assert {r.levelno for r in skips()} == {logging.DEBUG} and len(runs) >= 1
