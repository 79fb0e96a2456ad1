"""The soak's load: workloads pinging, jobs published to JetStream, versions bumped.

Each generator runs until `stop` is set and pauses while the gate is closed, so the soak
can take a quiet reading of the manager between the warm-up and the measured phase, and
again at the end, without tearing the load down in between. Everything is counted on the
client side, errors by kind, so the report can set it against what the manager counted.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from app.adapters.bus import JetStreamBus
from app.domain.jobs import STREAMS
from app.domain.tokens import ping_token
from app.services.streams import new_job, publish_job

PING_TIMEOUT = 5.0  # seconds; a ping slower than this counts as an error
# uvicorn closes a keep-alive connection idle for 5 s, as long as the ping interval: a
# client that kept it longer would race that close. Each ping opens a connection, then.
KEEPALIVE_EXPIRY = 4.0
DEGRADED_SHARE = 0.02  # of pings; the rest say healthy
PUBLISH_TIMEOUT = 5.0
JOB_KINDS: tuple[str, ...] = tuple(STREAMS)  # online, offline, write: every tier consumer works
JOB_MAX_DELAY = 0.02  # seconds a noop job sleeps at most (uniform), so jobs overlap a little


class Gate:
    """Open: generators run. Closed: they finish what is in flight and wait."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.stop = asyncio.Event()

    @property
    def is_open(self) -> bool:
        return self._open.is_set() and not self.stop.is_set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def wait_open(self) -> bool:
        """Wait until the gate opens; False once the load is stopping."""
        while not self.stop.is_set():
            if self._open.is_set():
                return True
            await self.sleep(0.1)
        return False

    async def sleep(self, seconds: float) -> bool:
        """Sleep, or less if the load is stopped meanwhile; True when stopping."""
        if seconds <= 0:
            return self.stop.is_set()
        try:
            await asyncio.wait_for(self.stop.wait(), timeout=seconds)
        except TimeoutError:
            return False
        return True


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class PingStats:
    sent: int = 0
    in_flight: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  # transport errors by type
    latencies: list[float] = field(default_factory=list)  # seconds, since the last reset

    @property
    def failed(self) -> int:
        """Pings that did not get a 2xx: a non-2xx status or no answer at all."""
        rejected = sum(n for status, n in self.statuses.items() if not 200 <= status < 300)
        return rejected + sum(self.errors.values())

    def latency_ms(self) -> dict[str, float | None]:
        def ms(value: float | None) -> float | None:
            return None if value is None else round(1000 * value, 2)

        return {
            "p50": ms(_percentile(self.latencies, 0.50)),
            "p99": ms(_percentile(self.latencies, 0.99)),
            "max": ms(max(self.latencies, default=None)),
        }

    def as_dict(self) -> dict[str, object]:
        return {
            "sent": self.sent,
            "failed": self.failed,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "transport_errors": dict(self.errors),
            "latency_ms_measured_phase": self.latency_ms(),
        }


class Pingers:
    """One task per workload, each with its own HTTP client, as pods have: a ping every
    `interval` seconds, the first at a random point of the first interval."""

    def __init__(
        self,
        url: str,
        names: Sequence[str],
        versions: Mapping[str, str],
        *,
        secret: str,
        interval: float,
        gate: Gate,
    ) -> None:
        self._url = url
        self._secret = secret
        self._names = names
        self._versions = versions  # read at each ping: the bumper changes it
        self._interval = interval
        self._gate = gate
        self.stats = PingStats()
        self.idle = asyncio.Event()  # set while no ping is in flight
        self.idle.set()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._run(name), name=f"ping-{name}") for name in self._names
        ]

    async def join(self) -> None:
        await asyncio.gather(*self._tasks)

    async def _run(self, name: str) -> None:
        token = ping_token(self._secret, name)
        limits = httpx.Limits(max_connections=1, keepalive_expiry=KEEPALIVE_EXPIRY)
        headers = {"authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(
            base_url=self._url, timeout=PING_TIMEOUT, limits=limits, headers=headers
        ) as client:
            next_at = time.monotonic() + random.uniform(0, self._interval)
            while not await self._gate.sleep(next_at - time.monotonic()):
                if not self._gate.is_open:
                    if not await self._gate.wait_open():
                        return
                    # back from a pause: spread out again rather than all ping at once
                    next_at = time.monotonic() + random.uniform(0, self._interval)
                    continue
                await self._ping(client, name)
                next_at += self._interval

    async def _ping(self, client: httpx.AsyncClient, name: str) -> None:
        status = "degraded" if random.random() < DEGRADED_SHARE else "healthy"
        body = {"status": status, "version": self._versions[name]}
        self.stats.sent += 1
        self.stats.in_flight += 1
        self.idle.clear()
        started = time.perf_counter()
        try:
            response = await client.post(f"/v1/workloads/{name}/health", json=body)
        except httpx.HTTPError as exc:
            self.stats.errors[type(exc).__name__] += 1
        else:
            self.stats.statuses[response.status_code] += 1
            self.stats.latencies.append(time.perf_counter() - started)
        finally:
            self.stats.in_flight -= 1
            if not self.stats.in_flight:
                self.idle.set()


