"""The backend client against the local contract-enforcing backend, over real HTTP."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from email.utils import formatdate
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from app.adapters.backend import DESIRED, BackendClient, BackendError, BackendHeld
from app.adapters.backend import REPORT as REPORT_KIND
from app.adapters.signing import NodeSigner
from standins.backend import LocalBackend
from standins.servers import ThreadedServer, serve

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
    server_url: str,
    *,
    timeout: float = 2.0,
    attempts: int = 3,
    signer: NodeSigner | None = None,
    max_wait: float = 0.05,
    deadline: float = 10.0,
    max_response_bytes: int = 1024 * 1024,
    retry_after_max: float = 3600.0,
    clock: Callable[[], float] = time.time,
) -> BackendClient:
    return BackendClient(
        base_url=server_url,
        signer=signer or NodeSigner(NODE, KEY),
        timeout=timeout,
        attempts=attempts,
        max_wait=max_wait,
        deadline=deadline,
        max_response_bytes=max_response_bytes,
        retry_after_max=retry_after_max,
        clock=clock,
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


# ------------------------------------------------------- a backend that hangs or floods


async def test_a_trickled_answer_ends_at_the_deadline(backend: LocalBackend, url: str) -> None:
    backend.set_desired([{"name": "api", "version": "1.0.0"}])
    # a byte every 0.3 s: the per-read timeout (2 s) never fires, and the answer (over a
    # hundred bytes) would take more than 30 s to arrive
    backend.fail("workloads", "trickle", times=None, interval=0.3)
    client = make_client(url, timeout=2.0, attempts=3, deadline=1.0)
    started = time.monotonic()
    try:
        with pytest.raises(BackendError, match=r"deadline of 1 s.*still arriving"):
            await client.get_desired(None)
    finally:
        await client.aclose()
    # far below the trickle's time (room for a busy machine), so ended by the deadline
    assert time.monotonic() - started < 10.0
    # one attempt, abandoned: the deadline left no time for another
    assert [r.status for r in backend.wait_for_requests(1)] == [499]


async def test_the_deadline_covers_every_attempt_and_wait(backend: LocalBackend, url: str) -> None:
    # 30 attempts of 0.5 s each would take 15 s and more: the deadline ends them at 3 s,
    # long after the second attempt began (at about 0.7 s)
    backend.fail("health", "timeout", times=None, delay=30)
    client = make_client(url, timeout=0.5, attempts=30, max_wait=0.2, deadline=3.0)
    started = time.monotonic()
    try:
        with pytest.raises(BackendError, match=r"deadline of 3 s"):
            await client.post_health(REPORT)
    finally:
        await client.aclose()
    assert time.monotonic() - started < 10.0
    assert 2 <= len(backend.wait_for_requests(2)) < 30


async def test_a_huge_answer_is_refused_past_the_bound(backend: LocalBackend, url: str) -> None:
    backend.set_desired([{"name": "api", "version": "1.0.0"}])
    backend.fail("workloads", "huge", times=None, size=4 * 1024 * 1024)
    client = make_client(url, max_response_bytes=64 * 1024)
    try:
        with pytest.raises(BackendError, match="answer larger than 65536 bytes"):
            await client.get_desired(None)
    finally:
        await client.aclose()
    # not retried: the same backend would send the same answer
    assert [r.injected_failure for r in backend.wait_for_requests(1)] == ["huge"]


async def test_a_declared_length_past_the_bound_is_refused_unread(
    backend: LocalBackend, url: str
) -> None:
    big = {"kind": "Deployment", "metadata": {"name": "api"}, "padding": "x" * 100_000}
    backend.set_manifest("api", "1.0.0", big)
    client = make_client(url, max_response_bytes=64 * 1024)
    try:
        with pytest.raises(BackendError, match=r"Content-Length 100\d+ is larger than 65536"):
            await client.get_manifest("api", "1.0.0")
    finally:
        await client.aclose()


async def test_an_answer_within_the_bound_is_read_whole(backend: LocalBackend, url: str) -> None:
    big = {"kind": "Deployment", "metadata": {"name": "api"}, "padding": "x" * 50_000}
    backend.set_manifest("api", "1.0.0", big)
    client = make_client(url, max_response_bytes=64 * 1024)
    try:
        assert await client.get_manifest("api", "1.0.0") == big
    finally:
        await client.aclose()


REDIRECTS = ["workloads", "health", "version"]


@pytest.mark.parametrize("route", REDIRECTS)
async def test_a_redirect_is_an_error_and_never_followed(
    backend: LocalBackend, url: str, route: str
) -> None:
    backend.set_desired([{"name": "api", "version": "1.0.0"}])
    backend.fail(route, "redirect", times=None)  # type: ignore[arg-type]
    client = make_client(url)
    status = 302 if route == "workloads" else 307
    try:
        with pytest.raises(BackendError, match=f"HTTP {status}: redirects are refused"):
            if route == "workloads":
                await client.get_desired(None)
            elif route == "health":
                await client.post_health(REPORT)
            else:
                await client.put_version("api", {"version": "1.0.0", "applied_at": APPLIED})
    finally:
        await client.aclose()
    # asked once, not retried, not followed: the backend stored nothing
    assert [r.status for r in backend.requests] == [status]
    assert backend.reports == [] and backend.versions == []


APPLIED = "2026-11-29T12:00:00Z"


async def test_retry_after_in_seconds_is_honoured(backend: LocalBackend, url: str) -> None:
    # longer than any backoff of its own (at most 0.2 s plus 1 s of jitter)
    backend.fail("health", "429", times=1, retry_after="2")
    client = make_client(url, max_wait=3.0, deadline=10.0)
    try:
        await client.post_health(REPORT)
    finally:
        await client.aclose()
    first, second = backend.requests
    assert (first.status, second.status) == (429, 202)
    assert second.received_at - first.received_at >= 2.0


async def test_retry_after_as_an_http_date_is_honoured(backend: LocalBackend, url: str) -> None:
    # an HTTP date has whole seconds: 3 s ahead is more than 2 s ahead once rounded down
    backend.fail("health", "503", times=1, retry_after=formatdate(time.time() + 3, usegmt=True))
    client = make_client(url, max_wait=3.0, deadline=10.0)
    try:
        await client.post_health(REPORT)
    finally:
        await client.aclose()
    first, second = backend.requests
    assert (first.status, second.status) == (503, 202)
    assert second.received_at - first.received_at >= 1.9


@pytest.mark.parametrize(
    ("retry_after", "deadline", "reason"),
    [
        # what is left is read when the answer comes: 60 s, or a little less on a busy machine
        ("120", 60.0, r"Retry-After 120 s is past the (60|59\.\d) s left of the deadline"),
        ("30", 60.0, r"Retry-After 30 s is longer than the longest wait \(3 s\)"),
    ],
)
async def test_a_retry_after_too_far_away_gives_up_at_once(
    backend: LocalBackend, url: str, retry_after: str, deadline: float, reason: str
) -> None:
    backend.fail("health", "503", times=None, retry_after=retry_after)
    client = make_client(url, max_wait=3.0, deadline=deadline)
    started = time.monotonic()
    try:
        with pytest.raises(BackendError, match=reason):
            await client.post_health(REPORT)
    finally:
        await client.aclose()
    # asked once, and ended long before either the asked wait or the deadline
    assert len(backend.requests) == 1
    assert time.monotonic() - started < min(float(retry_after), deadline) / 2


DEEP = b"[" * 100_000 + b"]" * 100_000  # 200 kB: inside the size bound, past any parser's depth


async def _deep_json(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Any GET: 200 with JSON nested 100 000 deep (a backend's answer is not verified, so
    a plain server stands in for it)."""
    if scope["type"] != "http":
        return
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(DEEP))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": DEEP})


