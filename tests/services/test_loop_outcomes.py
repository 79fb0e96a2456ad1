"""A loop's outcome is recorded in one place: the supervisor's guard.

Each row is one run: what the body returns (or raises), after how many failed runs, and
what the guard records of it — the component's state, the loop's state, the
`scheduled_runs_total` label, the alerts the outcome carries, the log level, and the
run's duration. The runs are made with
`run_now`, so no schedule and no clock is involved."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from app.domain.components import Component, ComponentState, Outcome
from app.metrics import Metrics
from app.services.alerting import Alerter
from app.services.supervision import Supervisor


class Unreachable(ConnectionError):
    pass


@dataclass(frozen=True)
class Row:
    id: str
    run: Outcome | Exception | None
    failed_before: int  # failed runs (FAILED outcomes) just before this one
    component: ComponentState
    loop: str
    label: str
    alerts: tuple[str, ...]
    log: int | None  # the level of the guard's line about this run (None: none)
    traceback: bool = False


FAILED = Outcome.failed("the backend answered 502")
ROWS = [
    Row("ok", Outcome.ok(revision="r1"), 0, ComponentState.OK, "ok", "ok", (), None),
    Row("none is ok", None, 0, ComponentState.OK, "ok", "ok", (), None),
    Row("ok after failures", Outcome.ok(), 2, ComponentState.OK, "ok", "ok", (), logging.INFO),
    Row("failed", FAILED, 0, ComponentState.FAILING, "failing", "failed", (), logging.WARNING),
    Row(
        "failed the third time",
        FAILED,
        2,
        ComponentState.FAILING,
        "failing",
        "failed",
        (),  # one policy: the outage watch alerts once the component has failed a grace
        logging.WARNING,
    ),
    Row(
        "raised",
        KeyError("a bug"),
        0,
        ComponentState.FAILING,
        "failing",
        "error",
        (),
        logging.ERROR,
        traceback=True,
    ),
    Row(
        "outage raised",
        Unreachable("refused"),
        0,
        ComponentState.FAILING,
        "unavailable",
        "unavailable",
        (),
        logging.WARNING,
    ),
    Row(
        "outage returned",
        Outcome.unavailable("refused"),
        0,
        ComponentState.FAILING,
        "unavailable",
        "unavailable",
        (),
        logging.WARNING,
    ),
    Row(
        "skipped",
        Outcome.skipped("busy"),
        0,
        ComponentState.STARTING,
        "waiting",
        "skipped",
        (),
        None,
    ),
    Row(
        "skipped after failures keeps failing",
        Outcome.skipped("busy"),
        1,
        ComponentState.FAILING,
        "failing",
        "skipped",
        (),
        None,
    ),
    Row(
        "an event alert",
        Outcome.failed("rolled back").alerting("update:rolled-back:2", "text"),
        0,
        ComponentState.FAILING,
        "failing",
        "failed",
        ("update:rolled-back:2",),
        logging.WARNING,
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
async def test_the_guard_records_each_outcome(row: Row, caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    alerts = Alerter(node_id="n1", metrics=metrics, window_seconds=3600, deliver=False)
    supervisor = Supervisor(metrics=metrics, alerts=alerts)
    component = Component("sync", True, "test")
    queue: list[Outcome | Exception | None] = [*([FAILED] * row.failed_before), row.run]

    async def body() -> Outcome | None:
        run = queue.pop(0)
        if isinstance(run, Exception):
            raise run
        return run

    supervisor.add_loop(
        "sync",
        body,
        every=3600,
        what="deployment sync",
        outage=(Unreachable,),
        component=component,
    )
    for _ in range(row.failed_before):
        await supervisor.run_now("sync")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="app.services.supervision"):
        returned = await supervisor.run_now("sync")

    assert component.state is row.component
    loop = supervisor.loops()["sync"]
    assert loop["state"] == row.loop
    assert [a.key for a in alerts.recent] == list(row.alerts)
    runs = metrics.job_runs.labels("sync", row.label)._value.get()
    assert runs == 1 + (row.failed_before if row.label == "failed" else 0)
    lines = [
        r for r in caplog.records if r.levelno > logging.DEBUG and r.name.endswith("supervision")
    ]
    assert [r.levelno for r in lines] == ([row.log] if row.log is not None else [])
    assert any(r.exc_info for r in lines) is row.traceback
    timed = metrics.registry.get_sample_value(
        "workload_manager_loop_duration_seconds_count", {"loop": "sync"}
    )
    assert timed == 1 + row.failed_before  # every run measured once, by the guard
    if isinstance(row.run, Outcome):
        assert returned == row.run
        if row.run.detail:
            assert component.detail["revision"] == "r1"


async def test_a_run_outside_the_schedule_is_recorded_like_one() -> None:
    """An operator's sync (POST /v1/sync) goes through `record`: one place again."""
    metrics = Metrics()
    supervisor = Supervisor(metrics=metrics)
    component = Component("sync", True, "test")

    async def never() -> None:
        raise AssertionError("not scheduled in this test")

    supervisor.add_loop("sync", never, every=3600, component=component)
    supervisor.record("sync", Outcome.failed("2 workload(s) failed"))
    assert component.state is ComponentState.FAILING
    assert supervisor.loops()["sync"]["last_error"] == "2 workload(s) failed"
    assert metrics.job_runs.labels("sync", "failed")._value.get() == 1


async def test_a_task_that_returns_an_outcome_has_it_recorded() -> None:
    supervisor = Supervisor()
    component = Component("self_update", True, "test")

    async def resume(_stopping: object) -> Outcome:
        return Outcome.failed("update to 0.2.0 rolled back: the new pod was not available")

    entry = supervisor.start("self-update-resume", resume, restart=False, component=component)
    assert entry.task is not None
    await entry.task
    assert component.state is ComponentState.FAILING
    assert "rolled back" in (component.last_error or "")
