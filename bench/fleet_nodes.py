"""The simulated nodes of the fleet benchmark (bench/fleet.py): many in one process, each
on the manager's own code.

A node here is what a manager's registry and job worker are, without the rest of it:

- its registry: `AsyncpgRegistry` with the pooler setting (`transaction_pooler=True`:
  asyncpg's statement cache off) and `DATABASE_POOL_SIZE` connections at most, and the
  `Heartbeat` service (register, then the one-row heartbeat, retried with stamina as the
  manager retries it), run by the manager's `Scheduler` (APScheduler, the interval with
  SCHEDULER_JITTER_FRACTION of jitter), its first run a `StartupSpread` draw late, as the
  registry's timer is;
- its NATS connection: `JetStreamBus` with its inbox prefix and its `ReconnectPolicy`
  (full jitter, never giving up), connected a `StartupSpread` draw late as the worker is,
  announcing `node.online`, and the worker's `Fetcher` long-polling each of the tier's
  three durable consumers (WORKER_PULL_WAIT_SECONDS), re-subscribing after a reconnect.

What the real manager adds around them (the supervisor's retry of a failed loop, the
runners, the leases' renewals: no job is ever published here) is left out. The process
answers commands from bench/fleet.py on a pipe (`serve`); counting is done by wrapping
the bus the fetcher sees, never by changing the code under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import resource
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from typing import Any, cast

from app import __version__
from app.adapters.bus import BusError, JetStreamBus, inbox_prefix
from app.adapters.registry import AsyncpgRegistry
from app.domain.components import Result
from app.domain.job_flow import WorkerConfig
from app.domain.jobs import STREAMS, EventKind, event_body, event_subject
from app.domain.nats_servers import NatsServers
from app.domain.requirements import Tier
from app.domain.spreading import ReconnectPolicy, StartupSpread
from app.services.fetching import Fetcher, JobQueue, Subscription
from app.services.heartbeating import Heartbeat
from app.services.leasing import Leases, LoopClock, Message, Terms
from app.services.profile import LocalProfile
from app.services.scheduling import Scheduler
from app.settings import Settings

TIERS = tuple(t.value for t in Tier)
REGIONS = ("eu-west", "eu-central", "us-east", "us-west", "ap-south")
HEARTBEAT_FIRST_AFTER = 0.1  # the registry's timer's first_after (app/services/features)


def _default(name: str) -> Any:
    return Settings.model_fields[name].get_default(call_default_factory=True)


def node_id(index: int) -> str:
    return f"fleet-{index:05d}"


def tier_of(index: int) -> str:
    return TIERS[index % len(TIERS)]


@dataclass(frozen=True)
class NodesSpec:
    """One process's share of the fleet and the settings every node runs with."""

    process: int
    first: int  # the index of its first node
    count: int
    database_url: str  # through PgBouncer
    nats_url: str  # every server, comma-separated, as NATS_URL
    heartbeat_interval: float = _default("heartbeat_interval_seconds")
    jitter_fraction: float = _default("scheduler_jitter_fraction")
    startup_spread: float = 30.0  # STARTUP_SPREAD_SECONDS' production value
    pull_wait: float = _default("worker_pull_wait_seconds")
    reconnect_base: float = _default("nats_reconnect_base_seconds")
    reconnect_cap: float = _default("nats_reconnect_max_seconds")
    pool_size: int = _default("database_pool_size")
    database_timeout: float = _default("database_timeout_seconds")
    nats_timeout: float = _default("backend_timeout_seconds")
    nice: int = 0  # added to the process's niceness: the nodes' CPU is not the servers'


def worker_config(tier: str, pull_wait: float) -> WorkerConfig:
    """The worker's configuration at the defaults (what the worker feature decides)."""
    return WorkerConfig(
        tier=tier, concurrency=_default("worker_concurrency"), batch=_default("job_fetch_batch"),
        ack_wait=_default("job_ack_wait_seconds"), max_attempts=_default("job_max_attempts"),
        max_deliveries=_default("job_max_deliveries"),
        backoff=tuple(_default("job_backoff_seconds")),
        not_here_delay=_default("job_not_here_delay_seconds"),
        held_delay=_default("job_held_delay_seconds"),
        job_timeout=_default("job_timeout_seconds"), pull_wait=pull_wait,
    )  # fmt: skip


