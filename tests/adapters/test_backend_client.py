"""The backend client against the local contract-enforcing backend, over real HTTP."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from app.adapters.backend import BackendClient, BackendError
from app.adapters.signing import NodeSigner
from tests.support.backend import LocalBackend
from tests.support.servers import ThreadedServer

NODE = "node-test-1"
KEY = Ed25519PrivateKey.generate()
REPORT = {
    "node_id": NODE,
    "manager_version": "0.1.0",
    "reported_at": "2026-11-29T12:00:00Z",
    "workloads": [{"name": "api", "status": "healthy"}],
}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[LocalBackend, ThreadedServer]]:
    backend = LocalBackend(NODE, KEY.public_key())
    with backend.serve() as server:
        yield backend, server


@pytest.fixture
def backend(served: tuple[LocalBackend, ThreadedServer]) -> LocalBackend:
    served[0].reset()
    return served[0]


def make_client(
    server_url: str, *, timeout: float = 2.0, attempts: int = 3, signer: NodeSigner | None = None
) -> BackendClient:
    return BackendClient(
        base_url=server_url,
        signer=signer or NodeSigner(NODE, KEY),
        timeout=timeout,
        attempts=attempts,
        max_wait=0.05,
    )


@pytest.fixture
def url(served: tuple[LocalBackend, ThreadedServer]) -> str:
    return served[1].url


async def test_signed_report_is_accepted(backend: LocalBackend, url: str) -> None:
    client = make_client(url)
    try:
        await client.post_health(REPORT)
    finally:
        await client.aclose()
    assert backend.reports == [REPORT]
    (request,) = backend.requests
    assert request.verified and not request.rejected
    assert request.headers["user-agent"].startswith("workload-manager/")


async def test_5xx_is_retried_then_succeeds(backend: LocalBackend, url: str) -> None:
    backend.fail("health", "500", times=2)
    client = make_client(url, attempts=3)
    try:
        await client.post_health(REPORT)
    finally:
        await client.aclose()
    assert [r.status for r in backend.requests] == [500, 500, 202]
    assert len(backend.reports) == 1


async def test_persistent_5xx_raises_after_the_attempts(backend: LocalBackend, url: str) -> None:
    backend.fail("health", "503", times=None)
    client = make_client(url, attempts=2)
    try:
        with pytest.raises(BackendError, match="HTTP 503"):
            await client.post_health(REPORT)
    finally:
        await client.aclose()
    assert len(backend.requests) == 2


async def test_timeout_is_a_backend_error_within_the_budget(
    backend: LocalBackend, url: str
) -> None:
    backend.fail("health", "timeout", times=None, delay=30)
    client = make_client(url, timeout=0.3, attempts=2)
    started = time.monotonic()
    try:
        with pytest.raises(BackendError, match="Timeout"):
            await client.post_health(REPORT)
    finally:
        await client.aclose()
    assert time.monotonic() - started < 3.0
    # both attempts reached the backend and were abandoned by the client
    assert [r.status for r in backend.wait_for_requests(2)] == [499, 499]


async def test_4xx_is_not_retried(backend: LocalBackend, url: str) -> None:
    wrong_key = NodeSigner(NODE, Ed25519PrivateKey.generate())
    client = make_client(url, signer=wrong_key, attempts=3)
    try:
        with pytest.raises(BackendError, match="HTTP 401"):
            await client.post_health(REPORT)
    finally:
        await client.aclose()
    assert len(backend.requests) == 1
    assert backend.requests[0].rejected


async def test_unreachable_backend_is_a_backend_error() -> None:
    client = make_client("http://127.0.0.1:9", timeout=0.5, attempts=2)
    try:
        with pytest.raises(BackendError, match="ConnectError"):
            await client.post_health(REPORT)
    finally:
        await client.aclose()
