"""The JetStream job worker: fetch, admit, claim, run, answer — each job once in effect.

For each job stream (MM_ONLINE, MM_OFFLINE, MM_WRITE) one loop fetches from the tier's
shared durable consumer, within `concurrency` jobs in flight across all three. A job is
parsed and admitted (pure `admit`), claimed in the idempotency ledger (PostgreSQL, or a
JetStream key-value bucket on nodes without a database) by its idempotency key, run by
its handler while `in_progress()` and a lease renewal keep it ours, and answered: ack
after success, nak with the backoff delay for a retryable failure, term plus a
dead-letter event otherwise. Every outcome is also an event on MM_EVENTS.

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
from typing import TYPE_CHECKING, Any, Protocol

import stamina

from app.adapters.bus import BusError, Delivery, JetStreamBus, PullSubscription
from app.adapters.kv_ledger import LedgerUnavailable
from app.adapters.registry import AsyncpgRegistry, RegistryUnavailable
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
from app.domain.ledger import Claim
from app.domain.requirements import NodeProfile
from app.metrics import Metrics
from app.services.handlers import Handler, HandlerContext

if TYPE_CHECKING:
    from app.services.alerting import Alerter

log = logging.getLogger(__name__)

# kept at the end of a drain for releasing and handing back the jobs that did not finish
HAND_BACK_SECONDS = 1.0
# tries of a ledger write or an event publish that fit in one lease: a request to a stream
# whose leader just died gets no answer until it times out, so each try gets a quarter of
# the lease, and the keep-alive's renewals get through as soon as a new leader answers
LEASE_TRIES = 4
# what a ledger raises when its store cannot be reached (PostgreSQL or JetStream)
LEDGER_ERRORS = (*RegistryUnavailable, LedgerUnavailable)


def lease_seconds(ack_wait: float) -> float:
    """A claim's lease: two ack waits (the keep-alive renews it every third of one)."""
    return 2 * ack_wait


def request_timeout(ack_wait: float) -> float:
    """The most one ledger request or event publish may take: a quarter of the lease."""
    return lease_seconds(ack_wait) / LEASE_TRIES


class EventUnsent(Exception):
    """A job event the stream did not acknowledge (retried, then the job is handed back)."""


