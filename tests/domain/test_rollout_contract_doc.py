"""docs/backend-api.md says what the rollout code sends and reads: the outcomes of the
version PUT, the update states, the report's `update` fields and the desired workload's
`update` and `rollout` fields fail here until the file names them."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

from app.domain.reports import UpdateView
from app.domain.rollout import RolloutSpec, UpdateSpec, UpdateWindow
from app.domain.rollout_machine import Outcome, UpdateState

DOC = (Path(__file__).resolve().parents[2] / "docs" / "backend-api.md").read_text()


def test_every_outcome_of_the_version_put_is_in_its_table() -> None:
    rows = set(re.findall(r"^\| `([a-z_]+)` \| ", DOC, re.MULTILINE))
    assert {o.value for o in Outcome} <= rows


def test_every_update_state_is_named() -> None:
    assert [s.value for s in UpdateState if f"`{s.value}`" not in DOC] == []


def test_the_reports_update_fields_are_those_sent() -> None:
    sent = UpdateView("1", "current", datetime(2026, 1, 1, tzinfo=UTC), "", 0.0).as_dict()
    example = re.search(r'"update": (\{"target".*?\})', DOC, re.DOTALL)
    assert example is not None
    assert set(re.findall(r'"([a-z_]+)":', example.group(1))) == set(sent)


def test_the_desired_workloads_update_and_rollout_fields_are_documented() -> None:
    fields = {*UpdateSpec.model_fields, *RolloutSpec.model_fields, *UpdateWindow.model_fields}
    assert [f for f in sorted(fields) if f"`{f}`" not in DOC] == []