@dataclass
class JobStats:
    published: list[str] = field(default_factory=list)  # idempotency keys JetStream acked
    attempted: int = 0
    failures: Counter[str] = field(default_factory=Counter)  # by exception type
    by_kind: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, object]:
        return {
            "attempted": self.attempted,
            "published": len(self.published),
            "publish_failures": dict(self.failures),
            "by_kind": dict(self.by_kind),
        }


class JobFlow:
    """noop jobs at a steady rate (open loop), rotating over the job kinds of one tier.

    Keys are unique per run, so JetStream's duplicate window never drops one and every
    acked publish must end as one completed ledger row.
    """

    def __init__(self, bus: JetStreamBus, *, tier: str, rate: float, gate: Gate) -> None:
        self._bus = bus
        self._tier = tier
        self._period = 1.0 / rate
        self._gate = gate
        self.run_id = uuid.uuid4().hex[:8]
        self.key_prefix = f"soak-{self.run_id}-"
        self.stats = JobStats()
        self._task: asyncio.Task[None] | None = None
        self._seq = itertools.count()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="soak-jobs")

    async def join(self) -> None:
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        next_at = time.monotonic()
        while not await self._gate.sleep(next_at - time.monotonic()):
            if not self._gate.is_open:
                if not await self._gate.wait_open():
                    return
                next_at = time.monotonic()
                continue
            await self._publish_one(next(self._seq))
            next_at += self._period
            # fallen behind by more than a second (a slow publish): do not burst to catch up
            next_at = max(next_at, time.monotonic() - 1.0)

    async def _publish_one(self, seq: int) -> None:
        kind = JOB_KINDS[seq % len(JOB_KINDS)]
        key = f"{self.key_prefix}{seq:07d}"
        payload = {"seq": seq, "delay_seconds": round(random.uniform(0, JOB_MAX_DELAY), 4)}
        job = new_job("noop", idempotency_key=key, payload=payload)
        self.stats.attempted += 1
        try:
            async with asyncio.timeout(PUBLISH_TIMEOUT):
                await publish_job(self._bus, job, kind=kind, tier=self._tier)
        except Exception as exc:  # any failure to get JetStream's ack is a client-side error
            self.stats.failures[type(exc).__name__] += 1
            return
        self.stats.published.append(key)
        self.stats.by_kind[kind] += 1


class VersionBumper:
    """Every `every` seconds, a new version for the next `count` workloads (round robin), so
    syncs keep fetching manifests, applying and reporting versions, not only answering 304."""

    def __init__(
        self,
        desire: Callable[[Mapping[str, str]], None],
        versions: Mapping[str, str],
        *,
        every: float,
        count: int,
        gate: Gate,
    ) -> None:
        self._desire = desire
        self._versions = versions
        self._every = every
        self._count = count
        self._gate = gate
        self._next = itertools.cycle(sorted(versions))
        self.bumped = 0
        self.rounds = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._every > 0 and self._count > 0:
            self._task = asyncio.create_task(self._run(), name="soak-bumper")

    async def join(self) -> None:
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        while not await self._gate.sleep(self._every):
            if not self._gate.is_open:
                continue  # skip a round during a quiet reading
            self.rounds += 1
            names = [next(self._next) for _ in range(min(self._count, len(self._versions)))]
            self._desire({name: _bumped(self._versions[name]) for name in names})
            self.bumped += len(names)


def _bumped(version: str) -> str:
    major, minor, _patch = (int(part) for part in version.split("."))
    return f"{major}.{minor + 1}.0"
