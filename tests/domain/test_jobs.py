"""Job schema v1, subjects, admission and failure decisions, table-driven."""

from __future__ import annotations

import json
import ssl
import tracemalloc
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from app.domain.jobs import (
    FAILURE_CLASSES,
    MAX_JOB_BYTES,
    MAX_JOB_DEPTH,
    MAX_JOB_VALUES,
    MAX_REJECTION_REASON,
    TRUNCATED_MARK,
    Admission,
    EventKind,
    FailureKind,
    Job,
    JobFailure,
    PermanentJobFailure,
    Rejection,
    RetryableJobFailure,
    admit,
    after_failure,
    classify_failure,
    consumer_filter,
    consumer_name,
    encode_event,
    event_body,
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
TOO_MANY = f"more than the {MAX_JOB_VALUES} values a job may have"
SUBJECT = "mm.write.A.memory.write"


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
        (b"[" * 40_000, TOO_DEEP),
        (b'{"a":' * 20_000, TOO_DEEP),
        (b"[" * 40_000 + b"]" * 40_000, TOO_DEEP),
        # ... and with more structure than a job may have: refused before it is decoded
        (b"[" * 100_000, TOO_MANY),
        (b'{"a":' * 100_000, TOO_MANY),
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


def poison(element: bytes) -> bytes:
    """A job of MAX_JOB_BYTES at most whose payload is one array of `element`, repeated."""
    base = raw(body(payload={"a": []}))
    count = (MAX_JOB_BYTES - len(base)) // (len(element) + 1)
    data = base.replace(b"[]", b"[" + b",".join([element] * count) + b"]")
    assert len(data) <= MAX_JOB_BYTES
    return data


def traced_peak(data: bytes) -> tuple[Job | Rejection, int]:
    """parse_job's result and the most memory it held at once (tracemalloc: deterministic)."""
    tracemalloc.start()
    try:
        result = parse_job(data, SUBJECT)
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    "element", [b"{}", b"[]", b"0", b"null", b'""', b"[0]", b'{"a":0}', b'{"\\"{[,:":[]}']
)
def test_a_job_of_too_many_values_is_refused_before_it_is_decoded(element: bytes) -> None:
    # 1 MiB of `{},{},...` is a valid job's size, and json.loads kept 24 MiB of it (47 MiB
    # at its peak): a few at once exhausted a 256 MiB pod
    result, peak = traced_peak(poison(element))
    assert isinstance(result, Rejection), result
    assert TOO_MANY in result.reason
    assert peak < 1024 * 1024  # measured: 2.4 KiB


def structure(value: Any) -> int:
    """The `{`, `[`, `,` and `:` of a value's JSON outside its strings: at least one for
    every value in it but the outermost."""
    if isinstance(value, dict):
        return 1 + max(len(value) - 1, 0) + len(value) + sum(map(structure, value.values()))
    if isinstance(value, list):
        return 1 + max(len(value) - 1, 0) + sum(map(structure, value))
    return 0


def test_the_value_bound_is_exact() -> None:
    zeros = MAX_JOB_VALUES - structure(body(payload={"a": []})) + 1
    at_bound = body(payload={"a": [0] * zeros})
    assert structure(at_bound) == MAX_JOB_VALUES
    assert isinstance(parse_job(raw(at_bound), SUBJECT), Job)
    over = parse_job(raw(body(payload={"a": [0] * (zeros + 1)})), SUBJECT)
    assert isinstance(over, Rejection) and TOO_MANY in over.reason


def test_structure_inside_strings_is_not_counted() -> None:
    payload = {
        "code": "{[,:]}" * 80_000,
        # escaped quotes and backslashes do not end a string
        "quoted": '"{,' * 60_000,
        "slashes": "\\" * 10_000 + '"' + "{" * 60_000,
        "text": "日本語{[,:}" * 10_000,
    }
    data = json.dumps(body(payload=payload), indent=2, ensure_ascii=False).encode()
    assert len(data) <= MAX_JOB_BYTES
    assert isinstance(parse_job(data, SUBJECT), Job)


def test_the_costliest_allowed_structure_stays_small() -> None:
    # one-member objects were the costliest structure per counted character measured
    # (72 bytes retained each); the bound keeps any allowed job's structure below the
    # ~8 MiB that the text of a 1 MiB job can take on its own (one astral character makes
    # Python hold every character of the decoded text in 4 bytes)
    count = (MAX_JOB_VALUES - structure(body(payload={"a": []}))) // 3
    data = raw(body(payload={"a": [{"a": 1.5}] * count}))
    result, peak = traced_peak(data)
    assert isinstance(result, Job)
    assert peak < 8 * 1024 * 1024


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
        # another trust zone is one more requirement: a node of the tier in that zone (the
        # consumer is shared by the whole tier) may run it
        (job(requirements={"trust_zone": "z2"}), Admission.NOT_HERE,
         "requirements not met: trust_zone"),
        (job(requirements={"trust_zone": "z2", "tier": ["B"]}), Admission.NOT_HERE,
         "requirements not met: tier, trust_zone"),
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


