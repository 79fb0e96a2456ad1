"""The version file over http(s), against a real local server: redirects are refused, and
with a public key the file counts only with a valid detached signature (`<location>.sig`),
including one made by `workload-manager sign-version-file`."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from app.adapters.versions import VersionFile, VersionSourceError
from app.domain.updates import VersionFileKey
from standins.servers import ThreadedServer, serve

ROOT = Path(__file__).resolve().parents[2]
BODY = b'{"version": "0.2.0", "image": "ghcr.io/node-system/workload-manager:0.2.0"}'
KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
OTHER_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33)))


def public_base64(key: Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def public_pem(key: Ed25519PrivateKey) -> str:
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


def signature(key: Ed25519PrivateKey, body: bytes) -> bytes:
    return base64.b64encode(key.sign(body)) + b"\n"


class Releases:
    """/version and /version.sig (a settable body and signature; None is a 404), with an
    ETag; /moved/{status} redirects to /version. Counts the requests to each path."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.body = BODY
        self.sig: bytes | None = None
        self.hits: dict[str, int] = {}
        # a status and Retry-After /version answers instead of the file (None: the file)
        self.busy: tuple[int, str] | None = None
        self.app = Starlette(
            routes=[
                Route("/version", self._version),
                Route("/version.sig", self._sig),
                Route("/moved/{status:int}", self._moved),
                Route("/drip", self._drip),
            ]
        )

    def set(self, body: bytes, sig: bytes | None) -> None:
        with self.lock:
            self.body, self.sig = body, sig

    def count(self, path: str) -> int:
        with self.lock:
            return self.hits.get(path, 0)

    def _hit(self, request: Request) -> None:
        with self.lock:
            self.hits[request.url.path] = self.hits.get(request.url.path, 0) + 1

    async def _version(self, request: Request) -> Response:
        self._hit(request)
        with self.lock:
            body, busy = self.body, self.busy
        if busy is not None:
            return Response(b"slow down", status_code=busy[0], headers={"Retry-After": busy[1]})
        etag = f'"{hash(body)}"'
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304)
        return Response(body, headers={"ETag": etag})

    async def _sig(self, request: Request) -> Response:
        self._hit(request)
        with self.lock:
            sig = self.sig
        return Response(b"not found", status_code=404) if sig is None else Response(sig)

    async def _drip(self, request: Request) -> Response:
        """The version file, one byte every 0.1 s: each read is quick, the whole is not."""

        async def body() -> AsyncIterator[bytes]:
            for byte in BODY:
                yield bytes([byte])
                await asyncio.sleep(0.1)

        return StreamingResponse(body(), headers={"Content-Length": str(len(BODY))})

    async def _moved(self, request: Request) -> Response:
        self._hit(request)
        return RedirectResponse("/version", status_code=request.path_params["status"])


@pytest.fixture(scope="module")
def releases_server() -> Iterator[tuple[Releases, ThreadedServer]]:
    releases = Releases()
    with serve(releases.app) as server:
        yield releases, server


@pytest.fixture
def releases(releases_server: tuple[Releases, ThreadedServer]) -> Releases:
    releases, _server = releases_server
    releases.set(BODY, None)
    with releases.lock:
        releases.hits.clear()
        releases.busy = None
    return releases


@pytest.fixture
def url(releases_server: tuple[Releases, ThreadedServer]) -> str:
    return f"{releases_server[1].url}/version"


