"""Built-in job handlers: `http` against a local workload over real HTTP (the cluster's
names routed to it, as the cluster's DNS routes them to a Service); plugin loading."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.adapters.embedded import free_port
from app.adapters.workload_http import MAX_RESPONSE_BYTES, WorkloadHttp
from app.domain.http_targets import AllowedTargets
from app.domain.jobs import (
    FailureKind,
    Job,
    PermanentJobFailure,
    RetryableJobFailure,
    classify_failure,
)
from app.services import handlers
from app.services.handlers import HandlerContext, load_handlers
from app.services.streams import new_job
from standins.servers import ThreadedServer, serve
from tests.support.polling import eventually

WORKLOAD = "http://api.workloads.svc:8080"  # routed to the local server by ClusterDns
WORKLOADS = AllowedTargets.namespace("workloads")  # what the http job may call here

received: list[tuple[dict[str, Any], str | None]] = []
hosts: list[str | None] = []  # the Host header of every request the workload got


async def answer(request: Request) -> JSONResponse:
    hosts.append(request.headers.get("host"))
    received.append((await request.json(), request.headers.get("idempotency-key")))
    status = int(request.path_params["status"])
    if status == 0:
        await asyncio.sleep(5)
        status = 200
    return JSONResponse({"stored": True}, status_code=status)


async def sized(request: Request) -> Response:
    """`size` bytes of JSON (a string field padded out) or of plain text."""
    size = int(request.path_params["size"])
    if request.path_params["kind"] == "json":
        padding = "x" * (size - len(json.dumps({"data": ""})))
        return Response(json.dumps({"data": padding}), media_type="application/json")
    return Response(b"y" * size, media_type="text/plain")


class Endless:
    """A body that never ends, counting what it sent; it stops when the client goes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent = 0
        self.running = False

    async def respond(self, request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            with self.lock:
                self.running = True
            try:
                while True:
                    with self.lock:
                        self.sent += 16 * 1024
                    yield b"z" * (16 * 1024)
                    await asyncio.sleep(0)
            finally:
                with self.lock:
                    self.running = False

        return StreamingResponse(chunks(), status_code=int(request.path_params["status"]))


endless = Endless()


async def raw(request: Request) -> Response:
    """An answer as it is written in RAW: JSON with a NUL or a lone surrogate escaped,
    text with a NUL byte."""
    content, media_type = RAW[request.path_params["name"]]
    return Response(content, media_type=media_type)


RAW = {
    "json-nul": (b'{"text": "a\\u0000b"}', "application/json"),
    "json-surrogate": (b'{"text": "\\ud800"}', "application/json"),
    "text-nul": (b"a\x00b", "text/plain; charset=utf-8"),
}


class ClusterDns(httpx.AsyncHTTPTransport):
    """Connects every request to the local workload server, as the cluster's DNS would
    to the Service named: the URL's host stays in the Host header. Records the names it
    was asked to connect to."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__()
        self.address = host, port
        self.looked_up: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.looked_up.append(request.url.host)
        host, port = self.address
        request.url = request.url.copy_with(host=host, port=port)
        return await super().handle_async_request(request)


@pytest.fixture(scope="module")
def workload() -> Iterator[ThreadedServer]:
    app = Starlette(routes=[
        Route("/answer/{status}", answer, methods=["POST"]),
        Route("/sized/{kind}/{size}", sized, methods=["POST"]),
        Route("/endless/{status}", endless.respond, methods=["POST"]),
        Route("/raw/{name}", raw, methods=["POST"]),
    ])  # fmt: skip
    with serve(app) as server:
        yield server


@pytest.fixture
def dns(workload: ThreadedServer) -> ClusterDns:
    return ClusterDns(workload.host, workload.port)


@pytest.fixture
async def http(dns: ClusterDns) -> AsyncIterator[WorkloadHttp]:
    client = WorkloadHttp(timeout=0.5, allowed_targets=WORKLOADS, transport=dns)
    yield client
    await client.aclose()


def context(http: WorkloadHttp, delivered: int = 1, attempt: int = 1) -> HandlerContext:
    return HandlerContext(node_id="n1", delivered=delivered, attempt=attempt, http=http)


def http_job(url: str) -> Job:
    return new_job("http", payload={"url": url, "body": {"text": "hi"}}, idempotency_key="k-9")


async def test_http_handler_posts_the_body_with_the_idempotency_key(http: WorkloadHttp) -> None:
    received.clear()
    result = await handlers.http(http_job(f"{WORKLOAD}/answer/201"), context(http))
    assert result == {"status": 201, "body": {"stored": True}}
    assert received == [({"text": "hi"}, "k-9")]


@pytest.mark.parametrize(
    ("url", "looked_up", "host"),
    [
        ("http://api.workloads:8080", "api.workloads.svc", "api.workloads:8080"),
        ("http://api.workloads.svc:8080", "api.workloads.svc", "api.workloads.svc:8080"),
        ("http://API.Workloads.svc.cluster.local.",
         "api.workloads.svc.cluster.local.", "api.workloads.svc.cluster.local."),
    ],
)  # fmt: skip
async def test_http_handler_calls_a_service_by_its_cluster_name(
    http: WorkloadHttp, dns: ClusterDns, url: str, looked_up: str, host: str
) -> None:
    """The short `<service>.<namespace>` is looked up as `<service>.<namespace>.svc`
    (a missing Service then never falls through to a public name); the workload is told
    the URL's host."""
    hosts.clear()
    result = await handlers.http(http_job(f"{url}/answer/200"), context(http))
    assert result["status"] == 200
    assert (dns.looked_up, hosts) == ([looked_up], [host])


@pytest.mark.parametrize(
    ("path", "failure"),
    [("/answer/503", RetryableJobFailure), ("/answer/0", RetryableJobFailure),
     ("/answer/404", PermanentJobFailure), ("/answer/422", PermanentJobFailure)],
)  # fmt: skip
async def test_http_handler_failures_are_classified(
    http: WorkloadHttp, path: str, failure: type[Exception]
) -> None:
    with pytest.raises(failure):
        await handlers.http(http_job(f"{WORKLOAD}{path}"), context(http))


@pytest.mark.parametrize(
    ("kind", "size", "body"),
    [
        ("json", 1000, {"data": "x" * (1000 - len('{"data": ""}'))}),
        ("json", MAX_RESPONSE_BYTES, {"data": "x" * (MAX_RESPONSE_BYTES - len('{"data": ""}'))}),
        ("text", 10_000, "y" * 10_000),  # more than the 4096 characters kept before, unsaid
        ("text", MAX_RESPONSE_BYTES, "y" * MAX_RESPONSE_BYTES),
    ],
)
async def test_http_handler_keeps_a_body_within_the_cap_whole(
    http: WorkloadHttp, kind: str, size: int, body: Any
) -> None:
    result = await handlers.http(http_job(f"{WORKLOAD}/sized/{kind}/{size}"), context(http))
    assert result == {"status": 200, "body": body}


@pytest.mark.parametrize("kind", ["json", "text"])
async def test_http_handler_cuts_a_larger_body_and_says_so(http: WorkloadHttp, kind: str) -> None:
    size = 5 * MAX_RESPONSE_BYTES
    result = await handlers.http(http_job(f"{WORKLOAD}/sized/{kind}/{size}"), context(http))
    assert result["status"] == 200
    assert result["truncated"] is True and result["kept_bytes"] == MAX_RESPONSE_BYTES
    # a cut JSON document does not parse: its first bytes are kept as text
    assert isinstance(result["body"], str) and len(result["body"]) == MAX_RESPONSE_BYTES
    assert result["body"].startswith('{"data": "xxx' if kind == "json" else "yyy")


@pytest.mark.parametrize(
    ("status", "outcome"),
    [(200, None), (201, None), (422, PermanentJobFailure), (503, RetryableJobFailure)],
)
async def test_http_handler_stops_reading_an_endless_body(
    http: WorkloadHttp, status: int, outcome: type[Exception] | None
) -> None:
    """Read whole, this body would never end (and fill the memory): the handler stops
    at the cap, and the workload sees the connection go."""
    with endless.lock:
        endless.sent = 0
    call = handlers.http(http_job(f"{WORKLOAD}/endless/{status}"), context(http))
    if outcome is None:
        result = await asyncio.wait_for(call, timeout=20)
        assert (result["status"], result["truncated"]) == (status, True)
        assert result["kept_bytes"] == MAX_RESPONSE_BYTES == len(result["body"])
    else:
        with pytest.raises(outcome, match=f"HTTP {status}"):
            await asyncio.wait_for(call, timeout=20)

    async def workload_stopped() -> bool:
        with endless.lock:
            return not endless.running

    await eventually(workload_stopped)
    with endless.lock:
        # what the socket buffers took before the client closed, not an endless stream
        assert endless.sent < 64 * 1024 * 1024


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://example.com/x", "host 'example.com' is not allowed"),
        ("http://nats.nats.svc:8222/varz", "host 'nats.nats.svc' is not allowed"),
        ("http://kube-dns.kube-system.svc.cluster.local:9153/metrics",
         "host 'kube-dns.kube-system.svc.cluster.local' is not allowed"),
        ("http://workload-manager.workload-manager.svc:8080/",
         "host 'workload-manager.workload-manager.svc' is not allowed"),
        ("http://evil.svc.example.com/", "host 'evil.svc.example.com' is not allowed"),
        ("http://127.0.0.1:8080/", "host '127.0.0.1' is an IP address"),
        ("http://localhost:8080/", "host 'localhost' is not allowed"),
        ("file:///etc/passwd", "not an http"),
    ],
)  # fmt: skip
async def test_http_handler_only_calls_the_allowed_services(
    http: WorkloadHttp, dns: ClusterDns, url: str, why: str
) -> None:
    with pytest.raises(PermanentJobFailure, match=why) as caught:
        await handlers.http(http_job(url), context(http))
    if why.startswith("host"):
        allowed = "the http job may call the Services of namespace workloads, as <service>"
        assert allowed in str(caught.value)
    assert dns.looked_up == []  # nothing was sent


