"""A local stand-in for the node-system backend, for the tests and the benchmarks (never shipped).

It enforces the signed node API contract (Ed25519 request signing, routes, body shapes),
records every request including rejected ones, and can be told to fail a route, so a test
against it proves the manager speaks the contract. Serve it with `backend.serve()`.

Failure modes (`fail`): "500", "503" and "429" answer that status (with `Retry-After` when
asked); "timeout" holds the request without answering; "garbage" answers 200 with a body
of the wrong shape; "trickle" sends the headers of a good answer, then its body one byte
every `interval` seconds; "huge" streams a good answer padded with JSON whitespace to
`size` bytes, without a Content-Length; "redirect" answers 302 (GET) or 307 (PUT, POST)
to the same target on `localhost` instead of `127.0.0.1`, where the request would be
accepted. A failed request is never carried out: nothing is stored.

Steering (`steer`): the interval the backend asks a node to keep, sent on the report's 2xx
(`X-Report-Interval-Seconds`) and the desired state's 200 and 304
(`X-Sync-Interval-Seconds`), as docs/backend-api.md "The backend steers" defines them;
`fleet_interval`, `stagger` and `after_outage` are that page's formula for spreading a fleet,
which a test backend can serve (`steer_fleet`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import hashlib
import json
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import parse_qs, unquote

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from app.domain.desired_trust import SIGNATURE_HEADER, signed_bytes
from app.domain.steering import REPORT_INTERVAL_HEADER, SYNC_INTERVAL_HEADER
from standins.servers import ThreadedServer

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

Route = Literal["workloads", "manifest", "version", "health"]
FailureMode = Literal["500", "503", "429", "timeout", "garbage", "trickle", "huge", "redirect"]
# The development key the local backend signs desired states with (`development_signer`);
# its public half is DESIRED_STATE_PUBLIC_KEYS in .env.example. A manager in production
# refuses to trust it (app/settings.py).
DEVELOPMENT_SEED = hashlib.sha256(b"workload-manager development desired-state key").digest()


def development_signer() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(DEVELOPMENT_SEED)


# what a signing backend can be made to serve instead of its honest answer (`forge`)
Forgery = Literal["unsigned", "tampered", "other-node", "replay", "wrong-digest"]
FORGERIES: tuple[Forgery, ...] = ("unsigned", "tampered", "other-node", "replay", "wrong-digest")

ROUTES: tuple[Route, ...] = ("workloads", "manifest", "version", "health")
# the routes whose good answers may carry the interval the backend asks for, and its header
STEERED: dict[Route, str] = {"health": REPORT_INTERVAL_HEADER, "workloads": SYNC_INTERVAL_HEADER}
FAILURE_MODES: tuple[FailureMode, ...] = (
    "500",
    "503",
    "429",
    "timeout",
    "garbage",
    "trickle",
    "huge",
    "redirect",
)
# the modes that answer with a status and a small error body
_STATUS_MODES: tuple[FailureMode, ...] = ("500", "503", "429")

HEADER_NODE_ID = "x-node-id"
HEADER_TIMESTAMP = "x-node-timestamp"
HEADER_SIGNATURE = "x-node-signature"

# Recorded as the status of a request whose client gave up while a "timeout"
# failure was stalling it, or a "trickle" or "huge" answer was still being sent
# (nginx's convention); no complete answer ever reached the client.
STATUS_CLIENT_CLOSED = 499

# A redirect points at the same server under this name, which is exempt from "redirect"
# failures, so a client that followed it would be answered (and its request carried out).
REDIRECT_HOST = "localhost"
# what a "huge" answer grows to unless told otherwise: past any sane bound
HUGE_BYTES = 64 * 1024 * 1024
_HUGE_CHUNK = 64 * 1024
# the body of a "trickle" or "huge" answer to a PUT or POST (2xx with any body is success)
_ACCEPTED = b'{"accepted": true}'

_TIMESTAMP_RE = re.compile(r"[0-9]{1,12}")
# RFC 3339 section 5.6 date-time: `T` separator and an explicit offset are mandatory,
# which datetime.fromisoformat alone does not insist on.
_RFC3339_RE = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2})"
)
_GARBAGE_HTML = b"<html><body>502 Bad Gateway (injected garbage)</body></html>"


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the backend saw it, and what it answered."""

    method: str
    path: str  # decoded path, for readable assertions
    target: str  # raw path plus `?query`, exactly what the signature must cover
    headers: dict[str, str]  # lower-cased names; repeated headers joined with ", "
    body: bytes
    json: Any  # parsed body, or None when empty or not JSON
    status: int
    verified: bool  # every signing check passed (even if the request failed later)
    rejected_reason: str | None  # set when the request broke the contract
    route: Route | None = None
    injected_failure: FailureMode | None = None
    received_at: float = 0.0

    @property
    def rejected(self) -> bool:
        return self.rejected_reason is not None