class _NoRenewals:
    """The leases' ledger: never called, since no job is published to the fleet."""

    async def renew(self, *, key: str, lease_seconds: float) -> bool:
        raise AssertionError("the fleet benchmark publishes no job")


@dataclass
class Storm:
    """One node's connection through a storm: when it lost the server, when it was
    connected again, the waits of its attempts, when its pulls were subscribed again."""

    server: int | None  # the port connected to when the storm began
    lost_at: float | None = None
    back_at: float | None = None
    back_to: int | None = None
    waits: list[float] = field(default_factory=list)
    resubscribed: set[str] = field(default_factory=set)
    resubscribed_at: float | None = None


class _Counted:
    """A pull subscription that counts its fetches (one pull request each)."""

    def __init__(self, node: Node, stream: str, sub: Subscription) -> None:
        self._node, self._stream, self._sub = node, stream, sub

    async def fetch(
        self, batch: int, *, wait: float, cut: Sequence[asyncio.Event] = ()
    ) -> Sequence[Message]:
        self._node.stats.pulls[(self._node.tier, self._stream)] += 1
        return await self._sub.fetch(batch, wait=wait, cut=cut)

    async def unsubscribe(self) -> None:
        await self._sub.unsubscribe()


class _CountingSource:
    """The bus as the fetcher sees it, counting pull requests and noting subscribes."""

    def __init__(self, node: Node) -> None:
        self._node = node
        self._bus = node.bus

    @property
    def connected(self) -> bool:
        return self._bus.connected

    @property
    def reconnects(self) -> int:
        return self._bus.reconnects

    @property
    def lost(self) -> asyncio.Event:
        return self._bus.lost

    async def subscribe(self, *, stream: str, durable: str) -> Subscription:
        sub = await self._bus.subscribe(stream=stream, durable=durable)
        self._node.subscribed(stream)
        return _Counted(self._node, stream, sub)


@dataclass
class Stats:
    """What the nodes of one process measured since the last `take`."""

    beats: list[int] = field(default_factory=list)  # heartbeat wall, ns
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    pulls: Counter[tuple[str, str]] = field(default_factory=Counter)