@pytest.mark.parametrize(
    "url",
    [
        f"{WORKLOAD}/answer/201\t",
        f"{WORKLOAD}/answer/201\n",
        f"{WORKLOAD}/answer/2\x0001",
        f"{WORKLOAD}/answer /201",
        "http://api.work\tloads.svc:8080/answer/201",
        "http://api.workloads.svc:99999/answer/201",
        "http://api.workloads.svc:0/answer/201",
        "http://api.workloads.svc:x/answer/201",
        "http://user:pw@api.workloads.svc:8080/answer/201",
    ],
)
async def test_http_handler_fails_a_url_that_cannot_be_sent_for_good(
    http: WorkloadHttp, dns: ClusterDns, url: str
) -> None:
    """Such a URL fails the same way on every delivery: retrying it would only spend the
    job's attempts. Before, a tab was retried as if the workload were away."""
    received.clear()
    with pytest.raises(PermanentJobFailure) as caught:
        await handlers.http(http_job(url), context(http))
    assert classify_failure(caught.value) is FailureKind.PERMANENT
    assert (dns.looked_up, received) == ([], [])


async def test_http_handler_fails_a_request_httpx_cannot_send_for_good(
    http: WorkloadHttp, dns: ClusterDns
) -> None:
    """A header h11 refuses to write (the idempotency key goes in one) is no transient
    error either."""
    received.clear()
    job = new_job("http", payload={"url": f"{WORKLOAD}/answer/201"}, idempotency_key="k\n1")
    with pytest.raises(PermanentJobFailure, match="LocalProtocolError: Illegal header value"):
        await handlers.http(job, context(http))
    assert received == []


