"""Jobs on NATS JetStream: the schema v1 payload, subjects, and what to do with a delivery.

Everything here is pure. `admit` decides, before anything runs, whether a delivered
job is rejected, expired, refused for a security reason, not for this node, or run;
`after_failure` decides between a delayed retry and the dead letter. Subjects are an
interface shared with producers across the fleet: keep them exact.
"""

from __future__ import annotations

import json
import math
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


# NATS's default max_payload: a bigger message does not reach a consumer anyway, and one
# that does (a server configured larger) is refused before it is decoded.
MAX_JOB_BYTES = 1024 * 1024
# Arrays and objects inside one another, the job object being level 1: deep enough for any
# payload a handler means to read, and far below what json, pydantic and the encoders the
# job meets later (events, the ledger, HTTP bodies) recurse through.
MAX_JOB_DEPTH = 64
MAX_REJECTION_REASON = 500
_MAX_ID_CHARS = 255
_SURROGATE = re.compile("[\ud800-\udfff]")
_UNFIT_IN_ID = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")


class _NotJson(ValueError):
    """A token Python's json reads but JSON does not have (NaN, Infinity)."""


def _refuse_constant(name: str) -> Any:
    raise _NotJson(f"{name} is not a JSON number")


def parse_job(data: bytes, subject: str) -> Job | Rejection:
    """The job a delivery carries, or why it is not one. Total: whatever the bytes, a Job
    or a Rejection, never an exception (it would leave the delivery unanswered).

    A Job returned can go on: its text is Unicode (it encodes to UTF-8 for the ledger,
    events and HTTP bodies), its numbers are finite, its nesting bounded and its key free
    of NUL, which PostgreSQL text cannot hold.
    """
    if len(data) > MAX_JOB_BYTES:
        return Rejection(
            f"payload is {len(data)} bytes, more than the {MAX_JOB_BYTES} a job may be"
        )
    try:
        # strictly UTF-8 (RFC 8259): json.loads(bytes) would also take UTF-16 and UTF-32
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Rejection(f"payload is not JSON: not UTF-8 (byte {exc.start})")
    try:
        raw = json.loads(text, parse_constant=_refuse_constant)
    except _NotJson as exc:
        return Rejection(f"payload is not JSON: {exc}")
    except json.JSONDecodeError as exc:
        return Rejection(f"payload is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")
    except ValueError:  # an integer of more than sys.get_int_max_str_digits() digits
        return Rejection("payload is not JSON: a number too long to read")
    except RecursionError:
        return Rejection(f"payload nests arrays and objects more than {MAX_JOB_DEPTH} deep")
    ids: dict[str, Any] = {}
    if isinstance(raw, dict):
        ids = {key: _readable_id(raw.get(key)) for key in ("job_id", "idempotency_key")}
    unfit = _unfit(raw)
    if unfit is not None:
        return Rejection(unfit, **ids)
    try:
        job = Job.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = _bounded(".".join(str(p) for p in first["loc"]), 120) or "payload"
        return Rejection(_bounded(f"{where}: {first['msg']}"), **ids)
    if "\x00" in job.idempotency_key:
        return Rejection("idempotency_key: must not contain NUL (\\u0000)", **ids)
    parsed = parse_subject(subject)
    if parsed is None:
        return Rejection(_bounded(f"subject {subject!r} is not mm.<kind>.<tier>.<type>"), **ids)
    if parsed[2] != job.type:
        return Rejection(
            _bounded(f"subject type {parsed[2]!r} differs from payload type {job.type!r}"),
            **ids,
        )
    return job


def _unfit(value: Any) -> str | None:
    """Why parsed JSON cannot travel on as a job, or None. Iterative, so that no depth can
    make it recurse; json.loads gives exactly dict, list, str, int, float, bool and None."""
    stack: list[tuple[Any, int]] = [([value], 0)]
    while stack:
        container, depth = stack.pop()
        if depth > MAX_JOB_DEPTH:
            return f"payload nests arrays and objects more than {MAX_JOB_DEPTH} deep"
        if type(container) is dict:
            for key in container:
                if not key.isascii() and _SURROGATE.search(key):
                    return _not_unicode(key)
            items = container.values()
        else:
            items = container
        for item in items:
            kind = type(item)
            if kind is dict or kind is list:
                stack.append((item, depth + 1))
            elif kind is str:
                if not item.isascii() and _SURROGATE.search(item):
                    return _not_unicode(item)
            elif kind is float and not math.isfinite(item):
                return "payload has a number out of range (it does not fit a 64-bit float)"
    return None


def _not_unicode(text: str) -> str:
    found = _SURROGATE.search(text)
    code = f"\\u{ord(found.group()):04x}" if found else "?"
    return f"payload has text with an unpaired surrogate ({code}), which is not Unicode"


def _readable_id(value: Any) -> str | None:
    """An id worth reporting with a rejection: a short string (or integer) that can go
    into an event and a Nats-Msg-Id header; None for anything else (a 100 kB string, a
    nested list, a control character or an unpaired surrogate)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_ID_CHARS:
        return None
    return None if _UNFIT_IN_ID.search(value) else value


def _bounded(text: str, limit: int = MAX_REJECTION_REASON) -> str:
    """Short enough for an event and a log line, however long the input was."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


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
        )
    if misses:
        return Decision(
            Admission.NOT_HERE,
            "requirements not met: " + ", ".join(m.value for m in misses),
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
    """Retry or dead-letter a handler's failure (docs/jobs.md says why), in this order:
    what the handler says with a JobFailure; timeouts and connection errors (any OSError,
    even one that is also a ValueError, like a certificate that does not verify) are
    retried; a ValueError (validation errors among them), KeyError or TypeError fails
    the same way on every delivery of the same payload, so it is permanent; anything else
    is retried within max_deliver, as it may be transient. An exception group (from a
    TaskGroup) is permanent only when everything in it is."""
    if isinstance(exc, JobFailure):
        return exc.kind
    if isinstance(exc, BaseExceptionGroup):
        kinds = {classify_failure(inner) for inner in exc.exceptions}
        return FailureKind.PERMANENT if kinds == {FailureKind.PERMANENT} else FailureKind.RETRYABLE
    if isinstance(exc, OSError | TimeoutError):
        return FailureKind.RETRYABLE
    if isinstance(exc, ValueError | KeyError | TypeError):
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
