"""Job schema v1, subjects, admission and failure decisions, table-driven."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from app.domain.jobs import (
    Admission,
    EventKind,
    FailureKind,
    Job,
    PermanentJobFailure,
    Rejection,
    RetryableJobFailure,
    admit,
    after_failure,
    classify_failure,
    consumer_filter,
    consumer_name,
    event_subject,
    job_subject,
    parse_job,
    parse_subject,
)
from app.domain.requirements import NodeProfile

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
NODE = NodeProfile(node_id="n1", tier="A", region="eu", trust_zone="z1",
                   hardware={"gpu": False, "memory_gb": 32, "cpu_count": 8},
                   capabilities=["embeddings"])  # fmt: skip


def body(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "schema": "job/v1",
        "job_id": "3f1c9a2e-8f6e-4d0a-9a55-1f5b2d9b8c11",
        "idempotency_key": "k1",
        "type": "memory.write",
        "requirements": {"tier": ["A"]},
        "payload": {"text": "hi"},
        "created_at": "2026-11-29T11:59:00Z",
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def raw(data: dict[str, Any]) -> bytes:
    return json.dumps(data).encode()


def test_a_valid_job_parses() -> None:
    job = parse_job(raw(body(deadline="2026-11-29T13:00:00+01:00")), "mm.write.A.memory.write")
    assert isinstance(job, Job)
    assert (job.type, job.idempotency_key, job.payload) == ("memory.write", "k1", {"text": "hi"})
    assert job.deadline == datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("data", "subject", "reason"),
    [
        (b"{not json", "mm.write.A.noop", "payload is not JSON"),
        (b"\xff\xfe", "mm.write.A.noop", "payload is not JSON"),
        (raw(body(schema="job/v2")), "mm.write.A.memory.write", "schema"),
        (raw(body(job_id="nope")), "mm.write.A.memory.write", "job_id"),
        (raw(body(idempotency_key="")), "mm.write.A.memory.write", "idempotency_key"),
        (raw(body(type="Memory Write")), "mm.write.A.memory.write", "type"),
        (raw(body(created_at="yesterday")), "mm.write.A.memory.write", "created_at"),
        (raw(body(created_at="2026-11-29T11:59:00")), "mm.write.A.memory.write", "created_at"),
        (raw(body(requirements={"tier": ["Z"]})), "mm.write.A.memory.write", "requirements.tier"),
        (raw(body(extra=1)), "mm.write.A.memory.write", "extra"),
        (raw(body(payload=[1])), "mm.write.A.memory.write", "payload"),
        (raw(body()), "mm.write.A.other", "differs from payload type"),
        (raw(body()), "mm.read.A.memory.write", "is not mm.<kind>.<tier>.<type>"),
    ],
)
def test_invalid_jobs_are_rejections_naming_the_field(
    data: bytes, subject: str, reason: str
) -> None:
    result = parse_job(data, subject)
    assert isinstance(result, Rejection)
    assert reason in result.reason


def test_rejections_keep_the_ids_they_could_read() -> None:
    result = parse_job(raw(body(type=None)), "mm.write.A.noop")
    assert isinstance(result, Rejection)
    assert (result.job_id, result.idempotency_key) == (body()["job_id"], "k1")


@pytest.mark.parametrize(
    ("subject", "parsed"),
    [
        ("mm.write.A.memory.write", ("write", "A", "memory.write")),
        ("mm.online.C.noop", ("online", "C", "noop")),
        ("mm.offline.B.a.b.c", ("offline", "B", "a.b.c")),
        ("mm.write.D.noop", None),
        ("mm.write.A.", None),
        ("mm.events.n1.job.completed", None),
    ],
)
def test_subjects(subject: str, parsed: tuple[str, str, str] | None) -> None:
    assert parse_subject(subject) == parsed


def test_subject_builders_match_the_contract() -> None:
    assert job_subject("write", "A", "memory.write") == "mm.write.A.memory.write"
    assert consumer_filter("offline", "B") == "mm.offline.B.>"
    assert consumer_name("C") == "wm-C"
    assert event_subject("n1", EventKind.DEAD) == "mm.events.n1.job.dead"


def job(**overrides: Any) -> Job:
    return Job.model_validate(body(**overrides))


@pytest.mark.parametrize(
    ("candidate", "admission", "says"),
    [
        (Rejection("payload is not JSON"), Admission.REJECT, "not JSON"),
        (job(), Admission.RUN, ""),
        (job(deadline="2026-11-29T12:00:00Z"), Admission.EXPIRE, "has passed"),
        (job(deadline="2026-11-29T12:00:01Z"), Admission.RUN, ""),
        (job(requirements={"trust_zone": "z2"}), Admission.SECURITY, "trust zone 'z2'"),
        (job(requirements={"trust_zone": "z2", "tier": ["B"]}), Admission.SECURITY, "z2"),
        (job(requirements={"tier": ["B", "C"]}), Admission.NOT_HERE, "tier"),
        (job(requirements={"capabilities": ["gpu"]}), Admission.NOT_HERE, "capabilities"),
        (job(requirements={"hardware": {"min_memory_gb": 64}}), Admission.NOT_HERE,
         "hardware.min_memory_gb"),
        # an expired job is expired even if it could not run here anyway
        (job(deadline="2026-11-29T11:00:00Z", requirements={"tier": ["B"]}), Admission.EXPIRE,
         "has passed"),
    ],
)  # fmt: skip
def test_admit(candidate: Job | Rejection, admission: Admission, says: str) -> None:
    decision = admit(candidate, node=NODE, now=NOW)
    assert decision.admission is admission
    assert says in decision.reason


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (RetryableJobFailure("upstream 503"), FailureKind.RETRYABLE),
        (PermanentJobFailure("bad request"), FailureKind.PERMANENT),
        (TimeoutError(), FailureKind.RETRYABLE),
        (ConnectionResetError(), FailureKind.RETRYABLE),
        (RuntimeError("bug"), FailureKind.RETRYABLE),
        (KeyError("text"), FailureKind.PERMANENT),
        (ValueError("bad"), FailureKind.PERMANENT),
        (TypeError("bad"), FailureKind.PERMANENT),
    ],
)
def test_classify_failure(error: BaseException, kind: FailureKind) -> None:
    assert classify_failure(error) is kind


def test_a_payload_validation_error_is_permanent() -> None:
    with pytest.raises(ValidationError) as caught:
        Job.model_validate({})
    assert classify_failure(caught.value) is FailureKind.PERMANENT


BACKOFF = (5.0, 30.0, 120.0)


@pytest.mark.parametrize(
    ("kind", "delivered", "retry", "delay"),
    [
        (FailureKind.RETRYABLE, 1, True, 5.0),
        (FailureKind.RETRYABLE, 2, True, 30.0),
        (FailureKind.RETRYABLE, 3, True, 120.0),
        (FailureKind.RETRYABLE, 4, True, 120.0),  # past the list: its last step
        (FailureKind.RETRYABLE, 5, False, 0.0),  # the last delivery: dead letter
        (FailureKind.RETRYABLE, 9, False, 0.0),
        (FailureKind.PERMANENT, 1, False, 0.0),
    ],
)
def test_after_failure(kind: FailureKind, delivered: int, retry: bool, delay: float) -> None:
    verdict = after_failure(kind, delivered=delivered, max_deliver=5, backoff=BACKOFF)
    assert (verdict.retry, verdict.delay) == (retry, delay)


def test_after_failure_without_a_backoff_list() -> None:
    verdict = after_failure(FailureKind.RETRYABLE, delivered=1, max_deliver=3, backoff=())
    assert verdict.retry and verdict.delay == 1.0


def test_deadline_is_compared_with_the_given_clock() -> None:
    later = NOW + timedelta(hours=2)
    assert admit(job(deadline="2026-11-29T13:00:00Z"), node=NODE, now=later).admission is (
        Admission.EXPIRE
    )
