"""Requirement matching, table-driven (the same table runs against SQL in the adapter tests)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from app.domain.jobs import MAX_JOB_BYTES, MAX_REJECTION_REASON, Rejection, parse_job
from app.domain.requirements import (
    MAX_CAPABILITIES,
    MAX_NAME_CHARS,
    Mismatch,
    Requirements,
    match_requirements,
)
from tests.support.requirement_cases import CASES, NODES, expected_mismatches


@pytest.mark.parametrize(("title", "requirements", "expected"), CASES, ids=[c[0] for c in CASES])
def test_matching(
    title: str, requirements: Requirements, expected: dict[str, list[Mismatch]]
) -> None:
    for node in NODES:
        assert match_requirements(requirements, node) == expected_mismatches(
            node.node_id, expected
        ), node.node_id


@pytest.mark.parametrize(
    "fields",
    [
        {"tier": ["D"]},
        {"hardware": {"min_memory_gb": -1}},
        {"hardware": {"gpus": 2}},
        {"colour": "red"},
        # every field is bounded: a requirement is echoed in rejection and unroutable
        # events, which must stay far below NATS's max_payload
        {"trust_zone": "z" * 360_000},
        {"trust_zone": "z" * (MAX_NAME_CHARS + 1)},
        {"region": "r" * (MAX_NAME_CHARS + 1)},
        {"tier": ["A", "B", "C", "A"]},
        {"capabilities": ["c"] * (MAX_CAPABILITIES + 1)},
        {"capabilities": ["c" * 65]},
        # names are names: ASCII letters, digits and -_.:, like a capability's
        {"region": ""},
        {"region": "eu west"},
        {"region": "eu\n"},
        {"trust_zone": "zone/1"},
        {"trust_zone": "zône"},
        {"capabilities": ["gpu", "bad name"]},
        {"capabilities": [""]},
    ],
)
def test_invalid_requirements_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        Requirements.model_validate(fields)


@pytest.mark.parametrize(
    "fields",
    [
        {"region": "r" * MAX_NAME_CHARS, "trust_zone": "z" * MAX_NAME_CHARS},
        {"region": "eu-west-1", "trust_zone": "prod:zone_a.1"},
        {"tier": ["A", "B", "C"]},
        {"capabilities": [f"cap-{i}" for i in range(MAX_CAPABILITIES)]},
        {"capabilities": ["c" * 64, "embeddings:v2"]},
    ],
)
def test_requirements_at_their_bounds_are_accepted(fields: dict[str, object]) -> None:
    Requirements.model_validate(fields)


def test_a_huge_requirement_is_a_short_rejection() -> None:
    job = {"schema": "job/v1", "job_id": "3f1c9a2e-8f6e-4d0a-9a55-1f5b2d9b8c11",
           "idempotency_key": "k", "type": "noop", "created_at": "2026-11-29T11:59:00Z",
           "requirements": {"trust_zone": "z" * 360_000}}  # fmt: skip
    data = json.dumps(job).encode()
    assert len(data) <= MAX_JOB_BYTES
    result = parse_job(data, "mm.write.A.noop")
    assert isinstance(result, Rejection)
    assert result.reason.startswith("requirements.trust_zone")
    assert len(result.reason) <= MAX_REJECTION_REASON
