"""docs/asyncapi.yaml says what the code does: its subjects are the ones the code makes,
its enums the code's (event kinds, codes, stream kinds, tiers, ledger states), its
schemas valid JSON Schema whose fields are the code's, and every reference resolves. A
rename or a new field fails here until the document says it too (and the CHANGELOG)."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from typing import Any

import jsonschema
import pytest

from app.adapters.kv_ledger import bucket, key_name
from app.domain.job_flow import Code
from app.domain.jobs import (
    JOB_KINDS,
    EventKind,
    event_body,
    event_subject,
    job_json_schema,
    job_subject,
)
from app.domain.ledger import FINISHED, RUNNING, LedgerRecord
from app.services.streams import TIERS
from tests.support import asyncapi


def channel(name: str) -> dict[str, Any]:
    found: dict[str, Any] = asyncapi.document()["channels"][name]
    return found


def enum(channel_name: str, parameter: str) -> list[str]:
    return list(channel(channel_name)["parameters"][parameter]["enum"])


def refs(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [value["$ref"]] if "$ref" in value else [r for v in value.values() for r in refs(v)]
    if isinstance(value, list):
        return [r for v in value for r in refs(v)]
    return []


def test_it_is_an_asyncapi_3_document_whose_references_resolve() -> None:
    doc = asyncapi.document()
    assert doc["asyncapi"] == "3.0.0"
    assert {"title", "version"} <= set(doc["info"])
    for ref in refs(doc):
        assert asyncapi.resolve(ref) is not None, ref
    for name, operation in doc["operations"].items():
        assert operation["action"] in ("send", "receive"), name
        target = asyncapi.deref(operation["channel"])
        assert target in doc["channels"].values(), name
        for message in operation["messages"]:
            assert asyncapi.deref(message) in doc["components"]["messages"].values(), name


@pytest.mark.parametrize("name", ["jobEvent", "nodeEvent", "ledgerRecord"])
def test_every_schema_is_json_schema(name: str) -> None:
    jsonschema.Draft7Validator.check_schema(asyncapi.document()["components"]["schemas"][name])


def test_the_job_message_is_the_published_job_schema() -> None:
    assert asyncapi.payload_schema("jobs") == job_json_schema()


def test_the_enums_are_the_codes() -> None:
    assert enum("jobs", "kind") == list(JOB_KINDS)
    assert enum("jobs", "tier") == list(TIERS) == enum("ledger", "tier")
    job_kinds = [k.value.removeprefix("job.") for k in EventKind if k.value.startswith("job.")]
    node_kinds = [k.value.removeprefix("node.") for k in EventKind if k.value.startswith("node.")]
    assert enum("jobEvents", "event") == job_kinds
    assert enum("nodeEvents", "event") == node_kinds
    assert len(job_kinds) + len(node_kinds) == len(EventKind), "every event kind has a channel"
    codes = asyncapi.document()["components"]["schemas"]["jobEvent"]["properties"]["code"]
    assert codes["enum"] == [c.value for c in Code]
    states = asyncapi.document()["components"]["schemas"]["ledgerRecord"]["properties"]
    assert states["status"]["enum"] == [
        RUNNING,
        *sorted(FINISHED, key=["completed", "retrying", "dead"].index),
    ]


@pytest.mark.parametrize("kind", list(EventKind))
def test_each_event_subject_is_its_channels(kind: EventKind) -> None:
    expected = "jobEvents" if kind.value.startswith("job.") else "nodeEvents"
    assert asyncapi.channel_of(event_subject("node-c1", kind)) == expected


def test_job_and_ledger_subjects_are_their_channels() -> None:
    for kind in JOB_KINDS:
        for tier in TIERS:
            assert asyncapi.channel_of(job_subject(kind, tier, "embed.text")) == "jobs"
            assert asyncapi.channel_of(f"$KV.{bucket(tier)}.{key_name('k-1')}") == "ledger"
    assert asyncapi.channel_of("mm.write.D.noop") is None, "tier D is no tier"
    assert asyncapi.channel_of("mm.events.node-c1.job.unroutable") is None, "renamed: job.dead"


def test_the_ledger_record_is_the_codes() -> None:
    schema = asyncapi.payload_schema("ledger")
    fields = [f.name for f in dataclasses.fields(LedgerRecord)]
    assert list(schema["properties"]) == fields == schema["required"]
    for record in (
        LedgerRecord("running", "j", "noop", "n", "c", 1, 1.5e9, fingerprint="f"),
        LedgerRecord("completed", "j", "noop", "n", "c", 1, None, result={"ok": True}),
        LedgerRecord("dead", "j", "noop", "n", "c", 3, None, error="permanent: no"),
    ):
        jsonschema.validate(json.loads(record.encode()), schema)


def test_an_event_body_has_only_documented_fields() -> None:
    at = datetime(2026, 12, 5, tzinfo=UTC)
    every: dict[str, Any] = {
        "delivered": 1, "code": "completed", "attempt": 1, "duplicate": True,
        "retry_in_seconds": 2.5, "truncated": True,
    }  # fmt: skip
    body = event_body(
        node_id="n", job_id="j", idempotency_key="k", at=at, reason="r", result={"x": 1}, **every
    )
    jsonschema.validate(body, asyncapi.payload_schema("jobEvents"))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**body, "surprise": 1}, asyncapi.payload_schema("jobEvents"))