async def test_http_handler_retries_a_workload_that_is_not_there() -> None:
    """A real connection refused (nothing listens on the port): retried."""
    client = WorkloadHttp(
        timeout=2.0,
        allowed_targets=WORKLOADS,
        transport=ClusterDns("127.0.0.1", free_port()),
    )
    try:
        with pytest.raises(RetryableJobFailure, match="ConnectError"):
            await handlers.http(http_job(f"{WORKLOAD}/answer/201"), context(client))
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("name", "body"),
    [
        ("json-nul", {"text": "a\x00b"}),
        ("json-surrogate", {"text": "\ud800"}),
        ("text-nul", "a\x00b"),
    ],
)
async def test_http_handler_result_is_json_whatever_the_answer_holds(
    http: WorkloadHttp, name: str, body: Any
) -> None:
    """The answer is kept as sent, a NUL included (the ledger's JSONB cannot hold one:
    its writer's concern); the result still goes through JSON, both ways."""
    result = await handlers.http(http_job(f"{WORKLOAD}/raw/{name}"), context(http))
    assert result == {"status": 200, "body": body}
    assert json.loads(json.dumps(result)) == result


async def test_http_handler_needs_a_url(http: WorkloadHttp) -> None:
    with pytest.raises(PermanentJobFailure, match=r"payload\.url is required"):
        await handlers.http(new_job("http"), context(http))


@pytest.mark.parametrize(
    ("payload", "attempt", "delivered", "outcome"),
    [
        ({}, 1, 1, None),
        ({"fail": "permanent"}, 1, 1, FailureKind.PERMANENT),
        ({"fail": "retryable"}, 3, 3, FailureKind.RETRYABLE),
        ({"fail": "retryable", "fail_times": 1}, 1, 1, FailureKind.RETRYABLE),
        ({"fail": "retryable", "fail_times": 1}, 2, 2, None),
        # deliveries spent handing the job on, or waiting for its key, are no attempts
        ({"fail": "retryable", "fail_times": 1}, 1, 7, FailureKind.RETRYABLE),
        ({"fail": "retryable", "fail_times": 2}, 2, 9, FailureKind.RETRYABLE),
        ({"fail": "retryable", "fail_times": 2}, 3, 9, None),
        ({"fail": "permanent", "fail_times": 0}, 1, 1, None),
    ],
)
async def test_noop_fails_on_the_first_fail_times_attempts(
    http: WorkloadHttp,
    payload: dict[str, Any],
    attempt: int,
    delivered: int,
    outcome: FailureKind | None,
) -> None:
    job = new_job("noop", payload=payload)
    if outcome is None:
        assert await handlers.noop(job, context(http, delivered, attempt)) == {
            "noop": True,
            "delivered": delivered,
        }
    else:
        with pytest.raises((RetryableJobFailure, PermanentJobFailure)) as caught:
            await handlers.noop(job, context(http, delivered, attempt))
        assert caught.value.kind is outcome


def test_built_ins_are_always_loaded() -> None:
    loaded = load_handlers()
    assert loaded["noop"] is handlers.noop and loaded["http"] is handlers.http
