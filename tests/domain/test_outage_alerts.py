"""`outage_alerts`: one alert when a component has failed for the grace period, one when
it is no longer failing; nothing for a short failure, a component off, or twice."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest

from app.domain.components import Component, outage_alerts

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
GRACE = 60.0


def component(state: str, *, failing_for: float = 0.0, enabled: bool = True) -> Component:
    made = Component("nats", enabled, "connects")
    if state == "failing":
        made.failed(NOW - timedelta(seconds=failing_for), "disconnected from nats://n:4222: EOF")
    elif state == "ok":
        made.succeeded(NOW)
    elif state == "off":
        made.switch_off("NATS_URL is not set")
    return made


@dataclass(frozen=True)
class Row:
    state: str
    failing_for: float
    alerted: bool
    keys: tuple[str, ...]
    alerted_after: bool


ROWS = {
    "failing for less than the grace: nothing": Row("failing", 59.9, False, (), False),
    "failing for the grace: down": Row("failing", 60.0, False, ("nats:down",), True),
    "failing long, alerted already: nothing more": Row("failing", 600.0, True, (), True),
    "ok, never alerted: nothing": Row("ok", 0.0, False, (), False),
    "ok after an alert: recovered": Row("ok", 0.0, True, ("nats:recovered",), False),
    "starting, never alerted: nothing": Row("starting", 0.0, False, (), False),
    "switched off after an alert: recovered (off)": Row(
        "off", 0.0, True, ("nats:recovered",), False
    ),
    "off: nothing": Row("off", 0.0, False, (), False),
}


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_outage_alerts(row: Row) -> None:
    made = component(row.state, failing_for=row.failing_for)
    alerted = frozenset({"nats"}) if row.alerted else frozenset()
    raised, after = outage_alerts([made], alerted, now=NOW, grace=GRACE)
    assert tuple(key for key, _text in raised) == row.keys
    assert ("nats" in after) == row.alerted_after


def test_the_alert_names_how_long_and_why() -> None:
    raised, _ = outage_alerts([component("failing", failing_for=75)], frozenset(), now=NOW,
                              grace=GRACE)  # fmt: skip
    assert raised == [("nats:down", "nats down for 75 s: disconnected from nats://n:4222: EOF")]


def test_a_failure_after_recovery_counts_from_its_own_start() -> None:
    made = component("failing", failing_for=600)
    made.succeeded(NOW - timedelta(seconds=30))
    made.failed(NOW - timedelta(seconds=10), "again")
    assert made.failing_since == NOW - timedelta(seconds=10)
    assert outage_alerts([made], frozenset(), now=NOW, grace=GRACE) == ([], frozenset())
