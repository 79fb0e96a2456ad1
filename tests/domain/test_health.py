"""Derived workload status, table-driven: one row per branch of the decision."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.domain.health import (
    Ping,
    PingRecord,
    PingStatus,
    Rollout,
    RolloutPhase,
    WorkloadStatus,
    derive_status,
    is_workload_name,
    ping_age,
    rollout_of,
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


def deployment(
    *, generation: int = 2, observed: int = 2, replicas: int = 2, updated: int = 2,
    ready: int = 2, available: int = 2, total: int | None = None,
    deadline: bool = False,
) -> dict[str, object]:  # fmt: skip
    conditions = [{"type": "Available", "status": "True"}]
    if deadline:
        conditions.append(
            {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}
        )
    status = {
        "observedGeneration": observed,
        "replicas": updated if total is None else total,
        "updatedReplicas": updated,
        "readyReplicas": ready,
        "availableReplicas": available,
        "conditions": conditions,
    }
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": status,
    }


@pytest.mark.parametrize(
    ("obj", "phase"),
    [
        (deployment(), RolloutPhase.READY),
        (deployment(observed=1), RolloutPhase.ROLLING_OUT),  # controller has not seen it yet
        (deployment(updated=1), RolloutPhase.ROLLING_OUT),
        (deployment(available=1), RolloutPhase.ROLLING_OUT),
        (deployment(ready=1, available=1), RolloutPhase.ROLLING_OUT),
        (deployment(total=3), RolloutPhase.ROLLING_OUT),  # an old pod is still there
        (deployment(deadline=True), RolloutPhase.FAILED),
        (deployment(updated=1, deadline=True), RolloutPhase.FAILED),
        (deployment(replicas=0, updated=0, ready=0, available=0), RolloutPhase.READY),
        ({"metadata": {}, "spec": {}, "status": {}}, RolloutPhase.ROLLING_OUT),  # brand new
    ],
)
def test_rollout_phase(obj: dict[str, object], phase: RolloutPhase) -> None:
    assert rollout_of(obj).phase is phase


HEALTHY_PING = record(PingStatus.HEALTHY, 100.0)
READY = rollout_of(deployment())
ROLLING = rollout_of(deployment(updated=1))
FAILED = rollout_of(deployment(deadline=True))


@pytest.mark.parametrize(
    ("last", "expected", "rollout", "status"),
    [
        (HEALTHY_PING, True, READY, WorkloadStatus.HEALTHY),
        (None, True, READY, WorkloadStatus.UNKNOWN),
        (HEALTHY_PING, True, None, WorkloadStatus.MISSING),
        (None, True, None, WorkloadStatus.MISSING),
        (HEALTHY_PING, False, None, WorkloadStatus.HEALTHY),  # not desired, not deployed
        (HEALTHY_PING, True, ROLLING, WorkloadStatus.ROLLING_OUT),
        (HEALTHY_PING, True, FAILED, WorkloadStatus.FAILED),
        (record(PingStatus.UNHEALTHY, 100.0), True, READY, WorkloadStatus.UNHEALTHY),
        (record(PingStatus.HEALTHY, 10.0), True, READY, WorkloadStatus.STALE),
        (None, False, FAILED, WorkloadStatus.FAILED),  # deployed but no longer desired
    ],
)
def test_cluster_view_comes_first(
    last: PingRecord | None, expected: bool, rollout: Rollout | None, status: WorkloadStatus
) -> None:
    assert derive_status(last, now=100.0, stale_after=30.0, expected=expected, rollout=rollout) is (
        status
    )