async def test_an_answer_nested_too_deeply_is_a_backend_error() -> None:
    with serve(_deep_json) as server:
        client = make_client(server.url)
        try:
            with pytest.raises(BackendError, match="answer nested too deeply"):
                await client.get_manifest("api", "1.0.0")
        finally:
            await client.aclose()


async def test_a_retry_after_it_cannot_wait_holds_that_kind_of_call_until_it_passes(
    backend: LocalBackend, url: str
) -> None:
    """One 429 with `Retry-After: 30`: the report asks once; a report before the 30 s (and
    its jitter) have passed is not sent, and says how long is left; other calls go on;
    once the time has passed (the client's clock moved on) the report is sent again."""
    backend.fail("health", "429", times=None, retry_after="30")
    now = [time.time()]
    client = make_client(url, max_wait=3.0, clock=lambda: now[0])
    try:
        with pytest.raises(BackendError) as first:
            await client.post_health(REPORT)
        assert first.value.retry_after is not None
        assert 30.0 <= first.value.retry_after <= 33.0  # jittered: up to 10 % more
        assert "Retry-After until " in str(first.value)
        assert first.value.until is not None
        now[0] += 29.0
        with pytest.raises(BackendHeld, match="not sent: Retry-After until ") as held:
            await client.post_health(REPORT)
        assert held.value.retry_after == pytest.approx(first.value.retry_after - 29.0)
        assert len(backend.requests) == 1
        await client.get_desired(None)  # another kind of call is not held
        assert len(backend.requests) == 2
        now[0] += 4.5
        with pytest.raises(BackendError, match="HTTP 429"):
            await client.post_health(REPORT)
    finally:
        await client.aclose()
    assert [(r.route, r.status) for r in backend.requests] == [
        ("health", 429), ("workloads", 200), ("health", 429)
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("retry_after", "cap", "low", "high"),
    [
        ("86400", 60.0, 60.0, 66.0),  # a day, capped at RETRY_AFTER_MAX_SECONDS, jittered
        ("45", 3600.0, 45.0, 49.5),
        ("0", 3600.0, 0.0, 1.0),  # now: no wait but the jitter (at most a second)
        ("date+40", 3600.0, 38.0, 44.0),  # an HTTP date 40 s ahead (whole seconds)
    ],
)
async def test_the_hold_is_capped_and_jittered(
    backend: LocalBackend, url: str, retry_after: str, cap: float, low: float, high: float
) -> None:
    if retry_after.startswith("date+"):
        retry_after = formatdate(time.time() + float(retry_after[5:]), usegmt=True)
    backend.fail("version", "503", times=None, retry_after=retry_after)
    client = make_client(url, attempts=1, max_wait=0.05, retry_after_max=cap)
    try:
        with pytest.raises(BackendError) as raised:
            await client.put_version("api", {"version": "1.0.0"})
    finally:
        await client.aclose()
    assert raised.value.retry_after is not None
    assert low <= raised.value.retry_after <= high
    assert raised.value.unreachable  # a 503: the backend failed rather than answered


