"""The published version file, fetched with an ETag: over HTTPS, or from S3 with AWS credentials.

An https:// URL is read with plain GETs (a public object). An s3://bucket/key URL is read
with GETs signed with AWS Signature V4 (botocore signs them; the credentials come from
botocore's standard chain: environment variables, web identity as on EKS, shared config
and credentials files, container and instance metadata). Both are sent with httpx, with the
same timeout (for each whole exchange), size limit and ETag handling. botocore is imported
only when an s3:// URL is read, so nodes without one do not load it.

A 304 means unchanged; anything that is not a 200 with a small body is an error the caller
shows and ignores. A redirect is one of those: it is never followed, so the file comes from
the configured location or not at all. The body is read streamed, and reading stops once
it passes the limit. For S3, the error's code and message from S3's XML answer (never the
rest of it: it may echo the signed request) are added to the error.

With a public key (SELF_UPDATE_PUBLIC_KEY), each new content of the file is taken only with
a valid detached Ed25519 signature over its exact bytes, read from the same location plus
`.sig` through the same path (plain or SigV4-signed GET), or from SELF_UPDATE_SIGNATURE_URL
when set (an https URL, presigned as the file's may be, or an s3://bucket/key read with
SigV4); a missing, malformed or wrong signature is an error, and nothing of that content is
kept (not even its ETag), so the next fetch reads it again in full. `sign_version_file`
makes such a signature.

A 429 or 503 with `Retry-After` holds the file's reads until it passes (capped at
`retry_after_max`, plus a small jitter): a read before then is not sent, and its error
carries the seconds left (`retry_after`), which the check's loop takes as its next run.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import httpx
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from app.adapters.bounded_http import Holds
from app.domain.redaction import redact_text
from app.domain.retrying import parse_retry_after
from app.domain.updates import (
    MAX_SIGNATURE_BYTES,
    MAX_VERSION_FILE_BYTES,
    SIGNATURE_SUFFIX,
    SignatureError,
    VersionFileKey,
    parse_signature,
    signature_location,
)

if TYPE_CHECKING:
    from botocore.awsrequest import AWSRequest
    from botocore.client import BaseClient
    from botocore.credentials import Credentials, ReadOnlyCredentials
    from botocore.session import Session

log = logging.getLogger(__name__)

# How much of an S3 error answer is read for its <Code> and <Message>.
_S3_ERROR_BYTES = 8 * 1024
_S3_ERROR_FIELD = re.compile(rb"<(Code|Message)>([^<]{1,300})</\1>")


class VersionSourceError(RuntimeError):
    """The file could not be fetched (the message is shown in /v1/status and logged, so it
    is redacted: a presigned URL's signature and credential never appear in it).
    `retry_after`: the seconds before the file may be read again, after its server's
    Retry-After (capped, jittered); None without one."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(redact_text(message))
        self.retry_after = retry_after


class VersionSignatureError(VersionSourceError):
    """The file's signature is missing, malformed or does not verify: the file is refused."""


def sign_version_file(content: bytes, key: Ed25519PrivateKey) -> bytes:
    """The detached signature file of a version file: base64 of the Ed25519 signature over
    its exact bytes, and a newline."""
    return base64.b64encode(key.sign(content)) + b"\n"


def split_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/key` -> (bucket, key); the key is everything after the first `/`."""
    bucket, _, key = url.removeprefix("s3://").partition("/")
    if not url.startswith("s3://") or not bucket or not key:
        raise ValueError(f"{url!r} is not an s3://bucket/key URL")
    return bucket, key


class VersionFile:
    def __init__(
        self,
        url: str,
        *,
        timeout: float,
        s3_endpoint: str | None = None,
        public_key: VersionFileKey | None = None,
        signature_url: str | None = None,
        retry_after_max: float = 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.url = url
        self._clock = clock
        self._holds = Holds(longest=retry_after_max, clock=clock)
        self._timeout = timeout
        self._s3 = S3Object(url, endpoint=s3_endpoint) if url.startswith("s3://") else None
        # the signature's location, and how it is read: beside the file (the same object
        # and a suffix), or its own URL (an S3 object of its own, or a plain GET)
        self._signature_url = signature_location(url, signature_url)
        if signature_url is None:
            self._signature_s3, self._signature_suffix = self._s3, SIGNATURE_SUFFIX
        else:
            own = signature_url.startswith("s3://")
            self._signature_s3 = S3Object(signature_url, endpoint=s3_endpoint) if own else None
            self._signature_suffix = ""
        # never follow a redirect: the file is read from its configured location only (and
        # a signed S3 request is not sent on to wherever a redirect points)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout), follow_redirects=False)
        self._key = (
            Ed25519PublicKey.from_public_bytes(public_key.raw) if public_key is not None else None
        )
        self._etag: str | None = None
        self._body: bytes | None = None

    async def aclose(self) -> None:
        await self._client.aclose()

    async def fetch(self) -> bytes:
        """The file's content (the cached copy after a 304).

        Read streamed and only up to MAX_VERSION_FILE_BYTES: a larger (or endless) body
        is an error as soon as its Content-Length or its bytes pass the limit, and the
        rest is never read. With a public key, new content is returned only once its
        signature verifies.
        """
        held = self._holds.held("file")
        if held is not None:  # the file's server said when (its signature's included)
            raise VersionSourceError(f"GET {self.url}: {held.text()}", retry_after=held.left)
        conditional = self._etag is not None and self._body is not None
        headers = {"If-None-Match": self._etag} if conditional and self._etag else {}
        got = await self._get(self.url, self._s3, "", headers, MAX_VERSION_FILE_BYTES)
        if got is None:  # 304
            assert self._body is not None
            return self._body
        body, etag = got
        if self._key is not None:
            await self._verify(body, self._key)
        self._etag = etag
        self._body = body
        return body

    async def _verify(self, body: bytes, key: Ed25519PublicKey) -> None:
        location = self._signature_url
        where = f"signature of {self.url} (GET {location})"
        try:
            got = await self._get(
                location, self._signature_s3, self._signature_suffix, {}, MAX_SIGNATURE_BYTES
            )
        except VersionSourceError as exc:
            raise VersionSignatureError(
                f"{where}: {str(exc).removeprefix(f'GET {location}: ')} "
                "(SELF_UPDATE_PUBLIC_KEY is set: the version file must be signed); nothing decided",
                retry_after=exc.retry_after,
            ) from None
        assert got is not None  # never conditional
        try:
            key.verify(parse_signature(got[0]), body)
        except SignatureError as exc:
            raise VersionSignatureError(f"{where}: {exc}; nothing decided") from None
        except InvalidSignature:
            raise VersionSignatureError(
                f"{where}: does not verify the version file with the key in "
                "SELF_UPDATE_PUBLIC_KEY; nothing decided"
            ) from None

    async def _get(
        self,
        shown: str,
        s3: S3Object | None,
        suffix: str,
        headers: dict[str, str],
        limit: int,
    ) -> tuple[bytes, str | None] | None:
        """GET `shown` (with `s3`, that object, or with `suffix` the object beside it,
        signed): (body, ETag), or None for a 304 to a conditional request. `shown` is the
        location errors name."""
        target, conditional = shown, "If-None-Match" in headers
        if s3 is not None:
            try:
                async with asyncio.timeout(self._timeout):
                    target, headers = await s3.signed_get(headers, suffix=suffix)
            except TimeoutError:
                raise VersionSourceError(
                    f"GET {shown}: finding AWS credentials took longer than {self._timeout:g} s"
                ) from None
        try:
            # the whole exchange, not only each read: a body sent a byte at a time ends here
            async with (
                asyncio.timeout(self._timeout),
                self._client.stream("GET", target, headers=headers) as response,
            ):
                status = response.status_code
                if status == 304 and conditional:
                    return None
                if 300 <= status < 400:
                    raise VersionSourceError(
                        f"GET {shown}: HTTP {status}: a redirect, refused (the version file is "
                        "read from SELF_UPDATE_URL itself, never from where it points)"
                    )
                if status != 200:
                    why = await _s3_error(response) if s3 is not None else ""
                    raise self._refused(shown, status, why, response.headers)
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > limit:
                    raise _too_large(shown, limit)
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > limit:
                        raise _too_large(shown, limit)
                etag = response.headers.get("etag")
        except (httpx.TimeoutException, TimeoutError):
            raise VersionSourceError(f"GET {shown}: timed out") from None
        except httpx.TransportError as exc:
            raise VersionSourceError(f"GET {shown}: {type(exc).__name__}: {exc}") from None
        return bytes(body), etag

    def _refused(
        self, shown: str, status: int, why: str, headers: httpx.Headers
    ) -> VersionSourceError:
        """The error of a status other than 200: with a 429 or 503's Retry-After, the file
        (and its signature) is not read again until it passes."""
        asked = None
        if status in (429, 503):
            now = datetime.fromtimestamp(self._clock(), UTC)
            asked = parse_retry_after(headers.get("retry-after"), now)
        if asked is None:
            return VersionSourceError(f"GET {shown}: HTTP {status}{why}")
        wait = self._holds.hold("file", asked, unreachable=status >= 500)
        held = self._holds.held("file")
        until = f"; {held.text().removeprefix('not sent: ')}" if held is not None else ""
        return VersionSourceError(f"GET {shown}: HTTP {status}{why}{until}", retry_after=wait)


def _too_large(shown: str, limit: int) -> VersionSourceError:
    return VersionSourceError(f"GET {shown}: body larger than {limit} bytes (not read further)")


async def _s3_error(response: httpx.Response) -> str:
    """` Code: Message` from the start of an S3 error answer, else ""."""
    head = bytearray()
    async for chunk in response.aiter_bytes():
        head += chunk
        if len(head) >= _S3_ERROR_BYTES:
            break
    fields = {
        name.decode(): " ".join(value.decode("utf-8", "replace").split())
        for name, value in _S3_ERROR_FIELD.findall(bytes(head[:_S3_ERROR_BYTES]))
    }
    if not fields:
        return ""
    return " " + ": ".join(fields[name] for name in ("Code", "Message") if name in fields)


class S3Object:
    """The object of an s3://bucket/key URL: its HTTP URL, and GETs to it signed with SigV4.

    The region is AWS_REGION, else botocore's (AWS_DEFAULT_REGION, or the config file's).
    The object's URL is botocore's, from an S3 client of its own: at `endpoint` (an
    S3-compatible store) if given, else at the endpoint the AWS SDKs' settings give S3 (by
    botocore's rules: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the config file's `services`
    section, then the profile's `endpoint_url`; none with
    AWS_IGNORE_CONFIGURED_ENDPOINT_URLS), both path-style, else at AWS's own (virtual-hosted
    where the bucket name allows). Credentials are found once, by botocore's chain, and kept:
    botocore renews the temporary ones (web identity, instance profile) itself, before they
    expire. Finding or renewing them may read files and call the instance metadata service
    or STS, so it runs in a worker thread (which the caller bounds with its timeout); an
    empty chain is looked at again on the next fetch.
    """

    def __init__(self, url: str, *, endpoint: str | None) -> None:
        self.url = url
        self.bucket, self.key = split_s3_url(url)
        self._endpoint = endpoint.rstrip("/") if endpoint else None
        self._lock = threading.Lock()  # one chain lookup at a time (they run in threads)
        self._session: Session | None = None
        self._region: str | None = None
        self._credentials: Credentials | None = None
        self._client: BaseClient | None = None

    async def signed_get(
        self, headers: dict[str, str], *, suffix: str = ""
    ) -> tuple[str, dict[str, str]]:
        """The URL to GET and the headers (`headers` and the signature's) to send with it;
        with `suffix`, of the object whose key is this one's followed by it."""
        credentials, region, url = await asyncio.to_thread(self._prepare, suffix)
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        request = AWSRequest(method="GET", url=url, headers=headers)
        S3SigV4Auth(credentials, "s3", region).add_auth(request)
        return url, dict(request.headers.items())

    def _prepare(self, suffix: str) -> tuple[ReadOnlyCredentials, str, str]:
        """In a worker thread: the chain's current credentials (renewed if due), the region
        and the URL of the object (with `suffix` after its key)."""
        with self._lock:
            frozen, region = self._credentials_and_region()
            try:
                url = self._object_url(region, suffix)
            except Exception as exc:  # botocore's: a bad endpoint setting, a bad config file
                raise VersionSourceError(
                    f"GET {self.url}: S3 endpoint: {type(exc).__name__}: {exc}"
                ) from None
        return frozen, region, url

    def http_url(self, region: str, *, suffix: str = "") -> str:
        """The object's URL in `region` (with `suffix` after its key), as GETs use it."""
        with self._lock:
            if self._session is None:
                self._session = _botocore_session()
            return self._object_url(region, suffix)

    def _object_url(self, region: str, suffix: str) -> str:
        """botocore's URL of the object: that of the GetObject request its S3 client (made
        once) builds, stopped before it is signed and sent (the GET is signed here)."""
        assert self._session is not None
        if self._client is None:
            from botocore.config import Config

            path_style = self._endpoint is not None or _configured_endpoint(self._session)
            client = self._session.create_client(
                "s3",
                region_name=region,
                endpoint_url=self._endpoint,
                config=Config(s3={"addressing_style": "path"}) if path_style else None,
            )
            client.meta.events.register_last("before-sign.s3.GetObject", _stop_at_signing)
            self._client = client
        try:
            self._client.get_object(  # type: ignore[attr-defined]  # botocore's, generated
                Bucket=self.bucket, Key=self.key + suffix
            )
        except _Built as built:
            # without its query (`x-id=GetObject`): the URL shown to S3 is the object's own
            return built.url.partition("?")[0]
        raise AssertionError("botocore sent a GetObject request")  # pragma: no cover

    def _credentials_and_region(self) -> tuple[ReadOnlyCredentials, str]:
        """Under the lock: the chain's current credentials (renewed if due), the region."""
        try:
            if self._session is None:
                self._session = _botocore_session()
            if self._region is None:
                region = os.environ.get("AWS_REGION") or self._session.get_config_variable("region")
                if not region:
                    raise VersionSourceError(
                        f"GET {self.url}: no AWS region: set AWS_REGION (or "
                        "AWS_DEFAULT_REGION, or region in the AWS config file)"
                    )
                self._region = str(region)
            if self._credentials is None:
                self._credentials = self._session.get_credentials()
                if self._credentials is None:
                    raise VersionSourceError(
                        f"GET {self.url}: no AWS credentials found (looked in the "
                        "environment, web identity, the shared config and credentials "
                        "files, container and instance metadata)"
                    )
                log.info(
                    "self-update: AWS credentials for %s from %s",
                    self.url, self._credentials.method,
                )  # fmt: skip
            frozen = self._credentials.get_frozen_credentials()
        except VersionSourceError:
            raise
        except Exception as exc:  # botocore's, from reading files, IMDS or STS
            raise VersionSourceError(
                f"GET {self.url}: AWS credentials: {type(exc).__name__}: {exc}"
            ) from None
        if not frozen.access_key or not frozen.secret_key:
            raise VersionSourceError(f"GET {self.url}: AWS credentials are incomplete")
        return frozen, self._region


class _Built(Exception):  # not an error: how the built request comes back
    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.url = url


def _stop_at_signing(request: AWSRequest, **_: object) -> None:
    """botocore's before-sign hook: the request is built (its URL final), and is never
    signed nor sent by botocore."""
    raise _Built(str(request.url))


def _configured_endpoint(session: Session) -> bool:
    """Whether the AWS SDKs' settings give S3 an endpoint (which botocore then uses), by
    botocore's own lookup: AWS_IGNORE_CONFIGURED_ENDPOINT_URLS (or the config file's
    ignore_configured_endpoint_urls), then AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the config
    file's `services` section for s3, the profile's endpoint_url."""
    from botocore.configprovider import ConfiguredEndpointProvider

    if session.get_config_variable("ignore_configured_endpoint_urls"):
        return False
    provider = ConfiguredEndpointProvider(
        full_config=session.full_config,
        scoped_config=session.get_scoped_config(),
        client_name="s3",
    )
    return bool(provider.provide())


def _botocore_session() -> Session:
    import botocore.session

    # botocore's debug lines hold signed requests (with the session token) and STS answers
    # (with secret keys): never let them through, whatever LOG_LEVEL says
    logging.getLogger("botocore").setLevel(logging.WARNING)
    return botocore.session.get_session()
