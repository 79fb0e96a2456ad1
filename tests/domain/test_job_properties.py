"""Property tests: any delivery parses to a Job or a Rejection and gets a decision —
never an exception that would crash-loop the consumer."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from app.domain.jobs import MAX_REJECTION_REASON, Admission, Job, Rejection, admit, parse_job
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
