"""The supervisor and the shutdown deadline: start, restart with backoff, stop in budget."""

from __future__ import annotations

import asyncio

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


async def test_a_step_is_cut_off_at_its_budget() -> None:
    finished = asyncio.Event()

    async def slow() -> None:
        await asyncio.sleep(60)

    async def quick() -> None:
        finished.set()

    assert not await within("slow", 0.05, slow)
    assert await within("quick", 1.0, quick) and finished.is_set()
    assert not await within("nothing left", 0.0, quick)


async def test_a_failing_task_is_restarted_and_shown() -> None:
    supervisor = Supervisor(backoff_initial=0.01, backoff_max=0.02)
    component = Component("worker", True, "test")
    runs = 0

    async def body(stopping: asyncio.Event) -> None:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise RuntimeError(f"crash {runs}")
        await stopping.wait()

    supervisor.start("worker", body, restart=True, component=component)

    async def third_run() -> bool:
        return runs == 3

    await eventually(third_run)
    status = supervisor.status()["worker"]
    assert (status["state"], status["restarts"], status["failures_in_a_row"]) == ("running", 2, 2)
    assert status["last_error"] == "RuntimeError: crash 2"
    assert component.state == "failing"
    await supervisor.stop_all(budget=1.0)
    assert supervisor.status()["worker"]["state"] == "stopped"


async def test_failures_in_a_row_reset_after_a_healthy_run() -> None:
    clock = FakeClock()
    supervisor = Supervisor(backoff_initial=0.01, backoff_max=0.02, healthy_after=60, clock=clock)
    runs = 0
    release = asyncio.Event()

    async def body(stopping: asyncio.Event) -> None:
        nonlocal runs
        runs += 1
        if runs == 2:
            clock.now += 120  # this run was healthy for two minutes before it failed
            await release.wait()
        if runs <= 2:
            raise RuntimeError(f"crash {runs}")
        await stopping.wait()

    supervisor.start("loop", body, restart=True)

    async def at(count: int) -> bool:
        return runs == count

    await eventually(lambda: at(2))
    assert supervisor.status()["loop"]["failures_in_a_row"] == 1
    release.set()
    await eventually(lambda: at(3))
    assert supervisor.status()["loop"]["failures_in_a_row"] == 1, "a new episode, not two"
    await supervisor.stop_all(budget=1.0)


async def test_a_task_without_restart_stays_down() -> None:
    supervisor = Supervisor()

    async def body(stopping: asyncio.Event) -> None:
        raise ValueError("bad config")

    entry = supervisor.start("once", body, restart=False)
    assert entry.task is not None
    await entry.task
    assert supervisor.status()["once"]["state"] == "failed"


async def test_stop_asks_first_then_cancels_what_does_not_listen() -> None:
    supervisor = Supervisor()
    polite_done = asyncio.Event()

    async def polite(stopping: asyncio.Event) -> None:
        await stopping.wait()
        polite_done.set()

    async def deaf(stopping: asyncio.Event) -> None:
        await asyncio.sleep(3600)

    supervisor.start("polite", polite, restart=True)
    supervisor.start("deaf", deaf, restart=True)
    await supervisor.stop_all(budget=0.1)
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
