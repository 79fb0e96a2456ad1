"""docs/openapi.json is the HTTP contract the code serves (regenerate with
`workload-manager openapi > docs/openapi.json`, and say what changed in the CHANGELOG):
a route, a field or a status renamed or reshaped fails here until the file says it."""

from __future__ import annotations

import json
from pathlib import Path

from app.main import create_app
from app.settings import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"


def test_the_published_document_is_what_the_app_serves() -> None:
    served = create_app(Settings(_env_file=None)).openapi()
    assert json.loads(DOC.read_text()) == served


def test_the_document_is_the_same_in_every_configuration() -> None:
    production = Settings(
        _env_file=None, app_env="production", api_token="t" * 24, ping_token_secret="p" * 24,
        nats_url="nats://nats:4222", probe_port=8081,
    )  # fmt: skip
    assert create_app(production).openapi() == json.loads(DOC.read_text())
