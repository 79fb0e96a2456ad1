"""Derived workload status, table-driven: one row per branch of the decision."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.domain.health import (
    Ping,
    PingRecord,
    PingStatus,
    WorkloadStatus,
    derive_status,
    is_workload_name,
    ping_age,
)

STALE_AFTER = 30.0


def record(status: PingStatus, at: float) -> PingRecord:
    return PingRecord(ping=Ping(status=status), received_at=at, received_wall=1_700_000_000.0)


@pytest.mark.parametrize(
    ("last", "now", "expected"),
    [
        (None, 100.0, WorkloadStatus.UNKNOWN),
        (record(PingStatus.HEALTHY, 100.0), 100.0, WorkloadStatus.HEALTHY),
        (record(PingStatus.DEGRADED, 100.0), 110.0, WorkloadStatus.DEGRADED),
        (record(PingStatus.UNHEALTHY, 100.0), 129.0, WorkloadStatus.UNHEALTHY),
        # exactly at the threshold is still fresh; just past it is stale, whatever it said
        (record(PingStatus.HEALTHY, 100.0), 130.0, WorkloadStatus.HEALTHY),
        (record(PingStatus.HEALTHY, 100.0), 130.001, WorkloadStatus.STALE),
        (record(PingStatus.UNHEALTHY, 100.0), 500.0, WorkloadStatus.STALE),
    ],
)
def test_derive_status(last: PingRecord | None, now: float, expected: WorkloadStatus) -> None:
    assert derive_status(last, now=now, stale_after=STALE_AFTER) is expected


@pytest.mark.parametrize(
    ("last", "now", "expected"),
    [
        (None, 10.0, None),
        (record(PingStatus.HEALTHY, 10.0), 12.5, 2.5),
        # a clock that went backwards never yields a negative age
        (record(PingStatus.HEALTHY, 10.0), 9.0, 0.0),
    ],
)
def test_ping_age(last: PingRecord | None, now: float, expected: float | None) -> None:
    assert ping_age(last, now=now) == expected


@pytest.mark.parametrize(
    ("name", "valid"),
    [
        ("api", True),
        ("a", True),
        ("api-2", True),
        ("0day", True),
        ("a" * 63, True),
        ("a" * 64, False),
        ("", False),
        ("Api", False),
        ("-api", False),
        ("api-", False),
        ("api_v2", False),
        ("api.v2", False),
    ],
)
def test_workload_names_are_dns1123_labels(name: str, valid: bool) -> None:
    assert is_workload_name(name) is valid


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ('{"status": "fine"}', "status"),
        ("{}", "status"),
        ('{"status": "healthy", "extra": 1}', "extra"),
        ('{"status": "healthy", "version": ""}', "version"),
        ('{"status": "healthy", "message": "' + "m" * 1025 + '"}', "message"),
        ('{"status": "healthy", "details": []}', "details"),
    ],
)
def test_invalid_pings_name_the_field(body: str, field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        Ping.model_validate_json(body)
    assert caught.value.errors()[0]["loc"][0] == field
