"""The 60 s node health report: built from plain values, so its shape is testable."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

# the update states in which a new version is known and not yet running
PENDING_STATES = frozenset({"waiting-wave", "halted", "outside-window", "deferred", "applying"})


@dataclass(frozen=True, slots=True)
class UpdateView:
    """A workload's update as the node decided it last (app/domain/rollout_machine.py)."""

    target: str
    state: str
    since: datetime
    reason: str
    place: float  # the node's place in the target's rollout, [0, 100)
    failed_versions: tuple[str, ...] = ()
    in_flight: bool = False  # applying, or judging an update or a revert

    @property
    def pending(self) -> bool:
        return self.state in PENDING_STATES

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "state": self.state,
            "since": _rfc3339(self.since),
            "reason": self.reason,
            "place": round(self.place, 3),
            "failed_versions": list(self.failed_versions),
        }


@dataclass(frozen=True, slots=True)
class WorkloadView:
    """Everything the node knows about one workload at one instant."""

    name: str
    status: str
    ping_age_seconds: float | None
    version: str | None
    message: str | None
    last_ping_at: datetime | None
    desired_version: str | None = None
    deployed_version: str | None = None
    rollout: str | None = None
    # share of time healthy (healthy or degraded) over the last 24 h and 7 d, when known
    uptime_24h: float | None = None
    uptime_7d: float | None = None
    update: UpdateView | None = None


@dataclass(frozen=True, slots=True)
class SystemSample:
    cpu_percent: float
    cpu_count: int
    load_average: tuple[float, float, float]
    memory_total_bytes: int
    memory_used_percent: float
    disk_total_bytes: int
    disk_used_percent: float


def build_report(
    *,
    node_id: str,
    manager_version: str,
    uptime_seconds: float,
    reported_at: datetime,
    system: SystemSample,
    workloads: Iterable[WorkloadView],
    desired: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The report's body (docs/backend-api.md); `desired` says where the desired state
    the node enforces came from (`from`, `desired_serial`, `stored_at`, `offline_since`,
    `reason`, `text`), absent before the first sync."""
    report: dict[str, Any] = {
        "node_id": node_id,
        "manager_version": manager_version,
        "reported_at": _rfc3339(reported_at),
        "uptime_seconds": round(uptime_seconds, 3),
        "system": {
            "cpu_percent": system.cpu_percent,
            "cpu_count": system.cpu_count,
            "load_average": list(system.load_average),
            "memory_total_bytes": system.memory_total_bytes,
            "memory_used_percent": system.memory_used_percent,
            "disk_total_bytes": system.disk_total_bytes,
            "disk_used_percent": system.disk_used_percent,
        },
        "workloads": [
            {
                "name": w.name,
                "status": w.status,
                "version": w.version,
                "message": w.message,
                "last_ping_at": _rfc3339(w.last_ping_at) if w.last_ping_at else None,
                "ping_age_seconds": (
                    None if w.ping_age_seconds is None else round(w.ping_age_seconds, 3)
                ),
                "desired_version": w.desired_version,
                "deployed_version": w.deployed_version,
                "rollout": w.rollout,
                "uptime_24h": w.uptime_24h,
                "uptime_7d": w.uptime_7d,
                "update": w.update.as_dict() if w.update else None,
            }
            for w in sorted(workloads, key=lambda w: w.name)
        ],
    }
    if desired is not None:
        report["desired"] = {
            k: _rfc3339(v) if isinstance(v, datetime) else v for k, v in desired.items()
        }
    return report


def _rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")
