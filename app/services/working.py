"""The JetStream job worker: fetch, admit, claim, run, answer — each job once in effect.

For each job stream (MM_ONLINE, MM_OFFLINE, MM_WRITE) one loop fetches from the tier's
shared durable consumer, within `concurrency` jobs in flight across all three. A job is
parsed and admitted (pure `admit`), claimed in the Postgres ledger by its idempotency
key, run by its handler while `in_progress()` and a lease renewal keep it ours, and
answered: ack after success, nak with the backoff delay for a retryable failure, term
plus a dead-letter event otherwise. Every outcome is also an event on MM_EVENTS.

The loops re-create their pull subscription after every reconnect (a pull subscription
can go silent after a server restart) and back off on errors instead of spinning.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import stamina

from app.adapters.bus import BusError, Delivery, JetStreamBus, PullSubscription
from app.adapters.registry import AsyncpgLedger, AsyncpgRegistry, Claim, RegistryUnavailable
from app.adapters.workload_http import WorkloadHttp
from app.domain.components import Component
from app.domain.jobs import (
    STREAMS,
    Admission,
    EventKind,
    Job,
    Rejection,
    admit,
    after_failure,
    classify_failure,
    consumer_name,
    event_body,
    event_subject,
    parse_job,
)
from app.domain.requirements import NodeProfile
from app.metrics import Metrics
from app.services.handlers import Handler, HandlerContext

if TYPE_CHECKING:
    from app.services.alerting import Alerter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    tier: str
    concurrency: int
    batch: int
    ack_wait: float
    max_deliver: int
    backoff: tuple[float, ...]
    not_here_delay: float
    held_delay: float
    job_timeout: float
    fetch_wait: float = 1.0


class Worker:
    def __init__(
        self,
        *,
        bus: JetStreamBus,
        ledger: AsyncpgLedger,
        registry: AsyncpgRegistry,
        node: Callable[[], Awaitable[NodeProfile]],
        handlers: dict[str, Handler],
        http: WorkloadHttp,
        config: WorkerConfig,
        metrics: Metrics,
        component: Component,
        alerts: Alerter | None = None,
    ) -> None:
        self._alerts = alerts
        self._bus = bus
        self._ledger = ledger
        self._registry = registry
        self._node = node
        self._handlers = handlers
        self._http = http
        self._config = config
        self._metrics = metrics
        self._component = component
        self._tasks: set[asyncio.Task[None]] = set()
        # FIFO-fair: the three stream loops take turns, none can starve the others.
        self._slots = asyncio.Semaphore(config.concurrency)
        self._running_keys: set[str] = set()
        self._stopping = False
        self.node_id = ""

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def run(self) -> None:
        """The root task: one consume loop per job stream; returns when stopped."""
        self.node_id = (await self._node()).node_id
        await self._node_event(EventKind.NODE_ONLINE)
        async with asyncio.TaskGroup() as group:
            for kind, stream in STREAMS.items():
                group.create_task(self._consume(stream), name=f"consume-{kind}")

    async def stop(self, *, grace: float) -> None:
        """Stop fetching; let jobs in flight finish within `grace`, hand back the rest."""
        self._stopping = True
        if self._tasks:
            log.info("waiting up to %.1f s for %d job(s) in flight", grace, len(self._tasks))
            _done, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5)
        await self._node_event(EventKind.NODE_OFFLINE)

    async def announce_draining(self) -> None:
        await self._node_event(EventKind.NODE_DRAINING)

    # -- fetching ------------------------------------------------------------------

    async def _consume(self, stream: str) -> None:
        durable = consumer_name(self._config.tier)
        subscription: PullSubscription | None = None
        seen_reconnects = -1
        failures = 0
        # An idle stream long-polls with one slot; once it delivers, it fetches in batches.
        # Holding a batch of slots while waiting on an empty stream would starve busy ones.
        active = False
        while not self._stopping:
            if not self._bus.connected:
                await asyncio.sleep(0.2)
                continue
            if subscription is None or seen_reconnects != self._bus.reconnects:
                if subscription is not None:
                    await subscription.unsubscribe()
                try:
                    subscription = await self._bus.subscribe(stream=stream, durable=durable)
                except BusError as exc:
                    failures += 1
                    subscription = None
                    await self._pause(f"subscribe to {stream}/{durable}", exc, failures)
                    continue
                seen_reconnects = self._bus.reconnects
            slots = await self._reserve(batch=self._config.batch if active else 1)
            if slots == 0:
                continue
            try:
                deliveries = await subscription.fetch(slots, wait=self._config.fetch_wait)
            except BusError as exc:
                self._give_back(slots)
                failures += 1
                subscription = None
                await self._pause(f"fetch from {stream}", exc, failures)
                continue
            failures = 0
            active = bool(deliveries)
            self._give_back(slots - len(deliveries))
            for delivery in deliveries:
                self._spawn(delivery)
        if subscription is not None:
            await subscription.unsubscribe()

    async def _reserve(self, *, batch: int) -> int:
        """Wait for a free job slot (in turn), then take more free ones, up to `batch`."""
        while not self._stopping:
            try:
                await asyncio.wait_for(self._slots.acquire(), timeout=1.0)
            except TimeoutError:
                continue
            slots = 1
            while slots < batch and not self._slots.locked():
                await self._slots.acquire()  # free: returns at once
                slots += 1
            return slots
        return 0

    def _give_back(self, slots: int) -> None:
        for _ in range(slots):
            self._slots.release()

    async def _pause(self, what: str, exc: BaseException, failures: int) -> None:
        delay = min(30.0, 0.5 * 2 ** min(failures, 6)) * random.uniform(0.5, 1.0)
        log.warning("%s failed (%d in a row): %s; retrying in %.1f s", what, failures, exc, delay)
        self._component.failed(datetime.now(UTC), f"{what}: {exc}")
        await asyncio.sleep(delay)

    def _spawn(self, delivery: Delivery) -> None:
        task = asyncio.create_task(self._handle(delivery), name=f"job-{delivery.stream_sequence}")
        self._tasks.add(task)

        def finished(done: asyncio.Task[None]) -> None:
            self._tasks.discard(done)
            self._slots.release()

        task.add_done_callback(finished)

    # -- one job -------------------------------------------------------------------

    async def _handle(self, delivery: Delivery) -> None:
        started = time.monotonic()
        job = parse_job(delivery.data, delivery.subject)
        job_type = job.type if isinstance(job, Job) else "invalid"
        try:
            outcome = await self._process(delivery, job)
        except BusError as exc:
            # The answer could not be sent; JetStream redelivers after ack_wait and the
            # ledger makes the redelivery harmless.
            outcome = "bus-error"
            log.warning("job answer not sent (%s): %s", job_type, exc)
        except Exception:
            # A bug here must not kill the task silently; the unanswered message comes back
            # after ack_wait, and the ledger keeps that harmless.
            outcome = "error"
            log.exception("job %s could not be handled", job_type)
        # the type label is bounded by the handlers this node has: a publisher inventing
        # types must not invent time series
        label = job_type if job_type in self._handlers or job_type == "invalid" else "unknown"
        self._metrics.jobs.labels(label, outcome).inc()
        self._metrics.job_duration.labels(label).observe(time.monotonic() - started)
        if outcome not in ("bus-error", "ledger-error"):
            self._component.succeeded(datetime.now(UTC))

    async def _process(self, delivery: Delivery, job: Job | Rejection) -> str:
        decision = admit(job, node=await self._node(), now=datetime.now(UTC))
        if decision.admission is Admission.REJECT:
            await self._event(EventKind.REJECTED, job, reason=decision.reason)
            await delivery.term()
            log.warning("job rejected: %s", decision.reason)
            return "rejected"
        assert isinstance(job, Job)
        if decision.admission is Admission.EXPIRE:
            await self._event(EventKind.EXPIRED, job, reason=decision.reason)
            await delivery.term()
            return "expired"
        if decision.admission is Admission.SECURITY:
            await self._event(EventKind.REJECTED, job, reason=decision.reason, security=True)
            await delivery.term()
            log.error("security: job %s refused: %s", job.job_id, decision.reason)
            self._alert(f"job:security:{job.type}", f"job {job.job_id} refused: {decision.reason}")
            return "refused"
        if decision.admission is Admission.NOT_HERE:
            return await self._not_here(delivery, job, decision.reason)
        if job.type not in self._handlers:
            return await self._not_here(delivery, job, f"no handler for type {job.type!r}")
        if job.idempotency_key in self._running_keys:
            await delivery.nak(self._config.held_delay)
            return "held"
        return await self._claim_and_run(delivery, job)

    async def _not_here(self, delivery: Delivery, job: Job, reason: str) -> str:
        if delivery.delivered >= self._config.max_deliver:
            # the next NAK would be the last delivery spent: dead-letter it visibly instead
            await self._event(EventKind.DEAD, job, reason=f"{reason}; no node ran it after "
                              f"{delivery.delivered} deliveries")  # fmt: skip
            await delivery.term()
            return "dead"
        try:
            eligible = await self._registry.eligible(job.requirements)
        except RegistryUnavailable as exc:
            log.warning("cannot ask the registry who could run job %s: %s", job.job_id, exc)
            eligible = None
        if eligible == []:
            await self._event(
                EventKind.UNROUTABLE, job, reason=f"no live node can run it: {reason}"
            )
            log.warning("job %s (%s): no live node can run it: %s", job.job_id, job.type, reason)
            self._metrics.jobs_unroutable.inc()
            self._alert(f"job:unroutable:{job.type}",
                        f"no live node can run {job.type} jobs ({reason})")  # fmt: skip
        await delivery.nak(self._config.not_here_delay)
        return "not-here"

    async def _claim_and_run(self, delivery: Delivery, job: Job) -> str:
        key = job.idempotency_key
        try:
            claim, lease_left = await self._ledger.claim(
                key=key, job_id=str(job.job_id), job_type=job.type, node_id=self.node_id,
                lease_seconds=self._lease,
            )  # fmt: skip
        except RegistryUnavailable as exc:
            log.warning("ledger unavailable, job %s handed back: %s", job.job_id, exc)
            await delivery.nak(self._config.held_delay)
            return "ledger-error"
        if claim is Claim.COMPLETED:
            await delivery.ack()
            return "duplicate"
        if claim is Claim.DEAD:
            await delivery.term()
            return "duplicate-dead"
        if claim is Claim.HELD:
            if delivery.delivered >= self._config.max_deliver:
                # A duplicate of a job another node is running: that node's own delivery
                # completes it, or is redelivered if the node dies. This copy can go.
                await delivery.term()
                return "duplicate-held"
            # look again when the other node's lease would have run out
            await delivery.nak(max(self._config.held_delay, lease_left + 0.5))
            return "held"
        self._running_keys.add(key)
        try:
            return await self._run(delivery, job)
        finally:
            self._running_keys.discard(key)

    @property
    def _lease(self) -> float:
        return self._config.ack_wait * 2

    async def _run(self, delivery: Delivery, job: Job) -> str:
        key = job.idempotency_key
        keep_alive = asyncio.create_task(self._keep_alive(delivery, key))
        context = HandlerContext(
            node_id=self.node_id, delivered=delivery.delivered, http=self._http
        )
        try:
            result = await asyncio.wait_for(
                self._handlers[job.type](job, context), timeout=self._config.job_timeout
            )
        except asyncio.CancelledError:
            # shutdown ran out of grace: hand the job back for someone else, now
            await self._write(lambda: self._ledger.release(key=key, node_id=self.node_id))
            await delivery.nak(1.0)
            raise
        except Exception as exc:
            return await self._failed(delivery, job, exc)
        finally:
            keep_alive.cancel()
        await self._write(
            lambda: self._ledger.complete(key=key, node_id=self.node_id, result=result)
        )
        await self._event(EventKind.COMPLETED, job, result=result)
        await delivery.ack()
        return "completed"

    async def _failed(self, delivery: Delivery, job: Job, exc: Exception) -> str:
        kind = classify_failure(exc)
        verdict = after_failure(
            kind,
            delivered=delivery.delivered,
            max_deliver=self._config.max_deliver,
            backoff=self._config.backoff,
        )
        reason = f"{type(exc).__name__}: {exc}"
        key = job.idempotency_key
        if verdict.retry:
            await self._write(
                lambda: self._ledger.fail(key=key, node_id=self.node_id, error=reason, dead=False)
            )
            await self._event(EventKind.FAILED, job, reason=reason, retry_in_seconds=verdict.delay,
                              delivered=delivery.delivered)  # fmt: skip
            await delivery.nak(verdict.delay)
            log.info(
                "job %s failed (%s), retry in %.0f s: %s", job.job_id, kind, verdict.delay, reason
            )
            return "retrying"
        await self._write(
            lambda: self._ledger.fail(key=key, node_id=self.node_id, error=reason, dead=True)
        )
        await self._event(EventKind.DEAD, job, reason=reason, delivered=delivery.delivered)
        await delivery.term()
        self._alert(f"job:dead:{job.type}", f"{job.type} job {job.job_id} dead-lettered: {reason}")
        log.warning(
            "job %s dead-lettered after %d deliveries: %s", job.job_id, delivery.delivered, reason
        )
        return "dead"

    def _alert(self, key: str, text: str) -> None:
        if self._alerts is not None:
            self._alerts.alert(key, text)

    async def _keep_alive(self, delivery: Delivery, key: str) -> None:
        """Tell JetStream and the ledger the job is still ours, every ack_wait/3."""
        interval = max(self._config.ack_wait / 3, 0.1)
        while True:
            await asyncio.sleep(interval)
            try:
                await delivery.in_progress()
                await self._ledger.renew(key=key, node_id=self.node_id, lease_seconds=self._lease)
            except (*BusError, *RegistryUnavailable) as exc:
                log.warning("keep-alive for job %s failed: %s", key, exc)

    async def _write(self, operation: Callable[[], Awaitable[bool]]) -> None:
        """A ledger write after the work is done: retried briefly; failure is logged.

        The answer to JetStream is sent either way: holding it back would let the job
        run a second time, which is worse than a ledger row left `running`.
        """
        try:
            async for attempt in stamina.retry_context(
                on=RegistryUnavailable, attempts=3, wait_initial=0.1, wait_max=1.0, timeout=None
            ):
                with attempt:
                    await operation()
        except RegistryUnavailable as exc:
            log.error("ledger write failed after the job ran: %s", exc)

    async def _event(self, kind: EventKind, job: Job | Rejection, **fields: Any) -> None:
        job_id = str(job.job_id) if job.job_id is not None else None
        key = job.idempotency_key
        body = event_body(
            node_id=self.node_id, job_id=job_id, idempotency_key=key, at=datetime.now(UTC),
            **fields,
        )  # fmt: skip
        msg_id = f"{key or job_id or time.monotonic_ns()}:{kind.value}:{fields.get('delivered', 0)}"
        try:
            await self._bus.publish(event_subject(self.node_id, kind), body, msg_id=msg_id)
        except BusError as exc:
            log.warning("event %s for job %s not published: %s", kind.value, job_id, exc)

    async def _node_event(self, kind: EventKind) -> None:
        body = event_body(
            node_id=self.node_id, job_id=None, idempotency_key=None, at=datetime.now(UTC)
        )
        try:
            await self._bus.publish(event_subject(self.node_id, kind), body)
        except BusError as exc:
            log.warning("node event %s not published: %s", kind.value, exc)