class Node:
    def __init__(self, index: int, spec: NodesSpec, stats: Stats) -> None:
        self.id, self.tier, self.stats = node_id(index), tier_of(index), stats
        self.registry = AsyncpgRegistry(
            spec.database_url, timeout=spec.database_timeout, max_connections=spec.pool_size,
            manager_version=__version__, transaction_pooler=True,
        )  # fmt: skip
        hardware = {"cpu_count": 8, "memory_gb": 32, "arch": "x86_64", "gpu": index % 7 == 0}

        async def fingerprint() -> dict[str, Any]:
            return hardware

        profile = LocalProfile(
            node_id=self.id, tier=Tier(self.tier), region=REGIONS[index % len(REGIONS)],
            trust_zone=None, capabilities=["embeddings"] if index % 2 else ["scraping"],
            fingerprint=fingerprint,
        )  # fmt: skip
        interval = spec.heartbeat_interval
        # as the registry feature makes it (app/services/features/registry.py)
        self.heartbeat = Heartbeat(registry=self.registry, profile=profile,
                                   interval_seconds=interval,
                                   retry_max_wait=min(5.0, interval / 4))  # fmt: skip
        self.policy = ReconnectPolicy(base=spec.reconnect_base, cap=spec.reconnect_cap)
        # as the worker feature makes it (app/services/features/worker.py)
        self.bus = JetStreamBus(
            NatsServers.parse(spec.nats_url), name=f"workload-manager/{self.id}",
            timeout=spec.nats_timeout, inbox_prefix=inbox_prefix(self.tier, self.id),
            reconnect=self.policy, on_change=self._changed, on_attempt=self._attempted,
        )  # fmt: skip
        self.stop = asyncio.Event()
        self.config = worker_config(self.tier, spec.pull_wait)
        self.fetcher = Fetcher(bus=_CountingSource(self), config=self.config, clock=LoopClock(),
                               stop=self.stop)  # fmt: skip
        self.streams: set[str] = set()  # subscribed at least once
        self.registered = False
        self.storm: Storm | None = None
        self.task: asyncio.Task[None] | None = None

    @property
    def server(self) -> int | None:
        """The port of the server connected to now."""
        nc = self.bus._nc  # the bus keeps its client private; the benchmark only reads it
        url = getattr(nc, "connected_url", None) if nc is not None else None
        return url.port if url is not None and self.bus.connected else None

    def _changed(self, why: str | None) -> None:
        storm = self.storm
        if storm is None:
            return
        if why is not None and storm.lost_at is None:
            storm.lost_at = time.monotonic()
        elif why is None and storm.lost_at is not None and storm.back_at is None:
            storm.back_at, storm.back_to = time.monotonic(), self.server

    def _attempted(self, attempt: int, wait: float) -> None:
        if self.storm is not None and self.storm.back_at is None:
            self.storm.waits.append(wait)

    def subscribed(self, stream: str) -> None:
        self.streams.add(stream)
        storm = self.storm
        if storm is not None and storm.back_at is not None and storm.resubscribed_at is None:
            storm.resubscribed.add(stream)
            if len(storm.resubscribed) == len(STREAMS):
                storm.resubscribed_at = time.monotonic()

    async def beat(self) -> None:
        """The registry's timer body: one heartbeat (registering first), timed."""
        began = time.perf_counter_ns()
        outcome = await self.heartbeat.beat()
        self.stats.beats.append(time.perf_counter_ns() - began)
        self.stats.outcomes[outcome.result.value] += 1
        if outcome.result is Result.OK:
            self.registered = True
        elif outcome.error:
            self.stats.errors[outcome.error[:120]] += 1

    async def work(self, start_after: float) -> None:
        """The worker's run: connect a start-up draw late, announce, long-poll every stream."""
        await asyncio.sleep(start_after)
        await self.bus.connect()
        body = event_body(node_id=self.id, job_id=None, idempotency_key=None, at=datetime.now(UTC))
        try:
            await self.bus.publish(event_subject(self.id, EventKind.NODE_ONLINE), body)
        except BusError as exc:
            self.stats.errors[f"node.online: {exc}"[:120]] += 1
        queue = JobQueue(self.config.concurrency)
        terms = Terms(ledger=cast(Any, _NoRenewals()), ack_wait=self.config.ack_wait,
                      clock=LoopClock(), spawn=asyncio.create_task)  # fmt: skip
        leases = Leases(terms)
        await asyncio.gather(
            *(self.fetcher.fetch(stream, queue, leases) for stream in STREAMS.values())
        )

    async def close(self) -> None:
        self.stop.set()
        if self.task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self.task, 5)
        await self.bus.drain(within=2.0)
        await self.registry.close()


