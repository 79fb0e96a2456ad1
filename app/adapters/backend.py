"""HTTP client for the node-system backend: signed requests, timeouts, retries with jitter.

Every request is signed by `_SigningAuth` at the last moment, over the exact bytes
httpx sends, so what the backend verifies is what went on the wire. Retries cover
transport errors, 5xx and 429 only; a 4xx is the caller's bug and is raised at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import Any

import httpx
import stamina

from app import __version__
from app.adapters.signing import NodeSigner


class BackendError(RuntimeError):
    """The backend could not be reached or answered with an error (message is loggable)."""


def _is_retryable(exc: Exception) -> bool:
    if isinstance(exc, httpx.TransportError):
        return True
    if isinstance(exc, httpx.HTTPStatusError):
        code = exc.response.status_code
        return code >= 500 or code == 429
    return False


class _SigningAuth(httpx.Auth):
    def __init__(self, signer: NodeSigner, clock: Callable[[], float]) -> None:
        self._signer = signer
        self._clock = clock

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        target = request.url.raw_path.decode("ascii")
        request.headers.update(
            self._signer.headers(
                method=request.method,
                target=target,
                body=request.content,
                timestamp=int(self._clock()),
            )
        )
        yield request


class BackendClient:
    """The calls the manager makes to the backend (CONTRACTS §2)."""

    def __init__(
        self,
        *,
        base_url: str,
        signer: NodeSigner,
        timeout: float,
        attempts: int,
        max_wait: float,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._signer = signer
        self._attempts = attempts
        self._max_wait = max_wait
        self._client = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(timeout),
            auth=_SigningAuth(signer, clock),
            headers={"User-Agent": f"workload-manager/{__version__}"},
            transport=transport,
            follow_redirects=False,
        )

    @property
    def node_id(self) -> str:
        return self._signer.node_id

    def _node_path(self, suffix: str) -> str:
        return f"/v1/nodes/{self._signer.node_id}{suffix}"

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            async for attempt in stamina.retry_context(
                on=_is_retryable,
                attempts=self._attempts,
                wait_initial=min(0.2, self._max_wait),
                wait_max=self._max_wait,
                wait_jitter=min(1.0, self._max_wait),
                timeout=None,
            ):
                with attempt:
                    response = await self._client.request(method, path, **kwargs)
                    if response.status_code >= 400:
                        response.raise_for_status()
                    return response
        except httpx.HTTPStatusError as exc:
            raise BackendError(
                f"{method} {path}: HTTP {exc.response.status_code} {_excerpt(exc.response)}"
            ) from None
        except httpx.TransportError as exc:
            raise BackendError(f"{method} {path}: {type(exc).__name__}: {exc}") from None
        raise AssertionError("unreachable: stamina either returns or raises")

    async def post_health(self, report: dict[str, Any]) -> None:
        await self._send("POST", self._node_path("/health"), json=report)

    async def get_desired(self, etag: str | None) -> tuple[str | None, Any]:
        """(ETag, decoded body); the body is NOT_MODIFIED when the backend answered 304."""
        headers = {"If-None-Match": etag} if etag else {}
        response = await self._send("GET", self._node_path("/workloads"), headers=headers)
        if response.status_code == 304:
            return etag, NOT_MODIFIED
        return response.headers.get("etag"), _json(response)

    async def get_manifest(self, name: str, version: str) -> Any:
        response = await self._send(
            "GET", self._node_path(f"/workloads/{name}/manifest"), params={"version": version}
        )
        return _json(response)

    async def put_version(self, name: str, body: dict[str, Any]) -> None:
        await self._send("PUT", self._node_path(f"/workloads/{name}/version"), json=body)


NOT_MODIFIED = object()


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        raise BackendError(
            f"{response.request.method} {response.request.url.path}: "
            f"answer is not JSON: {_excerpt(response)}"
        ) from None


def _excerpt(response: httpx.Response) -> str:
    text = response.text.strip().replace("\n", " ")
    return text[:200]
