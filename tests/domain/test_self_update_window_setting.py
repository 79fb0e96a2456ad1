"""SELF_UPDATE_WINDOW and WORKLOAD_UPDATE_WINDOW: `HH:MM-HH:MM` (UTC, every day) or a
workload's window as JSON (`{"days", "start", "end", "tz"}`), parsed once at start-up by
`UpdateWindow.from_setting`; anything else stops start-up naming the variable."""

from __future__ import annotations

import pytest

from app.domain.rollout import UpdateWindow
from app.settings import Settings, SettingsError, load_settings


@pytest.mark.parametrize(
    ("value", "window"),
    [
        ("02:00-05:00", UpdateWindow(start="02:00", end="05:00")),
        (" 22:30-04:00 ", UpdateWindow(start="22:30", end="04:00")),
        ('{"days": ["sat", "sun"], "start": "02:00", "end": "05:00", "tz": "Europe/Kyiv"}',
         UpdateWindow(days=("sat", "sun"), start="02:00", end="05:00", tz="Europe/Kyiv")),
        ('{"start": "23:00", "end": "01:00"}', UpdateWindow(start="23:00", end="01:00")),
        ("", None),
        (None, None),
    ],
)  # fmt: skip
def test_accepted(value: str | None, window: UpdateWindow | None) -> None:
    settings = load_settings(_check_production=False, self_update_window=value)
    assert settings.update_window == window
    settings = load_settings(_check_production=False, workload_update_window=value)
    assert settings.workload_update_window == window


def test_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "SELF_UPDATE_WINDOW", '{"days": ["sun"], "start": "03:00", "end": "04:00", "tz": "UTC"}'
    )
    assert load_settings(_check_production=False, _env_file=None).update_window == UpdateWindow(
        days=("sun",), start="03:00", end="04:00"
    )


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("25:00-05:00", "start"),
        ("02:00", "end"),
        ("02:00-02:00", "empty window"),
        ("every night", "start"),
        ('{"start": "02:00"}', "end"),
        ('{"start": "02:00", "end": "05:00", "tz": "Mars/Olympus"}', "tz"),
        ('{"days": ["sat", "sat"], "start": "02:00", "end": "05:00"}', "days"),
        ('{"days": ["someday"], "start": "02:00", "end": "05:00"}', "days"),
        ('{"start": "02:00", "end": "05:00"', "JSON"),
    ],
)
@pytest.mark.parametrize("variable", ["self_update_window", "workload_update_window"])
def test_refused_naming_the_variable(value: str, says: str, variable: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(_check_production=False, **{variable: value})
    message = str(caught.value)
    assert message.startswith(f"{variable.upper()}: "), message
    assert says in message, message
    assert "\n" not in message, message


def test_dumped_as_the_setting_takes_it() -> None:
    """The settings dump (what the status and the fingerprint show) gives a value the
    setting takes again."""
    value = '{"days": ["sat", "sun"], "start": "02:00", "end": "05:00", "tz": "Europe/Kyiv"}'
    settings = Settings(_env_file=None, self_update_window=value)
    dumped = settings.model_dump(mode="json")["self_update_window"]
    assert Settings(_env_file=None, self_update_window=dumped) == settings