@dataclass
class _Failure:
    mode: FailureMode
    remaining: int | None
    delay: float
    interval: float = 0.5
    size: int = HUGE_BYTES
    retry_after: str | None = None


@dataclass
class _Reply:
    status: int
    body: bytes = b""
    content_type: str | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)
    rejected_reason: str | None = None


class _ContractError(Exception):
    """A request broke the contract; carries the status and the reason to report."""

    def __init__(self, status: int, reason: str, field_name: str | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.field_name = field_name

    def reply(self) -> _Reply:
        payload: dict[str, str] = {"error": self.reason}
        if self.field_name is not None:
            payload["field"] = self.field_name
        return _json_reply(self.status, payload, rejected_reason=self.reason)


def _json_reply(status: int, payload: Any, *, rejected_reason: str | None = None) -> _Reply:
    return _Reply(
        status=status,
        body=json.dumps(payload).encode(),
        content_type="application/json",
        rejected_reason=rejected_reason,
    )


def _is_rfc3339(value: object) -> bool:
    if not isinstance(value, str) or _RFC3339_RE.fullmatch(value) is None:
        return False
    try:
        datetime.fromisoformat(value.upper())
    except ValueError:  # e.g. month 13 passes the regex
        return False
    return True


def _etag_matches(if_none_match: str, etag: str) -> bool:
    candidates = [c.strip() for c in if_none_match.split(",")]
    # Weak comparison (RFC 9110 13.1.2) is what If-None-Match uses.
    return any(c == "*" or c.removeprefix("W/") == etag for c in candidates)


class LocalBackend:
    """In-process node-system backend that verifies signatures and records traffic.

    All state is guarded by one lock: tests read and configure it from their own
    thread while the server thread handles requests.
    """

    def __init__(
        self,
        node_id: str,
        public_key: Ed25519PublicKey,
        *,
        max_skew: float = 300.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node_id = node_id
        self.public_key = public_key
        self.max_skew = max_skew
        self.clock = clock
        self._lock = threading.Lock()
        self._requests: list[RecordedRequest] = []
        self._reports: list[Any] = []
        self._versions: list[tuple[str, dict[str, Any]]] = []
        self._failures: dict[Route, _Failure] = {}
        self._manifests: dict[tuple[str, str], dict[str, Any]] = {}
        self._revision_counter = 0
        self._revision = "r0"
        self._allow_empty = False
        self._desired: list[dict[str, Any]] = []
        # the desired state carries `reported_version` (a backend that predates it: off)
        self.serve_reported = True
        self._recorded: dict[str, str] = {}  # name -> the last version PUT
        # Bumped to wake requests stalled by a "timeout" failure, so that stopping
        # the server never waits out the full delay.
        self._release_generation = 0
        # Bumped by reset(): a request that began before it (a stalled one of the test
        # before) neither changes nor shows in what the next test sees.
        self._epoch = 0
        self._stalled = 0  # requests held by a "timeout" failure now
        # signing the desired state (docs/backend-api.md): off until a key is set; the
        # serial moves on whenever the state served changes
        self.signing_key: Ed25519PrivateKey | None = None
        self._serial = 0
        self._last_signed: str | None = None
        self._issued_at = ""  # of the serial served: the same serial is the same bytes
        self._signed_first: tuple[bytes, str] | None = None  # the first answer signed
        self._forgery: Forgery | None = None
        # the interval header's value per steered route (absent: not sent)
        self._steering: dict[Route, str] = {}

    # ----------------------------------------------------------------- test-facing API

    @property
    def app(self) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        """The ASGI application (a plain coroutine function, so uvicorn detects ASGI 3)."""

        async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
            await self._handle(scope, receive, send)

        return asgi

    @contextmanager
    def serve(self) -> Iterator[ThreadedServer]:
        server = ThreadedServer(self.app).start()
        try:
            yield server
        finally:
            self.release_stalled()
            server.stop()

    def set_desired(
        self,
        workloads: Sequence[Mapping[str, Any]],
        *,
        allow_empty: bool = False,
        revision: str | None = None,
    ) -> str:
        """Replace the desired state; returns the revision now served."""
        with self._lock:
            if revision is None:
                self._revision_counter += 1
                revision = f"r{self._revision_counter}"
            self._revision = revision
            self._allow_empty = allow_empty
            self._desired = [copy.deepcopy(dict(w)) for w in workloads]
            return revision

    def forge(self, forgery: Forgery | None) -> None:
        """Serve a forged desired state from now on (None: honest again): `unsigned` (no
        signature header), `tampered` (the signed bytes changed after signing),
        `other-node` (signed for another node), `replay` (the first answer signed, an older
        serial), `wrong-digest` (manifests whose bytes are not the digest signed). A forged
        answer is never a 304."""
        if forgery is not None and forgery not in FORGERIES:
            raise ValueError(f"unknown forgery {forgery!r}; expected one of {FORGERIES}")
        with self._lock:
            self._forgery = forgery

    def set_manifest(self, name: str, version: str, manifest: Mapping[str, Any]) -> None:
        with self._lock:
            self._manifests[(name, version)] = copy.deepcopy(dict(manifest))

    def fail(
        self,
        route: Route,
        mode: FailureMode,
        *,
        times: int | None = 1,
        delay: float = 30.0,
        interval: float = 0.5,
        size: int = HUGE_BYTES,
        retry_after: str | None = None,
    ) -> None:
        """Make `route` fail in `mode` for the next `times` requests (None: until cleared).

        `delay`: how long "timeout" holds a request; `interval`: the seconds between two
        bytes of a "trickle"; `size`: the bytes of a "huge" answer; `retry_after`: the
        `Retry-After` value sent with a "429" or "503" (none when None).

        Failures apply only to correctly signed requests on a known route, as a
        real backend would authenticate first.
        """
        if route not in ROUTES:
            raise ValueError(f"unknown route {route!r}; expected one of {ROUTES}")
        if mode not in FAILURE_MODES:
            raise ValueError(f"unknown failure mode {mode!r}; expected one of {FAILURE_MODES}")
        if times is not None and times < 1:
            raise ValueError("times must be >= 1 or None")
        if interval <= 0 or size < 1:
            raise ValueError("interval must be > 0 and size >= 1")
        if retry_after is not None and mode not in ("429", "503"):
            raise ValueError("retry_after goes with the 429 and 503 modes only")
        with self._lock:
            self._failures[route] = _Failure(
                mode=mode,
                remaining=times,
                delay=delay,
                interval=interval,
                size=size,
                retry_after=retry_after,
            )

    def steer(self, route: Route, interval: float | str | None) -> None:
        """Ask for `interval` seconds on `route`'s good answers from now on ("health": the
        report's 2xx, `X-Report-Interval-Seconds`; "workloads": the desired state's 200
        and 304, `X-Sync-Interval-Seconds`); None: send no header. A string is sent as it
        is (a malformed value, for the tests)."""
        if route not in STEERED:
            raise ValueError(f"route {route!r} carries no interval; expected one of {STEERED}")
        with self._lock:
            if interval is None:
                self._steering.pop(route, None)
            else:
                self._steering[route] = (
                    interval if isinstance(interval, str) else f"{float(interval):g}"
                )

    def steer_fleet(
        self, *, nodes: int, rate: float, configured: float = 60.0, route: Route = "health"
    ) -> float:
        """Serve `route` the interval that spreads `nodes` nodes at `rate` requests a
        second (docs/backend-api.md, `fleet_interval`); returns it."""
        interval = fleet_interval(nodes=nodes, rate=rate, configured=configured)
        self.steer(route, interval)
        return interval

    def clear_failures(self) -> None:
        with self._lock:
            self._failures.clear()
            self._release_generation += 1

    def release_stalled(self) -> None:
        """Let requests held by a "timeout" failure answer now, and end "trickle" answers."""
        with self._lock:
            self._release_generation += 1

    def record_version(self, name: str, version: str) -> None:
        """What the backend believes runs (served as `reported_version`), set by a test."""
        with self._lock:
            self._recorded[name] = version

    def clear_records(self) -> None:
        with self._lock:
            self._requests.clear()
            self._reports.clear()
            self._versions.clear()

    def reset(self) -> None:
        """Back to a fresh backend (same node and key), so one server can serve many tests."""
        with self._lock:
            self._requests.clear()
            self._reports.clear()
            self._versions.clear()
            self._failures.clear()
            self._manifests.clear()
            self._revision_counter = 0
            self._revision = "r0"
            self._allow_empty = False
            self._desired = []
            self._recorded.clear()
            self._steering.clear()
            self.serve_reported = True
            # the serial goes on (a node's serials only go forward); the forgeries end
            self._forgery = None
            self._signed_first = None
            self._release_generation += 1
            self._epoch += 1

    def stalled(self) -> int:
        """How many requests a "timeout" failure holds now."""
        with self._lock:
            return self._stalled

    @property
    def revision(self) -> str:
        with self._lock:
            return self._revision

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    @property
    def rejected(self) -> list[RecordedRequest]:
        with self._lock:
            return [r for r in self._requests if r.rejected_reason is not None]

    @property
    def reports(self) -> list[Any]:
        with self._lock:
            return copy.deepcopy(self._reports)

    @property
    def versions(self) -> list[tuple[str, dict[str, Any]]]:
        with self._lock:
            return copy.deepcopy(self._versions)

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Block until `predicate()` is true; raise TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"condition not met within {timeout} s; {self._summary()}")
            time.sleep(0.01)

    # The `timeout` parameters mirror the blocking helpers (ASYNC109 would rather see
    # asyncio.timeout), and the TimeoutError they raise carries a traffic summary.
    async def await_for(
        self,
        predicate: Callable[[], bool],
        timeout: float = 10.0,  # noqa: ASYNC109
    ) -> None:
        """Async twin of `wait_for`, for tests running on an event loop."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if predicate():
                return
            if loop.time() >= deadline:
                raise TimeoutError(f"condition not met within {timeout} s; {self._summary()}")
            await asyncio.sleep(0.01)

    def wait_for_reports(self, n: int, timeout: float = 10.0) -> list[Any]:
        self.wait_for(lambda: self._count_reports() >= n, timeout)
        return self.reports

    async def await_reports(self, n: int, timeout: float = 10.0) -> list[Any]:  # noqa: ASYNC109
        await self.await_for(lambda: self._count_reports() >= n, timeout)
        return self.reports

    def wait_for_requests(self, n: int, timeout: float = 10.0) -> list[RecordedRequest]:
        self.wait_for(lambda: len(self.requests) >= n, timeout)
        return self.requests

    async def await_requests(
        self,
        n: int,
        timeout: float = 10.0,  # noqa: ASYNC109
    ) -> list[RecordedRequest]:
        await self.await_for(lambda: len(self.requests) >= n, timeout)
        return self.requests

    # ----------------------------------------------------------------------- internals

    def _count_reports(self) -> int:
        with self._lock:
            return len(self._reports)

    def _summary(self) -> str:
        with self._lock:
            seen = [
                f"{r.method} {r.target} -> {r.status}"
                + (f" ({r.rejected_reason})" if r.rejected_reason else "")
                for r in self._requests
            ]
            return f"{len(self._reports)} report(s); requests: {seen}"

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            # Only plain HTTP is part of the contract (servers.py runs with lifespan off).
            return
        body = await _read_body(receive)
        method: str = scope["method"].upper()
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        query: bytes = scope.get("query_string", b"")
        target = raw_path.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
        headers = _collect_headers(scope)
        parsed_json = _try_json(body)
        received_at = self.clock()
        with self._lock:
            epoch = self._epoch

        route, params, reply = self._route(method, raw_path)
        # Checked even when the route is already refused, so the record says whether
        # the signing itself was right.
        auth_error = self._check_signing(
            method, target, body, headers, path_node=params.get("node")
        )
        verified = auth_error is None
        if reply is None and auth_error is not None:
            reply = auth_error.reply()

        failure: _Failure | None = None
        streamed: _Reply | None = None  # a good answer, sent slowly or padded
        if reply is None:
            assert route is not None
            failure = self._take_failure(route, redirected=_host_name(headers) == REDIRECT_HOST)
            if failure is not None and failure.mode == "timeout":
                if await self._stall(receive, failure.delay):
                    reply = _Reply(status=STATUS_CLIENT_CLOSED)
            elif failure is not None and failure.mode in ("trickle", "huge"):
                streamed = self._good_answer(route, params, query, headers)
            elif failure is not None and failure.mode == "redirect":
                reply = _redirect_reply(method, scope, target)
            elif failure is not None:
                reply = _failure_reply(route, failure)

        if streamed is not None:
            assert failure is not None
            sender = _trickle if failure.mode == "trickle" else _pad
            hung_up = await sender(send, receive, streamed, failure, self._generation)
            reply = _Reply(status=STATUS_CLIENT_CLOSED) if hung_up else streamed

        if reply is None and not self._current(epoch):
            reply = _Reply(status=503)  # began before a reset: changes nothing now
        if reply is None:
            assert route is not None
            try:
                reply = self._dispatch(route, params, query, headers, body, parsed_json)
            except _ContractError as exc:
                reply = exc.reply()

        if route in STEERED and reply.status in (200, 202, 204, 304):
            with self._lock:
                asked = self._steering.get(route)
            if asked is not None and failure is None:
                reply.headers.append((STEERED[route], asked))
        self._record(
            epoch,
            RecordedRequest(
                method=method,
                path=scope["path"],
                target=target,
                headers={k: ", ".join(v) for k, v in headers.items()},
                body=body,
                json=parsed_json,
                status=reply.status,
                verified=verified,
                rejected_reason=reply.rejected_reason,
                route=route,
                injected_failure=failure.mode if failure is not None else None,
                received_at=received_at,
            ),
        )
        if reply.status != STATUS_CLIENT_CLOSED and streamed is None:
            await _send_reply(send, reply)

    def _current(self, epoch: int) -> bool:
        with self._lock:
            return epoch == self._epoch

    def _record(self, epoch: int, request: RecordedRequest) -> None:
        with self._lock:
            if epoch == self._epoch:
                self._requests.append(request)

    def _route(
        self, method: str, raw_path: bytes
    ) -> tuple[Route | None, dict[str, str], _Reply | None]:
        # Split before decoding so an encoded "/" (%2F) stays inside its segment.
        parts = [unquote(p) for p in raw_path.decode("latin-1").split("/")]
        found: tuple[Route, dict[str, str], str] | None
        match parts:
            case ["", "v1", "nodes", node, "workloads"]:
                found = ("workloads", {"node": node}, "GET")
            case ["", "v1", "nodes", node, "workloads", name, "manifest"]:
                found = ("manifest", {"node": node, "name": name}, "GET")
            case ["", "v1", "nodes", node, "workloads", name, "version"]:
                found = ("version", {"node": node, "name": name}, "PUT")
            case ["", "v1", "nodes", node, "health"]:
                found = ("health", {"node": node}, "POST")
            case _:
                found = None
        if found is None or not all(found[1].values()):
            reason = f"no route for {method} {raw_path.decode('latin-1')}"
            return None, {}, _json_reply(404, {"error": reason}, rejected_reason=reason)
        route, params, allowed = found
        if method != allowed:
            reason = f"method {method} not allowed on {route} route (use {allowed})"
            reply = _json_reply(405, {"error": reason}, rejected_reason=reason)
            reply.headers.append(("allow", allowed))
            return route, params, reply
        return route, params, None

    def _check_signing(
        self,
        method: str,
        target: str,
        body: bytes,
        headers: Mapping[str, list[str]],
        *,
        path_node: str | None,
    ) -> _ContractError | None:
        try:
            self._authenticate(method, target, body, headers, path_node=path_node)
        except _ContractError as exc:
            return exc
        return None

    def _authenticate(
        self,
        method: str,
        target: str,
        body: bytes,
        headers: Mapping[str, list[str]],
        *,
        path_node: str | None,
    ) -> None:
        values: dict[str, str] = {}
        for name, display in (
            (HEADER_NODE_ID, "X-Node-Id"),
            (HEADER_TIMESTAMP, "X-Node-Timestamp"),
            (HEADER_SIGNATURE, "X-Node-Signature"),
        ):
            got = headers.get(name, [])
            if not got:
                raise _ContractError(401, f"missing {display} header")
            if len(got) > 1:
                raise _ContractError(401, f"{display} header sent {len(got)} times")
            values[name] = got[0]

        # The node id picks the key, so an unknown node is "forbidden", not "unauthenticated".
        node = values[HEADER_NODE_ID]
        if node != self.node_id:
            raise _ContractError(403, f"X-Node-Id {node!r} is not the configured node")
        if path_node is not None and path_node != node:
            raise _ContractError(403, f"X-Node-Id {node!r} does not match path node {path_node!r}")

        timestamp = values[HEADER_TIMESTAMP]
        if _TIMESTAMP_RE.fullmatch(timestamp) is None:
            raise _ContractError(401, "X-Node-Timestamp is not integer unix seconds")
        skew = abs(self.clock() - int(timestamp))
        if skew > self.max_skew:
            raise _ContractError(
                401, f"X-Node-Timestamp skew {skew:.0f} s exceeds {self.max_skew:.0f} s"
            )

        try:
            signature = base64.b64decode(values[HEADER_SIGNATURE], validate=True)
        except (binascii.Error, ValueError):
            raise _ContractError(401, "X-Node-Signature is not standard base64") from None
        if len(signature) != 64:
            raise _ContractError(401, "X-Node-Signature is not a 64-byte Ed25519 signature")
        message = f"{method}\n{target}\n{timestamp}\n{hashlib.sha256(body).hexdigest()}"
        try:
            self.public_key.verify(signature, message.encode("utf-8"))
        except InvalidSignature:
            raise _ContractError(
                401, "X-Node-Signature does not verify over method, target, timestamp and body"
            ) from None

    def _take_failure(self, route: Route, *, redirected: bool) -> _Failure | None:
        with self._lock:
            failure = self._failures.get(route)
            if failure is None or (redirected and failure.mode == "redirect"):
                return None
            if failure.remaining is not None:
                failure.remaining -= 1
                if failure.remaining <= 0:
                    del self._failures[route]
            return failure

    def _generation(self) -> int:
        with self._lock:
            return self._release_generation

    async def _stall(self, receive: Receive, delay: float) -> bool:
        """Hold the request for `delay` s; True if the client hung up meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + delay
        generation = self._generation()
        # The body is fully read, so the next receive() only returns on disconnect.
        disconnect: asyncio.Future[Message] = asyncio.ensure_future(receive())
        with self._lock:
            self._stalled += 1
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or self._generation() != generation:
                    return False
                # Short slices so release_stalled() from another thread is noticed.
                done, _ = await asyncio.wait({disconnect}, timeout=min(0.05, remaining))
                if done:
                    if disconnect.result().get("type") == "http.disconnect":
                        return True
                    # Anything else is not a hang-up; keep stalling without re-reading.
                    disconnect = loop.create_future()
        finally:
            with self._lock:
                self._stalled -= 1
            if not disconnect.done():
                disconnect.cancel()

    def _good_answer(
        self,
        route: Route,
        params: Mapping[str, str],
        query: bytes,
        headers: Mapping[str, list[str]],
    ) -> _Reply:
        """What a good answer would be, without carrying out a PUT or POST: the GETs have
        no side effects, the writes get a 200 with a small body instead of being stored."""
        if route in ("version", "health"):
            return _Reply(status=200, body=_ACCEPTED, content_type="application/json")
        try:
            if route == "workloads":
                # unconditional, so there is a body to send even to an If-None-Match
                return self._get_workloads({})
            return self._get_manifest(params["name"], query)
        except _ContractError as exc:
            return exc.reply()

    def _dispatch(
        self,
        route: Route,
        params: Mapping[str, str],
        query: bytes,
        headers: Mapping[str, list[str]],
        body: bytes,
        parsed_json: Any,
    ) -> _Reply:
        if route == "workloads":
            return self._get_workloads(headers)
        if route == "manifest":
            return self._get_manifest(params["name"], query)
        if route == "version":
            return self._put_version(params["name"], body, parsed_json)
        return self._post_health(params["node"], headers, body, parsed_json)

    def _get_workloads(self, headers: Mapping[str, list[str]]) -> _Reply:
        with self._lock:
            revision = self._revision
            # each workload's last version PUT, as the contract's `reported_version`
            # (advisory; it does not change the revision, so not the ETag either)
            reported = dict(self._recorded)
            workloads = copy.deepcopy(self._desired)
            if self.serve_reported:
                for workload in workloads:
                    if workload.get("name") in reported:
                        workload.setdefault("reported_version", reported[workload["name"]])
            payload = {
                "revision": revision,
                "allow_empty": self._allow_empty,
                "workloads": workloads,
            }
        etag = f'"{revision}"'
        if_none_match = ", ".join(headers.get("if-none-match", []))
        forged = self.signing_key is not None and self._forgery not in (None, "wrong-digest")
        if if_none_match and _etag_matches(if_none_match, etag) and not forged:
            return _Reply(status=304, headers=[("etag", etag)])
        if self.signing_key is None:
            reply = _json_reply(200, payload)
        else:
            reply = self._signed(payload)
        reply.headers.append(("etag", etag))
        return reply

    def _signed(self, payload: dict[str, Any]) -> _Reply:
        """The desired state signed for this node: serial, node id, issue time and each
        manifest's digest (over the exact bytes the manifest call answers)."""
        assert self.signing_key is not None
        with self._lock:
            for workload in payload["workloads"]:
                raw = self._manifests.get((workload.get("name"), workload.get("version")))
                if raw is not None:
                    digest = hashlib.sha256(json.dumps(raw).encode()).hexdigest()
                    workload.setdefault("manifest_sha256", digest)
            content = json.dumps(payload, sort_keys=True)
            if content != self._last_signed:
                self._serial += 1
                self._last_signed = content
                self._issued_at = datetime.now(UTC).isoformat().replace("+00:00", "Z")
            payload = {**payload, "serial": self._serial, "node_id": self.node_id,
                       "issued_at": self._issued_at}  # fmt: skip
            forgery = self._forgery
        node = self.node_id
        if forgery == "other-node":
            node = "another-node"
            payload = {**payload, "node_id": node}
        reply = _json_reply(200, payload)
        signature = base64.b64encode(self.signing_key.sign(signed_bytes(node, reply.body)))
        with self._lock:
            if self._signed_first is None and forgery is None:
                self._signed_first = (reply.body, signature.decode())
            first = self._signed_first
        if forgery == "unsigned":
            return reply
        if forgery == "replay" and first is not None:
            reply.body = first[0]
            signature = first[1].encode()
        if forgery == "tampered":
            reply.body = json.dumps({**payload, "revision": f"{payload['revision']}x"}).encode()
        reply.headers.append((SIGNATURE_HEADER, signature.decode()))
        return reply

    def _get_manifest(self, name: str, query: bytes) -> _Reply:
        versions = parse_qs(query.decode("latin-1"), keep_blank_values=True).get("version", [])
        if len(versions) != 1 or not versions[0]:
            raise _ContractError(400, "query parameter 'version' is required exactly once")
        version = versions[0]
        with self._lock:
            manifest = copy.deepcopy(self._manifests.get((name, version)))
            forged = self._forgery == "wrong-digest"
        if manifest is None:
            # A legitimate question with a negative answer, so not a contract breach.
            return _json_reply(404, {"error": f"no manifest for {name!r} version {version!r}"})
        if forged:  # not the bytes the signed state names
            manifest.setdefault("metadata", {}).setdefault("labels", {})["forged"] = "yes"
        return _json_reply(200, manifest)

    def _put_version(self, name: str, body: bytes, parsed: Any) -> _Reply:
        document = _require_object(body, parsed)
        version = document.get("version")
        if not isinstance(version, str) or not version:
            raise _ContractError(422, "field 'version' must be a non-empty string", "version")
        if not _is_rfc3339(document.get("applied_at")):
            raise _ContractError(
                422, "field 'applied_at' must be an RFC 3339 date-time with offset", "applied_at"
            )
        outcome = document.get("outcome", "applied")
        if outcome not in ("applied", "healthy", "rolled_back"):
            raise _ContractError(
                422, "field 'outcome' must be one of applied, healthy, rolled_back", "outcome"
            )
        for key, limit in (("attempted_version", 128), ("reason", 256)):
            value = document.get(key)
            if value is not None and not (isinstance(value, str) and 0 < len(value) <= limit):
                raise _ContractError(
                    422, f"field '{key}' must be a string of 1 to {limit} characters", key
                )
        if outcome == "rolled_back" and not (
            document.get("attempted_version") and document.get("reason")
        ):
            raise _ContractError(
                422, "a rolled_back outcome names its 'attempted_version' and 'reason'", "outcome"
            )
        with self._lock:
            self._versions.append((name, copy.deepcopy(document)))
            self._recorded[name] = version
        return _Reply(status=204)

    def _post_health(
        self, node: str, headers: Mapping[str, list[str]], body: bytes, parsed: Any
    ) -> _Reply:
        content_type = ", ".join(headers.get("content-type", []))
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            raise _ContractError(
                415, f"Content-Type must be application/json, got {content_type!r}"
            )
        report = _require_object(body, parsed)
        for key in ("node_id", "manager_version", "reported_at", "workloads"):
            if key not in report:
                raise _ContractError(422, f"missing field '{key}'", key)
        if report["node_id"] != node:
            raise _ContractError(
                422, f"field 'node_id' {report['node_id']!r} is not node {node!r}", "node_id"
            )
        if not isinstance(report["manager_version"], str) or not report["manager_version"]:
            raise _ContractError(
                422, "field 'manager_version' must be a non-empty string", "manager_version"
            )
        if not _is_rfc3339(report["reported_at"]):
            raise _ContractError(
                422, "field 'reported_at' must be an RFC 3339 date-time with offset", "reported_at"
            )
        workloads = report["workloads"]
        if not isinstance(workloads, list):
            raise _ContractError(422, "field 'workloads' must be a list", "workloads")
        for index, item in enumerate(workloads):
            where = f"workloads[{index}]"
            if not isinstance(item, dict):
                raise _ContractError(422, f"field '{where}' must be an object", where)
            for key in ("name", "status"):
                value = item.get(key)
                if not isinstance(value, str) or not value:
                    name = f"{where}.{key}"
                    raise _ContractError(422, f"field '{name}' must be a non-empty string", name)
        with self._lock:
            self._reports.append(copy.deepcopy(report))
        return _Reply(status=202)


def _require_object(body: bytes, parsed: Any) -> dict[str, Any]:
    if not body:
        raise _ContractError(422, "body is empty; expected a JSON object", "body")
    if not isinstance(parsed, dict):
        raise _ContractError(422, "body must be a JSON object", "body")
    return parsed


def _failure_reply(route: Route, failure: _Failure) -> _Reply:
    mode = failure.mode
    if mode == "garbage":
        if route == "workloads":
            # Valid JSON of the wrong shape: catches clients that only check parseability.
            return _Reply(200, body=b'{"workloads": "nope"}', content_type="application/json")
        return _Reply(status=200, body=_GARBAGE_HTML, content_type="text/html")
    assert mode in _STATUS_MODES, mode
    reply = _json_reply(int(mode), {"error": f"injected failure {mode} on {route}"})
    if failure.retry_after is not None:
        reply.headers.append(("retry-after", failure.retry_after))
    return reply


def _host_name(headers: Mapping[str, list[str]]) -> str:
    host = ", ".join(headers.get("host", []))
    return host.rsplit(":", 1)[0] if not host.endswith("]") else host


def _redirect_reply(method: str, scope: Scope, target: str) -> _Reply:
    """302 for a GET, 307 (method and body kept, RFC 9110 15.4.8) for a PUT or POST, to
    the same target on this server under REDIRECT_HOST."""
    _, port = scope["server"]
    status = 302 if method == "GET" else 307
    reply = _json_reply(status, {"error": f"moved; injected {status}"})
    reply.headers.append(("location", f"http://{REDIRECT_HOST}:{port}{target}"))
    return reply


def _watch_disconnect(receive: Receive) -> asyncio.Future[Message]:
    """A future that completes when the client hangs up (the body is already read)."""
    return asyncio.ensure_future(receive())


def _hung_up(watch: asyncio.Future[Message]) -> bool:
    return watch.done() and watch.result().get("type") == "http.disconnect"


async def _trickle(
    send: Send,
    receive: Receive,
    reply: _Reply,
    failure: _Failure,
    generation: Callable[[], int],
) -> bool:
    """Send the headers (with the full Content-Length), then one byte every interval;
    True if the client hung up first. release_stalled() ends it, the body unfinished."""
    started = generation()
    watch = _watch_disconnect(receive)
    try:
        headers = _reply_headers(reply)
        headers.append((b"content-length", str(len(reply.body)).encode()))
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        loop = asyncio.get_running_loop()
        for index in range(len(reply.body)):
            next_byte = loop.time() + failure.interval
            while (left := next_byte - loop.time()) > 0:
                # short slices so release_stalled() from another thread is noticed
                await asyncio.wait({watch}, timeout=min(0.05, left))
                if _hung_up(watch):
                    return True
                if generation() != started:
                    return False
            last = index == len(reply.body) - 1
            chunk = reply.body[index : index + 1]
            await send({"type": "http.response.body", "body": chunk, "more_body": not last})
        return _hung_up(watch)
    finally:
        if not watch.done():
            watch.cancel()


async def _pad(
    send: Send,
    receive: Receive,
    reply: _Reply,
    failure: _Failure,
    generation: Callable[[], int],
) -> bool:
    """Stream the answer followed by JSON whitespace up to `size` bytes, chunked (no
    Content-Length, so only counting tells the size); True if the client hung up first."""
    del generation  # not stalled: it ends as fast as the client reads
    watch = _watch_disconnect(receive)
    try:
        headers = _reply_headers(reply)
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        await send({"type": "http.response.body", "body": reply.body, "more_body": True})
        left = max(0, failure.size - len(reply.body))
        while left > 0:
            if _hung_up(watch):
                return True
            chunk = b" " * min(_HUGE_CHUNK, left)
            left -= len(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await asyncio.sleep(0)  # let the disconnect watcher run
        await send({"type": "http.response.body", "body": b""})
        return _hung_up(watch)
    finally:
        if not watch.done():
            watch.cancel()


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _collect_headers(scope: Scope) -> dict[str, list[str]]:
    headers: dict[str, list[str]] = {}
    for raw_name, raw_value in scope.get("headers", []):
        name = raw_name.decode("latin-1").lower()
        headers.setdefault(name, []).append(raw_value.decode("latin-1"))
    return headers


def _try_json(body: bytes) -> Any:
    if not body:
        return None
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None


def _reply_headers(reply: _Reply) -> list[tuple[bytes, bytes]]:
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers]
    if reply.content_type is not None and reply.body:
        headers.append((b"content-type", reply.content_type.encode("latin-1")))
    return headers


async def _send_reply(send: Send, reply: _Reply) -> None:
    headers = _reply_headers(reply)
    body = b"" if reply.status in (204, 304) else reply.body
    if reply.status not in (204, 304):  # RFC 9110 8.6: no Content-Length on 204
        headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def fleet_interval(*, nodes: int, rate: float, configured: float) -> float:
    """The interval that keeps `nodes` nodes calling at most `rate` times a second: never
    below the one the nodes are configured with (docs/backend-api.md)."""
    if nodes < 0 or rate <= 0:
        raise ValueError("nodes must be >= 0 and rate > 0")
    return max(configured, nodes / rate)


def stagger(node_id: str, interval: float) -> float:
    """A node's place in the interval, in seconds: the first 8 bytes of SHA-256 of its id
    as a fraction of 2^64, times the interval (the same node always gets the same place)."""
    digest = hashlib.sha256(node_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * interval


def after_outage(interval: float, *, down_for: float, since_back: float, ramp: float) -> float:
    """The interval to ask for `since_back` seconds after an outage of `down_for` seconds:
    the fleet's nodes all come back at once, so the backend asks for up to twice the
    interval (more the longer it was down, at most x4), eased back over `ramp` seconds."""
    if since_back >= ramp:
        return interval
    stretch = min(4.0, 2.0 + down_for / 3600.0)  # x2, plus one per hour it was down
    left = 1.0 - since_back / ramp
    return interval * (1.0 + (stretch - 1.0) * left)