@pytest.fixture
async def signed_source(url: str) -> AsyncIterator[VersionFile]:
    source = VersionFile(url, timeout=5.0, public_key=VersionFileKey.parse(public_base64(KEY)))
    try:
        yield source
    finally:
        await source.aclose()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`workload-manager ARGS`, as a real process."""
    return subprocess.run(
        [sys.executable, "-m", "app", *args],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip


async def fetch_once(url: str, public_key: str | None = None) -> bytes:
    key = None if public_key is None else VersionFileKey.parse(public_key)
    source = VersionFile(url, timeout=5.0, public_key=key)
    try:
        return await asyncio.wait_for(source.fetch(), timeout=20)
    finally:
        await source.aclose()


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_a_redirect_is_refused_and_not_followed(
    releases: Releases, releases_server: tuple[Releases, ThreadedServer], status: int
) -> None:
    moved = f"{releases_server[1].url}/moved/{status}"
    with pytest.raises(VersionSourceError) as caught:
        await fetch_once(moved)
    assert str(caught.value) == (
        f"GET {moved}: HTTP {status}: a redirect, refused (the version file is read from "
        "SELF_UPDATE_URL itself, never from where it points)"
    )
    assert releases.count("/version") == 0


async def test_the_timeout_bounds_the_whole_read_not_each_chunk(
    releases_server: tuple[Releases, ThreadedServer],
) -> None:
    drip = f"{releases_server[1].url}/drip"  # about 7 s in all, 0.1 s per byte
    source = VersionFile(drip, timeout=1.0)
    try:
        with pytest.raises(VersionSourceError, match=f"^GET {drip}: timed out$"):
            await asyncio.wait_for(source.fetch(), timeout=20)
    finally:
        await source.aclose()


async def test_without_a_public_key_no_signature_is_read(releases: Releases, url: str) -> None:
    assert await fetch_once(url) == BODY
    assert releases.count("/version.sig") == 0


@pytest.mark.parametrize("key", [public_base64(KEY), public_pem(KEY)], ids=["base64", "pem"])
async def test_a_signed_file_is_read_and_its_etag_kept(
    releases: Releases, url: str, key: str
) -> None:
    releases.set(BODY, signature(KEY, BODY))
    source = VersionFile(url, timeout=5.0, public_key=VersionFileKey.parse(key))
    try:
        assert await source.fetch() == BODY
        assert await source.fetch() == BODY  # a 304: the copy verified before
        assert (releases.count("/version"), releases.count("/version.sig")) == (2, 1)
        changed = BODY.replace(b"0.2.0", b"0.3.0")
        releases.set(changed, signature(KEY, changed))
        assert await source.fetch() == changed
        assert releases.count("/version.sig") == 2
    finally:
        await source.aclose()


@pytest.mark.parametrize(
    ("sig", "says"),
    [
        (None, "HTTP 404 (SELF_UPDATE_PUBLIC_KEY is set: the version file must be signed)"),
        (b"", "not the base64 of a 64-byte Ed25519 signature"),
        (b"<html>signature</html>", "not the base64 of a 64-byte Ed25519 signature"),
        (KEY.sign(BODY), "not the base64 of a 64-byte Ed25519 signature"),  # raw, not base64
        (b"A" * 2000, "larger than 1024 bytes"),
        (signature(OTHER_KEY, BODY), "does not verify the version file with the key in "
         "SELF_UPDATE_PUBLIC_KEY"),
        (signature(KEY, BODY + b"\n"), "does not verify"),  # over other bytes
    ],
)  # fmt: skip
async def test_a_file_without_a_valid_signature_is_refused_and_not_kept(
    releases: Releases, url: str, signed_source: VersionFile, sig: bytes | None, says: str
) -> None:
    releases.set(BODY, sig)
    with pytest.raises(VersionSourceError) as caught:
        await signed_source.fetch()
    assert str(caught.value).startswith(f"signature of {url} (GET {url}.sig"), caught.value
    assert says in str(caught.value)
    # nothing of the refused file is kept: once the signature is right, it is read again
    # in full (no If-None-Match answered from the refused copy) and taken
    releases.set(BODY, signature(KEY, BODY))
    assert await signed_source.fetch() == BODY
    assert releases.count("/version") == 2


async def test_a_file_signed_with_the_cli_is_taken(
    releases: Releases, url: str, tmp_path: Path
) -> None:
    key_file = tmp_path / "release.key"
    made = await asyncio.to_thread(cli, "keygen", "--format", "pem")
    assert made.returncode == 0, made.stderr
    key_file.write_text(made.stdout)
    version_file = tmp_path / "version.json"
    version_file.write_bytes(BODY)
    signed = await asyncio.to_thread(
        cli, "sign-version-file", str(version_file), "--key-file", str(key_file)
    )
    assert signed.returncode == 0, signed.stderr
    public = signed.stdout.strip().removeprefix("SELF_UPDATE_PUBLIC_KEY=")
    sig = (tmp_path / "version.json.sig").read_bytes()
    releases.set(version_file.read_bytes(), sig)
    assert await fetch_once(url, public) == BODY
    # and the key it names is the key's: another key refuses the same file
    with pytest.raises(VersionSourceError, match="does not verify"):
        await fetch_once(url, public_base64(OTHER_KEY))


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--key-file", "/nonexistent/release.key"], "cannot read /nonexistent/release.key"),
        (["--key-file", "{key}"], "expected a PKCS#8 PEM or a 32-byte seed"),
    ],
)
def test_the_cli_refuses_an_unusable_key(tmp_path: Path, args: list[str], says: str) -> None:
    bad = tmp_path / "bad.key"
    bad.write_text("not a key\n")
    version_file = tmp_path / "version.json"
    version_file.write_bytes(BODY)
    run = cli("sign-version-file", str(version_file), *[a.format(key=bad) for a in args])
    assert run.returncode == 2 and says in run.stderr, run.stderr
    assert not (tmp_path / "version.json.sig").exists()


PRESIGN_KEY = b"presign-test-key"


def presigned(base: str, path: str) -> str:
    """A presigned-style URL: a query signature over the exact path (as S3, GCS and Azure
    sign theirs), so the same query does not open any other path."""
    sig = hmac.new(PRESIGN_KEY, path.encode(), hashlib.sha256).hexdigest()
    return f"{base}{path}?X-Amz-Expires=900&X-Amz-Signature={sig}"


class PresignedStore:
    """/bucket/{key}: the object, only with a query signature for its exact path (else 403)."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects
        self.refused: list[str] = []
        self.app = Starlette(routes=[Route("/bucket/{key:path}", self._object)])

    async def _object(self, request: Request) -> Response:
        path = request.url.path
        expected = hmac.new(PRESIGN_KEY, path.encode(), hashlib.sha256).hexdigest()
        given = request.query_params.get("X-Amz-Signature", "")
        if not hmac.compare_digest(given, expected):
            self.refused.append(path)
            return Response(b"<Error><Code>SignatureDoesNotMatch</Code></Error>", 403)
        body = self.objects.get(path.removeprefix("/bucket/"))
        return Response(b"not found", 404) if body is None else Response(body)


