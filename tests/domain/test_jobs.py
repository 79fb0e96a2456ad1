"""Job schema v1, subjects, admission and failure decisions, table-driven."""

from __future__ import annotations

import json
import ssl
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from app.domain.jobs import (
    MAX_JOB_BYTES,
    MAX_JOB_DEPTH,
    MAX_REJECTION_REASON,
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


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for level in range(depth):
        value = [value] if level % 2 else {"n": value}
    return value


TOO_DEEP = f"nests arrays and objects more than {MAX_JOB_DEPTH} deep"
TOO_BIG = f"more than the {MAX_JOB_BYTES} a job may be"


def with_fields(**fields: str) -> bytes:
    """A valid job's bytes with some fields replaced by raw JSON text (NaN, escapes, ...)."""
    text = json.dumps(body(**{name: "@" + name for name in fields}))
    for name, raw_json in fields.items():
        text = text.replace(f'"@{name}"', raw_json)
    return text.encode()


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        # nesting deeper than the interpreter's recursion limit: RecursionError before
        (b"[" * 100_000, TOO_DEEP),
        (b'{"a":' * 100_000, TOO_DEEP),
        (b"[" * 100_000 + b"]" * 100_000, TOO_DEEP),
        # deep but parseable: a Job before, whose payload no encoder downstream may take
        (raw(body(payload={"deep": nested(MAX_JOB_DEPTH - 1)})), TOO_DEEP),
        # more than NATS's default max_payload: refused before it is decoded
        (raw(body(payload={"blob": "x" * MAX_JOB_BYTES})), TOO_BIG),
        (b" " * (MAX_JOB_BYTES + 1), TOO_BIG),
        # not UTF-8: json.loads would have read UTF-16 and UTF-32 as well
        (json.dumps(body()).encode("utf-16"), "not UTF-8"),
        (json.dumps(body()).encode("utf-32"), "not UTF-8"),
        (raw(body())[:-2] + b'\xff"}', "not UTF-8"),
        (raw(body()).replace(b'"hi"', b'"h\xc3"'), "not UTF-8"),
        (b"\xef\xbb\xbf" + raw(body()), "payload is not JSON"),
        # numbers JSON has no room for
        (with_fields(payload='{"x": NaN}'), "NaN is not a JSON number"),
        (with_fields(payload='{"x": -Infinity}'), "-Infinity is not a JSON number"),
        (with_fields(payload='{"x": 1e999}'), "out of range"),
        (with_fields(payload='{"x": ' + "9" * 5000 + "}"), "payload is not JSON"),
        # text that is not Unicode: it cannot be encoded to be stored, published or sent on
        (with_fields(payload='{"x": "\\ud800"}'), "unpaired surrogate"),
        (with_fields(payload='{"\\udfff": 1}'), "unpaired surrogate"),
        (with_fields(idempotency_key='"k\\ud83d"'), "unpaired surrogate"),
        # PostgreSQL text cannot hold NUL: the ledger could never claim this key
        (with_fields(idempotency_key='"k\\u0000"'), "idempotency_key: must not contain NUL"),
        # wrong types at the top
        (b"[]", "payload: Input should be"),
        (b'"job"', "payload: Input should be"),
        (b"null", "payload: Input should be"),
        (b"", "payload is not JSON"),
    ],
)
def test_any_bytes_are_a_job_or_a_clear_rejection(data: bytes, reason: str) -> None:
    result = parse_job(data, "mm.write.A.memory.write")
    assert isinstance(result, Rejection), result
    assert reason in result.reason


def test_an_unparseable_payload_says_where() -> None:
    result = parse_job(b'{"schema": "job/v1",, }', "mm.write.A.noop")
    assert isinstance(result, Rejection)
    assert result.reason == (
        "payload is not JSON: Expecting property name enclosed in double quotes at line 1 column 21"
    )


