"""The JetStream job worker: fetch, decide, answer — each job once in effect.

The shape, in one place:

- **fetchers**, one per job stream (MM_ONLINE, MM_OFFLINE, MM_WRITE), pull from the
  tier's shared durable consumer into one bounded queue (room for WORKER_CONCURRENCY
  jobs beyond those running, so a runner that finishes finds its next job waiting);
- **runners**, WORKER_CONCURRENCY of them, take a delivery each and find out what
  becomes of it (`_decide`: parse, admit, route, claim in the idempotency ledger, run the
  handler, record the outcome) as one `Outcome`;
- one rule, `app.domain.job_flow.plan`, maps that outcome to exactly one JetStream answer
  (ack, nak with a delay, term) and at most one event; `_answer` sends them, the event
  first when the answer is final;
- one **keep-alive** loop tells JetStream (`in_progress`) and the ledger (its lease) that
  every delivery held here is still ours, from the moment it is fetched until it is
  answered. A renewal the ledger refuses while the handler runs means the lease ran out
  and another process took the key: the handler is stopped, and nothing is published or
  acked for it.

Budgets: the retry budget is the ledger's count of real attempts (JOB_MAX_ATTEMPTS), so a
job handed on to a node that can run it, or handed back during an outage, spends none
of it; JOB_MAX_DELIVERIES bounds deliveries spent on anything, so every path ends.
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
from app.adapters.registry import RegistryUnavailable
from app.domain import components
from app.domain.job_flow import (
    DEAD_LETTERS,
    Delays,
    Outcome,
    Plan,
    Verb,
    WorkerConfig,
    plan,
    unsent,
)
from app.domain.jobs import (
    STREAMS,
    Admission,
    EventKind,
    FailureKind,
    Job,
    Rejection,
    admit,
    after_failure,
    classify_failure,
    consumer_name,
    encode_event,
    event_body,
    event_subject,
    parse_job,
)
from app.domain.ledger import Claim, job_fingerprint
from app.domain.requirements import NodeProfile, Requirements, Tier
from app.metrics import Metrics
from app.services.handlers import HandlerContext, JobHandlers

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
# how long the registry's answer to "could a live node run this?" is reused, and for how
# many distinct requirements: a hand-on costs no query per delivery
ROUTE_CACHE_SECONDS = 10.0
ROUTE_CACHE_ENTRIES = 1024
# a failure's text kept in the ledger and the event
MAX_REASON_CHARS = 1000


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
        self, *, key: str, job_id: str, job_type: str, fingerprint: str, lease_seconds: float
    ) -> tuple[Claim, float]: ...

    async def renew(self, *, key: str, lease_seconds: float) -> bool: ...

    async def complete(self, *, key: str, result: Any) -> bool: ...

    async def fail(self, *, key: str, error: str, dead: bool) -> bool: ...

    async def release(self, *, key: str) -> bool: ...


class Registry(Protocol):
    """Who else could run a job: the capability registry's live nodes (PostgreSQL)."""

    async def eligible(self, requirements: Requirements) -> list[NodeProfile]: ...


class _Held:
    """A delivery fetched here and not yet answered (what the keep-alive keeps ours)."""

    __slots__ = ("answered", "delivery", "key", "lost", "scope", "touched")

    def __init__(self, delivery: Delivery, now: float) -> None:
        self.delivery = delivery
        self.touched = now  # the last moment JetStream heard of it (fetch, in_progress)
        self.key: str | None = None  # the idempotency key, once claimed here
        self.lost = False  # the ledger gave the claim to another process
        self.scope: asyncio.Timeout | None = None  # the running handler's time limit
        # set as the answer is sent: an `in_progress` after a NAK would take the message
        # back from redelivery and hold it for a backoff step (up to the last, minutes)
        self.answered = False


@dataclass(frozen=True, slots=True)
class _Decided:
    """What became of a delivery, with what its answer and event need."""

    outcome: Outcome
    job: Job | Rejection | None = None
    reason: str | None = None
    result: Any = None
    attempt: int | None = None
    retry_in: float = 0.0
    held_for: float = 0.0


