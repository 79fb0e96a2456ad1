"""The published version file (a public S3 object), fetched over HTTPS with an ETag.

Plain GETs, no S3 client: the object is public. A 304 means unchanged; anything that
is not a 200 with a small body is an error the caller shows and ignores. The body is read
streamed, and reading stops once it passes the limit.
"""

from __future__ import annotations

import httpx

from app.domain.updates import MAX_VERSION_FILE_BYTES


class VersionSourceError(RuntimeError):
    """The file could not be fetched (the message is shown in /v1/status)."""


class VersionFile:
    def __init__(self, url: str, *, timeout: float) -> None:
        self.url = url
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout), follow_redirects=True)
        self._etag: str | None = None
        self._body: bytes | None = None

    async def aclose(self) -> None:
        await self._client.aclose()

    async def fetch(self) -> bytes:
        """The file's content (the cached copy after a 304).

        Read streamed and only up to MAX_VERSION_FILE_BYTES: a larger (or endless) body
        is an error as soon as its Content-Length or its bytes pass the limit, and the
        rest is never read.
        """
        headers = {"If-None-Match": self._etag} if self._etag and self._body is not None else {}
        try:
            async with self._client.stream("GET", self.url, headers=headers) as response:
                if response.status_code == 304 and self._body is not None:
                    return self._body
                if response.status_code != 200:
                    raise VersionSourceError(f"GET {self.url}: HTTP {response.status_code}")
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > MAX_VERSION_FILE_BYTES:
                    raise self._too_large()
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_VERSION_FILE_BYTES:
                        raise self._too_large()
                etag = response.headers.get("etag")
        except httpx.TimeoutException:
            raise VersionSourceError(f"GET {self.url}: timed out") from None
        except httpx.TransportError as exc:
            raise VersionSourceError(f"GET {self.url}: {type(exc).__name__}: {exc}") from None
        self._etag = etag
        self._body = bytes(body)
        return self._body

    def _too_large(self) -> VersionSourceError:
        return VersionSourceError(
            f"GET {self.url}: body larger than {MAX_VERSION_FILE_BYTES} bytes (not read further)"
        )