class Fleet:
    """One process's nodes, one scheduler for all of their heartbeats."""

    def __init__(self, spec: NodesSpec) -> None:
        self.spec = spec
        self.stats = Stats()
        self.nodes: list[Node] = []
        self.scheduler: Scheduler | None = None
        self.marked_at: float | None = None

    async def start(self) -> dict[str, Any]:
        spec = self.spec
        self.scheduler = Scheduler(jitter_fraction=spec.jitter_fraction)
        spread = StartupSpread(spec.startup_spread)
        for index in range(spec.first, spec.first + spec.count):
            node = Node(index, spec, self.stats)
            await node.registry.open()  # an empty pool: no connection until the first beat
            self.scheduler.add(f"heartbeat-{node.id}", node.beat, every=spec.heartbeat_interval,
                               first_after=spread.after(HEARTBEAT_FIRST_AFTER))  # fmt: skip
            node.task = asyncio.create_task(node.work(spread.offset()), name=f"work-{node.id}")
            self.nodes.append(node)
        self.scheduler.start()
        return {"nodes": len(self.nodes), "pid": os.getpid()}

    async def status(self) -> dict[str, Any]:
        """How many nodes are registered, connected and pulling from every stream; where."""
        servers = Counter(str(n.server) for n in self.nodes if n.server is not None)
        failed = [n.task for n in self.nodes if n.task is not None and n.task.done()]
        return {
            "registered": sum(n.registered for n in self.nodes),
            "connected": sum(n.bus.connected for n in self.nodes),
            "subscribed": sum(len(n.streams) == len(STREAMS) for n in self.nodes),
            "servers": dict(servers),
            "worker_ended": [
                repr(t.exception() if not t.cancelled() else "cancelled") for t in failed
            ][:5],
            "gave_up": sum(n.bus._nc is not None and n.bus._nc.is_closed for n in self.nodes),
        }

    async def take(self) -> dict[str, Any]:
        """What was measured since the last take, as lists and counts; starts over."""
        stats, self.stats = self.stats, Stats()
        for node in self.nodes:
            node.stats = self.stats
        return {
            "beats_us": [ns // 1000 for ns in stats.beats], "outcomes": dict(stats.outcomes),
            "errors": dict(stats.errors.most_common(10)),
            "pulls": {f"{tier}/{stream}": n for (tier, stream), n in stats.pulls.items()},
        }  # fmt: skip

    async def policy(self, *, fixed_wait: float | None) -> dict[str, Any]:
        """Every node's reconnect policy: the configured full jitter, or with `fixed_wait`
        the same wait before every attempt (nats-py's own behaviour, for comparison)."""
        for node in self.nodes:
            node.bus._policy = (  # the bus has no setter: the comparison swaps it in place
                node.policy
                if fixed_wait is None
                else ReconnectPolicy(base=fixed_wait, cap=fixed_wait, draw=lambda: 1.0)
            )
        return {}

    async def mark(self) -> dict[str, Any]:
        """A storm begins: every node notes where it is connected and starts its record."""
        for node in self.nodes:
            node.storm = Storm(server=node.server)
        return await self.status()

    async def storm(self, *, server: int) -> dict[str, Any]:
        """The records of the nodes that were on `server` (monotonic seconds), and ends
        the storm's record once every one of them is back and subscribed."""
        rows = []
        for node in self.nodes:
            storm = node.storm
            if storm is None or storm.server != server:
                continue
            rows.append({"lost_at": storm.lost_at, "back_at": storm.back_at,
                         "back_to": storm.back_to, "waits": storm.waits,
                         "resubscribed_at": storm.resubscribed_at})  # fmt: skip
        return {"nodes": rows, "now": time.monotonic()}

    async def unmark(self) -> dict[str, Any]:
        for node in self.nodes:
            node.storm = None
        return {}

    async def close(self) -> dict[str, Any]:
        if self.scheduler is not None:
            await self.scheduler.stop(within=2.0)
        await asyncio.gather(*(n.close() for n in self.nodes), return_exceptions=True)
        return {}


class CountingHandler(logging.Handler):
    """The nodes' log records counted by what they say (numbers as N), not printed: a
    thousand fetchers retrying after a server's loss would fill the terminal."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        text = re.sub(r"\d+(\.\d+)?", "N", record.getMessage().split(": ", 1)[0])
        self.counts[f"{record.levelname} {text[:90]}"] += 1

    def take(self) -> dict[str, int]:
        counts, self.counts = self.counts, Counter()
        return dict(counts.most_common(12))


def raise_open_files() -> tuple[int, int]:
    """The soft open-file limit raised to the hard one; both, as they are now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def serve(conn: Connection, spec: NodesSpec) -> None:
    """A process of the fleet: answers (command, arguments) on `conn` until `close`."""
    raise_open_files()
    if spec.nice:
        os.nice(spec.nice)
    handler = CountingHandler()
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    asyncio.run(_serve(conn, spec, handler))


async def _serve(conn: Connection, spec: NodesSpec, handler: CountingHandler) -> None:
    fleet = Fleet(spec)
    while True:
        command, arguments = await asyncio.to_thread(conn.recv)
        try:
            if command == "logs":
                reply: dict[str, Any] = {"logs": handler.take()}
            else:
                reply = await getattr(fleet, command)(**arguments)
        except Exception as exc:  # told to the benchmark, which reports it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        conn.send(reply)
        if command == "close":
            return
