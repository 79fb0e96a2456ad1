"""Tests of the local node-system backend double (standins/backend.py) itself.

Requests are signed here by a from-scratch implementation of the contract, so a
pass means the double accepts exactly what the contract allows, and rejects,
records and explains everything else, before any manager code relies on it.
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from standins.backend import STATUS_CLIENT_CLOSED, LocalBackend, RecordedRequest, Route
from standins.servers import ThreadedServer
from tests.support.polling import eventually_sync

NODE = "n1"
APPLIED_AT = "2024-05-01T12:00:00Z"
DEPLOYMENT: dict[str, Any] = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "api"},
    "spec": {"replicas": 1},
}


@dataclass(frozen=True)
class Tamper:
    """How to deviate from a correct signature; the default is a correct one."""

    omit: str | None = None  # header name to leave out
    signature: str | None = None  # literal X-Node-Signature value
    other_key: bool = False
    sign_method: str | None = None
    sign_target: str | None = None
    sign_body: bytes | None = None
    timestamp: str | None = None
    timestamp_offset: int = 0
    node_header: str | None = None


def signature_for(
    key: Ed25519PrivateKey, method: str, target: str, timestamp: str, body: bytes
) -> str:
    message = f"{method.upper()}\n{target}\n{timestamp}\n{hashlib.sha256(body).hexdigest()}"
    return base64.b64encode(key.sign(message.encode("utf-8"))).decode("ascii")


def signed_request(
    base_url: str,
    method: str,
    path: str,
    key: Ed25519PrivateKey,
    *,
    params: dict[str, str] | None = None,
    json_body: Any = None,
    content: bytes | None = None,
    headers: dict[str, str] | None = None,
    tamper: Tamper = Tamper(),  # frozen, so one shared default is harmless
) -> httpx.Request:
    request = httpx.Request(
        method,
        base_url + path,
        params=params,
        json=json_body,
        content=content,
        headers=headers,
    )
    # Sign what will actually go on the wire: httpx's encoded path and query.
    target = request.url.raw_path.decode("ascii")
    timestamp = tamper.timestamp or str(int(time.time()) + tamper.timestamp_offset)
    signer = Ed25519PrivateKey.generate() if tamper.other_key else key
    signature = tamper.signature or signature_for(
        signer,
        tamper.sign_method or method,
        tamper.sign_target if tamper.sign_target is not None else target,
        timestamp,
        tamper.sign_body if tamper.sign_body is not None else request.content,
    )
    values = {
        "X-Node-Id": tamper.node_header or NODE,
        "X-Node-Timestamp": timestamp,
        "X-Node-Signature": signature,
    }
    for name, value in values.items():
        if name != tamper.omit:
            request.headers[name] = value
    return request


def health_report(node: str = NODE) -> dict[str, Any]:
    return {
        "node_id": node,
        "manager_version": "0.1.0",
        "reported_at": "2024-05-01T12:00:00.123+02:00",
        "workloads": [{"name": "api", "status": "ready"}],
    }


@pytest.fixture(scope="module")
def node_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture(scope="module")
def served(node_key: Ed25519PrivateKey) -> Iterator[tuple[LocalBackend, ThreadedServer]]:
    # One server for the module: starting and stopping uvicorn costs ~0.2 s each.
    backend = LocalBackend(node_id=NODE, public_key=node_key.public_key())
    with backend.serve() as server:
        yield backend, server


@pytest.fixture
def backend(served: tuple[LocalBackend, ThreadedServer]) -> LocalBackend:
    served[0].reset()
    return served[0]


@pytest.fixture
def base_url(served: tuple[LocalBackend, ThreadedServer]) -> str:
    return served[1].url


@pytest.fixture
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(timeout=5.0) as c:
        yield c


class Call(Protocol):
    def __call__(self, method: str, path: str, **kwargs: Any) -> httpx.Response: ...


@pytest.fixture
def call(client: httpx.Client, base_url: str, node_key: Ed25519PrivateKey) -> Call:
    def do(method: str, path: str, **kwargs: Any) -> httpx.Response:
        return client.send(signed_request(base_url, method, path, node_key, **kwargs))

    return do


def only_request(backend: LocalBackend) -> RecordedRequest:
    # a streamed answer ("trickle", "huge") is recorded once its last byte is out: the
    # client may have read that byte first
    eventually_sync(lambda: bool(backend.requests), within=5.0)
    recorded = backend.requests
    assert len(recorded) == 1, recorded
    return recorded[0]


# ----------------------------------------------------------------------- accepted


def test_signed_get_of_desired_state_is_accepted(backend: LocalBackend, call: Call) -> None:
    revision = backend.set_desired([{"name": "api", "version": "1.4.2"}])

    response = call("GET", f"/v1/nodes/{NODE}/workloads")

    assert response.status_code == 200
    assert response.json() == {
        "revision": revision,
        "allow_empty": False,
        "workloads": [{"name": "api", "version": "1.4.2"}],
    }
    assert response.headers["etag"] == f'"{revision}"'
    recorded = only_request(backend)
    assert recorded.verified
    assert recorded.rejected_reason is None
    assert recorded.target == f"/v1/nodes/{NODE}/workloads"
    assert backend.rejected == []


def test_signed_post_of_health_report_is_accepted_and_recorded(
    backend: LocalBackend, call: Call
) -> None:
    report = health_report()

    response = call("POST", f"/v1/nodes/{NODE}/health", json_body=report)

    assert response.status_code in (202, 204)
    assert backend.wait_for_reports(1, timeout=2.0) == [report]
    recorded = only_request(backend)
    assert recorded.verified
    assert recorded.json == report
    assert backend.rejected == []


def test_timestamp_just_inside_the_skew_window_is_accepted(
    backend: LocalBackend, call: Call
) -> None:
    response = call("GET", f"/v1/nodes/{NODE}/workloads", tamper=Tamper(timestamp_offset=-290))

    assert response.status_code == 200
    assert backend.rejected == []


def test_percent_encoded_path_is_signed_as_sent(backend: LocalBackend, call: Call) -> None:
    response = call(
        "PUT",
        f"/v1/nodes/{NODE}/workloads/my%20app/version",
        json_body={"version": "2.0.0", "applied_at": APPLIED_AT},
    )

    assert response.status_code == 204
    assert backend.versions == [("my app", {"version": "2.0.0", "applied_at": APPLIED_AT})]
    assert only_request(backend).target == f"/v1/nodes/{NODE}/workloads/my%20app/version"


# ----------------------------------------------------------------------- rejected


@dataclass(frozen=True)
class Rejection:
    method: str
    path: str
    tamper: Tamper
    status: int
    reason: str
    params: dict[str, str] | None = None
    body: dict[str, Any] | None = None


HEALTH = f"/v1/nodes/{NODE}/health"
WORKLOADS = f"/v1/nodes/{NODE}/workloads"
MANIFEST = f"/v1/nodes/{NODE}/workloads/api/manifest"
VERSION = f"/v1/nodes/{NODE}/workloads/api/version"
VERSION_BODY = {"version": "1.4.2", "applied_at": APPLIED_AT}

REJECTIONS = {
    "missing node id": Rejection("GET", WORKLOADS, Tamper(omit="X-Node-Id"), 401, "X-Node-Id"),
    "missing timestamp": Rejection(
        "GET", WORKLOADS, Tamper(omit="X-Node-Timestamp"), 401, "X-Node-Timestamp"
    ),
    "missing signature": Rejection(
        "GET", WORKLOADS, Tamper(omit="X-Node-Signature"), 401, "X-Node-Signature"
    ),
    "signed by another key": Rejection(
        "GET", WORKLOADS, Tamper(other_key=True), 401, "does not verify"
    ),
    "signature not base64": Rejection(
        "GET", WORKLOADS, Tamper(signature="not base64!"), 401, "base64"
    ),
    "body changed after signing": Rejection(
        "POST",
        HEALTH,
        Tamper(sign_body=json.dumps(health_report()).encode()),
        401,
        "does not verify",
        body={**health_report(), "manager_version": "9.9.9"},
    ),
    "query string not covered": Rejection(
        "GET",
        MANIFEST,
        Tamper(sign_target=MANIFEST),
        401,
        "does not verify",
        params={"version": "1.4.2"},
    ),
    "method not covered": Rejection(
        "PUT", VERSION, Tamper(sign_method="POST"), 401, "does not verify", body=VERSION_BODY
    ),
    "decoded path signed": Rejection(
        "PUT",
        f"/v1/nodes/{NODE}/workloads/my%20app/version",
        Tamper(sign_target=f"/v1/nodes/{NODE}/workloads/my app/version"),
        401,
        "does not verify",
        body=VERSION_BODY,
    ),
    "timestamp too old": Rejection(
        "GET", WORKLOADS, Tamper(timestamp_offset=-301 - 5), 401, "skew"
    ),
    "timestamp in the future": Rejection(
        "GET", WORKLOADS, Tamper(timestamp_offset=301 + 5), 401, "skew"
    ),
    "timestamp not integer": Rejection(
        "GET", WORKLOADS, Tamper(timestamp="1714564800.5"), 401, "integer"
    ),
    "node header differs from path": Rejection(
        "GET", WORKLOADS, Tamper(node_header="n2"), 403, "n2"
    ),
    "path node differs from header": Rejection(
        "GET", "/v1/nodes/n2/workloads", Tamper(), 403, "path node"
    ),
    "node not the configured one": Rejection(
        "GET", "/v1/nodes/n2/workloads", Tamper(node_header="n2"), 403, "configured"
    ),
}


@pytest.mark.parametrize("case", REJECTIONS.values(), ids=REJECTIONS.keys())
def test_bad_request_is_rejected_and_recorded(
    backend: LocalBackend, call: Call, case: Rejection
) -> None:
    backend.set_manifest("api", "1.4.2", DEPLOYMENT)

    response = call(
        case.method, case.path, params=case.params, json_body=case.body, tamper=case.tamper
    )

    assert response.status_code == case.status
    assert case.reason in response.json()["error"]
    recorded = only_request(backend)
    assert recorded.status == case.status
    assert not recorded.verified
    assert recorded.rejected_reason is not None
    assert case.reason in recorded.rejected_reason
    assert backend.rejected == [recorded]
    assert backend.reports == []
    assert backend.versions == []


def test_unknown_route_is_404_and_recorded(backend: LocalBackend, call: Call) -> None:
    response = call("GET", f"/v1/nodes/{NODE}/nothing-here")

    assert response.status_code == 404
    recorded = only_request(backend)
    assert recorded.route is None
    assert recorded.verified  # correctly signed, merely lost
    assert recorded.rejected_reason is not None


def test_wrong_method_on_known_route_is_405(backend: LocalBackend, call: Call) -> None:
    response = call("POST", WORKLOADS, json_body={})

    assert response.status_code == 405
    assert response.headers["allow"] == "GET"
    assert only_request(backend).rejected


# ----------------------------------------------------------------- desired state


def test_etag_and_if_none_match(backend: LocalBackend, call: Call) -> None:
    backend.set_desired([{"name": "api", "version": "1.0.0"}])
    first = call("GET", WORKLOADS)
    etag = first.headers["etag"]

    unchanged = call("GET", WORKLOADS, headers={"If-None-Match": etag})
    weak = call("GET", WORKLOADS, headers={"If-None-Match": f"W/{etag}"})
    backend.set_desired([{"name": "api", "version": "1.1.0"}], allow_empty=True)
    changed = call("GET", WORKLOADS, headers={"If-None-Match": etag})
    backend.set_desired([], allow_empty=True, revision="pinned")
    pinned = call("GET", WORKLOADS)

    assert unchanged.status_code == 304
    assert unchanged.content == b""
    assert unchanged.headers["etag"] == etag
    assert weak.status_code == 304
    assert changed.status_code == 200
    assert changed.headers["etag"] != etag
    assert changed.json()["workloads"] == [{"name": "api", "version": "1.1.0"}]
    assert changed.json()["allow_empty"] is True
    assert pinned.headers["etag"] == '"pinned"'
    assert pinned.json()["revision"] == "pinned"
    assert backend.rejected == []


def test_manifest_lookup(backend: LocalBackend, call: Call) -> None:
    backend.set_manifest("api", "1.4.2", DEPLOYMENT)

    found = call("GET", MANIFEST, params={"version": "1.4.2"})
    unknown = call("GET", MANIFEST, params={"version": "0.0.1"})
    no_version = call("GET", MANIFEST)

    assert found.status_code == 200
    assert found.json() == DEPLOYMENT
    assert unknown.status_code == 404
    assert "error" in unknown.json()
    assert no_version.status_code == 400
    assert "version" in no_version.json()["error"]
    # An unknown version is a fair question; a missing parameter breaks the contract.
    assert [r.status for r in backend.rejected] == [400]


# ------------------------------------------------------------------- validation


VERSION_CASES = {
    "empty object": ({}, "version"),
    "empty version": ({"version": "", "applied_at": APPLIED_AT}, "version"),
    "numeric version": ({"version": 142, "applied_at": APPLIED_AT}, "version"),
    "missing applied_at": ({"version": "1.4.2"}, "applied_at"),
    "applied_at without offset": (
        {"version": "1.4.2", "applied_at": "2024-05-01T12:00:00"},
        "applied_at",
    ),
    "applied_at not a date": ({"version": "1.4.2", "applied_at": "yesterday"}, "applied_at"),
    "applied_at impossible date": (
        {"version": "1.4.2", "applied_at": "2024-13-01T00:00:00Z"},
        "applied_at",
    ),
    "body a list": (["1.4.2"], "body"),
}


@pytest.mark.parametrize(("body", "field"), VERSION_CASES.values(), ids=VERSION_CASES.keys())
def test_version_put_validation_names_the_field(
    backend: LocalBackend, call: Call, body: Any, field: str
) -> None:
    response = call("PUT", VERSION, json_body=body)

    assert response.status_code == 422
    assert response.json()["field"] == field
    assert field in response.json()["error"]
    recorded = only_request(backend)
    assert recorded.verified  # signed fine; the body is what broke the contract
    assert recorded.rejected_reason is not None and field in recorded.rejected_reason
    assert backend.versions == []


@pytest.mark.parametrize("applied_at", [APPLIED_AT, "2024-05-01T12:00:00.5+02:00"])
def test_valid_version_put_is_recorded(backend: LocalBackend, call: Call, applied_at: str) -> None:
    body = {"version": "1.4.2", "applied_at": applied_at}

    response = call("PUT", VERSION, json_body=body)

    assert response.status_code == 204
    assert backend.versions == [("api", body)]
    assert backend.rejected == []


def without(report: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k != key}


HEALTH_CASES = {
    "no node_id": (without(health_report(), "node_id"), "node_id"),
    "no manager_version": (without(health_report(), "manager_version"), "manager_version"),
    "no reported_at": (without(health_report(), "reported_at"), "reported_at"),
    "no workloads": (without(health_report(), "workloads"), "workloads"),
    "other node_id": (health_report(node="n2"), "node_id"),
    "bad reported_at": ({**health_report(), "reported_at": "now"}, "reported_at"),
    "workloads not a list": ({**health_report(), "workloads": {}}, "workloads"),
    "workload without status": (
        {**health_report(), "workloads": [{"name": "api"}]},
        "workloads[0].status",
    ),
}


@pytest.mark.parametrize(("body", "field"), HEALTH_CASES.values(), ids=HEALTH_CASES.keys())
def test_health_report_validation_names_the_field(
    backend: LocalBackend, call: Call, body: dict[str, Any], field: str
) -> None:
    response = call("POST", HEALTH, json_body=body)

    assert response.status_code == 422
    assert response.json()["field"] == field
    assert field in response.json()["error"]
    assert backend.reports == []


def test_health_report_must_be_sent_as_json(backend: LocalBackend, call: Call) -> None:
    response = call(
        "POST",
        HEALTH,
        content=json.dumps(health_report()).encode(),
        headers={"Content-Type": "text/plain"},
    )

    assert response.status_code == 415
    assert only_request(backend).verified
    assert backend.reports == []


# ------------------------------------------------------------------ failure modes


@pytest.mark.parametrize("status", [500, 503])
def test_fail_once_then_recover(backend: LocalBackend, call: Call, status: int) -> None:
    backend.fail("workloads", "500" if status == 500 else "503")

    failed = call("GET", WORKLOADS)
    recovered = call("GET", WORKLOADS)

    assert failed.status_code == status
    assert "error" in failed.json()
    assert recovered.status_code == 200
    assert [r.injected_failure for r in backend.requests] == [str(status), None]
    assert backend.rejected == []


def test_fail_until_cleared_only_hits_its_route(backend: LocalBackend, call: Call) -> None:
    backend.fail("health", "503", times=None)

    statuses = [call("POST", HEALTH, json_body=health_report()).status_code for _ in range(3)]
    other = call("GET", WORKLOADS)
    backend.clear_failures()
    after = call("POST", HEALTH, json_body=health_report())

    assert statuses == [503, 503, 503]
    assert other.status_code == 200
    assert after.status_code in (202, 204)
    assert len(backend.reports) == 1


def test_garbage_desired_state_is_wrong_shape(backend: LocalBackend, call: Call) -> None:
    backend.fail("workloads", "garbage")

    response = call("GET", WORKLOADS)

    assert response.status_code == 200
    assert response.json() == {"workloads": "nope"}


GARBAGE_CASES = {
    "manifest": ("GET", MANIFEST, {"version": "1.4.2"}, None),
    "health": ("POST", HEALTH, None, health_report()),
    "version": ("PUT", VERSION, None, VERSION_BODY),
}


@pytest.mark.parametrize("route", GARBAGE_CASES.keys())
def test_garbage_is_not_json(backend: LocalBackend, call: Call, route: Route) -> None:
    method, path, params, body = GARBAGE_CASES[route]
    backend.set_manifest("api", "1.4.2", DEPLOYMENT)
    backend.fail(route, "garbage")

    response = call(method, path, params=params, json_body=body)

    assert response.status_code == 200
    assert response.text.startswith("<html>")
    with pytest.raises(ValueError):
        response.json()
    # The client never got a real answer, so nothing may count as accepted.
    assert backend.reports == []
    assert backend.versions == []


def test_timeout_outlasts_the_client(
    backend: LocalBackend, base_url: str, node_key: Ed25519PrivateKey
) -> None:
    backend.fail("health", "timeout")  # default delay: 30 s
    started = time.monotonic()

    with httpx.Client(timeout=0.3) as short, pytest.raises(httpx.ReadTimeout):
        short.send(signed_request(base_url, "POST", HEALTH, node_key, json_body=health_report()))

    recorded = backend.wait_for_requests(1, timeout=2.0)
    assert time.monotonic() - started < 3.0
    assert recorded[0].status == STATUS_CLIENT_CLOSED
    assert recorded[0].injected_failure == "timeout"
    assert backend.reports == []


def test_a_request_left_over_from_before_a_reset_is_not_recorded_after_it(
    backend: LocalBackend, base_url: str, node_key: Ed25519PrivateKey
) -> None:
    """A module-scoped backend serves many tests: a stalled request of one test that ends
    after the next test's reset must not show up among that test's requests."""
    backend.fail("health", "timeout", delay=30)
    with httpx.Client(timeout=5.0) as client:
        request = signed_request(base_url, "POST", HEALTH, node_key, json_body=health_report())
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.send, request)
            backend.wait_for(lambda: backend.stalled() == 1, 5.0)
            backend.reset()  # the next test begins; then the stalled request ends
            backend.release_stalled()
            pending.result(timeout=5.0)
    backend.wait_for(lambda: backend.stalled() == 0, 5.0)
    assert backend.requests == []


def test_short_timeout_delay_still_answers(backend: LocalBackend, call: Call) -> None:
    backend.fail("workloads", "timeout", delay=0.2)
    started = time.monotonic()

    response = call("GET", WORKLOADS)

    assert response.status_code == 200
    assert time.monotonic() - started >= 0.2
    assert only_request(backend).injected_failure == "timeout"


def test_fail_rejects_unknown_route_and_mode(backend: LocalBackend) -> None:
    with pytest.raises(ValueError):
        backend.fail("nodes", "500")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        backend.fail("health", "418")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="retry_after"):
        backend.fail("health", "500", retry_after="1")
    with pytest.raises(ValueError, match="interval"):
        backend.fail("health", "trickle", interval=0)


@pytest.mark.parametrize("mode", ["429", "503"])
def test_retry_after_is_sent_when_asked(backend: LocalBackend, call: Call, mode: str) -> None:
    backend.fail("workloads", "429" if mode == "429" else "503", retry_after="7")

    response = call("GET", WORKLOADS)

    assert response.status_code == int(mode)
    assert response.headers["retry-after"] == "7"


def test_trickle_sends_a_good_answer_one_byte_at_a_time(backend: LocalBackend, call: Call) -> None:
    backend.fail("health", "trickle", interval=0.02)
    started = time.monotonic()

    response = call("POST", HEALTH, json_body=health_report())

    # a patient client gets a whole 2xx answer, late; the report itself was not stored
    assert response.status_code == 200
    assert response.json() == {"accepted": True}
    assert int(response.headers["content-length"]) == len(response.content)
    assert time.monotonic() - started >= 0.02 * len(response.content)
    assert only_request(backend).injected_failure == "trickle"
    assert backend.reports == []


def test_trickle_is_recorded_as_abandoned_when_the_client_hangs_up(
    backend: LocalBackend, base_url: str, node_key: Ed25519PrivateKey
) -> None:
    revision = backend.set_desired([{"name": "api", "version": "1.4.2"}])
    backend.fail("workloads", "trickle", interval=0.05)
    request = signed_request(base_url, "GET", WORKLOADS, node_key)

    with httpx.Client(timeout=5.0) as client:
        response = client.send(request, stream=True)
        # the headers come at once: a per-read timeout never fires
        assert response.status_code == 200
        assert response.headers["etag"] == f'"{revision}"'
        first = next(response.iter_raw(1))
        response.close()

    assert first == b"{"
    (recorded,) = backend.wait_for_requests(1, timeout=5.0)
    assert recorded.status == STATUS_CLIENT_CLOSED
    assert recorded.injected_failure == "trickle"


def test_huge_streams_a_good_answer_padded_past_the_size(backend: LocalBackend, call: Call) -> None:
    revision = backend.set_desired([{"name": "api", "version": "1.4.2"}])
    backend.fail("workloads", "huge", size=1024 * 1024)

    response = call("GET", WORKLOADS)

    assert response.status_code == 200
    assert "content-length" not in response.headers  # only counting tells the size
    assert len(response.content) == 1024 * 1024
    # JSON whitespace: a client without a bound would take it as the desired state
    assert response.json()["revision"] == revision
    assert only_request(backend).injected_failure == "huge"


def test_huge_answer_to_a_write_stores_nothing(backend: LocalBackend, call: Call) -> None:
    backend.fail("version", "huge", size=200_000)

    response = call("PUT", VERSION, json_body=VERSION_BODY)

    assert response.status_code == 200
    assert len(response.content) == 200_000
    assert backend.versions == []


REDIRECT_CASES = {
    "workloads": ("GET", WORKLOADS, None, 302, 200),
    "health": ("POST", HEALTH, health_report(), 307, 202),
    "version": ("PUT", VERSION, VERSION_BODY, 307, 204),
}


@pytest.mark.parametrize("route", REDIRECT_CASES.keys())
def test_redirect_points_at_itself_where_the_request_would_be_accepted(
    backend: LocalBackend, base_url: str, node_key: Ed25519PrivateKey, route: Route
) -> None:
    method, path, body, redirect_status, final_status = REDIRECT_CASES[route]
    backend.fail(route, "redirect", times=None)
    request = signed_request(base_url, method, path, node_key, json_body=body)

    with httpx.Client(timeout=5.0) as client:
        refused = client.send(request)
        followed = client.send(request, follow_redirects=True)

    assert refused.status_code == redirect_status
    port = base_url.rsplit(":", 1)[1]
    assert refused.headers["location"] == f"http://localhost:{port}{path}"
    # 307 keeps the method and the body, and the signature covers neither host nor scheme
    assert followed.status_code == final_status
    assert [r.status for r in backend.requests] == [redirect_status, redirect_status, final_status]
    assert [r.injected_failure for r in backend.requests] == ["redirect", "redirect", None]
    assert backend.rejected == []
    if route == "health":
        assert backend.reports == [health_report()]
    if route == "version":
        assert [name for name, _ in backend.versions] == ["api"]


# ----------------------------------------------------------------------- helpers


def test_wait_for_reports_times_out_with_a_summary(backend: LocalBackend, call: Call) -> None:
    call("GET", WORKLOADS, tamper=Tamper(other_key=True))

    with pytest.raises(TimeoutError, match="does not verify"):
        backend.wait_for_reports(1, timeout=0.1)


@pytest.mark.asyncio
async def test_await_reports(
    backend: LocalBackend, base_url: str, node_key: Ed25519PrivateKey
) -> None:
    async with httpx.AsyncClient(timeout=5.0) as client:
        for _ in range(2):
            response = await client.send(
                signed_request(base_url, "POST", HEALTH, node_key, json_body=health_report())
            )
            assert response.status_code in (202, 204)

    reports = await backend.await_reports(2, timeout=2.0)

    assert reports == [health_report(), health_report()]


# ---------------------------------------------------------------------- steering


def test_steer_sends_the_interval_on_good_answers_only(backend: LocalBackend, call: Call) -> None:
    backend.set_desired([{"name": "api", "version": "1.0.0"}])
    backend.steer("health", 120)
    backend.steer("workloads", 900.5)

    report = call("POST", f"/v1/nodes/{NODE}/health", json_body=health_report())
    first = call("GET", WORKLOADS)
    unchanged = call("GET", WORKLOADS, headers={"If-None-Match": first.headers["etag"]})
    backend.fail("health", "429", retry_after="30")
    refused = call("POST", f"/v1/nodes/{NODE}/health", json_body=health_report())
    backend.steer("health", None)
    plain = call("POST", f"/v1/nodes/{NODE}/health", json_body=health_report())

    assert report.headers["x-report-interval-seconds"] == "120"
    assert first.headers["x-sync-interval-seconds"] == "900.5"
    assert unchanged.status_code == 304
    assert unchanged.headers["x-sync-interval-seconds"] == "900.5"
    assert refused.status_code == 429 and "x-report-interval-seconds" not in refused.headers
    assert "x-report-interval-seconds" not in plain.headers
    with pytest.raises(ValueError, match="carries no interval"):
        backend.steer("version", 10)


def test_the_fleet_formula_of_the_contract() -> None:
    """docs/backend-api.md's worked example: 15,000 nodes, 100 reports a second."""
    from standins.backend import after_outage, fleet_interval, stagger

    assert fleet_interval(nodes=15_000, rate=100, configured=60) == 150.0
    assert fleet_interval(nodes=150, rate=100, configured=60) == 60.0  # never below
    place = stagger("node-3f2a9c0d11e4b7a8", 150.0)
    assert 0 <= place < 150 and place == stagger("node-3f2a9c0d11e4b7a8", 150.0)
    # spread: 15,000 ids fill the interval about evenly (no second holds 3x its share)
    seconds = [int(stagger(f"node-{n}", 150.0)) for n in range(15_000)]
    assert max(seconds.count(s) for s in range(150)) < 3 * 15_000 / 150
    # back after 30 minutes down: 2.5x at once, 1.75x halfway through a 10-minute ramp
    assert after_outage(150.0, down_for=1800, since_back=0, ramp=600) == 375.0
    assert after_outage(150.0, down_for=1800, since_back=300, ramp=600) == 262.5
    assert after_outage(150.0, down_for=1800, since_back=600, ramp=600) == 150.0


def test_steer_fleet_serves_the_formulas_interval(backend: LocalBackend, call: Call) -> None:
    assert backend.steer_fleet(nodes=15_000, rate=100, configured=60) == 150.0
    report = call("POST", f"/v1/nodes/{NODE}/health", json_body=health_report())
    assert report.headers["x-report-interval-seconds"] == "150"
