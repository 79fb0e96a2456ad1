"""HTTP calls from jobs to the node's workloads (the `http` job handler), through httpx.

Only in-cluster addresses are allowed (hosts ending in one of the allowed suffixes,
`.svc` and `.svc.cluster.local` by default): a job must not make the node call out to
arbitrary hosts. Answers are read streamed and at most `MAX_RESPONSE_BYTES` of a body is
kept: what a job returns goes to the ledger and into the `job.completed` event, and a
workload must not be able to fill the node's memory with an endless answer.

httpx and the client (its connection pool and TLS context) are made on the first call:
a worker that never runs an `http` job does not pay for them (some 3 MiB of RSS; 6 in a
development environment, where httpx also imports its command-line client's rich and
pygments).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import httpx

MAX_RESPONSE_BYTES = 64 * 1024
_ERROR_EXCERPT_BYTES = 200


class WorkloadHttpError(RuntimeError):
    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True, slots=True)
class WorkloadResponse:
    """A workload's answer, cut to the limit the request was made with."""

    status: int
    body: Any  # the JSON document; or the text, when not JSON or cut short
    kept_bytes: int  # bytes of the body read and kept
    truncated: bool  # the body went on past the limit; the rest was never read


class WorkloadHttp:
    def __init__(self, *, timeout: float, allowed_suffixes: tuple[str, ...]) -> None:
        self._allowed = allowed_suffixes
        self._timeout = timeout
        self._client: httpx.AsyncClient | None = None
        self._closed = False

    def _http(self) -> httpx.AsyncClient:
        """The client, made on first use (no await in between: one client per instance)."""
        if self._closed:
            raise RuntimeError("WorkloadHttp is closed")
        if self._client is None:
            import httpx

            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self._timeout), follow_redirects=False
            )
        return self._client

    async def aclose(self) -> None:
        self._closed = True
        if self._client is not None:
            await self._client.aclose()

    def check_url(self, url: str) -> None:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if parts.scheme not in ("http", "https") or not host:
            raise WorkloadHttpError(f"{url!r} is not an http(s) URL", retryable=False)
        if not any(host == s.lstrip(".") or host.endswith(s) for s in self._allowed):
            raise WorkloadHttpError(
                f"host {host!r} is not in the cluster (allowed: {', '.join(self._allowed)})",
                retryable=False,
            )

    async def post(self, url: str, body: Any, *, headers: dict[str, str]) -> tuple[int, Any]:
        """(status, body) of a POST; the body cut to `MAX_RESPONSE_BYTES` (see post_capped
        for whether it was)."""
        response = await self.post_capped(url, body, headers=headers)
        return response.status, response.body

    async def post_capped(
        self, url: str, body: Any, *, headers: dict[str, str], limit: int = MAX_RESPONSE_BYTES
    ) -> WorkloadResponse:
        """POST `body` as JSON; read at most `limit` bytes of the answer, streamed.

        5xx, timeouts and connection errors raise a retryable WorkloadHttpError, 4xx a
        permanent one (with the first bytes of the answer).
        """
        self.check_url(url)
        client = self._http()
        import httpx  # imported by _http already

        # Uncompressed, so that the limit counts what crosses the wire; a workload that
        # compresses anyway is still cut at `limit` bytes once decoded.
        headers = {"Accept-Encoding": "identity", **headers}
        try:
            async with client.stream("POST", url, json=body, headers=headers) as response:
                status = response.status_code
                if status >= 500:
                    raise WorkloadHttpError(f"POST {url}: HTTP {status}", retryable=True)
                if status >= 400:
                    excerpt, _ = await _read_at_most(response, _ERROR_EXCERPT_BYTES)
                    raise WorkloadHttpError(
                        f"POST {url}: HTTP {status}: {_text(excerpt, response)}",
                        retryable=False,
                    )
                content, truncated = await _read_at_most(response, limit)
                text = _text(content, response)
        except httpx.TimeoutException as exc:
            raise WorkloadHttpError(f"POST {url}: timed out ({exc})", retryable=True) from None
        except httpx.TransportError as exc:
            raise WorkloadHttpError(
                f"POST {url}: {type(exc).__name__}: {exc}", retryable=True
            ) from None
        return WorkloadResponse(
            status=status,
            body=text if truncated else _json_or_text(text),
            kept_bytes=len(content),
            truncated=truncated,
        )


async def _read_at_most(response: httpx.Response, limit: int) -> tuple[bytes, bool]:
    """The first `limit` bytes of the body, and whether there was more. Reading stops
    there: leaving the `stream` block closes the connection on the rest."""
    kept = bytearray()
    async for chunk in response.aiter_bytes():
        room = limit - len(kept)
        if len(chunk) > room:
            kept += chunk[:room]
            return bytes(kept), True
        kept += chunk
    return bytes(kept), False


def _text(content: bytes, response: httpx.Response) -> str:
    # a character cut in two at the limit becomes U+FFFD
    return content.decode(response.encoding or "utf-8", errors="replace")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_or_text(text: str) -> Any:
    """The JSON document, or the text when it is none (or one the ledger's JSONB and the
    events could not carry: NaN, Infinity, nesting deeper than the interpreter takes)."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return text
