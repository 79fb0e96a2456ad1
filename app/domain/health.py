"""Workload health: the shape of a ping and the derivation of one status per workload.

Status is derived, never stored: the same inputs (last ping, its age, what the
cluster says about the rollout) always give the same answer, so the status API,
the report and the alerts cannot disagree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class PingStatus(StrEnum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"


class WorkloadStatus(StrEnum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"
    STALE = "stale"
    UNKNOWN = "unknown"


class Ping(BaseModel):
    """What a workload says about itself every 5-10 s."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    status: PingStatus
    version: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    message: Annotated[str, Field(max_length=1024)] | None = None
    details: dict[str, Any] | None = None


def is_workload_name(name: str) -> bool:
    return DNS1123_LABEL.fullmatch(name) is not None


@dataclass(frozen=True, slots=True)
class PingRecord:
    """A ping as received: `received_at` is monotonic, `received_wall` epoch seconds."""

    ping: Ping
    received_at: float
    received_wall: float


def derive_status(last: PingRecord | None, *, now: float, stale_after: float) -> WorkloadStatus:
    """One status from the last ping and the current monotonic time."""
    if last is None:
        return WorkloadStatus.UNKNOWN
    if now - last.received_at > stale_after:
        return WorkloadStatus.STALE
    return WorkloadStatus(last.ping.status.value)


def ping_age(last: PingRecord | None, *, now: float) -> float | None:
    if last is None:
        return None
    return max(0.0, now - last.received_at)
