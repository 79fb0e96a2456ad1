"""docs/job-schema-v1.json is the schema the code validates with (regenerate with
`workload-manager job-schema > docs/job-schema-v1.json`)."""

from __future__ import annotations

import json
from pathlib import Path

from app.domain.jobs import job_json_schema

DOC = Path(__file__).resolve().parents[2] / "docs" / "job-schema-v1.json"


def test_published_schema_is_current() -> None:
    assert json.loads(DOC.read_text()) == job_json_schema()


def test_schema_names_the_contract_fields() -> None:
    schema = job_json_schema()
    assert set(schema["required"]) == {"schema", "job_id", "idempotency_key", "type", "created_at"}
    assert schema["properties"]["schema"]["const"] == "job/v1"