def test_a_node_without_a_trust_zone_does_not_run_a_job_that_names_one() -> None:
    zoneless = NODE.model_copy(update={"trust_zone": None})
    decision = admit(job(requirements={"trust_zone": "z1"}), node=zoneless, now=NOW)
    assert decision == admit(job(requirements={"trust_zone": "z2"}), node=NODE, now=NOW)
    assert decision.admission is Admission.NOT_HERE
    assert "security" not in decision.reason


def test_no_admission_is_a_security_refusal() -> None:
    assert {a.value for a in Admission} == {"run", "reject", "expire", "not-here"}


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


class OwnKind(JobFailure):
    """A handler's JobFailure that sets its kind itself, not by subclassing."""

    kind = FailureKind.PERMANENT


def test_a_job_failure_says_its_own_kind() -> None:
    assert classify_failure(OwnKind()) is FailureKind.PERMANENT


def test_the_failure_table_is_ordered_first_match_wins() -> None:
    classes = [cls for cls, _ in FAILURE_CLASSES]
    assert classes == [OSError, ValueError, KeyError, TypeError, BaseException]
    # every row is reachable: no class is already taken by an earlier row
    for later, (cls, _) in enumerate(FAILURE_CLASSES):
        assert not any(issubclass(cls, earlier) for earlier in classes[:later]), cls
    # the last row takes anything: the table decides every exception
    assert FAILURE_CLASSES[-1] == (BaseException, FailureKind.RETRYABLE)


@pytest.mark.parametrize(("cls", "kind"), FAILURE_CLASSES)
def test_each_row_decides_its_class(cls: type[BaseException], kind: FailureKind) -> None:
    assert classify_failure(cls.__new__(cls)) is kind


def test_a_payload_validation_error_is_permanent() -> None:
    with pytest.raises(ValidationError) as caught:
        Job.model_validate({})
    assert classify_failure(caught.value) is FailureKind.PERMANENT


BACKOFF = (5.0, 30.0, 120.0)


@pytest.mark.parametrize(
    ("kind", "attempt", "retry", "delay"),
    [
        # the attempt is the ledger's claim number: 1 for the first run of the job
        (FailureKind.RETRYABLE, 1, True, 5.0),  # retry 1 waits backoff[0]
        (FailureKind.RETRYABLE, 2, True, 30.0),
        (FailureKind.RETRYABLE, 3, True, 120.0),
        (FailureKind.RETRYABLE, 4, True, 120.0),  # past the list: its last step
        (FailureKind.RETRYABLE, 5, False, 0.0),  # the last attempt: dead letter
        (FailureKind.RETRYABLE, 9, False, 0.0),
        (FailureKind.PERMANENT, 1, False, 0.0),
        (FailureKind.PERMANENT, 4, False, 0.0),
        # not a claim number; taken as the first attempt, not as backoff[-1]
        (FailureKind.RETRYABLE, 0, True, 5.0),
    ],
)
def test_after_failure(kind: FailureKind, attempt: int, retry: bool, delay: float) -> None:
    verdict = after_failure(kind, attempt=attempt, max_attempts=5, backoff=BACKOFF)
    assert (verdict.retry, verdict.delay) == (retry, delay)


@pytest.mark.parametrize(("attempt", "retry"), [(1, False), (2, False)])
def test_one_attempt_allowed_is_never_retried(attempt: int, retry: bool) -> None:
    verdict = after_failure(FailureKind.RETRYABLE, attempt=attempt, max_attempts=1, backoff=BACKOFF)
    assert verdict.retry is retry


def test_after_failure_without_a_backoff_list() -> None:
    verdict = after_failure(FailureKind.RETRYABLE, attempt=1, max_attempts=3, backoff=())
    assert verdict.retry and verdict.delay == 1.0


def test_deadline_is_compared_with_the_given_clock() -> None:
    later = NOW + timedelta(hours=2)
    assert admit(job(deadline="2026-11-29T13:00:00Z"), node=NODE, now=later).admission is (
        Admission.EXPIRE
    )


JOB_ID = "3f1c9a2e-8f6e-4d0a-9a55-1f5b2d9b8c11"
IDS = {"job_id": JOB_ID, "idempotency_key": "k1", "node_id": "n1", "at": "2026-11-29T12:00:00Z"}


def event(**fields: Any) -> dict[str, Any]:
    return event_body(**{"node_id": "n1", "job_id": JOB_ID, "idempotency_key": "k1", "at": NOW,
                         **fields})  # fmt: skip


def compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def decoded(data: bytes) -> dict[str, Any]:
    """Strict JSON (no NaN) in UTF-8, or the test fails."""
    value = json.loads(data.decode("utf-8"), parse_constant=lambda name: pytest.fail(name))
    assert isinstance(value, dict)
    return value


def assert_cut(original: str, cut: str) -> None:
    assert cut.endswith(TRUNCATED_MARK), cut[-40:]
    assert original.startswith(cut[: -len(TRUNCATED_MARK)])


