"""Requirement matching, table-driven (the same table runs against SQL in the adapter tests)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.domain.requirements import Mismatch, Requirements, match_requirements
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
    ],
)
def test_invalid_requirements_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        Requirements.model_validate(fields)
