"""SELF_UPDATE_MIN_HEALTHY_SECONDS: how long an available update must stay available to be
confirmed; 0 to 3600 seconds, 60 by default, 0 confirming once available."""

from __future__ import annotations

import pytest

from app.settings import Settings, SettingsError, load_settings


def test_the_default_is_a_minute() -> None:
    assert Settings(_env_file=None).self_update_min_healthy_seconds == 60


@pytest.mark.parametrize(("value", "seconds"), [("0", 0.0), ("2.5", 2.5), ("3600", 3600.0)])
def test_accepted(monkeypatch: pytest.MonkeyPatch, value: str, seconds: float) -> None:
    monkeypatch.setenv("SELF_UPDATE_MIN_HEALTHY_SECONDS", value)
    assert load_settings(
        _check_production=False, _env_file=None
    ).self_update_min_healthy_seconds == (seconds)


@pytest.mark.parametrize("value", ["-1", "3601", "a minute"])
def test_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("SELF_UPDATE_MIN_HEALTHY_SECONDS", value)
    with pytest.raises(SettingsError, match=r"^SELF_UPDATE_MIN_HEALTHY_SECONDS: "):
        load_settings(_check_production=False, _env_file=None)