def assert_excerpt(original: Any, excerpt: Any) -> None:
    assert set(excerpt) == {"truncated", "excerpt", "bytes"}
    assert excerpt["truncated"] is True and excerpt["bytes"] == len(compact(original))
    assert compact(original).decode().startswith(excerpt["excerpt"])


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"reason": "ok", "retry_in_seconds": 5.0, "delivered": 2},
        {"result": {"text": '日本語 😀 "quoted"\n', "n": [1, 2.5, None, True]}},
        {"result": "x" * 4000},
    ],
)
def test_an_event_that_fits_is_its_compact_json(fields: dict[str, Any]) -> None:
    body = event(**fields)
    assert encode_event(body, max_bytes=MAX_JOB_BYTES) == compact(body)
    # exactly at the bound too
    assert encode_event(body, max_bytes=len(compact(body))) == compact(body)


@pytest.mark.parametrize(
    ("result", "max_bytes"),
    [
        ({"body": "x" * 2_000_000}, MAX_JOB_BYTES),
        ({"body": "x" * 10_000}, 4096),
        ("s" * 100_000, 4096),
        ([{"n": i} for i in range(5_000)], 4096),
        ({"text": "日本語" * 10_000}, 4096),
        ({"text": "😀" * 10_000}, 4096),
        ({"quotes": '"\\' * 10_000, "controls": "\x01\n" * 1_000}, 4096),
    ],
)
def test_a_result_too_big_becomes_an_excerpt(result: Any, max_bytes: int) -> None:
    body = event(result=result, reason="fine")
    data = encode_event(body, max_bytes=max_bytes)
    # as close to the bound as whole characters allow (one may take 6 bytes, \u0001)
    assert max_bytes - 6 <= len(data) <= max_bytes
    out = decoded(data)
    assert out["truncated"] is True
    assert {k: out[k] for k in IDS} == IDS and out["reason"] == "fine"
    assert_excerpt(result, out["result"])


@pytest.mark.parametrize(
    "reason",
    ["r" * 10_000, "é" * 10_000, "😀" * 5_000, "日本" * 5_000, '"\\\n' * 5_000, "a\x00" * 3_000],
)
def test_a_long_reason_is_cut_with_a_mark(reason: str) -> None:
    data = encode_event(event(reason=reason), max_bytes=4096)
    assert 4096 - 6 <= len(data) <= 4096
    out = decoded(data)
    assert out["truncated"] is True and {k: out[k] for k in IDS} == IDS
    assert_cut(reason, out["reason"])


def test_the_biggest_part_is_shrunk_first() -> None:
    result = {"body": "x" * 100_000}
    out = decoded(encode_event(event(result=result, reason="r" * 2_000), max_bytes=8192))
    assert out["reason"] == "r" * 2_000
    assert_excerpt(result, out["result"])
    out = decoded(encode_event(event(result={"n": 1}, reason="r" * 100_000), max_bytes=8192))
    assert out["result"] == {"n": 1}
    assert_cut("r" * 100_000, out["reason"])


def test_parts_too_big_together_share_the_room() -> None:
    # neither is cut to nothing because the other was bigger
    result, reason = {"body": "x" * 2_000_000}, "r" * 1_000_000
    data = encode_event(event(result=result, reason=reason), max_bytes=8192)
    out = decoded(data)
    assert len(data) <= 8192
    assert_excerpt(result, out["result"])
    assert_cut(reason, out["reason"])
    assert len(out["result"]["excerpt"]) > 3000 and len(out["reason"]) > 3000


def test_the_ids_are_kept_while_anything_else_can_go() -> None:
    body = event(reason="r" * 1_000, result={"a": "b" * 1_000}, delivered=3, note="n" * 500)
    out = decoded(encode_event(body, max_bytes=250))
    assert {k: out[k] for k in IDS} == IDS and out["truncated"] is True
    assert len(encode_event(body, max_bytes=250)) <= 250


@pytest.mark.parametrize("max_bytes", [2, 10, 17, 18, 40, 100])
def test_any_bound_is_kept(max_bytes: int) -> None:
    body = event(reason="r" * 1_000, idempotency_key="k" * 255)
    data = encode_event(body, max_bytes=max_bytes)
    assert len(data) <= max_bytes
    decoded(data)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        # not JSON: kept as the text of its repr, and the event says it was changed
        ({"retry_in_seconds": float("nan")}, {"retry_in_seconds": "nan", "truncated": True}),
        ({"result": {1, 2}}, {"result": "{1, 2}", "truncated": True}),
        ({"result": {(1, 2): "tuple key"}}, {"result": "{(1, 2): 'tuple key'}", "truncated": True}),
        # text that is not Unicode: its unpaired surrogate becomes U+FFFD, nothing is cut
        ({"reason": "a\ud800b"}, {"reason": "a\ufffdb"}),
    ],
)
def test_what_is_not_json_still_makes_an_event(
    fields: dict[str, Any], expected: dict[str, Any]
) -> None:
    out = decoded(encode_event(event(**fields), max_bytes=4096))
    assert out == {**IDS, **expected}


def test_a_result_nested_beyond_the_encoders_reach_makes_an_event() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    out = decoded(encode_event(event(result=deep), max_bytes=4096))
    assert out["truncated"] is True and out["result"].startswith("[[[[")
