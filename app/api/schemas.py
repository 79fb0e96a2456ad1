"""Response shapes of the manager's own API (they make the OpenAPI document exact)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel


class NodeInfo(BaseModel):
    id: str
    version: str
    env: str
    started_at: datetime
    uptime_seconds: float
    managed_namespace: str


class ComponentInfo(BaseModel):
    enabled: bool
    state: str
    reason: str
    last_success_at: datetime | None
    last_failure_at: datetime | None
    last_error: str | None
    consecutive_failures: int
    failing_since: datetime | None = None
    detail: dict[str, Any]


class UpdateInfo(BaseModel):
    """A workload's update as the node last decided it (docs/rollout.md)."""

    target: str
    state: Literal[
        "current", "waiting-wave", "halted", "outside-window", "deferred", "applying",
        "judging", "healthy", "rolled-back", "held-failed",
    ]  # fmt: skip
    since: datetime
    reason: str
    place: float
    failed_versions: list[str]


class WorkloadInfo(BaseModel):
    name: str
    status: str
    version: str | None
    message: str | None
    last_ping_at: datetime | None
    ping_age_seconds: float | None
    desired_version: str | None
    deployed_version: str | None
    rollout: str | None
    uptime_24h: float | None = None
    uptime_7d: float | None = None
    update: UpdateInfo | None = None


class ReportInfo(BaseModel):
    interval_seconds: float  # now: the settings', or the one the backend asked for
    next_at: datetime | None
    last_reported_at: str | None
    last_workload_count: int | None


class SyncInfo(BaseModel):
    interval_seconds: float  # now: the settings', or the one the backend asked for
    next_at: datetime | None
    last: dict[str, Any] | None
    last_change: dict[str, Any] | None
    # where the desired state enforced comes from: `from` (backend | last good | folder),
    # `desired_serial`, `stored_at`, `offline_since`, `reason`, `text`; None before a sync
    desired: dict[str, Any] | None = None


class AlertInfo(BaseModel):
    at: datetime
    key: str
    text: str


class TaskInfo(BaseModel):
    """A long-lived task under the supervisor."""

    state: str  # starting | running | restarting | finished | failed | stopped
    restart: bool
    started_at: datetime | None
    failures_in_a_row: int
    restarts: int
    last_error: str | None


class LoopInfo(BaseModel):
    """A periodic loop's last runs."""

    state: str  # waiting | ok | failing | unavailable (a dependency is down)
    since: datetime | None
    failures_in_a_row: int
    last_error: str | None
    # its interval now, and whether the settings or the backend's answers set it
    interval_seconds: float | None = None
    interval_from: Literal["settings", "backend"] = "settings"
    # until when a backend's Retry-After puts it off, and that in words
    # ("Retry-After until 2026-12-06T10:00:31Z"); None when it does not
    retry_after_until: datetime | None = None
    waiting: str | None = None


class Status(BaseModel):
    node: NodeInfo
    components: dict[str, ComponentInfo]
    tasks: dict[str, TaskInfo]
    loops: dict[str, LoopInfo] = {}
    workloads: list[WorkloadInfo]
    report: ReportInfo
    sync: SyncInfo
    alerts: list[AlertInfo]


class WorkloadList(BaseModel):
    workloads: list[WorkloadInfo]


class Readiness(BaseModel):
    ready: bool
    reasons: list[str]


class Liveness(BaseModel):
    status: str
