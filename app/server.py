"""The HTTP server's own bounds: what one connection may cost the manager.

Any pod on the node can connect, so before the application sees a request the server
bounds it: the request head (request line and header section) is at most
HTTP_MAX_HEADER_BYTES, refused with 431 before more of it is buffered; a head must be
complete within HTTP_HEADER_TIMEOUT_SECONDS (the first from the connection's opening,
later ones from their first byte), else the connection is closed (with 408 if part of a
head came); a request's body must be complete within HTTP_BODY_TIMEOUT_SECONDS of its
head's completion, else the connection is closed (the application sees the client
disconnect); an idle kept-alive connection is closed after HTTP_KEEPALIVE_TIMEOUT_SECONDS;
at most HTTP_MAX_CONNECTIONS connections are held at once, and at most
HTTP_MAX_CONNECTIONS_PER_CLIENT from one peer address; one more is answered 503 and closed
before anything of it is read. With a probe port (PROBE_PORT), connections to it answer
/healthz and /readyz only (404 for anything else), have caps of their own
(PROBE_MAX_CONNECTIONS, PROBE_MAX_CONNECTIONS_PER_CLIENT) and are not counted in the
port's: the kubelet's probes are answered while pods hold every connection of the main
port. Pipelined requests are parsed one head at a time: while an
answer is owed on the connection, the bytes after a completed request stay unparsed (and
reading stops) until that answer is written, so at most two requests of a connection are
parsed and unanswered at once (the one being answered, and one whose head ended in the same
piece as a chunked body before it), whatever the client sends without reading. Every
refusal is counted in
`workload_manager_http_refusals_total{reason}` when the protocol has the counter.

A valid health ping is answered by the protocol itself when it is given `PingAnswers`
(app/api/fastping.py): a `POST /v1/workloads/<name>/health` head on a kept-alive HTTP/1.1
connection with nothing else owed on it, a Content-Length within the ping body limit, and
room in the transport's write buffer, is read without an ASGI task; a ping `PingAnswers`
accepts is answered 204 at once, anything else is handed to the application as if the
parser had just delivered it (head, body, end), in order.

uvicorn has no head timeout, and llhttp (httptools) buffers a header of any size, so the
bounds live in `BoundedHttpProtocol`, uvicorn's httptools protocol with the reading of the
socket wrapped. It relies on the asyncio protocol methods, on httptools' parser callbacks
(`on_headers_complete`, `on_body`, `on_message_complete`), on its WebSocket hand-over
(`handle_websocket_upgrade`) and on a few names of uvicorn's protocol; `check_uvicorn()`
and the constructor refuse to run on a uvicorn whose protocol lacks one of them, rather
than lose a bound silently.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

if TYPE_CHECKING:
    from prometheus_client import Counter as MetricCounter
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    from app.api.fastping import PingAnswers, PingTarget
    from app.metrics import HttpRefusal
    from app.settings import Settings

log = logging.getLogger(__name__)

# After a refusal the response is sent, the sending side shut down, and what the client
# still sends is read and dropped for a short while, so that it reads the response
# instead of a reset. Dropped bytes are never buffered; past either bound the connection
# is closed outright.
LINGER_SECONDS = 2.0
LINGER_MAX_BYTES = 1024 * 1024

# uvicorn's protocol must still have these for the bounds to hold (see check_uvicorn)
_OVERRIDDEN = (
    "connection_made",
    "connection_lost",
    "data_received",
    "on_headers_complete",
    "on_body",
    "on_message_complete",
    "on_response_complete",
    "handle_websocket_upgrade",
    # called, not overridden
    "_unset_keepalive_if_required",
    "timeout_keep_alive_handler",
)
_USED = (
    "timeout_keep_alive", "connections", "cycle", "pipeline", "loop", "transport", "flow", "app",
    "server", "client", "parser", "server_state", "limit_concurrency",
    "expect_100_continue", "timeout_keep_alive_task",
)  # fmt: skip
# where a request head can end: its blank line (CRLF CRLF, or a bare LF the parser may
# accept). The parser is fed up to and including one of these at a time, so one feed
# completes at most one head
_BLANK_LINE = re.compile(rb"\n\r?\n")
# the probe port: what it answers, and its own caps (the kubelet opens a connection per
# probe; pods are kept off it by the NetworkPolicy)
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
PROBE_MAX_CONNECTIONS = 32
PROBE_MAX_CONNECTIONS_PER_CLIENT = 8


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int
    header_timeout: float
    body_timeout: float
    keepalive_timeout: float
    max_connections: int
    max_connections_per_client: int
    probe_port: int | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> HttpLimits:
        return cls(
            max_header_bytes=settings.http_max_header_bytes,
            header_timeout=settings.http_header_timeout_seconds,
            body_timeout=settings.http_body_timeout_seconds,
            keepalive_timeout=settings.http_keepalive_timeout_seconds,
            max_connections=settings.http_max_connections,
            max_connections_per_client=settings.http_max_connections_per_client,
            probe_port=settings.probe_port,
        )


def _response(status: int, reason: str, *extra: str) -> bytes:
    body = reason.encode()
    head = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: text/plain; charset=utf-8",
        f"content-length: {len(body)}",
        "connection: close",
        *extra,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


TOO_LARGE = _response(431, "Request Header Fields Too Large")
TIMED_OUT = _response(408, "Request Timeout")
TOO_MANY = _response(503, "Service Unavailable", "retry-after: 1")


class _ClientCounts:
    """Connections held at once by peer address, for one server."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}
        self.total = 0

    def enter(self, address: str, cap: int) -> bool:
        """Count one more connection from `address`; False (not counted) past `cap`."""
        held = self._held.get(address, 0)
        if held >= cap:
            return False
        self._held[address] = held + 1
        self.total += 1
        return True

    def leave(self, address: str) -> None:
        held = self._held.pop(address, 0) - 1
        self.total -= 1
        if held > 0:
            self._held[address] = held


