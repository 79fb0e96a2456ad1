"""The JetStream job worker: fetch, decide, answer — each job once in effect.

The shape, in one place, three parts joined by one bounded queue:

- the **fetcher** (`app.services.fetching`): one loop per job stream (MM_ONLINE,
  MM_OFFLINE, MM_WRITE) pulls from the tier's shared durable consumer into the queue,
  which has room for WORKER_CONCURRENCY jobs beyond those running, so a runner that
  finishes finds its next job waiting; it refills the queue once it has room for half a
  batch, in one fetch;
- a **lease** per delivery (`app.services.leasing`), taken at fetch: the one owner of
  `in_progress` to JetStream and the renewal of the claim in the ledger, from the
  moment the delivery is fetched until it is answered, and of the claim's loss (a
  renewal refused while the handler runs stops the handler; nothing is published or
  acked for it);
- the **runners** (`app.services.running`), WORKER_CONCURRENCY tasks, take a lease each
  from the queue, find out what becomes of the delivery as one `Outcome`, and send the
  one answer and event `app.domain.job_flow.plan` gives for it.

The stop has one path. `begin_stop` (the supervisor's `stopping` leads to it too): no
job starts from then on; the fetchers end at once (the stop cuts a long poll short); the
runners, and one
more started for this, hand back (NAK without delay) whatever they take from the queue;
the jobs running finish. When
`drain` runs out of time it cuts the leases: the jobs still running are withdrawn,
released in the ledger and handed back. `run` returns once every delivery held here is
answered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

from app.adapters.bus import BusError
from app.domain import components
from app.domain.job_flow import WorkerConfig
from app.domain.jobs import STREAMS, EventKind, event_body, event_subject
from app.domain.requirements import NodeProfile
from app.metrics import Metrics
from app.services.fetching import Fetcher, JobQueue, Source
from app.services.handlers import JobHandlers
from app.services.leasing import (
    Clock,
    Leases,
    LoopClock,
    Terms,
    lease_seconds,
    request_timeout,
)
from app.services.running import (
    HAND_BACK_SECONDS,
    Events,
    EventUnsent,
    Ledger,
    Registry,
    Runner,
)

if TYPE_CHECKING:
    from app.services.alerting import Alerter

__all__ = [
    "HAND_BACK_SECONDS",
    "Bus",
    "EventUnsent",
    "Ledger",
    "Registry",
    "Worker",
    "lease_seconds",
    "request_timeout",
]

log = logging.getLogger(__name__)

# a stream whose fetch has not returned for this long beyond its long poll's wait (and
# that does not wait for room in the queue) is stuck: a long poll returns every pull wait
STALE_FETCH_SECONDS = 30.0


class Bus(Source, Events, Protocol):
    """What the worker asks of the bus (`app.adapters.bus.JetStreamBus`): job streams to
    fetch from, and the events stream."""


class Worker:
    """The job worker of one node: `run` is its supervised task; `begin_stop` and
    `drain` its stop."""

    def __init__(
        self,
        *,
        bus: Bus,
        ledger: Ledger,
        registry: Registry | None,
        node: Callable[[], Awaitable[NodeProfile]],
        handlers: JobHandlers,
        config: WorkerConfig,
        metrics: Metrics,
        alerts: Alerter | None = None,
        prepare: Callable[[], Awaitable[None]] | None = None,
        clock: Clock | None = None,
        start_after: float = 0.0,
    ) -> None:
        self._bus = bus
        # the first run waits this long before it connects (STARTUP_SPREAD_SECONDS' draw)
        self._start_after = start_after
        self._ledger = ledger
        self._node = node
        self._config = config
        self._prepare = prepare
        self._clock = clock or LoopClock()
        self._stop = asyncio.Event()  # no job starts here once it is set
        self._leases: Leases | None = None  # the running `run`'s
        self._runner = Runner(
            bus=bus, ledger=ledger, registry=registry, node=node, handlers=handlers,
            config=config, metrics=metrics, alerts=alerts, clock=self._clock,
            stop=self._stop,
        )  # fmt: skip
        self._fetcher = Fetcher(bus=bus, config=config, clock=self._clock, stop=self._stop)

    @property
    def node_id(self) -> str:
        return self._runner.node_id

    def state(self) -> components.Outcome | None:
        """What the worker is doing now, read from its fetchers: failing while a stream's
        subscribe or fetch fails (naming each), unavailable when a stream has not returned
        from a fetch for `STALE_FETCH_SECONDS` past its pull wait (a long poll returns
        every pull wait) and does not wait for room in the queue, else ok; None until it
        runs."""
        if self._leases is None:
            return None
        fetcher = self._fetcher
        if fetcher.troubles:
            return components.Outcome.failed("; ".join(sorted(fetcher.troubles.values())))
        now = self._clock.now()
        config = self._config
        stale = STALE_FETCH_SECONDS + max(config.fetch_wait, config.pull_wait)
        for stream, at in sorted(fetcher.fetched_at.items()):
            if now - at > stale and stream not in fetcher.waiting:
                return components.Outcome.unavailable(
                    f"no fetch from {stream} for {now - at:.0f} s"
                )
        return components.Outcome.ok(in_flight=self.in_flight)

    @property
    def in_flight(self) -> int:
        """Deliveries held here: running, or fetched and waiting for a runner."""
        return 0 if self._leases is None else len(self._leases)

    async def run(self, stopping: asyncio.Event) -> None:
        """The root task (supervised): connect and prepare, then the fetchers and runners;
        returns once the stop began (`stopping` set, or `begin_stop`) and what was held
        here is answered. Its first run waits `start_after` first (the stop ends it)."""
        if self._start_after > 0:
            delay, self._start_after = self._start_after, 0.0
            log.info("job worker connects in %.1f s (start-up spread)", delay)
            relay = asyncio.create_task(self._relay(stopping), name="worker-start-relay")
            try:
                await self._clock.wait(self._stop, delay)
            finally:
                relay.cancel()
                await asyncio.gather(relay, return_exceptions=True)
            if self._stop.is_set():
                return
        if self._prepare is not None:
            await self._prepare()
        self._runner.node_id = (await self._node()).node_id
        await self._node_event(EventKind.NODE_ONLINE)
        queue = JobQueue(self._config.concurrency)
        try:
            async with asyncio.TaskGroup() as group:
                terms = Terms(
                    ledger=self._ledger, ack_wait=self._config.ack_wait, clock=self._clock,
                    spawn=group.create_task,
                )  # fmt: skip
                leases = self._leases = Leases(terms)
                runners = [
                    group.create_task(self._runner.serve(queue), name=f"job-runner-{i}")
                    for i in range(self._config.concurrency)
                ]
                fetchers = [
                    group.create_task(
                        self._fetcher.fetch(stream, queue, leases), name=f"job-fetch-{kind}"
                    )
                    for kind, stream in STREAMS.items()
                ]
                relay = group.create_task(self._relay(stopping), name="worker-stop-relay")
                await self._stop.wait()
                # one runner more, which only hands back (nothing starts now): what waits
                # in the queue goes back at once, not once a running job is done
                runners.append(group.create_task(self._runner.serve(queue), name="job-hand-back"))
                # a fetch in flight is cut short by the stop; what it brought is queued,
                # and handed back
                await asyncio.wait(fetchers)
                await queue.join()
                for task in (*runners, relay):
                    task.cancel()
        finally:
            self._leases = None

    async def _relay(self, stopping: asyncio.Event) -> None:
        await stopping.wait()
        self.begin_stop()

    def begin_stop(self) -> None:
        """From now on no job starts here; what is fetched is handed back."""
        if not self._stop.is_set():
            self._stop.set()
            log.info("job worker stopping: %d job(s) in flight", self._runner.busy)

    async def drain(self, *, within: float) -> None:
        """Start nothing new; let the jobs in flight finish within `within` seconds, and
        hand back (release and NAK) those that cannot. The fetchers end at once (the
        stop cuts their pulls short); whatever they brought, or waits in the queue, is
        handed back."""
        self.begin_stop()
        leases = self._leases
        if leases is None or not len(leases):
            return
        clock = self._clock
        ends = clock.now() + within
        # the last moments are kept for the jobs that must be handed back
        wait = max(0.0, within - HAND_BACK_SECONDS)
        log.info("waiting up to %.1f s for %d job(s) in flight", wait, self._runner.busy)
        if await clock.wait(leases.none_held, wait):
            return
        leases.cut()  # each running job's lease withdraws it: released, handed back
        await clock.wait(leases.none_held, max(0.1, ends - clock.now()))

    async def announce_draining(self) -> None:
        await self._node_event(EventKind.NODE_DRAINING)

    async def announce_offline(self) -> None:
        await self._node_event(EventKind.NODE_OFFLINE)

    async def _node_event(self, kind: EventKind) -> None:
        body = event_body(
            node_id=self.node_id, job_id=None, idempotency_key=None, at=datetime.now(UTC)
        )
        try:
            await self._bus.publish(event_subject(self.node_id, kind), body)
        except BusError as exc:
            log.warning("node event %s not published: %s", kind.value, exc)
