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


def one(**fields: Any) -> dict[str, Any]:
    return {"workloads": [{"name": "api", "version": "1.4.3", **fields}]}


def test_update_and_rollout_parse_and_ignore_unknown_fields() -> None:
    workload = parse_desired(
        one(
            update={
                "judge": "pings",
                "min_healthy_seconds": 60,
                "deadline_seconds": 600,
                "revert": True,
                "window": {"days": ["sat", "sun"], "start": "02:00", "end": "05:00",
                           "tz": "Europe/Kyiv", "later": 1},
                "max_defer_seconds": 1800,
                "later": True,
            },
            rollout={"percent": 20, "halt": False, "seed": "api/1.4.3", "later": 1},
        )
    ).workloads[0]  # fmt: skip
    assert workload.update is not None and workload.rollout is not None
    assert workload.update.judge == "pings"
    assert workload.update.window is not None
    assert workload.update.window.days == ("sat", "sun")
    assert workload.update.window.tz == "Europe/Kyiv"
    assert (workload.rollout.percent, workload.rollout.halt) == (20, False)


def test_update_fields_left_out_are_the_node_s_defaults() -> None:
    workload = parse_desired(one(update={}, rollout={})).workloads[0]
    assert workload.update is not None and workload.rollout is not None
    assert workload.update.model_dump() == {
        "judge": None,
        "min_healthy_seconds": None,
        "deadline_seconds": None,
        "revert": None,
        "window": None,
        "max_defer_seconds": None,
        "retry": None,
    }
    assert workload.rollout.model_dump() == {"percent": 100, "halt": False, "seed": None}
    plain = parse_desired(one()).workloads[0]
    assert (plain.update, plain.rollout) == (None, None)


WINDOW = {"start": "02:00", "end": "05:00"}


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"update": 5}, "workloads.0.update"),
        ({"update": {"judge": "maybe"}}, "workloads.0.update.judge"),
        ({"update": {"min_healthy_seconds": 1}}, "workloads.0.update.min_healthy_seconds"),
        ({"update": {"min_healthy_seconds": 3601}}, "workloads.0.update.min_healthy_seconds"),
        ({"update": {"deadline_seconds": 5}}, "workloads.0.update.deadline_seconds"),
        ({"update": {"deadline_seconds": 86_401}}, "workloads.0.update.deadline_seconds"),
        ({"update": {"deadline_seconds": "nan"}}, "workloads.0.update.deadline_seconds"),
        ({"update": {"revert": "sometimes"}}, "workloads.0.update.revert"),
        ({"update": {"max_defer_seconds": -1}}, "workloads.0.update.max_defer_seconds"),
        ({"update": {"max_defer_seconds": 8 * 86_400}}, "workloads.0.update.max_defer_seconds"),
        ({"update": {"window": {"end": "05:00"}}}, "workloads.0.update.window.start"),
        ({"update": {"window": {**WINDOW, "start": "2:00"}}}, "workloads.0.update.window.start"),
        ({"update": {"window": {**WINDOW, "end": "24:00"}}}, "workloads.0.update.window.end"),
        (
            {"update": {"window": {**WINDOW, "end": "02:00"}}},
            "workloads.0.update.window: Value error, start and end",
        ),
        ({"update": {"window": {**WINDOW, "days": []}}}, "workloads.0.update.window.days"),
        (
            {"update": {"window": {**WINDOW, "days": ["sat", "saturday"]}}},
            "workloads.0.update.window.days.1",
        ),
        (
            {"update": {"window": {**WINDOW, "days": ["sat", "sat"]}}},
            "workloads.0.update.window.days",
        ),
        ({"update": {"window": {**WINDOW, "tz": "Mars/Olympus"}}}, "workloads.0.update.window.tz"),
        (
            {"update": {"window": {**WINDOW, "tz": "../../etc/passwd"}}},
            "workloads.0.update.window.tz",
        ),
        ({"update": {"window": {**WINDOW, "tz": "zone.tab"}}}, "workloads.0.update.window.tz"),
        ({"rollout": []}, "workloads.0.rollout"),
        ({"rollout": {"percent": -1}}, "workloads.0.rollout.percent"),
        ({"rollout": {"percent": 100.5}}, "workloads.0.rollout.percent"),
        ({"rollout": {"percent": "half"}}, "workloads.0.rollout.percent"),
        ({"rollout": {"halt": "soon"}}, "workloads.0.rollout.halt"),
        ({"rollout": {"seed": ""}}, "workloads.0.rollout.seed"),
        ({"rollout": {"seed": "s" * 129}}, "workloads.0.rollout.seed"),
    ],
)
def test_a_malformed_update_or_rollout_names_the_field(fields: dict[str, Any], where: str) -> None:
    with pytest.raises(DesiredStateError) as caught:
        parse_desired(one(**fields))
    assert str(caught.value).startswith(where)


SHA = "ab" * 32


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"serial": -1}, "serial"),
        ({"serial": "42"}, "serial"),
        ({"serial": 4.2}, "serial"),
        ({"serial": 2**63}, "serial"),
        ({"node_id": ""}, "node_id"),
        ({"issued_at": "2026-12-06T10:00:00"}, "issued_at"),  # no offset
        ({"workloads": [{"name": "api", "version": "1", "manifest_sha256": "ab"}]},
         "workloads.0.manifest_sha256"),
    ],
)  # fmt: skip
def test_a_signed_states_fields_are_bounded(fields: dict[str, Any], where: str) -> None:
    body = {"workloads": [{"name": "api", "version": "1"}], **fields}
    with pytest.raises(DesiredStateError, match=f"^{where}:"):
        parse_desired(body)


def test_a_signed_state_reads_its_order_and_binding() -> None:
    state = parse_desired({
        "serial": 42, "node_id": "node-a", "issued_at": "2026-12-06T10:00:00Z",
        "workloads": [{"name": "api", "version": "1", "manifest_sha256": SHA}],
    })  # fmt: skip
    assert state.issued_at is not None
    assert (state.serial, state.node_id, state.issued_at.isoformat()) == (
        42, "node-a", "2026-12-06T10:00:00+00:00",
    )  # fmt: skip
    assert state.workloads[0].manifest_sha256 == SHA
    unsigned = parse_desired({"workloads": []})
    assert (unsigned.serial, unsigned.node_id, unsigned.issued_at) == (None, None, None)