def test_deep_but_allowed_nesting_is_a_job() -> None:
    # the job object is level 1 and its payload level 2: MAX_JOB_DEPTH - 2 more fit inside
    result = parse_job(
        raw(body(payload={"deep": nested(MAX_JOB_DEPTH - 2)})), "mm.write.A.memory.write"
    )
    assert isinstance(result, Job)


def test_a_job_of_exactly_the_size_limit_parses() -> None:
    data = raw(body())
    padded = data[:-1] + b" " * (MAX_JOB_BYTES - len(data)) + b"}"
    assert len(padded) == MAX_JOB_BYTES
    assert isinstance(parse_job(padded, "mm.write.A.memory.write"), Job)


@pytest.mark.parametrize(
    "bad",
    [
        {"idempotency_key": "k" * 100_000, "type": None},
        {"job_id": nested(500), "idempotency_key": ["k"], "type": None},
        {"job_id": "x\ud800", "idempotency_key": "k\x00", "type": None},
    ],
)
def test_rejections_carry_only_ids_fit_to_publish(bad: dict[str, Any]) -> None:
    data = json.dumps(body(**bad)).encode()
    result = parse_job(data, "mm.write.A.noop")
    assert isinstance(result, Rejection)
    for value in (result.job_id, result.idempotency_key):
        assert value is None or (len(value) <= 255 and "\x00" not in value)
        assert value is None or value.encode("utf-8")


def test_rejection_reasons_are_bounded() -> None:
    result = parse_job(raw(body(**{"x" * 100_000: 1})), "mm.write.A.memory.write")
    assert isinstance(result, Rejection)
    assert "Extra inputs are not permitted" in result.reason
    assert len(result.reason) <= MAX_REJECTION_REASON


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


class PayloadMissing(PermanentJobFailure, KeyError):
    """A handler's own failure type that also is a KeyError."""


class UpstreamGarbled(RetryableJobFailure, ValueError):
    """A handler's own failure type that also is a ValueError: what it says wins."""


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        # what the handler says
        (RetryableJobFailure("upstream 503"), FailureKind.RETRYABLE),
        (PermanentJobFailure("bad request"), FailureKind.PERMANENT),
        (UpstreamGarbled("half a body"), FailureKind.RETRYABLE),
        (PayloadMissing("text"), FailureKind.PERMANENT),
        # timeouts and connection errors: transient, retried
        (TimeoutError(), FailureKind.RETRYABLE),
        (ConnectionResetError(), FailureKind.RETRYABLE),
        (OSError(28, "No space left on device"), FailureKind.RETRYABLE),
        # a certificate that does not verify is an OSError and a ValueError: a connection
        # error (a certificate being rotated), not a bad payload
        (ssl.SSLCertVerificationError(1, "certificate has expired"), FailureKind.RETRYABLE),
        # the same payload fails the same way on every delivery: dead-lettered at once
        (KeyError("text"), FailureKind.PERMANENT),
        (ValueError("bad"), FailureKind.PERMANENT),
        (TypeError("bad"), FailureKind.PERMANENT),
        (json.JSONDecodeError("Expecting value", "", 0), FailureKind.PERMANENT),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), FailureKind.PERMANENT),
        # anything else unexpected may be transient: retried within JOB_MAX_DELIVER
        (RuntimeError("bug"), FailureKind.RETRYABLE),
        (Exception("who knows"), FailureKind.RETRYABLE),
        # a TaskGroup's exception group: permanent only when everything in it is
        (ExceptionGroup("g", [PermanentJobFailure("4xx")]), FailureKind.PERMANENT),
        (ExceptionGroup("g", [KeyError("a"), ValueError("b")]), FailureKind.PERMANENT),
        (ExceptionGroup("g", [KeyError("a"), ConnectionResetError()]), FailureKind.RETRYABLE),
        (ExceptionGroup("g", [ExceptionGroup("h", [TypeError()]), PermanentJobFailure()]),
         FailureKind.PERMANENT),
        (ExceptionGroup("g", [ExceptionGroup("h", [TimeoutError()]), KeyError("a")]),
         FailureKind.RETRYABLE),
    ],
)  # fmt: skip
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
