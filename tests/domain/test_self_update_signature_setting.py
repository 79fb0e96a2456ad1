"""SELF_UPDATE_SIGNATURE_URL: where the version file's signature is, validated as
SELF_UPDATE_URL is. A presigned https SELF_UPDATE_URL (one with a query) cannot have its
signature beside it (the query signs the file's path alone), so with a public key set
it needs SELF_UPDATE_SIGNATURE_URL, and start-up says so, naming both variables."""

from __future__ import annotations

import base64

import pytest

from app.settings import SettingsError, load_settings

KEY = base64.b64encode(bytes(range(32))).decode()
PRESIGNED = "https://versions.example/manager/version?X-Amz-Expires=900&X-Amz-Signature=ab12"
PRESIGNED_SIG = "https://versions.example/manager/version.sig?X-Amz-Signature=cd34"


@pytest.mark.parametrize(
    ("url", "signature_url", "key"),
    [
        (PRESIGNED, PRESIGNED_SIG, KEY),
        (PRESIGNED, "s3://versions/manager/version.sig", KEY),
        (PRESIGNED, None, None),  # nothing is verified: no signature is read
        ("https://versions.example/manager/version", None, KEY),  # `.sig` beside it
        ("s3://versions/manager/version", None, KEY),  # signed requests, no query
    ],
)
def test_accepted(url: str, signature_url: str | None, key: str | None) -> None:
    settings = load_settings(
        _check_production=False,
        self_update_url=url,
        self_update_signature_url=signature_url,
        self_update_public_key=key,
    )
    assert settings.self_update_signature_url == signature_url


def test_a_presigned_url_with_a_key_needs_the_signature_url() -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(
            _check_production=False, self_update_url=PRESIGNED, self_update_public_key=KEY
        )
    message = str(caught.value)
    assert "SELF_UPDATE_SIGNATURE_URL" in message and "SELF_UPDATE_URL" in message, message
    assert "X-Amz-Signature=ab12" not in message  # the presigned URL is not repeated


@pytest.mark.parametrize(
    ("signature_url", "says"),
    [
        ("ftp://versions.example/version.sig", "must be an http(s) URL or s3://bucket/key"),
        ("s3://versions", "must be s3://bucket/key"),
        ("s3://Bad_Bucket/version.sig", "must be s3://bucket/key"),
    ],
)
def test_an_unusable_signature_url_stops_start_up(signature_url: str, says: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(
            _check_production=False,
            self_update_url=PRESIGNED,
            self_update_signature_url=signature_url,
            self_update_public_key=KEY,
        )
    message = str(caught.value)
    assert message.startswith("SELF_UPDATE_SIGNATURE_URL: ") and says in message, message


def test_a_signature_url_without_a_version_file_url_is_refused() -> None:
    with pytest.raises(SettingsError, match="SELF_UPDATE_SIGNATURE_URL is set but SELF_UPDATE_URL"):
        load_settings(_check_production=False, self_update_signature_url=PRESIGNED_SIG)


def test_a_signature_url_without_a_public_key_is_refused() -> None:
    # nothing would be verified: an operator who set only where the signature is must not
    # believe updates are checked
    with pytest.raises(
        SettingsError, match="SELF_UPDATE_SIGNATURE_URL is set but SELF_UPDATE_PUBLIC_KEY"
    ):
        load_settings(
            _check_production=False,
            self_update_url=PRESIGNED,
            self_update_signature_url=PRESIGNED_SIG,
        )
