"""A lean HTTP/1.1 load generator: asyncio protocols over raw keep-alive sockets.

Requests are pre-encoded bytes; responses are parsed only for status and framing. Closed
loop: each connection sends again the moment a response arrives. Open loop: a fixed
schedule, latency counted from the scheduled send time, so a stalled server is charged
for the queue it causes (no coordinated omission).
"""

from __future__ import annotations

import asyncio
import gc
import importlib.metadata
import importlib.util
import time
from collections import Counter, deque
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar, cast

T = TypeVar("T")

CONNECT_TIMEOUT = 5.0
DRAIN_TIMEOUT = 10.0  # the most a phase waits for in-flight responses after it ends


def encode_request(
    *, method: str, path: str, host: str, body: bytes, headers: Sequence[tuple[str, str]] = ()
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    lines += [f"{name}: {value}" for name, value in headers]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@dataclass
class PhaseResult:
    """What one phase measured; latencies in nanoseconds, unsorted."""

    mode: str
    connections: int
    wall_seconds: float
    completed: int
    statuses: Counter[int]
    transport_errors: int
    latencies_ns: list[int]
    client_cpu_seconds: float
    target_rate: float | None = None
    send_lag_ns: list[int] = field(default_factory=list)  # open loop: actual - scheduled send
    unsent: int = 0  # open loop: scheduled requests never sent before the drain deadline

    @property
    def errors(self) -> int:
        return self.transport_errors + sum(n for s, n in self.statuses.items() if s != 204)

    @property
    def throughput(self) -> float:
        return self.completed / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def client_cpu_percent(self) -> float:
        return 100.0 * self.client_cpu_seconds / self.wall_seconds if self.wall_seconds else 0.0

    def percentile_ms(self, q: float, values: Sequence[int] | None = None) -> float | None:
        data = sorted(self.latencies_ns if values is None else values)
        if not data:
            return None
        index = min(len(data) - 1, max(0, round(q / 100.0 * len(data)) - 1))
        return data[index] / 1e6

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_ns)
        lag = sorted(self.send_lag_ns)
        out: dict[str, Any] = {
            "mode": self.mode,
            "connections": self.connections,
            "wall_seconds": round(self.wall_seconds, 3),
            "completed": self.completed,
            "requests_per_second": round(self.throughput, 1),
            "errors": self.errors,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "transport_errors": self.transport_errors,
            "client_cpu_percent": round(self.client_cpu_percent, 1),
            "latency_ms": {
                name: _round(self.percentile_ms(q, lat))
                for name, q in (("p50", 50), ("p90", 90), ("p99", 99), ("p99.9", 99.9))
            }
            | {"max": _round(lat[-1] / 1e6 if lat else None)},
        }
        if self.target_rate is not None:
            out["target_rate"] = self.target_rate
            out["unsent"] = self.unsent
            out["send_lag_ms"] = {
                "p99": _round(self.percentile_ms(99, lag)),
                "max": _round(lag[-1] / 1e6 if lag else None),
            }
        return out


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


class _Phase:
    """Shared state of one phase: the clock, the sinks, and what to do after a response."""

    def __init__(self, requests: Sequence[bytes]) -> None:
        self.requests = requests
        self.latencies: list[int] = []
        self.statuses: Counter[int] = Counter()
        self.transport_errors = 0
        self.deadline_ns = 0
        self.in_flight = 0
        self.drained: asyncio.Future[None] | None = None
        # open loop only
        self.open_loop = False
        self.idle: list[_Conn] = []
        self.backlog: deque[int] = deque()
        self.send_lag: list[int] = []
        self.dispatch_done = False

    def result(
        self, mode: str, connections: int, wall_ns: int, cpu_seconds: float, **open_loop: Any
    ) -> PhaseResult:
        return PhaseResult(
            mode=mode,
            connections=connections,
            wall_seconds=wall_ns / 1e9,
            completed=len(self.latencies),
            statuses=self.statuses,
            transport_errors=self.transport_errors,
            latencies_ns=self.latencies,
            client_cpu_seconds=cpu_seconds,
            **open_loop,
        )

    def send(self, conn: _Conn, scheduled_ns: int) -> None:
        self.in_flight += 1
        conn.send(scheduled_ns)

    def on_response(self, conn: _Conn, status: int) -> None:
        now = time.perf_counter_ns()
        self.latencies.append(now - conn.started_ns)
        self.statuses[status] += 1
        self.in_flight -= 1
        if self.open_loop:
            if self.backlog:
                self.send(conn, self.backlog.popleft())
            else:
                self.idle.append(conn)
        elif now < self.deadline_ns:
            self.send(conn, now)
        self.check_drained()

    def on_lost(self, conn: _Conn, in_flight: bool) -> None:
        if in_flight:
            self.transport_errors += 1
            self.in_flight -= 1
        if conn in self.idle:
            self.idle.remove(conn)
        self.check_drained()

    def check_drained(self) -> None:
        finished = self.dispatch_done if self.open_loop else True
        if (
            finished
            and self.in_flight == 0
            and self.drained is not None
            and not self.drained.done()
            and (self.open_loop or time.perf_counter_ns() >= self.deadline_ns)
        ):
            self.drained.set_result(None)