def _probes_only(app: Any) -> Any:
    """`app` for the probe port: /healthz and /readyz, and 404 for anything else."""

    async def probes(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in PROBE_PATHS:
            await app(scope, receive, send)
            return
        body = b"Not Found: the probe port answers /healthz and /readyz only"
        await send({"type": "http.response.start", "status": 404,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    return probes


class _RefusalLog:
    """Refusals logged at most once a minute per kind, with how many there were: an attack
    must not turn into a flood of log lines."""

    def __init__(self, every: float = 60.0) -> None:
        self._every = every
        self._last: dict[str, float] = {}
        self._counts: Counter[str] = Counter()

    def note(self, kind: str, client: tuple[str, int] | None) -> None:
        self._counts[kind] += 1
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self._every:
            return
        self._last[kind] = now
        count = self._counts.pop(kind)
        peer = f"{client[0]}:{client[1]}" if client else "unknown peer"
        log.warning("HTTP: %d connection(s) refused: %s (the last from %s)", count, kind, peer)


refusals = _RefusalLog()


def check_uvicorn() -> None:
    """Fail loudly, at start-up, if uvicorn's httptools protocol no longer has what
    `BoundedHttpProtocol` overrides or sets (a renamed method would lose a bound)."""
    missing = [name for name in _OVERRIDDEN if not callable(getattr(HttpToolsProtocol, name, None))]
    if missing:
        raise RuntimeError(
            f"uvicorn's HttpToolsProtocol lacks {missing}: HTTP bounds would not hold"
        )
    if issubclass(HttpToolsProtocol, asyncio.BufferedProtocol):
        # asyncio would hand it reads through buffer_updated, past data_received
        raise RuntimeError(
            "uvicorn's HttpToolsProtocol reads through a buffer: HTTP bounds would not hold"
        )


_base = HttpToolsProtocol


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the request head bounded in size and time, the
    request body in time, the keep-alive timeout and the connection caps of `limits`.
    Without `limits` (as under `serve --reload`, where uvicorn builds the server in a child
    process) they come from the environment's settings. Refusals are counted in
    `refusal_counter` when set."""

    limits: ClassVar[HttpLimits | None] = None
    refusal_counter: ClassVar[MetricCounter | None] = None
    pings: ClassVar[PingAnswers | None] = None
    # shared by the connections of one server (`bounded_protocol` gives each its own)
    client_counts: ClassVar[_ClientCounts] = _ClientCounts()
    probe_counts: ClassVar[_ClientCounts] = _ClientCounts()

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._limits = self.limits or _limits_from_environment()
        missing = [name for name in _USED if name not in vars(self)]
        if missing:
            raise RuntimeError(f"uvicorn's HttpToolsProtocol has no {missing}")
        self.timeout_keep_alive = self._limits.keepalive_timeout  # type: ignore[assignment]
        self._reading_head = True
        # what the parser may be holding: the bytes of the head being read, or in a body,
        # those since the last body byte (chunk framing, trailers). At most
        # HTTP_MAX_HEADER_BYTES are fed to it at a time, so it never holds more than twice
        # that (a head that starts inside a read the previous request ended in).
        self._held = 0
        # when the head or body being read must be complete (loop time): a head from its
        # start (the connection's opening for the first one), a body from its head's
        # completion; None between requests. One timer per connection checks it,
        # re-armed when it fires or when a deadline comes before it, not once per request
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._handed_over = False  # to the WebSocket protocol
        # the peer address this connection is counted under, and where
        self._counted_as: str | None = None
        self._counts = self.client_counts
        self._pending_refusal: bytes | None = None
        self._dropped = 0
        # what the client pipelined behind a request still being answered, unparsed
        self._waiting = b""
        # the bytes of the body being read still to come, when its Content-Length says so
        # (the parser is fed up to its end, so the next head starts a piece of its own)
        self._body_left: int | None = None
        # the workload whose ping is being read on the fast path, and its body so far
        self._ping: PingTarget | None = None
        self._ping_body = b""
        self._keepalive_due = False  # a ping was answered: arm the keep-alive timer
        # a fast-path answer would skip the access log or the concurrency limit
        self._pings = (
            None if config.access_log or self.limit_concurrency is not None else self.pings
        )

    # --- asyncio protocol

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        probe_port = self._limits.probe_port
        if probe_port is not None and self.server is not None and self.server[1] == probe_port:
            self._counts = self.probe_counts
            self.app = _probes_only(self.app)
            held, cap = self._counts.total + 1, PROBE_MAX_CONNECTIONS
            per_client = PROBE_MAX_CONNECTIONS_PER_CLIENT
        else:  # the probe port's connections are not this port's
            held, cap = (
                len(self.connections) - self.probe_counts.total,
                self._limits.max_connections,
            )
            per_client = self._limits.max_connections_per_client
        if held > cap:
            self._refuse_connection("too-many-connections", "too many connections")
            return
        if self.client is not None:  # None: not an IP socket, nothing to count it under
            address = self.client[0]
            if not self._counts.enter(address, per_client):
                self._refuse_connection(
                    "too-many-connections-from-client", "too many connections from one client"
                )
                return
            self._counted_as = address
        self._head_began()  # a connection that never sends a head is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        # uvicorn marks a request in progress disconnected and wakes its receive()
        self._cancel_timer()
        self._uncount_client()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self) -> None:
        # the WebSocket protocol takes the connection over, and its end is not seen here:
        # it leaves the client's count now (the node's cap still counts it), and the
        # deadlines of HTTP requests no longer apply
        self._uncount_client()
        self._deadline = None
        self._cancel_timer()
        self._handed_over = True
        _base.handle_websocket_upgrade(self)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            self._dropped += len(data)
            if self._dropped > LINGER_MAX_BYTES:
                self.transport.close()
            return
        if self._waiting:
            self._hold(data)  # behind what is already waiting, in order
            return
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        # (the path of every request: attribute reads are kept to what each step needs; the
        # read is walked by offset, not sliced down, so a read of many pipelined requests
        # costs its length once, not once per request)
        if self._deadline is None and self._reading_head:
            self._head_began()  # the first bytes of a new head on a kept-alive connection
        limit = self._limits.max_header_bytes
        transport = self.transport
        at, size = 0, len(data)
        while at < size:
            body_left = None if self._reading_head else self._body_left
            if body_left:  # up to the body's end
                end = at + min(size - at, body_left)
                self._body_left = body_left - (end - at)
            else:
                if self._reading_head and self._answers_pending():
                    # between requests (or in a head) while an answer is owed: the rest
                    # waits unparsed until it is written
                    self._hold(data[at:])
                    return
                # a piece ends after the next blank line: it completes at most one head
                found = _BLANK_LINE.search(data, at)
                end = size if found is None else found.end()
                if end - at > limit - self._held:
                    rest = self._feed_over(data[at:], limit)
                    if rest is None:
                        return
                    data, at, size = rest, 0, len(rest)
                    continue
            piece = data if at == 0 and end == size else data[at:end]
            at = end
            self._held += len(piece)  # the parser's callbacks reset it
            _base.data_received(self, piece)
            if self._handed_over or transport.is_closing():
                return  # refused by the parser, or handed over (a WebSocket upgrade)
        if self._keepalive_due:  # pings were answered in this read: idle from now on
            self._keepalive_due = False
            if self._reading_head and not self._answers_pending():
                self._unset_keepalive_if_required()
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )

    def _feed_over(self, data: bytes, limit: int) -> bytes | None:
        """Feed the parser no more than it may hold: past that it must have finished the
        head (or met body bytes) inside what it was given. What is left of `data` to feed,
        or None when the connection is done with."""
        room = limit - self._held
        piece = data[:room]
        head = self._reading_head
        self._held += len(piece)
        if piece:
            _base.data_received(self, piece)
        if self._handed_over or self.transport.is_closing():
            return None
        if head and self._reading_head:
            self._refuse("header-too-large", "request head too large", TOO_LARGE)
            return None
        if not head and not self._reading_head and self._held >= limit:
            # chunk framing or trailers with no body byte between: trailers are
            # buffered whole by the parser, and this request has nothing to answer
            self._note("trailer-too-large", "request trailers too large")
            self._refused = True
            self.transport.close()
            return None
        return data[room:]

    def _hold(self, data: bytes) -> None:
        """Keep `data` unparsed until the answers owed are written, and read no more meanwhile:
        what waits is at most what one read brought."""
        self._waiting += data
        self.flow.pause_reading()

    # --- httptools parser callbacks

    # (the base class is called directly, not through super(): this is the path of
    # every request)

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._held = 0
        self._body_left = _content_length(self.headers)
        # the body, if any, from now on (on_message_complete ends it)
        self._deadline = self.loop.time() + self._limits.body_timeout
        self._arm_timer()
        if self._pings is not None:
            self._ping = self._fast_ping(self._pings)
            if self._ping is not None:
                return
        _base.on_headers_complete(self)

    def on_body(self, body: bytes) -> None:
        self._held = 0
        if self._ping is not None:
            self._ping_body += body  # within the Content-Length the fast path allowed
            return
        _base.on_body(self, body)

    def on_message_complete(self) -> None:
        if self._ping is not None:
            self._answer_ping()
        else:
            _base.on_message_complete(self)
        self._reading_head = True
        self._held = 0
        self._body_left = None
        self._deadline = None

    # --- the ping fast path

    def _fast_ping(self, pings: PingAnswers) -> PingTarget | None:
        """The workload, when this head is a ping the fast path may read (see the module)."""
        target = pings.target_of(self.url)
        if target is None:
            return None
        length, cycle, parser = self._body_left, self.cycle, self.parser
        if (
            length is None
            or length > pings.limit
            or self.expect_100_continue
            or self.pipeline
            or (cycle is not None and not cycle.response_complete)
            or self.flow.write_paused
            or parser.get_method() != b"POST"
            or parser.get_http_version() != "1.1"
            or not parser.should_keep_alive()
            or parser.should_upgrade()
        ):
            return None
        return target

    def _answer_ping(self) -> None:
        target, body, pings = self._ping, self._ping_body, self._pings
        self._ping, self._ping_body = None, b""
        assert target is not None and pings is not None
        request_id = pings.answer(target, self.headers, body)
        if request_id is None:
            # the application answers: it gets the request as the parser gave it
            _base.on_headers_complete(self)
            if body:
                _base.on_body(self, body)
            _base.on_message_complete(self)
            return
        head = [b"HTTP/1.1 204 No Content\r\n"]
        for key, value in self.server_state.default_headers:
            head += (key, b": ", value, b"\r\n")
        notice = pings.notices.get(target.name)
        if notice is not None:
            head += (b"x-workload-update: ", notice, b"\r\n")
        head += (b"x-request-id: ", request_id, b"\r\n\r\n")
        self.transport.write(b"".join(head))
        # uvicorn's bookkeeping of a complete response, but its keep-alive timer once the
        # read is parsed (`_feed`), not once per answer: a read of pipelined pings would
        # leave a cancelled timer per ping alive until the loop's next turn
        self.server_state.total_requests += 1
        self._keepalive_due = True

    # --- the bounds

    def _head_began(self) -> None:
        if self._deadline is None:  # the first head counts from the connection's opening
            self._deadline = self.loop.time() + self._limits.header_timeout
        self._arm_timer()

    def _arm_timer(self) -> None:
        deadline = self._deadline
        if deadline is None:
            return
        if self._timer is not None:
            if self._timer.when() <= deadline:
                return  # it fires first, and re-arms for what is left
            self._timer.cancel()
        self._timer = self.loop.call_at(deadline, self._check_deadline)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_deadline(self) -> None:
        self._timer = None
        if self.transport.is_closing() or self._deadline is None:
            return  # nothing is being read: the next head arms the timer again
        now = self.loop.time()
        if self._deadline > now:  # a later head or body than the timer was armed for
            self._timer = self.loop.call_at(self._deadline, self._check_deadline)
            return
        if not self._reading_head:
            self._body_late(now)
            return
        if self._held == 0:  # nothing was asked: nothing to answer
            self._note("header-timeout", "idle connection, no request head in time")
            self.transport.close()
            return
        self._refuse("header-timeout", "request head not complete in time", TIMED_OUT)

    def _body_late(self, now: float) -> None:
        if self.flow.read_paused:
            # uvicorn stopped reading (a pipelined request waits for the one before it, or
            # the application has not taken the body read so far): the client cannot be
            # late, and gets the whole time again once reading resumes
            self._deadline = now + self._limits.body_timeout
            self._timer = self.loop.call_at(self._deadline, self._check_deadline)
            return
        # the application holds the request and may be reading it: nothing can be answered
        # in its place. Closing marks the request disconnected (connection_lost), so its
        # receive() returns http.disconnect and the task ends
        self._note("body-timeout", "request body not complete in time")
        self._refused = True
        self.transport.close()

    def _note(self, reason: HttpRefusal, why: str) -> None:
        refusals.note(why, self.client)
        if self.refusal_counter is not None:
            self.refusal_counter.labels(reason).inc()

    def _uncount_client(self) -> None:
        if self._counted_as is not None:
            self._counts.leave(self._counted_as)
            self._counted_as = None

    def _refuse_connection(self, reason: HttpRefusal, why: str) -> None:
        """Refuse a new connection with 503 before anything of it is read."""
        self._note(reason, why)
        self._refused = True
        self.transport.write(TOO_MANY)
        self.transport.close()

    def _refuse(self, reason: HttpRefusal, why: str, response: bytes) -> None:
        self._note(reason, why)
        self._refused = True
        self._cancel_timer()
        if self._answers_pending():
            # requests pipelined before this one are answered first, in order; what the
            # client sends meanwhile is dropped
            self._pending_refusal = response
            return
        self._send_refusal(response)

    def _answers_pending(self) -> bool:
        cycle = self.cycle  # the request parsed last; earlier ones are answered before it
        return bool(self.pipeline) or (cycle is not None and not cycle.response_complete)

    def on_response_complete(self) -> None:
        waiting = bool(self.pipeline)
        _base.on_response_complete(self)
        if waiting and not self.pipeline and not self._reading_head:
            # the request whose body is being read has only now become the current one:
            # its body's time starts now
            self._deadline = self.loop.time() + self._limits.body_timeout
        if self._pending_refusal is not None and not self._answers_pending():
            response, self._pending_refusal = self._pending_refusal, None
            self._send_refusal(response)
        elif self._waiting and not self._answers_pending() and not self.transport.is_closing():
            # every answer owed is written: the next request's turn (its head's time
            # starts now; reading resumed in the base class)
            data, self._waiting = self._waiting, b""
            self._feed(data)

    def _send_refusal(self, response: bytes) -> None:
        if self.transport.is_closing():
            return
        self.transport.write(response)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self.loop.call_later(LINGER_SECONDS, self.transport.close)


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The body's length as the head declares it (the parser has checked it), or None when
    it is chunked or the head says nothing the parser has not refused."""
    length = None
    for name, value in headers:
        if name == b"transfer-encoding":
            return None
        if name == b"content-length" and value.isdigit():
            length = int(value)
    return length


@functools.cache
def _limits_from_environment() -> HttpLimits:
    from app.settings import load_settings

    return HttpLimits.from_settings(load_settings(_check_production=False))


def bounded_protocol(
    limits: HttpLimits,
    refusal_counter: MetricCounter | None = None,
    pings: PingAnswers | None = None,
) -> type[BoundedHttpProtocol]:
    """The protocol class to give `uvicorn.Config(http=...)`, bound to `limits`, counting
    refusals in `refusal_counter` (by reason), answering valid pings with `pings`, with its
    own per-client counts."""
    return type(
        "BoundedHttpProtocol",
        (BoundedHttpProtocol,),
        {
            "limits": limits,
            "refusal_counter": refusal_counter,
            "pings": pings,
            "client_counts": _ClientCounts(),
            "probe_counts": _ClientCounts(),
        },
    )


check_uvicorn()

# what `serve --reload` gives uvicorn (its child process imports it by name)
RELOAD_PROTOCOL = f"{__name__}:BoundedHttpProtocol"
