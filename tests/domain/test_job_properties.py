"""Property tests: any delivery parses to a Job or a Rejection and gets a decision —
never an exception that would crash-loop the consumer."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from app.domain.jobs import Admission, Job, Rejection, admit, parse_job
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
