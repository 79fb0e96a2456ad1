"""Every setting is documented where operators look: .env.example and the README."""

from __future__ import annotations

import re
from pathlib import Path

from app.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
ENV_NAMES = sorted(name.upper() for name in Settings.model_fields)


def test_env_example_lists_exactly_the_settings() -> None:
    text = (ROOT / ".env.example").read_text()
    listed = set(re.findall(r"^([A-Z][A-Z0-9_]*)=", text, re.MULTILINE))
    assert listed == set(ENV_NAMES)


def test_env_example_loads_as_the_defaults() -> None:
    from_example = Settings(_env_file=ROOT / ".env.example")
    assert from_example == Settings(_env_file=None)


def test_readme_documents_every_setting() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in ENV_NAMES if f"`{name}`" not in readme]
    assert missing == []
