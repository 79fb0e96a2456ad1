"""A component's record: a run's outcome describes that run (its detail replaces the last
one's, the start's facts stay), and a component with a live state is what `live` says
whenever it is read, its times saying when that changed."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from app.domain.components import Component, ComponentState, Outcome

T0 = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)


def test_a_run_s_detail_replaces_the_last_one_s_and_the_facts_stay() -> None:
    component = Component("sync", True, "test")
    component.facts["url"] = "https://backend.example"
    component.record(T0, Outcome.ok(revision="r1", counts={"created": 1}))
    component.record(T0, Outcome.failed("HTTP 502"))
    assert component.detail == {"url": "https://backend.example"}
    component.record(T0, Outcome.skipped("busy", standby="held"))
    assert component.detail == {"url": "https://backend.example", "standby": "held"}
    assert component.as_dict()["detail"] == component.detail


LIVE = [
    # (case, what live says at each read, state after, failures in a row, failing since n)
    ("nothing known yet: the record stands", [None], ComponentState.STARTING, 0, None),
    ("connected", [Outcome.ok()], ComponentState.OK, 0, None),
    ("lost", [Outcome.ok(), Outcome.unavailable("EOF")], ComponentState.FAILING, 1, 1),
    ("still lost, read again: one failure, since the first",
     [Outcome.unavailable("EOF")] * 3, ComponentState.FAILING, 1, 0),
    ("a new error is a new failure, the outage the same",
     [Outcome.unavailable("EOF"), Outcome.unavailable("refused")], ComponentState.FAILING, 2, 0),
    ("back", [Outcome.unavailable("EOF"), Outcome.ok()], ComponentState.OK, 0, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("reads", "state", "failures", "since"), [r[1:] for r in LIVE], ids=[r[0] for r in LIVE]
)
def test_a_live_state_is_read_when_the_record_is(
    reads: list[Outcome | None], state: ComponentState, failures: int, since: int | None
) -> None:
    at = [T0]
    component = Component("nats", True, "test", clock=lambda: at[0])
    said = iter(reads)
    component.live = lambda: next(said)
    for n in range(len(reads)):
        component.refresh(T0 + timedelta(seconds=n))
    component.live = lambda: reads[-1]  # asked again when the state is read: still so
    at[0] = T0 + timedelta(seconds=len(reads))
    assert component.state is state
    assert component.consecutive_failures == failures
    expected = None if since is None else T0 + timedelta(seconds=since)
    assert component.failing_since == expected


def test_a_component_switched_off_is_not_asked() -> None:
    component = Component("worker", True, "test")
    component.live = lambda: Outcome.unavailable("EOF")
    component.switch_off("nats-server is not running")
    component.refresh(T0)
    assert (component.state, component.healthy) == (ComponentState.OFF, True)


def test_reading_the_state_asks_the_live_state_at_the_component_s_clock() -> None:
    at = [T0]
    connected = [True]
    component = Component("nats", True, "test", clock=lambda: at[0])
    component.live = lambda: Outcome.ok() if connected[0] else Outcome.unavailable("EOF")
    assert component.state is ComponentState.OK
    connected[0], at[0] = False, T0 + timedelta(seconds=5)
    assert not component.healthy
    assert component.as_dict()["failing_since"] == T0 + timedelta(seconds=5)
