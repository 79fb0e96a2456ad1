"""SELF_UPDATE_PUBLIC_KEY is checked when the settings load: a key that cannot verify
anything stops start-up with one line naming the variable, never its value."""

from __future__ import annotations

import base64

import pytest

from app.domain.updates import VersionFileKey
from app.settings import SettingsError, load_settings

RAW = bytes(range(32))
PEM = (
    "-----BEGIN PUBLIC KEY-----\n"
    + base64.b64encode(bytes.fromhex("302a300506032b6570032100") + RAW).decode()
    + "\n-----END PUBLIC KEY-----\n"
)


@pytest.mark.parametrize("value", [base64.b64encode(RAW).decode(), PEM])
def test_a_usable_key_is_parsed_once_into_its_raw_bytes(value: str) -> None:
    settings = load_settings(_check_production=False, self_update_public_key=value)
    assert settings.self_update_public_key == VersionFileKey(RAW)
    assert settings.model_dump(mode="json")["self_update_public_key"] == str(VersionFileKey(RAW))


def test_blank_means_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SELF_UPDATE_PUBLIC_KEY", "")
    assert load_settings(_check_production=False).self_update_public_key is None


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("c2VjcmV0LWJ1dC1zaG9ydA==", "base64 of its 32 raw bytes"),
        (RAW.hex(), "base64 of its 32 raw bytes"),
        (PEM.replace("MCowBQYDK2Vw", "MCowBQYDK2Vx"), "not an Ed25519 key"),
    ],
)
def test_an_unusable_key_stops_start_up_naming_the_variable(value: str, says: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(_check_production=False, self_update_public_key=value)
    message = str(caught.value)
    assert message.startswith("SELF_UPDATE_PUBLIC_KEY: ") and says in message, message
    assert value.strip() not in message
