"""Jobs on NATS JetStream: the schema v1 payload, subjects, and what to do with a delivery.

Everything here is pure. `admit` decides, before anything runs, whether a delivered
job is rejected, expired, refused for a security reason, not for this node, or run;
`after_failure` decides between a delayed retry and the dead letter. Subjects are an
interface shared with producers across the fleet: keep them exact.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal
from uuid import UUID

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from app.domain.requirements import Mismatch, NodeProfile, Requirements, match_requirements

JOB_KINDS = ("online", "offline", "write")
STREAMS = {"online": "MM_ONLINE", "offline": "MM_OFFLINE", "write": "MM_WRITE"}
EVENTS_STREAM = "MM_EVENTS"
_TYPE = r"[a-z][a-z0-9_-]*(\.[a-z][a-z0-9_-]*)*"
_SUBJECT = re.compile(rf"^mm\.(online|offline|write)\.([ABC])\.({_TYPE})$")


class EventKind(StrEnum):
    COMPLETED = "job.completed"
    FAILED = "job.failed"
    REJECTED = "job.rejected"
    EXPIRED = "job.expired"
    DEAD = "job.dead"
    UNROUTABLE = "job.unroutable"
    NODE_ONLINE = "node.online"
    NODE_DRAINING = "node.draining"
    NODE_OFFLINE = "node.offline"


class Job(BaseModel):
    """Job payload, schema v1."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_: Literal["job/v1"] = Field(alias="schema")
    job_id: UUID
    idempotency_key: Annotated[str, Field(min_length=1, max_length=255)]
    type: Annotated[str, Field(pattern=f"^{_TYPE}$", max_length=128)]
    requirements: Requirements = Requirements()
    payload: dict[str, Any] = Field(default_factory=dict)
    created_at: AwareDatetime
    deadline: AwareDatetime | None = None


def job_json_schema() -> dict[str, Any]:
    """JSON Schema of job/v1, as published in docs/job-schema-v1.json."""
    schema = Job.model_json_schema(by_alias=True)
    schema["$id"] = "https://node-system/schemas/job/v1.json"
    schema["title"] = "Job (schema job/v1)"
    return schema


def job_subject(kind: str, tier: str, job_type: str) -> str:
    return f"mm.{kind}.{tier}.{job_type}"


def consumer_filter(kind: str, tier: str) -> str:
    return f"mm.{kind}.{tier}.>"


def consumer_name(tier: str) -> str:
    return f"wm-{tier}"


def event_subject(node_id: str, event: EventKind) -> str:
    return f"mm.events.{node_id}.{event.value}"


def parse_subject(subject: str) -> tuple[str, str, str] | None:
    """(kind, tier, type) of a job subject, or None when it is not one."""
    match = _SUBJECT.fullmatch(subject)
    return None if match is None else (match.group(1), match.group(2), match.group(3))


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a delivery is not a valid job, with whatever ids could be read from it."""

    reason: str
    job_id: str | None = None
    idempotency_key: str | None = None


def parse_job(data: bytes, subject: str) -> Job | Rejection:
    ids: dict[str, Any] = {}
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return Rejection("payload is not JSON")
    if isinstance(raw, dict):
        ids = {
            "job_id": str(raw["job_id"]) if "job_id" in raw else None,
            "idempotency_key": str(raw["idempotency_key"]) if "idempotency_key" in raw else None,
        }
    try:
        job = Job.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "payload"
        return Rejection(f"{where}: {first['msg']}", **ids)
    parsed = parse_subject(subject)
    if parsed is None:
        return Rejection(f"subject {subject!r} is not mm.<kind>.<tier>.<type>", **ids)
    if parsed[2] != job.type:
        return Rejection(
            f"subject type {parsed[2]!r} differs from payload type {job.type!r}", **ids
        )
    return job


class Admission(StrEnum):
    RUN = "run"
    REJECT = "reject"  # term + job.rejected
    EXPIRE = "expire"  # term + job.expired
    SECURITY = "security"  # term + job.rejected + alert: the job demands another trust zone
    NOT_HERE = "not-here"  # nak with delay; another node may run it


@dataclass(frozen=True, slots=True)
class Decision:
    admission: Admission
    reason: str = ""
    mismatches: tuple[Mismatch, ...] = ()


def admit(job: Job | Rejection, *, node: NodeProfile, now: datetime) -> Decision:
    if isinstance(job, Rejection):
        return Decision(Admission.REJECT, job.reason)
    if job.deadline is not None and job.deadline <= now:
        return Decision(Admission.EXPIRE, f"deadline {job.deadline.isoformat()} has passed")
    misses = match_requirements(job.requirements, node)
    if Mismatch.TRUST_ZONE in misses:
        return Decision(
            Admission.SECURITY,
            f"job requires trust zone {job.requirements.trust_zone!r}, "
            f"node is in {node.trust_zone!r}",
            tuple(misses),
        )
    if misses:
        return Decision(
            Admission.NOT_HERE,
            "requirements not met: " + ", ".join(m.value for m in misses),
            tuple(misses),
        )
    return Decision(Admission.RUN)


class FailureKind(StrEnum):
    RETRYABLE = "retryable"
    PERMANENT = "permanent"


class JobFailure(Exception):
    """Raised by handlers to say how a failure should be treated."""

    kind: FailureKind = FailureKind.RETRYABLE


class RetryableJobFailure(JobFailure):
    kind = FailureKind.RETRYABLE


class PermanentJobFailure(JobFailure):
    kind = FailureKind.PERMANENT


def classify_failure(exc: BaseException) -> FailureKind:
    """Handlers say what they mean with JobFailure; a bad payload is permanent; anything
    else unexpected (timeouts, connection errors, bugs) is retried, within max_deliver."""
    if isinstance(exc, JobFailure):
        return exc.kind
    if isinstance(exc, ValidationError | ValueError | KeyError | TypeError):
        return FailureKind.PERMANENT
    return FailureKind.RETRYABLE


@dataclass(frozen=True, slots=True)
class Verdict:
    retry: bool
    delay: float = 0.0


def after_failure(
    kind: FailureKind, *, delivered: int, max_deliver: int, backoff: tuple[float, ...]
) -> Verdict:
    """Retry with the backoff step for this delivery, or dead-letter the job."""
    if kind is FailureKind.PERMANENT or delivered >= max_deliver:
        return Verdict(retry=False)
    step = backoff[min(delivered, len(backoff)) - 1] if backoff else 1.0
    return Verdict(retry=True, delay=step)


def event_body(
    *,
    node_id: str,
    job_id: str | None,
    idempotency_key: str | None,
    at: datetime,
    reason: str | None = None,
    result: Any = None,
    **extra: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "job_id": job_id,
        "idempotency_key": idempotency_key,
        "node_id": node_id,
        "at": at.astimezone(UTC).isoformat().replace("+00:00", "Z"),
    }
    if reason is not None:
        body["reason"] = reason
    if result is not None:
        body["result"] = result
    body.update(extra)
    return body
