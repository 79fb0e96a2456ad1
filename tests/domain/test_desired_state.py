"""Parsing the desired state: what is accepted, and the field named when it is not."""

from __future__ import annotations

from typing import Any

import pytest

from app.domain.desired import DesiredStateError, parse_desired


def test_a_full_answer_parses_and_ignores_unknown_fields() -> None:
    state = parse_desired(
        {
            "revision": "r42",
            "allow_empty": False,
            "future_field": {"x": 1},
            "workloads": [{"name": "api", "version": "1.4.2", "channel": "stable"}],
        }
    )
    assert state.revision == "r42"
    assert state.by_name()["api"].version == "1.4.2"


def test_allow_empty_defaults_to_false() -> None:
    assert parse_desired({"workloads": []}).allow_empty is False


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (None, "body"),
        ([], "body"),
        ({}, "workloads"),
        ({"workloads": "nope"}, "workloads"),
        ({"workloads": [{"name": "api"}]}, "workloads.0.version"),
        ({"workloads": [{"version": "1"}]}, "workloads.0.name"),
        ({"workloads": [{"name": "Bad_Name", "version": "1"}]}, "workloads.0.name"),
        ({"workloads": [{"name": "api", "version": ""}]}, "workloads.0.version"),
        ({"workloads": [{"name": "api", "version": "1 2"}]}, "workloads.0.version"),
        ({"workloads": [{"name": "api", "version": "1"}, {"name": "api", "version": "2"}]},
         "listed twice"),
        ({"workloads": [], "allow_empty": "maybe"}, "allow_empty"),
    ],
)  # fmt: skip
def test_malformed_answers_name_the_field(body: Any, where: str) -> None:
    with pytest.raises(DesiredStateError) as caught:
        parse_desired(body)
    assert where in str(caught.value)


@pytest.mark.parametrize(
    ("given", "read"),
    [
        ("1.4.2", "1.4.2"),
        (None, None),
        ("", None),  # advisory: what is not a version is unknown, never an error
        (42, None),
        ("x" * 129, None),
    ],
)
def test_reported_version_is_advisory(given: Any, read: str | None) -> None:
    workload = {"name": "api", "version": "1.0.0", "reported_version": given}
    desired = parse_desired({"workloads": [workload]})
    assert desired.workloads[0].reported_version == read


def test_reported_version_may_be_absent() -> None:
    desired = parse_desired({"workloads": [{"name": "api", "version": "1.0.0"}]})
    assert desired.workloads[0].reported_version is None


def workloads(count: int) -> dict[str, Any]:
    return {"workloads": [{"name": f"w{i}", "version": "1"} for i in range(count)]}


def test_a_desired_state_with_more_workloads_than_the_bound_is_refused_whole() -> None:
    assert len(parse_desired(workloads(200)).workloads) == 200
    with pytest.raises(
        DesiredStateError, match=r"201 workloads, more than MAX_DESIRED_WORKLOADS \(200\)"
    ):
        parse_desired(workloads(201))
    with pytest.raises(
        DesiredStateError, match=r"3 workloads, more than MAX_DESIRED_WORKLOADS \(2\)"
    ):
        parse_desired(workloads(3), max_workloads=2)
    assert len(parse_desired(workloads(2), max_workloads=2).workloads) == 2