class Worker:
    def __init__(
        self,
        *,
        bus: JetStreamBus,
        ledger: Ledger,
        registry: Registry | None,
        node: Callable[[], Awaitable[NodeProfile]],
        handlers: JobHandlers,
        config: WorkerConfig,
        metrics: Metrics,
        report: Callable[[components.Outcome], None],
        alerts: Alerter | None = None,
        prepare: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._alerts = alerts
        self._prepare = prepare
        self._bus = bus
        self._ledger = ledger
        self._registry = registry
        self._node = node
        self._handlers = handlers.table
        self._http = handlers.http
        self._config = config
        self._metrics = metrics
        self._report = report  # connected or not, recorded by the supervisor
        self._delays = Delays(not_here=config.not_here_delay, held=config.held_delay)
        self._lease = lease_seconds(config.ack_wait)
        self._queue: asyncio.Queue[_Held] = asyncio.Queue()
        self._room = asyncio.Event()  # set when the queue may have room again
        self._reserved = 0  # queue places promised to fetches in flight
        self._held: dict[int, _Held] = {}
        self._busy = 0  # runners with a delivery
        self._idle = asyncio.Event()
        self._idle.set()
        self._running_keys: set[str] = set()
        self._routes: dict[str, tuple[float, int | None]] = {}
        self._counters: dict[tuple[str, str], Any] = {}
        self._runners: list[asyncio.Task[None]] = []
        self._fetchers: list[asyncio.Task[None]] = []
        self._keeper: asyncio.Task[None] | None = None
        self._stopping = False
        self.node_id = ""

    def _is_stopping(self) -> bool:
        # a call, not the attribute: the flag changes while a loop awaits
        return self._stopping

    @property
    def in_flight(self) -> int:
        """Deliveries held here: running, or fetched and waiting for a runner."""
        return len(self._held)

    async def run(self, stopping: asyncio.Event) -> None:
        """The root task (supervised): connect and prepare, then the fetchers, runners and
        keep-alive; returns once `stopping` is set (or `drain` began) and what was held
        here is answered."""
        if self._prepare is not None:
            await self._prepare()
        self.node_id = (await self._node()).node_id
        await self._node_event(EventKind.NODE_ONLINE)
        async with asyncio.TaskGroup() as group:
            self._runners = [
                group.create_task(self._runner(), name=f"job-runner-{i}")
                for i in range(self._config.concurrency)
            ]
            self._keeper = group.create_task(self._keep_alive(), name="job-keep-alive")
            self._fetchers = [
                group.create_task(self._fetch(stream), name=f"job-fetch-{kind}")
                for kind, stream in STREAMS.items()
            ]
            group.create_task(self._watch(stopping), name="worker-stop-watch")

    async def _watch(self, stopping: asyncio.Event) -> None:
        while not self._stopping:
            try:
                await asyncio.wait_for(stopping.wait(), timeout=self._config.fetch_wait)
            except TimeoutError:
                continue
            self._stopping = True
        # a fetch in flight ends within one fetch wait; what it brings is queued and
        # handed back by the runners, which must still be there
        await asyncio.wait(self._fetchers)
        await self._settled()
        self._end_tasks()

    async def _settled(self) -> None:
        """Until every delivery held here is answered (the fetchers have stopped)."""
        while self._held or self._busy:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=self._config.fetch_wait)
            except TimeoutError:
                continue

    def _end_tasks(self) -> None:
        for task in (*self._runners, self._keeper):
            if task is not None:
                task.cancel()

    def begin_stop(self) -> None:
        """From now on no job starts here; what is fetched is handed back."""
        if not self._stopping:
            self._stopping = True
            self._room.set()
            log.info("job worker stopping: %d job(s) in flight", self._busy)

    async def drain(self, *, within: float) -> None:
        """Start nothing new; let the jobs in flight finish within `within` seconds, and
        hand back (release and NAK) those that cannot. The fetchers end within one fetch
        wait; whatever is fetched meanwhile, or waits in the queue, is handed back."""
        self.begin_stop()
        if not self._held and not self._busy:
            return
        clock = asyncio.get_running_loop().time
        ends = clock() + within
        # the last moments are kept for the jobs that must be handed back
        wait = max(0.0, within - HAND_BACK_SECONDS)
        log.info("waiting up to %.1f s for %d job(s) in flight", wait, self._busy)
        try:
            await asyncio.wait_for(self._settled(), timeout=wait)
            return
        except TimeoutError:
            pass
        busy = [task for task in self._runners if not task.done()]
        for task in busy:
            task.cancel()  # a running handler hands its job back (release, nak)
        if busy:
            await asyncio.wait(busy, timeout=max(0.1, ends - clock()))
        await self._hand_back_queued()

    async def _hand_back_queued(self) -> None:
        """NAK what still waits in the queue once no runner is left to take it: it comes
        back to another node at once instead of after the ack wait."""
        waiting: list[_Held] = []
        while not self._queue.empty():
            held = self._queue.get_nowait()
            self._held.pop(id(held), None)
            waiting.append(held)
        back = plan(Outcome.HANDED_BACK, delays=self._delays, delivered=1)
        for held in waiting:
            try:
                await self._send(held, back)
            except BusError as exc:
                log.warning("queued job not handed back: %s", exc)
        if not self._held and not self._busy:
            self._idle.set()

    async def announce_draining(self) -> None:
        await self._node_event(EventKind.NODE_DRAINING)

    async def announce_offline(self) -> None:
        await self._node_event(EventKind.NODE_OFFLINE)

    # -- fetching ------------------------------------------------------------------

    async def _fetch(self, stream: str) -> None:
        durable = consumer_name(self._config.tier)
        subscription: PullSubscription | None = None
        seen_reconnects = -1
        failures = 0
        # An idle stream long-polls for one message without taking room in the queue
        # (with three streams, idle ones would keep a small WORKER_CONCURRENCY from the
        # busy one); once it delivers, it fetches as much as the queue has room for.
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
            room = await self._reserve() if active else 0
            if active and room == 0:
                continue
            try:
                deliveries = await subscription.fetch(max(room, 1), wait=self._config.fetch_wait)
            except BusError as exc:
                failures += 1
                await subscription.unsubscribe()
                subscription = None
                await self._pause(f"fetch from {stream}", exc, failures)
                continue
            finally:
                self._reserved -= room
            failures = 0
            active = bool(deliveries)
            now = asyncio.get_running_loop().time()
            for delivery in deliveries:
                held = _Held(delivery, now)
                self._held[id(held)] = held
                self._queue.put_nowait(held)  # the stop hands it back from the queue
        if subscription is not None:
            await subscription.unsubscribe()

    async def _reserve(self) -> int:
        """Wait for room in the queue, then take what there is, up to a fetch batch."""
        bound = self._config.concurrency
        while not self._stopping:
            free = bound - self._queue.qsize() - self._reserved
            if free > 0:
                room = min(free, self._config.batch)
                self._reserved += room
                return room
            self._room.clear()
            try:
                await asyncio.wait_for(self._room.wait(), timeout=self._config.fetch_wait)
            except TimeoutError:
                continue
        return 0

    async def _pause(self, what: str, exc: BaseException, failures: int) -> None:
        delay = min(30.0, 0.5 * 2 ** min(failures, 6)) * random.uniform(0.5, 1.0)
        log.warning("%s failed (%d in a row): %s; retrying in %.1f s", what, failures, exc, delay)
        self._report(components.Outcome.failed(f"{what}: {exc}"))
        await asyncio.sleep(delay)

    # -- running -------------------------------------------------------------------

    async def _runner(self) -> None:
        while True:
            held = await self._queue.get()
            self._room.set()
            self._busy += 1
            self._idle.clear()
            try:
                await self._one(held)
            finally:
                self._held.pop(id(held), None)
                self._busy -= 1
                if not self._busy and not self._held:
                    self._idle.set()

    async def _one(self, held: _Held) -> None:
        started = time.monotonic()
        label, job_type = "error", "invalid"
        try:
            if self._stopping:
                decided = _Decided(Outcome.HANDED_BACK)
            else:
                decided = await self._decide(held)
            if isinstance(decided.job, Job):
                job_type = decided.job.type
            label = await self._answer(held, decided)
        except BusError as exc:
            # The answer could not be sent; JetStream redelivers after ack_wait and the
            # ledger makes the redelivery harmless.
            label = "bus-error"
            log.warning("job answer not sent (%s): %s", job_type, exc)
        except Exception:
            # A bug here must not kill the runner; the unanswered message comes back
            # after ack_wait, and the ledger keeps that harmless.
            log.exception("job %s could not be handled", job_type)
        # the type label is bounded by the handlers this node has: a publisher inventing
        # types must not invent time series
        kind = job_type if job_type in self._handlers or job_type == "invalid" else "unknown"
        self._count(kind, label)
        self._metrics.job_duration.labels(kind).observe(time.monotonic() - started)
        if label not in ("bus-error", Outcome.LEDGER_UNAVAILABLE.value, "event-unsent"):
            self._report(components.Outcome.ok())

    def _count(self, kind: str, label: str) -> None:
        counter = self._counters.get((kind, label))
        if counter is None:
            counter = self._counters[(kind, label)] = self._metrics.jobs.labels(kind, label)
        counter.inc()

    async def _decide(self, held: _Held) -> _Decided:
        """What becomes of one delivery: every way a job can go, in order."""
        delivery = held.delivery
        job = parse_job(delivery.data, delivery.subject)
        if isinstance(job, Rejection):
            return _Decided(Outcome.INVALID, job, reason=job.reason)
        if delivery.delivered > self._config.max_deliveries:
            return _Decided(
                Outcome.DELIVERIES_SPENT, job,
                reason=f"delivered {delivery.delivered} times (JOB_MAX_DELIVERIES "
                f"{self._config.max_deliveries}) without an outcome",
            )  # fmt: skip
        decision = admit(job, node=await self._node(), now=datetime.now(UTC))
        if decision.admission is Admission.REJECT:
            return _Decided(Outcome.INVALID, job, reason=decision.reason)
        if decision.admission is Admission.EXPIRE:
            return _Decided(Outcome.EXPIRED, job, reason=decision.reason)
        if decision.admission is Admission.NOT_HERE:
            return await self._route(job, decision.reason)
        if job.type not in self._handlers:
            return await self._route(job, f"no handler for type {job.type!r} here")
        key = job.idempotency_key
        if key in self._running_keys:
            return _Decided(Outcome.HELD, job)
        # taken before the first await of the claim: a second delivery of the key in the
        # same batch sees it and waits, instead of racing this one to the ledger
        self._running_keys.add(key)
        try:
            return await self._claim_and_run(held, job)
        finally:
            self._running_keys.discard(key)

    async def _route(self, job: Job, reason: str) -> _Decided:
        """Not for this node: handed on while a live node of this tier could run it (or
        nobody can tell), dead-lettered as unroutable when the registry has none. Only
        this tier's nodes read this tier's consumer: a node of another tier that could
        run the job would never see it."""
        wanted = job.requirements.tier
        tier = Tier(self._config.tier)
        if wanted is not None and tier not in wanted:
            return _Decided(
                Outcome.UNROUTABLE, job,
                reason=f"no node of tier {tier.value} may run it (requirements.tier): {reason}",
            )  # fmt: skip
        if await self._eligible(job.requirements.model_copy(update={"tier": [tier]})) == 0:
            return _Decided(Outcome.UNROUTABLE, job, reason=f"no live node can run it: {reason}")
        return _Decided(Outcome.HANDED_ON, job, reason=reason)

    async def _eligible(self, requirements: Requirements) -> int | None:
        """How many live nodes the registry says could run a job; None when unknown."""
        if self._registry is None:
            return None
        now = time.monotonic()
        cache_key = requirements.model_dump_json()
        cached = self._routes.get(cache_key)
        if cached is not None and cached[0] > now:
            return cached[1]
        try:
            count: int | None = len(await self._registry.eligible(requirements))
        except RegistryUnavailable as exc:
            log.warning("cannot ask the registry who could run a job: %s", exc)
            count = None
        if len(self._routes) >= ROUTE_CACHE_ENTRIES:
            self._routes.clear()
        self._routes[cache_key] = (now + ROUTE_CACHE_SECONDS, count)
        return count

    async def _claim_and_run(self, held: _Held, job: Job) -> _Decided:
        key = job.idempotency_key
        try:
            claim, number = await self._ledger.claim(
                key=key, job_id=str(job.job_id), job_type=job.type,
                fingerprint=job_fingerprint(job.type, job.payload), lease_seconds=self._lease,
            )  # fmt: skip
        except LEDGER_ERRORS as exc:
            log.warning("ledger unavailable, job %s handed back: %s", job.job_id, exc)
            return _Decided(Outcome.LEDGER_UNAVAILABLE, job, reason=str(exc))
        if claim is Claim.COMPLETED:
            return _Decided(Outcome.DUPLICATE, job)
        if claim is Claim.DEAD:
            return _Decided(Outcome.DUPLICATE_DEAD, job, reason="dead-lettered before (ledger)")
        if claim is Claim.HELD:
            return _Decided(Outcome.HELD, job, held_for=number)
        if claim is Claim.CONFLICT:
            return _Decided(
                Outcome.KEY_CONFLICT, job,
                reason="key-conflict: the idempotency key was used by a job of another type "
                "or payload",
            )  # fmt: skip
        attempt = int(number)
        held.key = key
        if attempt > self._config.max_attempts:
            # claimed more often than it may be attempted, yet never answered: earlier
            # runs ended in a crash or a hang past their lease; it is not run again
            reason = f"started {attempt - 1} times without finishing"
            if (
                await self._write(lambda: self._ledger.fail(key=key, error=reason, dead=True))
                is False
            ):
                return _Decided(Outcome.LOST_CLAIM, job)
            return _Decided(Outcome.STUCK, job, reason=reason, attempt=attempt - 1)
        return await self._run(held, job, attempt)

    async def _run(self, held: _Held, job: Job, attempt: int) -> _Decided:
        key = job.idempotency_key
        context = HandlerContext(
            node_id=self.node_id, delivered=held.delivery.delivered, attempt=attempt,
            http=self._http,
        )  # fmt: skip
        try:
            async with asyncio.timeout(self._config.job_timeout) as scope:
                held.scope = scope
                result = await self._handlers[job.type](job, context)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and not task.cancelling():
                # the handler's own (a future it awaited was cancelled), not a stop: a
                # failure like any other, and the runner goes on
                if held.lost:
                    return _Decided(Outcome.LOST_CLAIM, job, attempt=attempt)
                return await self._failed(job, attempt, RuntimeError("handler was cancelled"))
            # shutdown ran out of grace: hand the job back for someone else, now
            await self._write(lambda: self._ledger.release(key=key), within=HAND_BACK_SECONDS)
            held.answered = True
            try:
                await held.delivery.nak(1.0)
            except BusError as exc:
                log.warning("job %s not handed back: %s", job.job_id, exc)
            raise
        except Exception as exc:
            if held.lost:
                return _Decided(Outcome.LOST_CLAIM, job, attempt=attempt)
            return await self._failed(job, attempt, exc)
        finally:
            held.scope = None
        if held.lost:
            return _Decided(Outcome.LOST_CLAIM, job, attempt=attempt)
        if await self._write(lambda: self._ledger.complete(key=key, result=result)) is False:
            return _Decided(Outcome.LOST_CLAIM, job, attempt=attempt)
        return _Decided(Outcome.COMPLETED, job, result=result, attempt=attempt)

    async def _failed(self, job: Job, attempt: int, exc: Exception) -> _Decided:
        kind = classify_failure(exc)
        verdict = after_failure(
            kind, attempt=attempt, max_attempts=self._config.max_attempts,
            backoff=self._config.backoff,
        )  # fmt: skip
        reason = f"{type(exc).__name__}: {exc}"[:MAX_REASON_CHARS]
        key = job.idempotency_key
        written = await self._write(
            lambda: self._ledger.fail(key=key, error=reason, dead=not verdict.retry)
        )
        if written is False:
            return _Decided(Outcome.LOST_CLAIM, job, attempt=attempt)
        if verdict.retry:
            log.info("job %s failed (%s), retry in %.0f s: %s",
                     job.job_id, kind, verdict.delay, reason)  # fmt: skip
            return _Decided(
                Outcome.RETRYING, job, reason=reason, attempt=attempt, retry_in=verdict.delay
            )
        outcome = Outcome.PERMANENT if kind is FailureKind.PERMANENT else Outcome.ATTEMPTS_SPENT
        return _Decided(outcome, job, reason=reason, attempt=attempt)

    # -- answering -----------------------------------------------------------------

    async def _answer(self, held: _Held, decided: _Decided) -> str:
        """Send the one answer (and event) the plan gives; the metrics label."""
        delivery = held.delivery
        outcome = decided.outcome
        step = plan(
            outcome, delays=self._delays, delivered=delivery.delivered,
            retry_in=decided.retry_in, held_for=decided.held_for,
        )  # fmt: skip
        label = outcome.value
        if step.event is not None:
            fields = self._event_fields(step, decided, delivery)
            if step.final and held.key is not None and not held.lost:
                # the claim is ours while the keep-alive runs: retry within one lease
                sent = await self._event_retried(step.event, decided.job, delivery, **fields)
            else:
                sent = await self._event(step.event, decided.job, delivery, **fields)
            if not sent and step.final:
                self._metrics.job_events_unsent.inc()
                step, label = (
                    unsent(delays=self._delays, delivered=delivery.delivered),
                    ("event-unsent"),
                )
        await self._send(held, step)
        if label == outcome.value:
            self._noted(decided)
        return label

    @staticmethod
    async def _send(held: _Held, step: Plan) -> None:
        delivery = held.delivery
        held.answered = True
        if step.verb is Verb.ACK:
            await delivery.ack()
        elif step.verb is Verb.TERM:
            await delivery.term()
        else:
            delay = step.delay * random.uniform(0.8, 1.0) if step.transient else step.delay
            await delivery.nak(delay)

    def _event_fields(self, step: Plan, decided: _Decided, delivery: Delivery) -> dict[str, Any]:
        fields: dict[str, Any] = {"delivered": delivery.delivered}
        if step.code is not None:
            fields["code"] = step.code.value
        if decided.reason is not None:
            fields["reason"] = decided.reason
        if decided.attempt is not None:
            fields["attempt"] = decided.attempt
        if decided.outcome is Outcome.COMPLETED:
            fields["result"] = decided.result
        elif decided.outcome is Outcome.DUPLICATE:
            fields["duplicate"] = True
        elif decided.outcome is Outcome.RETRYING:
            fields["retry_in_seconds"] = decided.retry_in
        return fields

    def _noted(self, decided: _Decided) -> None:
        """Logs and alerts of an outcome whose answer was sent."""
        outcome, job = decided.outcome, decided.job
        job_id = getattr(job, "job_id", None)
        job_type = job.type if isinstance(job, Job) else "invalid"
        # alert keys are bounded by the handlers this node has, not by what publishers send
        kind = job_type if job_type in self._handlers else "unknown"
        if outcome is Outcome.INVALID:
            log.warning("job rejected: %s", decided.reason)
        elif outcome is Outcome.UNROUTABLE:
            self._metrics.jobs_unroutable.inc()
            log.warning("job %s (%s) dead-lettered: %s", job_id, job_type, decided.reason)
            self._alert(f"job:unroutable:{kind}",
                        f"no live node can run {job_type} jobs ({decided.reason})")  # fmt: skip
        elif outcome is Outcome.LOST_CLAIM:
            log.warning(
                "job %s: this process lost its claim (lease ran out, another took it over); "
                "its outcome is the holder's", job_id,
            )  # fmt: skip
        elif outcome in DEAD_LETTERS and outcome is not Outcome.DUPLICATE_DEAD:
            log.warning("job %s (%s) dead-lettered (%s): %s",
                        job_id, job_type, outcome.value, decided.reason)  # fmt: skip
            self._alert(f"job:dead:{kind}",
                        f"{job_type} job {job_id} dead-lettered: {decided.reason}")  # fmt: skip

    def _alert(self, key: str, text: str) -> None:
        if self._alerts is not None:
            self._alerts.alert(key, text)

    # -- keeping deliveries ours ---------------------------------------------------

    async def _keep_alive(self) -> None:
        """Every ack_wait/3: `in_progress` for each delivery held that long without one,
        and a lease renewal for each claimed job. The renewals run beside the loop, one
        at a time per key and each within a request timeout: a ledger that stalls must
        not hold the next `in_progress` back past the ack wait (JetStream would hand the
        running job out again)."""
        interval = max(self._config.ack_wait / 3, 0.1)
        clock = asyncio.get_running_loop().time
        renewing: set[str] = set()  # keys with a renewal on its way
        # the renewals are this loop's children: stopping the loop stops them, and one
        # that fails unexpectedly fails the worker's task group, as any of its tasks would
        async with asyncio.TaskGroup() as renewals:
            while True:
                await asyncio.sleep(interval)
                now = clock()
                due = [held for held in self._held.values() if now - held.touched >= interval]
                for held in due:
                    held.touched = now
                if due:
                    await asyncio.gather(*(self._touch(held) for held in due))
                for held in due:
                    key = held.key
                    if key is None or held.lost or held.answered or key in renewing:
                        continue
                    renewing.add(key)
                    renewals.create_task(self._renew(held, key, renewing), name="job-lease-renewal")

    @staticmethod
    async def _touch(held: _Held) -> None:
        if held.answered:
            return
        try:
            # no await between the check and this: the two go out in this order
            await held.delivery.in_progress()
        except BusError as exc:
            log.warning("in_progress for a job failed: %s", exc)

    async def _renew(self, held: _Held, key: str, renewing: set[str]) -> None:
        try:
            async with asyncio.timeout(request_timeout(self._config.ack_wait)):
                renewed = await self._ledger.renew(key=key, lease_seconds=self._lease)
        except LEDGER_ERRORS as exc:
            log.warning("lease renewal for job %s failed: %s", key, exc)
            return
        finally:
            renewing.discard(key)
        # refused while the handler runs: another process took the key. Once it has run,
        # a refusal is this process's own completion or failure having landed
        if not renewed and held.scope is not None:
            held.lost = True
            held.scope.reschedule(asyncio.get_running_loop().time())  # its effects are not ours

    async def _write(
        self, operation: Callable[[], Awaitable[bool]], *, within: float | None = None
    ) -> bool | None:
        """A ledger write after the work is done, retried with jitter for up to `within`
        seconds (default: one lease, which the keep-alive renews meanwhile): what the
        ledger answered (False: the claim is no longer ours), or None when it could not
        be reached, which is logged.

        The answer to JetStream is sent either way: holding it back would let the job
        run a second time, which is worse than a ledger row left `running`.
        """
        answer: list[bool] = []

        async def write() -> None:
            answer.append(await operation())

        try:
            await self._persist(
                write, LEDGER_ERRORS, within=self._lease if within is None else within
            )
        except LEDGER_ERRORS as exc:
            log.error("ledger write failed after the job ran: %s", exc)
            return None
        return answer[-1]

    async def _event_retried(
        self, kind: EventKind, job: Job | Rejection | None, delivery: Delivery, **fields: Any
    ) -> bool:
        """A job's final event, retried with jitter for up to one lease while the
        keep-alive holds the job (a stream electing a new leader answers nothing for a
        few seconds); its message id makes a copy that did get stored harmless."""

        async def send() -> None:
            if not await self._event(kind, job, delivery, **fields):
                raise EventUnsent(kind.value)

        try:
            await self._persist(send, (EventUnsent,), within=self._lease)
        except (EventUnsent, TimeoutError):
            return False
        return True

    @staticmethod
    async def _persist(
        operation: Callable[[], Awaitable[object]],
        errors: tuple[type[Exception], ...],
        *,
        within: float,
    ) -> None:
        """`operation`, and only when it fails, again with jitter, all within `within`
        seconds (the first try counts too: past it, TimeoutError). The first try goes
        without the retry machinery: entering it for every job cost a tenth of a noop
        job's CPU (py-spy, `make bench`)."""
        async with asyncio.timeout(within):
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

    async def _event(
        self, kind: EventKind, job: Job | Rejection | None, delivery: Delivery, **fields: Any
    ) -> bool:
        """Publish a job event; True once the stream acknowledged it."""
        job_id = None if job is None or job.job_id is None else str(job.job_id)
        key = None if job is None else job.idempotency_key
        body = event_body(
            node_id=self.node_id, job_id=job_id, idempotency_key=key, at=datetime.now(UTC),
            **fields,
        )  # fmt: skip
        # a final event is sent again when its first publish was not acknowledged: one id
        # per job and kind lets the stream drop the copy; job.failed is one per attempt
        subject_id = key or job_id or f"{delivery.subject}#{delivery.stream_sequence}"
        msg_id = f"{subject_id}:{kind.value}"
        if kind in (EventKind.REJECTED, EventKind.EXPIRED) and job_id is not None:
            # another job under the same key (a key conflict) has events of its own
            msg_id = f"{subject_id}:{job_id}:{kind.value}"
        if kind is EventKind.FAILED:
            msg_id += f":{fields.get('attempt', 0)}"
        subject = event_subject(self.node_id, kind)
        # cut to fit the server's max_payload: a refused event would hold the answer back
        data = encode_event(body, max_bytes=self._bus.room(subject, msg_id))
        try:
            await self._bus.publish(
                subject, data, msg_id=msg_id, within=request_timeout(self._config.ack_wait)
            )
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
