"""HTTP calls from jobs to the node's workloads (the `http` job handler), through httpx.

Only in-cluster addresses are allowed (hosts ending in one of the allowed suffixes,
`.svc` and `.svc.cluster.local` by default): a job must not make the node call out to
arbitrary hosts.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import httpx


class WorkloadHttpError(RuntimeError):
    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class WorkloadHttp:
    def __init__(self, *, timeout: float, allowed_suffixes: tuple[str, ...]) -> None:
        self._allowed = allowed_suffixes
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout), follow_redirects=False)

    async def aclose(self) -> None:
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
        self.check_url(url)
        try:
            response = await self._client.post(url, json=body, headers=headers)
        except httpx.TimeoutException as exc:
            raise WorkloadHttpError(f"POST {url}: timed out ({exc})", retryable=True) from None
        except httpx.TransportError as exc:
            raise WorkloadHttpError(
                f"POST {url}: {type(exc).__name__}: {exc}", retryable=True
            ) from None
        if response.status_code >= 500:
            raise WorkloadHttpError(f"POST {url}: HTTP {response.status_code}", retryable=True)
        if response.status_code >= 400:
            raise WorkloadHttpError(
                f"POST {url}: HTTP {response.status_code}: {response.text[:200]}", retryable=False
            )
        try:
            return response.status_code, response.json()
        except ValueError:
            return response.status_code, response.text[:4096]
