"""Derived workload status, table-driven: one row per branch of the decision."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from app.domain.health import (
    Ping,
    PingRecord,
    PingStatus,
    Rollout,
    RolloutPhase,
    WorkloadStatus,
    crash_loop,
    crashlooping_workloads,
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


@pytest.mark.parametrize(
    ("obj", "unobserved"),
    [
        (deployment(), False),
        (deployment(generation=3, observed=2), True),  # an annotation written, not yet seen
        (deployment(generation=3, observed=2, deadline=True), True),
        (deployment(generation=2, observed=3), False),  # never below: the status is current
        ({"metadata": {"generation": 1}, "spec": {}, "status": {}}, True),  # brand new
        ({"metadata": {}, "spec": {}, "status": {}}, False),  # no generation at all
    ],
)
def test_a_status_older_than_the_spec_is_unobserved(
    obj: dict[str, object], unobserved: bool
) -> None:
    assert rollout_of(obj).unobserved is unobserved


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


@pytest.mark.parametrize(
    ("rollout", "last", "status"),
    [
        (READY, HEALTHY_PING, WorkloadStatus.CRASHLOOPING),  # its own word comes after
        (ROLLING, HEALTHY_PING, WorkloadStatus.CRASHLOOPING),  # a rollout stuck on it
        (FAILED, None, WorkloadStatus.FAILED),  # the deadline says more
    ],
)
def test_a_crash_loop_comes_before_the_rollout_and_the_ping(
    rollout: Rollout, last: PingRecord | None, status: WorkloadStatus
) -> None:
    found = derive_status(
        last, now=100.0, stale_after=30.0, expected=True, rollout=rollout, crashlooping=True
    )
    assert found is status


def pod(name: str, labels: dict[str, str], *containers: dict[str, object]) -> dict[str, object]:
    return {
        "metadata": {"name": name, "labels": labels},
        "status": {"containerStatuses": list(containers)},
    }


def container(
    restarts: int = 0, ready: bool = True, waiting: str | None = None
) -> dict[str, object]:
    state: dict[str, object] = {"waiting": {"reason": waiting}} if waiting else {"running": {}}
    return {"name": "app", "ready": ready, "restartCount": restarts, "state": state}


@pytest.mark.parametrize(
    ("containers", "why"),
    [
        ((), None),
        ((container(),), None),
        ((container(restarts=3, ready=False),), None),
        ((container(restarts=40, ready=True),), None),  # restarted long ago, fine now
        ((container(restarts=5, ready=False),), "restarted 5 times and is not ready"),
        ((container(restarts=2, ready=False, waiting="CrashLoopBackOff"),),
         "CrashLoopBackOff after 2 restarts"),
        ((container(waiting="ContainerCreating", ready=False),), None),
        ((container(), container(restarts=7, ready=False)), "restarted 7 times"),
    ],
)  # fmt: skip
def test_crash_loop(containers: tuple[dict[str, object], ...], why: str | None) -> None:
    found = crash_loop(pod("p", {}, *containers))
    assert (found is None) if why is None else (found is not None and why in found)


def test_crash_loops_belong_to_the_deployment_whose_selector_matches() -> None:
    deployments: list[dict[str, Any]] = [
        {"metadata": {"name": "api"}, "spec": {"selector": {"matchLabels": {"app": "api"}}}},
        {"metadata": {"name": "web"}, "spec": {"selector": {"matchLabels": {"app": "web"}}}},
        {"metadata": {"name": "odd"}, "spec": {}},
    ]
    pods = [
        pod(
            "api-1", {"app": "api", "pod-template-hash": "x"}, container(waiting="CrashLoopBackOff")
        ),
        pod("web-1", {"app": "web"}, container()),
        pod("other-1", {"app": "other"}, container(waiting="CrashLoopBackOff")),
    ]
    found = crashlooping_workloads(deployments, pods)
    assert list(found) == ["api"]
    assert found["api"].startswith("pod api-1: container app in CrashLoopBackOff")