async def test_a_429_without_retry_after_holds_nothing(backend: LocalBackend, url: str) -> None:
    backend.fail("health", "429", times=1)
    client = make_client(url, attempts=1)
    try:
        with pytest.raises(BackendError) as raised:
            await client.post_health(REPORT)
        assert raised.value.retry_after is None
        await client.post_health(REPORT)
    finally:
        await client.aclose()
    assert [r.status for r in backend.requests] == [429, 202]


async def test_the_interval_an_answer_asks_for_is_kept_until_the_next_answer(
    backend: LocalBackend, url: str
) -> None:
    """`X-Report-Interval-Seconds` on the report's 2xx, `X-Sync-Interval-Seconds` on the
    desired state's 200 and 304; an answer without it (or with a malformed value) says
    none; a failed call changes nothing."""
    client = make_client(url, attempts=1)
    try:
        assert client.interval_asked(REPORT_KIND) is None
        backend.steer("health", 120)
        await client.post_health(REPORT)
        assert client.interval_asked(REPORT_KIND) == 120.0
        backend.fail("health", "500", times=1)
        with pytest.raises(BackendError):
            await client.post_health(REPORT)
        assert client.interval_asked(REPORT_KIND) == 120.0  # no answer: as it was
        backend.steer("health", "soon")
        await client.post_health(REPORT)
        assert client.interval_asked(REPORT_KIND) is None
        backend.steer("health", None)
        backend.steer("workloads", 900)
        etag, _ = await client.get_desired(None)
        assert client.interval_asked(DESIRED) == 900.0
        backend.steer("workloads", 1200.5)
        await client.get_desired(etag)  # a 304 carries it too
        assert client.interval_asked(DESIRED) == 1200.5
        backend.steer("workloads", None)
        await client.get_desired(etag)
        assert client.interval_asked(DESIRED) is None
    finally:
        await client.aclose()
    assert [r.status for r in backend.requests][-3:] == [200, 304, 304]