class Ledger(Protocol):
    """The idempotency ledger (app/domain/ledger.py has its rules): PostgreSQL's
    `AsyncpgLedger` or the JetStream bucket's `JetStreamLedger`, one contract suite."""

    async def claim(
        self, *, key: str, job_id: str, job_type: str, lease_seconds: float
    ) -> tuple[Claim, float]: ...

    async def renew(self, *, key: str, lease_seconds: float) -> bool: ...

    async def complete(self, *, key: str, result: Any) -> bool: ...

    async def fail(self, *, key: str, error: str, dead: bool) -> bool: ...

    async def release(self, *, key: str) -> bool: ...


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
        ledger: Ledger,
        registry: AsyncpgRegistry | None,
        node: Callable[[], Awaitable[NodeProfile]],
        handlers: dict[str, Handler],
        http: WorkloadHttp,
        config: WorkerConfig,
        metrics: Metrics,
        component: Component,
        alerts: Alerter | None = None,
        prepare: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._alerts = alerts
        self._prepare = prepare
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

    def _is_stopping(self) -> bool:
        # a call, not the attribute: the flag changes while a loop awaits
        return self._stopping

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def run(self, stopping: asyncio.Event) -> None:
        """The root task (supervised): connect and prepare, then one consume loop per job
        stream; returns once `stopping` is set (or `drain` began) and the loops ended."""
        if self._prepare is not None:
            await self._prepare()
        self.node_id = (await self._node()).node_id
        await self._node_event(EventKind.NODE_ONLINE)
        async with asyncio.TaskGroup() as group:
            group.create_task(self._watch(stopping), name="worker-stop-watch")
            for kind, stream in STREAMS.items():
                group.create_task(self._consume(stream), name=f"consume-{kind}")

    async def _watch(self, stopping: asyncio.Event) -> None:
        while not self._stopping:
            try:
                await asyncio.wait_for(stopping.wait(), timeout=self._config.fetch_wait)
            except TimeoutError:
                continue
            self._stopping = True

    def begin_stop(self) -> None:
        """From now on no job starts here; what is fetched is handed back."""
        if not self._stopping:
            self._stopping = True
            log.info("job worker stopping: %d job(s) in flight", len(self._tasks))

    async def drain(self, *, within: float) -> None:
        """Start nothing new; let the jobs in flight finish within `within` seconds, and
        hand back (release and NAK) those that cannot. The consume loops end within one
        fetch wait; whatever they fetch meanwhile is handed back at once."""
        self.begin_stop()
        if not self._tasks:
            return
        clock = asyncio.get_running_loop().time
        ends = clock() + within
        # the last moments are kept for the jobs that must be handed back
        wait = max(0.0, within - HAND_BACK_SECONDS)
        log.info("waiting up to %.1f s for %d job(s) in flight", wait, len(self._tasks))
        _done, pending = await asyncio.wait(set(self._tasks), timeout=wait)
        for task in pending:
            task.cancel()
        if pending:
            _done, stuck = await asyncio.wait(pending, timeout=max(0.1, ends - clock()))
            for task in stuck:
                task.cancel()  # its hand-back outlasted the budget: the ack wait brings it back

    async def announce_draining(self) -> None:
        await self._node_event(EventKind.NODE_DRAINING)

    async def announce_offline(self) -> None:
        await self._node_event(EventKind.NODE_OFFLINE)

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
            # An idle stream's long poll holds no job slot (with three streams, idle ones
            # would keep most of a small WORKER_CONCURRENCY from the busy one): the one
            # message it may bring waits for a slot after it arrives.
            slots = await self._reserve(batch=self._config.batch) if active else 0
            if active and slots == 0:
                continue
            if self._is_stopping():
                self._give_back(slots)
                break
            try:
                deliveries = await subscription.fetch(max(slots, 1), wait=self._config.fetch_wait)
            except BusError as exc:
                self._give_back(slots)
                failures += 1
                subscription = None
                await self._pause(f"fetch from {stream}", exc, failures)
                continue
            failures = 0
            active = bool(deliveries)
            if deliveries and slots == 0:
                slots = await self._reserve(batch=1)  # 0 once the stop began
            if self._is_stopping():
                # fetched while the stop began: another node runs them, none starts here
                self._give_back(slots)
                await self._hand_back(deliveries)
                break
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

    async def _hand_back(self, deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            try:
                await delivery.nak(0.0)
            except BusError as exc:  # it comes back after ack_wait instead
                log.warning("job not handed back on shutdown: %s", exc)

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
        job_type = "invalid"
        try:
            job = parse_job(delivery.data, delivery.subject)
            job_type = job.type if isinstance(job, Job) else "invalid"
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
            if not await self._terminate(delivery, EventKind.REJECTED, job, reason=decision.reason):
                return "event-unsent"
            log.warning("job rejected: %s", decision.reason)
            return "rejected"
        assert isinstance(job, Job)
        if decision.admission is Admission.EXPIRE:
            if not await self._terminate(delivery, EventKind.EXPIRED, job, reason=decision.reason):
                return "event-unsent"
            return "expired"
        if decision.admission is Admission.SECURITY:
            if not await self._terminate(
                delivery, EventKind.REJECTED, job, reason=decision.reason, security=True
            ):
                return "event-unsent"
            log.error("security: job %s refused: %s", job.job_id, decision.reason)
            self._alert(f"job:security:{job.type}", f"job {job.job_id} refused: {decision.reason}")
            return "refused"
        if decision.admission is Admission.NOT_HERE:
            return await self._not_here(delivery, job, decision.reason)
        if job.type not in self._handlers:
            return await self._not_here(delivery, job, f"no handler for type {job.type!r}")
        key = job.idempotency_key
        if key in self._running_keys:
            return await self._held(delivery, self._config.held_delay)
        # taken before the first await of the claim: a second delivery of the key in the
        # same batch sees it and waits, instead of racing this one to the ledger
        self._running_keys.add(key)
        try:
            return await self._claim_and_run(delivery, job)
        finally:
            self._running_keys.discard(key)

    async def _not_here(self, delivery: Delivery, job: Job, reason: str) -> str:
        if delivery.delivered >= self._config.max_deliver:
            # its deliveries are spent: dead-letter it visibly
            spent = f"{reason}; no node ran it after {delivery.delivered} deliveries"
            dead = await self._terminate(delivery, EventKind.DEAD, job, reason=spent)
            return "dead" if dead else "event-unsent"
        eligible = None  # without a registry nobody can say whether another node could
        try:
            if self._registry is not None:
                eligible = await self._registry.eligible(job.requirements)
        except RegistryUnavailable as exc:
            log.warning("cannot ask the registry who could run job %s: %s", job.job_id, exc)
        if eligible == []:
            await self._event(
                EventKind.UNROUTABLE, job, reason=f"no live node can run it: {reason}",
                delivered=delivery.delivered,
            )  # fmt: skip
            log.warning("job %s (%s): no live node can run it: %s", job.job_id, job.type, reason)
            self._metrics.jobs_unroutable.inc()
            self._alert(f"job:unroutable:{job.type}",
                        f"no live node can run {job.type} jobs ({reason})")  # fmt: skip
        await delivery.nak(self._config.not_here_delay)
        return "not-here"

    async def _claim_and_run(self, delivery: Delivery, job: Job) -> str:
        key = job.idempotency_key
        try:
            claim, number = await self._ledger.claim(
                key=key, job_id=str(job.job_id), job_type=job.type, lease_seconds=self._lease
            )
        except LEDGER_ERRORS as exc:
            log.warning("ledger unavailable, job %s handed back: %s", job.job_id, exc)
            await delivery.nak(self._config.held_delay)
            return "ledger-error"
        if claim is Claim.COMPLETED:
            await delivery.ack()
            return "duplicate"
        if claim is Claim.DEAD:
            # dead-lettered before; its event may not have been stored then, so it is sent
            # again (deduplicated by its message id) before the message goes
            if not await self._terminate(
                delivery, EventKind.DEAD, job, reason="dead-lettered before (ledger)"
            ):
                return "event-unsent"
            return "duplicate-dead"
        if claim is Claim.HELD:
            # look again when the holder's lease would have run out (`number` is the
            # seconds left on it)
            return await self._held(delivery, max(self._config.held_delay, number + 0.5))
        if number > self._config.max_deliver:
            # claimed more often than it may be delivered, yet never answered: earlier runs
            # ended in a crash or a hang past their lease; it is not run again
            return await self._dead_letter(
                delivery, job, f"started {int(number) - 1} times without finishing"
            )
        return await self._run(delivery, job)

    async def _held(self, delivery: Delivery, delay: float) -> str:
        """A copy of a job that is running (here or elsewhere): look again later.

        Never terminated while held: the copy that runs may still fail and be handed back
        (or its holder die), and then this copy is what is left of the job. Once the job
        is finished this copy is answered from the ledger.
        """
        await delivery.nak(delay)
        return "held"

    @property
    def _lease(self) -> float:
        return lease_seconds(self._config.ack_wait)

    async def _run(self, delivery: Delivery, job: Job) -> str:
        """Run the handler and answer. The keep-alive lasts until the answer is sent, not
        only while the handler runs: while the ledger cannot record the outcome (its
        store is electing a leader, say) the job stays ours, and neither JetStream's
        redelivery nor an expired lease lets another node run it a second time."""
        key = job.idempotency_key
        keep_alive = asyncio.create_task(self._keep_alive(delivery, key))
        try:
            return await self._run_and_answer(delivery, job)
        finally:
            keep_alive.cancel()

    async def _run_and_answer(self, delivery: Delivery, job: Job) -> str:
        key = job.idempotency_key
        context = HandlerContext(
            node_id=self.node_id, delivered=delivery.delivered, http=self._http
        )
        try:
            result = await asyncio.wait_for(
                self._handlers[job.type](job, context), timeout=self._config.job_timeout
            )
        except asyncio.CancelledError:
            # shutdown ran out of grace: hand the job back for someone else, now
            await self._write(lambda: self._ledger.release(key=key), within=HAND_BACK_SECONDS)
            await delivery.nak(1.0)
            raise
        except Exception as exc:
            return await self._failed(delivery, job, exc)
        await self._write(lambda: self._ledger.complete(key=key, result=result))
        if not await self._event_retried(EventKind.COMPLETED, job, result=result):
            # the job is done (the ledger says so); its next delivery is acked as a
            # duplicate. Acking now would lose the event for good.
            self._metrics.job_events_unsent.inc()
            await delivery.nak(self._config.held_delay)
            return "event-unsent"
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
            await self._write(lambda: self._ledger.fail(key=key, error=reason, dead=False))
            await self._event(EventKind.FAILED, job, reason=reason, retry_in_seconds=verdict.delay,
                              delivered=delivery.delivered)  # fmt: skip
            await delivery.nak(verdict.delay)
            log.info(
                "job %s failed (%s), retry in %.0f s: %s", job.job_id, kind, verdict.delay, reason
            )
            return "retrying"
        return await self._dead_letter(delivery, job, reason)

    async def _dead_letter(self, delivery: Delivery, job: Job, reason: str) -> str:
        key = job.idempotency_key
        await self._write(lambda: self._ledger.fail(key=key, error=reason, dead=True))
        if not await self._terminate(
            delivery, EventKind.DEAD, job, reason=reason, delivered=delivery.delivered
        ):
            return "event-unsent"
        self._alert(f"job:dead:{job.type}", f"{job.type} job {job.job_id} dead-lettered: {reason}")
        log.warning(
            "job %s dead-lettered after %d deliveries: %s", job.job_id, delivery.delivered, reason
        )
        return "dead"

    async def _terminate(
        self, delivery: Delivery, kind: EventKind, job: Job | Rejection, **fields: Any
    ) -> bool:
        """A final answer: the event first, `term` only once the stream has stored it.

        Otherwise the message is handed back with a delay and the decision is taken again
        at its next delivery (the consumer has no delivery limit of its own, so none is
        lost to JetStream's), and the event is sent again then.
        """
        if await self._event(kind, job, **fields):
            await delivery.term()
            return True
        self._metrics.job_events_unsent.inc()
        await delivery.nak(self._config.held_delay)
        return False

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
                await self._ledger.renew(key=key, lease_seconds=self._lease)
            except (*BusError, *LEDGER_ERRORS) as exc:
                log.warning("keep-alive for job %s failed: %s", key, exc)

    async def _write(
        self, operation: Callable[[], Awaitable[bool]], *, within: float | None = None
    ) -> None:
        """A ledger write after the work is done, retried with jitter for up to `within`
        seconds (default: one lease, which the keep-alive renews meanwhile); then logged.

        The answer to JetStream is sent either way: holding it back would let the job
        run a second time, which is worse than a ledger row left `running`.
        """
        try:
            await self._persist(
                operation, LEDGER_ERRORS, within=self._lease if within is None else within
            )
        except LEDGER_ERRORS as exc:
            log.error("ledger write failed after the job ran: %s", exc)

    async def _event_retried(self, kind: EventKind, job: Job, **fields: Any) -> bool:
        """A job's final event, retried with jitter for up to one lease while the
        keep-alive holds the job (a stream electing a new leader answers nothing for a
        few seconds); its message id makes a copy that did get stored harmless."""

        async def send() -> None:
            if not await self._event(kind, job, **fields):
                raise EventUnsent(kind.value)

        try:
            await self._persist(send, (EventUnsent,), within=self._lease)
        except EventUnsent:
            return False
        return True

    @staticmethod
    async def _persist(
        operation: Callable[[], Awaitable[object]],
        errors: tuple[type[Exception], ...],
        *,
        within: float,
    ) -> None:
        """`operation`, and only when it fails, again with jitter for up to `within`
        seconds. The first try goes without the retry machinery: entering it for every
        job cost a tenth of a noop job's CPU (py-spy, `make bench`)."""
        try:
            await operation()
            return
        except errors:
            pass
        async for attempt in stamina.retry_context(
            on=errors, attempts=None, wait_initial=0.1, wait_max=1.0, timeout=within
        ):
            with attempt:
                await operation()

    async def _event(self, kind: EventKind, job: Job | Rejection, **fields: Any) -> bool:
        """Publish a job event; True once the stream acknowledged it."""
        job_id = str(job.job_id) if job.job_id is not None else None
        key = job.idempotency_key
        body = event_body(
            node_id=self.node_id, job_id=job_id, idempotency_key=key, at=datetime.now(UTC),
            **fields,
        )  # fmt: skip
        # a final event is sent again when its first publish was not acknowledged: one id
        # per job and kind lets the stream drop the copy; progress events are per delivery
        msg_id = f"{key or job_id or time.monotonic_ns()}:{kind.value}"
        if kind in (EventKind.FAILED, EventKind.UNROUTABLE):
            msg_id += f":{fields.get('delivered', 0)}"
        try:
            await self._bus.publish(
                event_subject(self.node_id, kind), body, msg_id=msg_id,
                within=request_timeout(self._config.ack_wait),
            )  # fmt: skip
        except BusError as exc:
            log.warning("event %s for job %s not published: %s", kind.value, job_id, exc)
            return False
        return True

    async def _node_event(self, kind: EventKind) -> None:
        body = event_body(
            node_id=self.node_id, job_id=None, idempotency_key=None, at=datetime.now(UTC)
        )
        try:
            await self._bus.publish(event_subject(self.node_id, kind), body)
        except BusError as exc:
            log.warning("node event %s not published: %s", kind.value, exc)
