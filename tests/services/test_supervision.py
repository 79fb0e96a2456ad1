"""The supervisor and the shutdown deadline: start, restart with backoff, stop in budget.

The async tests run on looptime's fake loop time: they use the real backoff (1 s growing
to 60 s) and real budgets, and assert when things happened in loop time, not how long the
machine took."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from app.domain.components import Component
from app.services.supervision import Deadline, Supervisor, within
from tests.support.polling import eventually


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_deadline_starts_once_and_shares_what_is_left() -> None:
    clock = FakeClock()
    deadline = Deadline(20.0, clock=clock)
    assert not deadline.began and deadline.remaining() == 20.0
    deadline.begin()
    clock.now += 5
    deadline.begin()  # a second start changes nothing
    assert deadline.remaining() == 15.0
    assert deadline.budget(reserve=5.0) == 10.0
    assert deadline.budget(cap=3.0, reserve=5.0) == 3.0
    clock.now += 30
    assert deadline.remaining() == 0.0 and deadline.budget(reserve=1.0) == 0.0


def _now() -> float:
    return asyncio.get_running_loop().time()


@pytest.mark.looptime
async def test_a_step_is_cut_off_at_its_budget() -> None:
    finished = asyncio.Event()

    async def slow() -> None:
        await asyncio.sleep(60)

    async def quick() -> None:
        finished.set()

    began = _now()
    assert not await within("slow", 5.0, slow)
    assert _now() - began == pytest.approx(5.0)
    assert await within("quick", 1.0, quick) and finished.is_set()
    assert not await within("nothing left", 0.0, quick)
    assert _now() - began == pytest.approx(5.0)


@pytest.mark.looptime
async def test_a_failing_task_is_restarted_after_a_growing_jittered_delay() -> None:
    supervisor = Supervisor(clock=_now)  # the real backoff: 1 s, doubling, at most 60 s
    component = Component("worker", True, "test")
    started: list[float] = []

    async def body(stopping: asyncio.Event) -> None:
        started.append(_now())
        if len(started) < 4:
            raise RuntimeError(f"crash {len(started)}")
        await stopping.wait()

    supervisor.start("worker", body, restart=True, component=component)

    async def fourth_run() -> bool:
        return len(started) == 4

    await eventually(fourth_run)
    gaps = [later - earlier for earlier, later in itertools.pairwise(started)]
    for failures, gap in enumerate(gaps, start=1):
        step = 2.0 ** (failures - 1)
        assert step / 2 <= gap <= step, (failures, gaps)
    status = supervisor.status()["worker"]
    assert (status["state"], status["restarts"], status["failures_in_a_row"]) == ("running", 3, 3)
    assert status["last_error"] == "RuntimeError: crash 3"
    assert component.state == "failing"
    await supervisor.stop_all(budget=1.0)
    assert supervisor.status()["worker"]["state"] == "stopped"


@pytest.mark.looptime
async def test_failures_in_a_row_reset_after_a_healthy_run() -> None:
    supervisor = Supervisor(healthy_after=60, clock=_now)
    in_a_row: list[int] = []  # as each run starts

    async def body(stopping: asyncio.Event) -> None:
        in_a_row.append(supervisor.status()["loop"]["failures_in_a_row"])
        if len(in_a_row) == 2:
            await asyncio.sleep(120)  # this run is healthy for two minutes, then fails
        if len(in_a_row) <= 3:
            raise RuntimeError(f"crash {len(in_a_row)}")
        await stopping.wait()

    supervisor.start("loop", body, restart=True)

    async def fourth_run() -> bool:
        return len(in_a_row) == 4

    await eventually(fourth_run)
    # crash 1: one in a row; crash 2 ended a healthy run: a new episode, one again;
    # crash 3 came at once: two in a row
    assert in_a_row == [0, 1, 1, 2]
    await supervisor.stop_all(budget=1.0)


async def test_a_task_without_restart_stays_down() -> None:
    supervisor = Supervisor()

    async def body(stopping: asyncio.Event) -> None:
        raise ValueError("bad config")

    entry = supervisor.start("once", body, restart=False)
    assert entry.task is not None
    await entry.task
    assert supervisor.status()["once"]["state"] == "failed"


@pytest.mark.looptime
async def test_stop_asks_first_then_cancels_what_does_not_listen() -> None:
    supervisor = Supervisor()
    polite_done = asyncio.Event()

    async def polite(stopping: asyncio.Event) -> None:
        await asyncio.sleep(2)  # finishing takes a while, within the budget
        await stopping.wait()
        polite_done.set()

    async def deaf(stopping: asyncio.Event) -> None:
        await asyncio.sleep(3600)

    supervisor.start("polite", polite, restart=True)
    supervisor.start("deaf", deaf, restart=True)
    began = _now()
    await supervisor.stop_all(budget=10.0)
    assert _now() - began == pytest.approx(10.0), "the deaf one had the whole budget"
    assert polite_done.is_set()
    assert {n: s["state"] for n, s in supervisor.status().items()} == {
        "deaf": "stopped",
        "polite": "stopped",
    }


@pytest.mark.parametrize(
    ("failures", "low", "high"),
    [(1, 0.5, 1.0), (2, 1.0, 2.0), (3, 2.0, 4.0), (7, 30.0, 60.0), (50, 30.0, 60.0)],
)
def test_backoff_grows_with_jitter_and_a_cap(failures: int, low: float, high: float) -> None:
    supervisor = Supervisor(backoff_initial=1.0, backoff_max=60.0)
    delays = [supervisor.backoff(failures) for _ in range(50)]
    assert all(low <= d <= high for d in delays)
    assert len(set(delays)) > 1, "jittered"
