"""The version file read from S3 (`s3://bucket/key`) against moto's S3 server with IAM
checks on: signed GETs with credentials from botocore's chain, conditional on the ETag."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from app.adapters.versions import S3Object, VersionFile, VersionSourceError, sign_version_file
from app.domain.updates import VersionFileKey
from tests.support.moto_s3 import (
    KEY,
    REGION,
    Keys,
    MotoS3,
    S3World,
    isolated_aws_environment,
    use_keys,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def s3(moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> S3World:
    isolated_aws_environment(monkeypatch, tmp_path)
    world = moto_s3.provision()
    world.put(b'{"version": "0.2.0"}')
    return world


@pytest.fixture
async def source(s3: S3World) -> AsyncIterator[VersionFile]:
    """The version file as the self-updater reads it."""
    version_file = VersionFile(s3.version_file, timeout=5.0, s3_endpoint=s3.url)
    try:
        yield version_file
    finally:
        await version_file.aclose()


def statuses_of(source: VersionFile) -> list[int]:
    """The HTTP statuses the source gets from now on."""
    statuses: list[int] = []

    async def record(response: httpx.Response) -> None:
        statuses.append(response.status_code)

    source._client.event_hooks["response"].append(record)
    return statuses


async def test_the_right_keys_read_the_object_and_then_only_its_etag(
    s3: S3World, source: VersionFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_keys(monkeypatch, s3.reader)
    statuses = statuses_of(source)
    assert await source.fetch() == b'{"version": "0.2.0"}'
    assert await source.fetch() == b'{"version": "0.2.0"}'
    assert statuses == [200, 304]  # the second read: If-None-Match, unchanged
    s3.put(b"0.3.0")
    assert await source.fetch() == b"0.3.0"
    assert statuses == [200, 304, 200]


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        ("wrong secret", "HTTP 403 SignatureDoesNotMatch: The request signature we calculated"),
        ("unknown key", "HTTP 403 InvalidAccessKeyId"),
        ("no rights", "HTTP 403 AccessDenied"),
        ("none", "no AWS credentials found"),
    ],
)
async def test_refused_or_missing_credentials_say_why(
    s3: S3World, source: VersionFile, monkeypatch: pytest.MonkeyPatch, keys: str, says: str
) -> None:
    given = {
        "wrong secret": Keys(s3.reader.access_key_id, "not-the-secret-key-of-the-reader"),
        "unknown key": Keys("AKIAUNKNOWNKEY000000", s3.reader.secret_access_key),
        "no rights": s3.stranger,
    }.get(keys)
    if given is not None:
        use_keys(monkeypatch, given)
    with pytest.raises(VersionSourceError) as caught:
        await source.fetch()
    message = str(caught.value)
    assert message.startswith(f"GET {s3.version_file}: ") and says in message
    assert s3.reader.secret_access_key not in message
    assert "not-the-secret" not in message


async def test_a_missing_object_says_no_such_key(
    s3: S3World, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_keys(monkeypatch, s3.reader)
    source = VersionFile(f"s3://wm-releases/{KEY}.missing", timeout=5.0, s3_endpoint=s3.url)
    try:
        with pytest.raises(VersionSourceError, match="HTTP 404 NoSuchKey: The specified key"):
            await source.fetch()
    finally:
        await source.aclose()


async def test_a_region_is_needed(
    s3: S3World, source: VersionFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_keys(monkeypatch, s3.reader)
    monkeypatch.delenv("AWS_REGION")
    with pytest.raises(VersionSourceError, match="no AWS region: set AWS_REGION"):
        await source.fetch()
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)  # botocore's own variable counts too
    assert await source.fetch() == b'{"version": "0.2.0"}'


async def test_temporary_credentials_sign_with_their_token_and_never_show_it(
    s3: S3World, source: VersionFile, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.DEBUG)
    use_keys(monkeypatch, s3.temporary)
    assert await source.fetch() == b'{"version": "0.2.0"}'
    # the same key without its token is refused by S3, and the error shows neither secret
    monkeypatch.delenv("AWS_SESSION_TOKEN")
    fresh = VersionFile(s3.version_file, timeout=5.0, s3_endpoint=s3.url)
    try:
        with pytest.raises(VersionSourceError, match="HTTP 403") as caught:
            await fresh.fetch()
    finally:
        await fresh.aclose()
    assert s3.temporary.session_token is not None
    for secret in (s3.temporary.secret_access_key, s3.temporary.session_token):
        assert secret not in caplog.text
        assert secret not in str(caught.value)


async def test_a_web_identity_as_on_eks_is_exchanged_for_credentials(
    s3: S3World, moto_s3: MotoS3, source: VersionFile, monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """What EKS sets for a ServiceAccount with an IAM role: botocore's chain calls STS
    AssumeRoleWithWebIdentity (here moto's, which does not check the token) and signs with
    the temporary credentials it gets."""
    caplog.set_level(logging.DEBUG)
    token = tmp_path / "token"
    token.write_text("eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06c2VydmljZWFjY291bnQifQ.c2ln")
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(token))
    monkeypatch.setenv("AWS_ROLE_ARN", s3.role_arn)
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", s3.url)
    moto_s3.auth_after(1)  # AssumeRoleWithWebIdentity is unsigned; the S3 GET is checked
    assert await source.fetch() == b'{"version": "0.2.0"}'
    assert "from assume-role-with-web-identity" in caplog.text
    assert token.read_text() not in caplog.text


RELEASE_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
RELEASE_PUBLIC = (
    RELEASE_KEY.public_key()
    .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    .decode()
)


async def test_with_a_public_key_the_signature_is_read_beside_the_object_with_the_same_keys(
    s3: S3World, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_keys(monkeypatch, s3.reader)
    body = b'{"version": "0.2.0"}'
    source = VersionFile(
        s3.version_file,
        timeout=5.0,
        s3_endpoint=s3.url,
        public_key=VersionFileKey.parse(RELEASE_PUBLIC),
    )
    try:
        with pytest.raises(VersionSourceError) as caught:  # no signature yet
            await source.fetch()
        assert str(caught.value) == (
            f"signature of {s3.version_file} (GET {s3.version_file}.sig): HTTP 404 NoSuchKey: "
            "The specified key does not exist. (SELF_UPDATE_PUBLIC_KEY is set: the version "
            "file must be signed); nothing decided"
        )
        s3.put(b"bm90IGEgc2lnbmF0dXJl", key=f"{KEY}.sig")
        with pytest.raises(VersionSourceError, match="not the base64 of a 64-byte Ed25519"):
            await source.fetch()
        s3.put(sign_version_file(body, RELEASE_KEY), key=f"{KEY}.sig")
        assert await source.fetch() == body
    finally:
        await source.aclose()


async def test_a_signature_url_of_its_own_is_read_as_that_object_with_the_same_keys(
    s3: S3World, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_keys(monkeypatch, s3.reader)
    body = b'{"version": "0.2.0"}'
    own = s3.version_file.rpartition("/")[0] + "/signatures/version.sig"
    source = VersionFile(
        s3.version_file,
        timeout=5.0,
        s3_endpoint=s3.url,
        public_key=VersionFileKey.parse(RELEASE_PUBLIC),
        signature_url=own,
    )
    try:
        s3.put(sign_version_file(body, RELEASE_KEY), key=f"{KEY}.sig")  # beside: not read
        with pytest.raises(VersionSourceError) as caught:
            await source.fetch()
        assert str(caught.value).startswith(
            f"signature of {s3.version_file} (GET {own}): HTTP 404 NoSuchKey"
        ), caught.value
        s3.put(sign_version_file(body, RELEASE_KEY), key=own.split("/", 3)[3])
        assert await source.fetch() == body
    finally:
        await source.aclose()


def requested_urls(source: VersionFile) -> list[str]:
    """The URLs the source GETs from now on (none is sent: each is answered 404 here)."""
    urls: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        urls.append(str(request.url))
        return httpx.Response(404)

    source._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    return urls


DEAD = "http://127.0.0.1:9"  # nothing listens there: a request to it fails at once


@pytest.mark.parametrize(
    ("variables", "config"),
    [
        ({"AWS_ENDPOINT_URL": "{moto}"}, ""),
        ({"AWS_ENDPOINT_URL_S3": "{moto}"}, ""),
        ({"AWS_ENDPOINT_URL_S3": "{moto}", "AWS_ENDPOINT_URL": DEAD}, ""),  # S3's first
        ({}, "[default]\nendpoint_url = {moto}\n"),
        ({}, "[default]\nendpoint_url = " + DEAD  # the services section's S3 one first
         + "\nservices = here\n[services here]\ns3 =\n  endpoint_url = {moto}\n"),
    ],
)  # fmt: skip
async def test_the_sdks_endpoint_settings_point_an_s3_url_at_the_store(
    s3: S3World, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    variables: dict[str, str], config: str,
) -> None:  # fmt: skip
    """Without SELF_UPDATE_S3_ENDPOINT, the AWS SDKs' own endpoint settings count, in their
    order (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the config file's), and path-style."""
    use_keys(monkeypatch, s3.reader)
    for name, value in variables.items():
        monkeypatch.setenv(name, value.format(moto=s3.url))
    if config:
        (tmp_path / "aws-config").write_text(config.format(moto=s3.url))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    source = VersionFile(s3.version_file, timeout=5.0)
    try:
        assert await source.fetch() == b'{"version": "0.2.0"}'
        assert await source.fetch() == b'{"version": "0.2.0"}'  # a 304, the cached copy
        s3.put(b"0.3.0")
        assert await source.fetch() == b"0.3.0"
    finally:
        await source.aclose()


async def test_self_update_s3_endpoint_wins_over_the_sdks_endpoint_variables(
    s3: S3World, source: VersionFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_keys(monkeypatch, s3.reader)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", DEAD)
    monkeypatch.setenv("AWS_ENDPOINT_URL", DEAD)
    assert await source.fetch() == b'{"version": "0.2.0"}'


async def test_ignoring_configured_endpoints_reads_from_aws_again(
    s3: S3World, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_keys(monkeypatch, s3.reader)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.url)
    monkeypatch.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    source = VersionFile(s3.version_file, timeout=5.0)
    urls = requested_urls(source)
    try:
        with pytest.raises(VersionSourceError, match="HTTP 404"):
            await source.fetch()
    finally:
        await source.aclose()
    assert urls == [f"https://wm-releases.s3.{REGION}.amazonaws.com/{KEY}"]


@pytest.mark.parametrize(
    ("url", "endpoint", "expected"),
    [
        ("s3://wm-releases/wm/version.json", None,
         "https://wm-releases.s3.eu-west-1.amazonaws.com/wm/version.json"),
        ("s3://wm.releases/wm/version.json", None,
         "https://s3.eu-west-1.amazonaws.com/wm.releases/wm/version.json"),
        ("s3://wm-releases/a b+c.json", "http://minio:9000/",
         "http://minio:9000/wm-releases/a%20b%2Bc.json"),
    ],
)  # fmt: skip
def test_the_object_url(url: str, endpoint: str | None, expected: str) -> None:
    assert S3Object(url, endpoint=endpoint).http_url(REGION) == expected
    assert S3Object(url, endpoint=endpoint).http_url(REGION, suffix=".sig") == expected + ".sig"


def test_botocore_is_loaded_only_for_an_s3_url() -> None:
    code = (
        "import sys\n"
        "import app.main, app.services.features\n"
        "from app.adapters.versions import VersionFile\n"
        "VersionFile('https://example.invalid/version', timeout=1.0)\n"
        "VersionFile('s3://bucket/key', timeout=1.0)\n"
        "assert 'botocore' not in sys.modules, 'botocore loaded'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