class _Conn(asyncio.Protocol):
    """One keep-alive connection with at most one request in flight."""

    def __init__(self, phase: _Phase, first: int) -> None:
        self.phase = phase
        self._next = first
        self._buf = b""
        self._busy = False
        self.started_ns = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def send(self, started_ns: int) -> None:
        requests = self.phase.requests
        request = requests[self._next % len(requests)]
        self._next += 1
        self.started_ns = started_ns
        self._busy = True
        assert self.transport is not None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            body_at = end + 4
            status = int(buf[9:12])
            if status == 204 or status == 304:
                stop = body_at
            else:
                head = buf[:end].lower()
                at = head.find(b"\r\ncontent-length:")
                if at >= 0:
                    eol = head.find(b"\r\n", at + 2)
                    stop = body_at + int(head[at + 17 : eol if eol >= 0 else len(head)])
                elif b"\r\ntransfer-encoding: chunked" in head:
                    last = buf.find(b"\r\n0\r\n\r\n", body_at - 2)
                    stop = last + 7 if last >= 0 else len(buf) + 1
                else:
                    stop = body_at
            if stop > len(buf):
                break
            buf = buf[stop:]
            self._busy = False
            self.phase.on_response(self, status)
        self._buf = buf

    def connection_lost(self, exc: Exception | None) -> None:
        self.phase.on_lost(self, self._busy)
        self._busy = False


class LoadGenerator:
    """Drives one server; every phase opens its own keep-alive connections and closes them."""

    def __init__(self, host: str, port: int, requests: Sequence[bytes]) -> None:
        self.host = host
        self.port = port
        self.requests = requests

    async def _connect(self, phase: _Phase, count: int) -> list[_Conn]:
        loop = asyncio.get_running_loop()
        conns: list[_Conn] = []
        try:
            for index in range(count):
                first = index * 7  # spread the connections over the names
                _, conn = await asyncio.wait_for(
                    loop.create_connection(partial(_Conn, phase, first), self.host, self.port),
                    CONNECT_TIMEOUT,
                )
                conns.append(conn)
        except BaseException:
            _close(conns)
            raise
        return conns

    async def closed_loop(self, *, connections: int, duration: float) -> PhaseResult:
        """Every connection keeps one request in flight for `duration` seconds."""
        phase = _Phase(self.requests)
        conns = await self._connect(phase, connections)
        phase.drained = asyncio.get_running_loop().create_future()
        try:
            with _quiet_gc():
                cpu0, t0 = time.process_time(), time.perf_counter_ns()
                phase.deadline_ns = t0 + int(duration * 1e9)
                for conn in conns:
                    phase.send(conn, time.perf_counter_ns())
                await _bounded(phase.drained, duration + DRAIN_TIMEOUT)
                t1, cpu1 = time.perf_counter_ns(), time.process_time()
        finally:
            _close(conns)
        return phase.result("closed-loop", len(conns), t1 - t0, cpu1 - cpu0)

    async def open_loop(self, *, connections: int, rate: float, duration: float) -> PhaseResult:
        """Send `rate` requests/s on a fixed schedule for `duration` seconds."""
        phase = _Phase(self.requests)
        phase.open_loop = True
        conns = await self._connect(phase, connections)
        phase.idle = list(conns)
        phase.drained = asyncio.get_running_loop().create_future()
        total = int(rate * duration)
        interval_ns = 1e9 / rate
        give_up_ns = int((duration + DRAIN_TIMEOUT) * 1e9)
        try:
            with _quiet_gc():
                cpu0, t0 = time.process_time(), time.perf_counter_ns()
                sent = 0
                while sent < total and time.perf_counter_ns() - t0 < give_up_ns:
                    now = time.perf_counter_ns()
                    due = min(total, int((now - t0) / interval_ns) + 1)
                    while sent < due:
                        scheduled = t0 + int(sent * interval_ns)
                        if phase.idle:
                            conn = phase.idle.pop()
                            phase.send_lag.append(time.perf_counter_ns() - scheduled)
                            phase.send(conn, scheduled)
                        else:
                            phase.backlog.append(scheduled)
                        sent += 1
                    wake = t0 + int(sent * interval_ns)
                    await asyncio.sleep(max(0.0, (wake - time.perf_counter_ns()) / 1e9))
                phase.dispatch_done = True
                phase.check_drained()
                await _bounded(phase.drained, DRAIN_TIMEOUT)
                t1, cpu1 = time.perf_counter_ns(), time.process_time()
        finally:
            _close(conns)
        return phase.result(
            "open-loop",
            len(conns),
            t1 - t0,
            cpu1 - cpu0,
            target_rate=rate,
            send_lag_ns=phase.send_lag,
            unsent=len(phase.backlog) + (total - sent),
        )


def _close(conns: list[_Conn]) -> None:
    for conn in conns:
        if conn.transport is not None:
            conn.transport.close()


async def _bounded(future: asyncio.Future[None], seconds: float) -> None:
    """Wait for `future`, but never longer than `seconds`."""
    try:
        async with asyncio.timeout(seconds):
            await asyncio.shield(future)
    except TimeoutError:
        pass


class _quiet_gc:
    """No collector pauses inside a measured phase (the client allocates little anyway)."""

    def __enter__(self) -> None:
        gc.collect()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        gc.enable()


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop when it is installed (it is, with uvicorn[standard]); else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def loop_name() -> str:
    if importlib.util.find_spec("uvloop") is None:
        return "asyncio (uvloop not installed)"
    return f"uvloop {importlib.metadata.version('uvloop')}"
