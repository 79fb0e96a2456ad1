"""Property tests: any delivery parses to a Job or a Rejection and gets a decision —
never an exception that would crash-loop the consumer."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from app.domain.jobs import (
    MAX_REJECTION_REASON,
    TRUNCATED_MARK,
    Admission,
    FailureKind,
    Job,
    Rejection,
    admit,
    after_failure,
    encode_event,
    parse_job,
)
from app.domain.requirements import NodeProfile

NODE = NodeProfile(node_id="n", tier="A", region="eu", trust_zone="z1",
                   hardware={"gpu": False, "memory_gb": 8}, capabilities=["x"])  # fmt: skip
NOW = datetime(2026, 11, 29, tzinfo=UTC)

LEAF = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
JSON = st.recursive(
    LEAF,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=10,
)
FIELDS = {
    "schema": st.sampled_from(["job/v1", "job/v2", 1]),
    "job_id": st.uuids().map(str) | JSON,
    "idempotency_key": st.text(max_size=20) | JSON,
    "type": st.sampled_from(["noop", "memory.write", "Bad Type", ""]) | JSON,
    "requirements": st.fixed_dictionaries(
        {},
        optional={
            "tier": st.lists(st.sampled_from(["A", "B", "C", "D"]), max_size=3) | JSON,
            "region": st.text(max_size=5) | JSON,
            "trust_zone": st.sampled_from(["z1", "z2"]) | JSON,
            "hardware": st.fixed_dictionaries(
                {}, optional={"gpu": st.booleans() | JSON, "min_memory_gb": st.floats(-5, 100)}
            )
            | JSON,
            "capabilities": st.lists(st.text(max_size=5), max_size=3) | JSON,
        },
    )
    | JSON,
    "payload": st.dictionaries(st.text(max_size=5), JSON, max_size=3) | JSON,
    "created_at": st.sampled_from(["2026-11-29T00:00:00Z", "2026-11-29", "soon"]) | JSON,
    "deadline": st.sampled_from(["2026-11-28T00:00:00Z", "2026-12-01T00:00:00+01:00"]) | JSON,
}
JOBS = st.fixed_dictionaries({}, optional=FIELDS)
SUBJECTS = st.sampled_from(["mm.write.A.noop", "mm.online.B.memory.write", "mm.x.A.noop", "foo"])


@settings(max_examples=300, deadline=None)
@given(body=JOBS | JSON, subject=SUBJECTS)
def test_any_json_delivery_parses_and_is_decided(body: Any, subject: str) -> None:
    parsed = parse_job(json.dumps(body).encode(), subject)
    assert isinstance(parsed, Job | Rejection)
    decision = admit(parsed, node=NODE, now=NOW)
    assert isinstance(decision.admission, Admission)
    if isinstance(parsed, Rejection):
        assert decision.admission is Admission.REJECT and parsed.reason


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=300), subject=SUBJECTS)
def test_any_bytes_are_a_rejection_or_a_job(raw: bytes, subject: str) -> None:
    assert isinstance(parse_job(raw, subject), Job | Rejection)


VALID = json.dumps(
    {"schema": "job/v1", "job_id": "3f1c9a2e-8f6e-4d0a-9a55-1f5b2d9b8c11",
     "idempotency_key": "k1", "type": "noop", "payload": {"text": "hi", "n": [1, 2.5]},
     "created_at": "2026-11-29T11:59:00Z"}
).encode()  # fmt: skip
# pieces that reach the corners of a JSON decoder: nesting, escapes, non-finite numbers,
# bytes that are not UTF-8, a BOM, NUL, numbers too long to convert, the job's own names
TOKENS = st.sampled_from(
    [b"{", b"}", b"[", b"]", b"[" * 2000, b"{\"a\":" * 300, b'"', b"\\", b"\\u", b"d800",
     b"dfff", b"0000", b"\\ud83d\\ude00", b":", b",", b" ", b"0", b"-1", b"1e999", b"-1e400",
     b"NaN", b"Infinity", b"-Infinity", b"true", b"null", b"\xff", b"\xc3", b"\xe2\x82",
     b"\x00", b"\xef\xbb\xbf", b"\xfe\xff", b"9" * 5000, b'"job_id"', b'"idempotency_key"',
     b'"payload"', b'"schema"', b'"job/v1"', b'"type"', b'"noop"']
)  # fmt: skip
JSONISH = st.lists(TOKENS, max_size=40).map(b"".join)


@st.composite
def spliced(draw: st.DrawFn) -> bytes:
    """A valid job with some of its bytes replaced by JSON-ish pieces."""
    start = draw(st.integers(0, len(VALID)))
    end = draw(st.integers(start, min(len(VALID), start + 12)))
    return VALID[:start] + draw(JSONISH | st.binary(max_size=8)) + VALID[end:]


def assert_total(raw: bytes, subject: str) -> None:
    """A Job that can go on (strict JSON, UTF-8, a key the ledger can store) or a
    Rejection whose reason and ids can be published."""
    parsed = parse_job(raw, subject)
    if isinstance(parsed, Rejection):
        assert parsed.reason and len(parsed.reason) <= MAX_REJECTION_REASON
        for value in (parsed.job_id, parsed.idempotency_key):
            assert value is None or 0 < len(value) <= 255
            assert value is None or value.encode("utf-8")
        return
    assert isinstance(parsed, Job)
    json.dumps(
        parsed.model_dump(mode="json", by_alias=True), allow_nan=False, ensure_ascii=False
    ).encode("utf-8")
    assert "\x00" not in parsed.idempotency_key


@settings(max_examples=500, deadline=None)
@given(raw=st.binary(max_size=2000) | JSONISH | spliced(), subject=SUBJECTS)
def test_any_bytes_give_a_job_fit_to_run_or_a_publishable_rejection(
    raw: bytes, subject: str
) -> None:
    assert_total(raw, subject)


@settings(max_examples=50, deadline=None)
@given(depth=st.integers(0, 200_000), opener=st.sampled_from([b"[", b'{"a":', b'{"payload":']))
def test_any_nesting_depth_is_decided(depth: int, opener: bytes) -> None:
    assert_total(opener * depth, "mm.write.A.noop")
    assert_total(VALID[:-1] + b',"x":' + b"[" * depth + b"]" * depth + b"}", "mm.write.A.noop")


# Events: any body encodes to strict JSON in UTF-8 within the bound, never raising.
# Text of any code point (unpaired surrogates too, as a handler's result may hold),
# made long by repetition, which drawing alone would take long to reach.
ANY_TEXT = st.text(st.characters(codec=None), max_size=40)
LONG_TEXT = st.builds(lambda text, times: text * times, ANY_TEXT, st.integers(0, 400))
VALUE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | LONG_TEXT,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(ANY_TEXT, c, max_size=4),
    max_leaves=12,
)  # fmt: skip
IDS = st.fixed_dictionaries(
    {
        "job_id": st.uuids().map(str) | st.none(),
        "idempotency_key": st.text(st.characters(codec="utf-8"), min_size=1, max_size=255)
        | st.none(),
        "node_id": st.from_regex(r"[a-z0-9-]{1,64}", fullmatch=True),
        "at": st.just("2026-11-29T12:00:00Z"),
    }
)
BODIES = st.builds(
    lambda ids, extra: {**ids, **extra},
    IDS,
    st.fixed_dictionaries(
        {},
        optional={
            "reason": LONG_TEXT,
            "result": VALUE,
            "retry_in_seconds": st.floats(0, 3600),
            "delivered": st.integers(1, 1000),
            "note": VALUE,
        },
    ),
)
ID_KEYS = ("job_id", "idempotency_key", "node_id", "at")


def utf8_json(value: Any) -> bytes | None:
    """The compact JSON of a value in UTF-8, or None when its text is not Unicode."""
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return None


def repaired(value: Any) -> Any:
    """The value with its unpaired surrogates as U+FFFD, as an event carries it."""
    text = json.dumps(value, ensure_ascii=False)
    return json.loads(re.sub("[\ud800-\udfff]", "\ufffd", text))


def assert_shortened(original: Any, sent: Any, key: str) -> None:
    """What a part of an event may have become: itself, a cut string, an excerpt."""
    if sent == repaired(original):
        return
    if key == "result" or isinstance(original, dict | list):
        assert set(sent) == {"truncated", "excerpt", "bytes"}, sent
        whole = utf8_json(original)
        if whole is not None:
            assert sent["bytes"] == len(whole)
            assert whole.decode().startswith(sent["excerpt"])
        return
    assert isinstance(original, str) and isinstance(sent, str)
    if utf8_json(original) is not None:
        assert sent.endswith(TRUNCATED_MARK)
        assert original.startswith(sent[: -len(TRUNCATED_MARK)])


@settings(max_examples=600, deadline=None)
@given(
    body=BODIES,
    max_bytes=st.integers(2, 300) | st.integers(300, 6000) | st.sampled_from([4096, 65536]),
)
def test_any_event_encodes_within_its_bound(body: dict[str, Any], max_bytes: int) -> None:
    data = encode_event(body, max_bytes=max_bytes)
    assert len(data) <= max_bytes
    sent = json.loads(data.decode("utf-8"), parse_constant=lambda name: pytest.fail(name))
    assert isinstance(sent, dict) and set(sent) <= {*body, "truncated"}
    whole = utf8_json(body)
    if whole is not None and len(whole) <= max_bytes:
        # nothing to shorten: exactly its compact JSON
        event("fits")
        assert data == whole
        return
    event("shortened" if len(sent) > 1 else "only the mark left" if sent else "left empty")
    if whole is not None:
        assert sent.get("truncated") is True or sent == {}
    if max_bytes >= 4096:
        # room for the ids at their longest: they are never shortened then
        assert all(sent[key] == body[key] for key in ID_KEYS if utf8_json(body[key]))
    for key, value in sent.items():
        if key != "truncated" and key not in ID_KEYS:
            assert_shortened(body[key], value, key)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(FailureKind),
    attempt=st.integers(1, 50),
    max_attempts=st.integers(1, 20),
    backoff=st.lists(st.floats(0.1, 600), max_size=5).map(tuple),
)
def test_retries_stay_within_the_attempts(
    kind: FailureKind, attempt: int, max_attempts: int, backoff: tuple[float, ...]
) -> None:
    verdict = after_failure(kind, attempt=attempt, max_attempts=max_attempts, backoff=backoff)
    assert verdict.retry is (kind is FailureKind.RETRYABLE and attempt < max_attempts)
    if verdict.retry:
        assert verdict.delay == (backoff[min(attempt, len(backoff)) - 1] if backoff else 1.0)
