"""The restart rule of uptime management, table-driven."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import pytest

from app.domain.uptime import DAY, WEEK, RestartPolicy, UptimeRecord, decide_restart

POLICY = RestartPolicy(
    after_seconds=120, backoff_seconds=300, backoff_max_seconds=1200,
    per_workload_per_hour=3, per_node_per_hour=5,
)  # fmt: skip
NOW = 10_000.0


@pytest.mark.parametrize(
    ("status", "managed", "bad_for", "mine", "node", "restart", "budget", "reason"),
    [
        ("healthy", True, None, (), (), False, False, ""),
        ("degraded", True, None, (), (), False, False, ""),
        ("rolling-out", True, 500, (), (), False, False, ""),
        # never pinged: unknown, not stale; not restarted for silence
        ("unknown", True, 5000, (), (), False, False, ""),
        ("unhealthy", True, 60, (), (), False, False, "restarted after 120 s"),
        ("unhealthy", False, 500, (), (), False, False, "not a managed Deployment"),
        ("unhealthy", True, 120, (), (), True, False, "unhealthy for 120 s"),
        ("stale", True, 300, (), (), True, False, "stale for 300 s"),
        # backoff: 300 s after the first restart, 600 after the second
        ("unhealthy", True, 500, (NOW - 200,), (), False, False, "next restart in 100 s"),
        ("unhealthy", True, 500, (NOW - 300,), (), True, False, "unhealthy"),
        ("unhealthy", True, 500, (NOW - 900, NOW - 500), (), False, False, "in 100 s (backoff)"),
        ("unhealthy", True, 500, (NOW - 1300, NOW - 600), (), True, False, "unhealthy"),
        # budgets over the last hour
        ("unhealthy", True, 500, (NOW - 3000, NOW - 2000, NOW - 1000), (), False, True,
         "3 restarts of this workload"),
        ("unhealthy", True, 500, (NOW - 4000, NOW - 2000, NOW - 1300), (), True, False, ""),
        ("unhealthy", True, 500, (), (NOW - 10,) * 5, False, True, "node's restart budget"),
        ("unhealthy", True, 500, (), (NOW - 3601,) * 5, True, False, ""),
    ],
)  # fmt: skip
def test_decide_restart(
    status: str, managed: bool, bad_for: float | None, mine: Sequence[float],
    node: Sequence[float], restart: bool, budget: bool, reason: str,
) -> None:  # fmt: skip
    decision = decide_restart(
        status, managed=managed, bad_since=None if bad_for is None else NOW - bad_for,
        now=NOW, workload_restarts=mine, node_restarts=node, policy=POLICY,
    )  # fmt: skip
    assert (decision.restart, decision.budget_spent) == (restart, budget), decision
    assert reason in decision.reason


def test_backoff_doubles_up_to_its_maximum() -> None:
    assert [POLICY.backoff(n) for n in (1, 2, 3, 4)] == [300, 600, 1200, 1200]


# --- the share of time healthy -----------------------------------------------------------

H = 3600.0
T0 = 1_000 * H  # a clock hour's start


def test_time_is_split_at_hour_boundaries_and_unknown_is_not_observed() -> None:
    record = UptimeRecord()
    record.observe({"api": "healthy", "new": "unknown"}, start=T0 + H - 60, end=T0 + H + 30)
    record.observe({"api": "unhealthy"}, start=T0 + H + 30, end=T0 + H + 90)
    assert record.hours == {"api": {1000: [60.0, 60.0], 1001: [90.0, 30.0]}}


@pytest.mark.parametrize(
    ("periods", "now", "window", "share"),
    [
        ([], T0, DAY, None),
        ([("healthy", 0, H)], T0 + H, DAY, 1.0),
        ([("healthy", 0, H), ("stale", H, 2 * H)], T0 + 2 * H, DAY, 0.5),
        ([("degraded", 0, H), ("rolling-out", H, 1.5 * H)], T0 + 2 * H, DAY, 0.666667),
        # the first hour has left the last 24 h; it is still in the week
        ([("failed", 0, H), ("healthy", H, 2 * H)], T0 + 25 * H, DAY, 1.0),
        ([("failed", 0, H), ("healthy", H, 2 * H)], T0 + 25 * H, WEEK, 0.5),
        ([("crashlooping", 0, H)], T0 + 8 * DAY, WEEK, None),
    ],
)
def test_share(
    periods: list[tuple[str, float, float]], now: float, window: float, share: float | None
) -> None:
    record = UptimeRecord()
    for status, start, end in periods:
        record.observe({"api": status}, start=T0 + start, end=T0 + end)
    assert record.share("api", now=now, window=window) == share


def test_a_week_is_kept_and_the_record_survives_json() -> None:
    record = UptimeRecord()
    record.observe({"old": "healthy"}, start=T0, end=T0 + 60)
    record.observe({"api": "healthy"}, start=T0 + 3 * DAY, end=T0 + 3 * DAY + 60)
    record.prune(now=T0 + 7 * DAY + 2 * H)
    assert list(record.hours) == ["api"]
    again = UptimeRecord.from_json(json.loads(json.dumps(record.to_json())))
    assert again.hours == record.hours


def test_restarts_are_kept_a_day_and_survive_json() -> None:
    record = UptimeRecord()
    record.restarted("api", at=T0 + 0.7)
    record.restarted("api", at=T0 + DAY + 5)
    record.restarted("db", at=T0 + 10)
    record.prune(now=T0 + DAY + 60)
    assert record.restarts == {"api": [T0 + DAY + 5]}
    again = UptimeRecord.from_json(json.loads(json.dumps(record.to_json())))
    assert again.restarts == record.restarts
    assert again.history("api", now=T0 + DAY + 60).hours[-1].restarts == 1


def test_the_compact_record_keeps_whole_seconds_and_every_hour_of_the_week() -> None:
    record = UptimeRecord()
    record.observe({"api": "healthy"}, start=T0, end=T0 + WEEK + 0.4)
    record.observe(
        {"api": "unhealthy", "db": "healthy"}, start=T0 + WEEK + 0.4, end=T0 + WEEK + 99.7
    )
    record.prune(now=T0 + WEEK + 99.7)
    data = record.to_json()
    assert data["version"] == 2
    again = UptimeRecord.from_json(json.loads(json.dumps(data)))
    assert again.hours.keys() == record.hours.keys()
    for name, by in record.hours.items():
        assert again.hours[name].keys() == by.keys()
        for hour, (seen, up) in by.items():
            assert again.hours[name][hour] == [round(seen), min(round(seen), round(up))]
    now = T0 + WEEK + 99.7
    share, exact = (
        again.share("api", now=now, window=WEEK),
        record.share("api", now=now, window=WEEK),
    )
    assert share is not None and exact is not None and abs(share - exact) < 1e-4


@pytest.mark.parametrize(
    ("data", "where"),
    [
        (None, "version 2 or 1"),
        ({"version": 3, "hours": {}}, "version 2 or 1"),
        ({"version": 2, "hours": {}}, "first_hour"),
        ({"version": 2, "first_hour": True, "hours": {}}, "first_hour"),
        ({"version": 2, "first_hour": 7, "hours": []}, "hours: not a mapping"),
        ({"version": 2, "first_hour": 7, "hours": {"api": 5}}, "hours.api: not base64"),
        ({"version": 2, "first_hour": 7, "hours": {"api": "AAA"}}, "hours.api: not base64"),
        ({"version": 2, "first_hour": 7, "hours": {"api": "AAAA" * 171}}, "a week at most"),
        ({"version": 2, "first_hour": 7, "hours": {"api": "////"}}, "hour 7 is not"),
        ({"version": 2, "first_hour": 7, "hours": {"api": "AAAAAAEA"}}, "hour 8 is not"),
        ({"version": 2, "first_hour": 7, "hours": {}, "restarts": []}, "restarts: not a"),
        ({"version": 2, "first_hour": 7, "hours": {}, "restarts": {"a": [1.5]}}, "restarts.a"),
        ({"version": 2, "first_hour": 7, "hours": {}, "restarts": {"a": [0] * 241}}, "restarts.a"),
        ({"version": 1, "hours": []}, "hours: not a mapping"),
        ({"version": 1, "hours": {"api": 5}}, "hours.api"),
        ({"version": 1, "hours": {"api": {"7": [1, 2]}}}, "hours.api.7"),
        ({"version": 1, "hours": {"api": {"7": ["x", 0]}}}, "hours.api.7"),
    ],
)
def test_a_garbled_record_is_an_error_naming_where(data: object, where: str) -> None:
    with pytest.raises(ValueError, match=re.escape(where)):
        UptimeRecord.from_json(data)
