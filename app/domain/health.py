"""Workload health: the shape of a ping and the derivation of one status per workload.

Status is derived, never stored: the same inputs (last ping, its age, what the
cluster says about the rollout) always give the same answer, so the status API,
the report and the alerts cannot disagree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator

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
    MISSING = "missing"
    ROLLING_OUT = "rolling-out"
    FAILED = "failed"
    CRASHLOOPING = "crashlooping"


class RolloutPhase(StrEnum):
    READY = "ready"
    ROLLING_OUT = "rolling-out"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Rollout:
    """What a Deployment's status says about its rollout."""

    generation: int
    observed_generation: int
    replicas: int
    updated: int
    total: int  # status.replicas: pods of every ReplicaSet, old ones still terminating
    ready: int
    available: int
    deadline_exceeded: bool

    @property
    def unobserved(self) -> bool:
        """The deployment controller has not looked at the last write yet (a Deployment's
        generation moves with its annotations too): its status is of the spec before."""
        return self.observed_generation < self.generation

    @property
    def phase(self) -> RolloutPhase:
        if self.deadline_exceeded:
            return RolloutPhase.FAILED
        if (
            self.observed_generation < self.generation
            or self.updated < self.replicas
            or self.total > self.updated
            or self.available < self.replicas
            or self.ready < self.replicas
        ):
            return RolloutPhase.ROLLING_OUT
        return RolloutPhase.READY


def rollout_of(deployment: Mapping[str, Any]) -> Rollout:
    """Read a Deployment object's rollout state (as the deployment controller reports it)."""
    metadata = deployment.get("metadata") or {}
    spec = deployment.get("spec") or {}
    status = deployment.get("status") or {}
    deadline = any(
        c.get("type") == "Progressing"
        and c.get("status") == "False"
        and c.get("reason") == "ProgressDeadlineExceeded"
        for c in status.get("conditions") or []
        if isinstance(c, Mapping)
    )
    return Rollout(
        generation=int(metadata.get("generation") or 0),
        observed_generation=int(status.get("observedGeneration") or 0),
        replicas=int(spec.get("replicas", 1) or 0),
        updated=int(status.get("updatedReplicas") or 0),
        total=int(status.get("replicas") or 0),
        ready=int(status.get("readyReplicas") or 0),
        available=int(status.get("availableReplicas") or 0),
        deadline_exceeded=deadline,
    )


class Ping(BaseModel):
    """What a workload says about itself every 5-10 s.

    `details` is accepted (a JSON object, within the body's size limit) and not kept:
    nothing reads it, and kept as parsed objects a 16 KiB ping of small nested objects
    costs some 370 KiB of the manager's memory per workload until the next ping."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    status: PingStatus
    version: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    message: Annotated[str, Field(max_length=1024)] | None = None
    details: dict[str, Any] | None = None
    # a request to hold a pending update back this long from now (a lease each ping
    # renews; capped per ping by UPDATE_DEFER_STEP_SECONDS, per version by the cap), and why
    defer_update_seconds: Annotated[float, Field(ge=0, le=86_400, allow_inf_nan=False)] | None = (
        None
    )
    defer_reason: Annotated[str, Field(max_length=256)] | None = None

    @field_validator("details")
    @classmethod
    def _not_kept(cls, value: dict[str, Any] | None) -> None:
        return None


def is_workload_name(name: str) -> bool:
    return DNS1123_LABEL.fullmatch(name) is not None


class PingRecord(NamedTuple):
    """A ping as received: `received_at` is monotonic, `received_wall` epoch seconds. (A
    named tuple: one is made per ping, the request the manager serves most.)"""

    ping: Ping
    received_at: float
    received_wall: float


def derive_status(
    last: PingRecord | None,
    *,
    now: float,
    stale_after: float,
    expected: bool = False,
    rollout: Rollout | None = None,
    crashlooping: bool = False,
) -> WorkloadStatus:
    """One status per workload: the cluster's view first, then the workload's own word.

    `expected`: the desired state lists the workload and the cluster was read, so no
    Deployment means `missing`. `rollout`: its Deployment's state, when there is one.
    `crashlooping`: one of its pods' containers is in a crash loop (`crash_loop`).
    """
    if rollout is not None:
        phase = rollout.phase
        if phase is RolloutPhase.FAILED:
            return WorkloadStatus.FAILED
        if crashlooping:
            return WorkloadStatus.CRASHLOOPING
        if phase is RolloutPhase.ROLLING_OUT:
            return WorkloadStatus.ROLLING_OUT
    elif expected:
        return WorkloadStatus.MISSING
    if last is None:
        return WorkloadStatus.UNKNOWN
    if now - last.received_at > stale_after:
        return WorkloadStatus.STALE
    return WorkloadStatus(last.ping.status.value)


def ping_age(last: PingRecord | None, *, now: float) -> float | None:
    if last is None:
        return None
    return max(0.0, now - last.received_at)


CRASHLOOP_RESTARTS = 5  # restarts of a container that is not ready: restarting repeatedly


def crash_loop(pod: Mapping[str, Any]) -> str | None:
    """Why a pod is in a crash loop (a container waiting in CrashLoopBackOff, or not ready
    after restarting `CRASHLOOP_RESTARTS` times or more), or None."""
    status = pod.get("status") or {}
    for container in status.get("containerStatuses") or []:
        if not isinstance(container, Mapping):
            continue
        name = container.get("name", "?")
        waiting = (container.get("state") or {}).get("waiting") or {}
        restarts = int(container.get("restartCount") or 0)
        if waiting.get("reason") == "CrashLoopBackOff":
            return f"container {name} in CrashLoopBackOff after {restarts} restarts"
        if restarts >= CRASHLOOP_RESTARTS and not container.get("ready"):
            return f"container {name} restarted {restarts} times and is not ready"
    return None


def crashlooping_workloads(
    deployments: Sequence[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]]
) -> dict[str, str]:
    """Deployment name -> why, for the Deployments with a pod in a crash loop. A pod
    belongs to the Deployment whose selector's `matchLabels` its labels carry."""
    found: dict[str, str] = {}
    for deployment in deployments:
        name = (deployment.get("metadata") or {}).get("name")
        selector = ((deployment.get("spec") or {}).get("selector") or {}).get("matchLabels")
        if not name or not selector:
            continue
        for pod in pods:
            labels = (pod.get("metadata") or {}).get("labels") or {}
            if all(labels.get(k) == v for k, v in selector.items()):
                why = crash_loop(pod)
                if why is not None:
                    found[name] = f"pod {(pod.get('metadata') or {}).get('name')}: {why}"
                    break
    return found