async def test_a_presigned_file_is_verified_with_the_signature_url_given() -> None:
    store = PresignedStore({"version": BODY, "version.sig": signature(KEY, BODY)})
    with serve(store.app) as server:
        url = presigned(server.url, "/bucket/version")
        sig_url = presigned(server.url, "/bucket/version.sig")
        source = VersionFile(
            url,
            timeout=5.0,
            public_key=VersionFileKey.parse(public_base64(KEY)),
            signature_url=sig_url,
        )
        try:
            assert await asyncio.wait_for(source.fetch(), timeout=20) == BODY
        finally:
            await source.aclose()
        assert store.refused == []
        # beside the file (the default), the presigned query does not cover `.sig`: refused
        with pytest.raises(VersionSourceError, match=r"HTTP 403 \(SELF_UPDATE_PUBLIC_KEY"):
            await fetch_once(url, public_base64(KEY))
        assert store.refused == ["/bucket/version.sig"]


@pytest.mark.parametrize("status", [429, 503])
async def test_a_retry_after_holds_the_reads_until_it_passes(
    releases: Releases, url: str, status: int
) -> None:
    """The version file's server answers 429 or 503 with `Retry-After: 30`: the check asks
    once; a read before the 30 s (and their jitter) is not sent and says how long is
    left, which the check's loop takes as its next run; after it the file is read."""
    with releases.lock:
        releases.busy = (status, "30")
    now = [time.time()]
    source = VersionFile(url, timeout=5.0, clock=lambda: now[0])
    try:
        with pytest.raises(VersionSourceError, match=f"HTTP {status}.*Retry-After until ") as first:
            await source.fetch()
        assert first.value.retry_after is not None
        assert 30.0 <= first.value.retry_after <= 33.0
        now[0] += 20.0
        with pytest.raises(VersionSourceError, match="not sent: Retry-After until ") as held:
            await source.fetch()
        assert held.value.retry_after == pytest.approx(first.value.retry_after - 20.0)
        assert releases.count("/version") == 1
        with releases.lock:
            releases.busy = None
        now[0] += 14.0
        assert await source.fetch() == BODY
    finally:
        await source.aclose()
    assert releases.count("/version") == 2
