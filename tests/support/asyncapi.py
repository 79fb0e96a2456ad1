"""docs/asyncapi.yaml as a checker: which channel a subject belongs to (its address with the
parameters' enums), and whether a body is what that channel's message says.

Every event a test's worker publishes goes through `check` (tests/support/jobs_world.py,
`watching_events`), so a renamed or reshaped event fails the tests until the document says
the same."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml

DOCS = Path(__file__).resolve().parents[2] / "docs"
DOCUMENT = DOCS / "asyncapi.yaml"


@functools.cache
def document() -> dict[str, Any]:
    loaded = yaml.safe_load(DOCUMENT.read_text())
    assert isinstance(loaded, dict)
    return loaded


def resolve(ref: str) -> Any:
    """A `$ref` of the document: `#/a/b` inside it, or a file beside it (docs/)."""
    if ref.startswith("#/"):
        found: Any = document()
        for part in ref[2:].split("/"):
            found = found[part]
        return found
    return json.loads((DOCS / ref).read_text())


def deref(value: Any) -> Any:
    while isinstance(value, Mapping) and set(value) == {"$ref"}:
        value = resolve(value["$ref"])
    return value


def address_pattern(channel: Mapping[str, Any]) -> re.Pattern[str]:
    """The channel's address as a regex: a parameter with an enum matches one of its values,
    any other one subject token, or the rest of the subject when it ends the address (a
    job type is dot-separated words)."""
    address = channel["address"]
    parameters = channel.get("parameters") or {}
    pattern = ""
    for literal, name in re.findall(r"([^{]*)(?:\{([^}]+)\})?", address):
        pattern += re.escape(literal)
        if name:
            enum = deref(parameters[name]).get("enum")
            last = address.endswith("{" + name + "}")
            anything = r"[^.]+(?:\.[^.]+)*" if last else r"[^.]+"
            alternatives = "|".join(re.escape(str(v)) for v in enum) if enum else anything
            pattern += f"(?P<{name}>{alternatives})"
    return re.compile(pattern)


def channel_of(subject: str) -> str | None:
    """The name of the one channel whose address the subject matches."""
    found = [
        name for name, channel in document()["channels"].items()
        if address_pattern(channel).fullmatch(subject)
    ]  # fmt: skip
    assert len(found) <= 1, f"{subject} matches the channels {found}"
    return found[0] if found else None


def payload_schema(channel: str) -> dict[str, Any]:
    (message,) = document()["channels"][channel]["messages"].values()
    schema = deref(deref(message)["payload"])
    assert isinstance(schema, dict)
    return schema


def check(subject: str, body: Any) -> str | None:
    """None when the document says this subject and body; else what it does not say."""
    channel = channel_of(subject)
    if channel is None:
        return f"{subject}: no channel of docs/asyncapi.yaml has this subject"
    validator = jsonschema.Draft7Validator(payload_schema(channel))
    errors = sorted(validator.iter_errors(body), key=lambda e: list(e.path))
    if errors:
        return f"{subject} ({channel}): {errors[0].message} at {list(errors[0].path)}"
    return None
