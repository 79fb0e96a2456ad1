"""The job worker's runner: what becomes of each delivery, and its one answer.

WORKER_CONCURRENCY runner tasks take a lease each from the fetcher's queue and find out
what becomes of its delivery (`_decide`: parse, admit, route, claim in the idempotency
ledger, run the handler, record the outcome) as one `Outcome`. One rule,
`app.domain.job_flow.plan`, maps that outcome to exactly one JetStream answer (ack, nak
with a delay, term) and at most one event; `_answer` sends them through the lease, the
event first when the answer is final. Once the stop began, a runner hands back (NAK
without delay) whatever it takes from the queue.

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

from app.adapters.bus import BusError
from app.adapters.registry import RegistryUnavailable
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
    Admission,
    EventKind,
    FailureKind,
    Job,
    Rejection,
    admit,
    after_failure,
    classify_failure,
    encode_event,
    event_body,
    event_subject,
    parse_job,
)
from app.domain.ledger import Claim, job_fingerprint
from app.domain.requirements import NodeProfile, Requirements, Tier
from app.metrics import Metrics
from app.services.handlers import HandlerContext, JobHandlers
from app.services.leasing import (
    LEDGER_ERRORS,
    Clock,
    Lease,
    Message,
    lease_seconds,
    request_timeout,
)

if TYPE_CHECKING:
    from app.adapters.bus import Published
    from app.services.alerting import Alerter

log = logging.getLogger(__name__)

# kept at the end of a drain for releasing and handing back the jobs that did not finish
HAND_BACK_SECONDS = 1.0
# how long the registry's answer to "could a live node run this?" is reused, and for how
# many distinct requirements: a hand-on costs no query per delivery
ROUTE_CACHE_SECONDS = 10.0
ROUTE_CACHE_ENTRIES = 1024
# a failure's text kept in the ledger and the event
MAX_REASON_CHARS = 1000
# the pauses between tries of a ledger write or an event publish (seconds, before jitter)
RETRY_FIRST_PAUSE = 0.1
RETRY_MAX_PAUSE = 1.0


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


class Events(Protocol):
    """Where job and node events go (`app.adapters.bus.JetStreamBus`)."""

    def room(self, subject: str, msg_id: str | None = None) -> int: ...

    async def publish(
        self,
        subject: str,
        body: dict[str, Any] | bytes,
        *,
        msg_id: str | None = None,
        within: float | None = None,
    ) -> Published: ...


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


class Runner:
    """Decides, answers and tells: shared by the worker's runner tasks (`serve`)."""

    def __init__(
        self,
        *,
        bus: Events,
        ledger: Ledger,
        registry: Registry | None,
        node: Callable[[], Awaitable[NodeProfile]],
        handlers: JobHandlers,
        config: WorkerConfig,
        metrics: Metrics,
        alerts: Alerter | None,
        clock: Clock,
        stop: asyncio.Event,
    ) -> None:
        self._bus = bus
        self._ledger = ledger
        self._registry = registry
        self._node = node
        self._handlers = handlers.table
        self._http = handlers.http
        self._config = config
        self._metrics = metrics
        self._alerts = alerts
        self._clock = clock
        self._stop = stop
        self._delays = Delays(not_here=config.not_here_delay, held=config.held_delay)
        self._lease = lease_seconds(config.ack_wait)
        self._running_keys: set[str] = set()
        self._routes: dict[str, tuple[float, int | None]] = {}
        self._counters: dict[tuple[str, str], Any] = {}
        self.busy = 0  # runner tasks with a delivery
        self.node_id = ""

    async def serve(self, queue: asyncio.Queue[Lease]) -> None:
        """One runner task: a lease at a time from `queue`, until cancelled."""
        while True:
            lease = await queue.get()
            self.busy += 1
            try:
                await self._one(lease)
            finally:
                self.busy -= 1
                queue.task_done()

    async def _one(self, lease: Lease) -> None:
        started = time.monotonic()
        label, job_type = "error", "invalid"
        async with lease:
            try:
                if self._stop.is_set():
                    decided = _Decided(Outcome.HANDED_BACK)
                else:
                    decided = await self._decide(lease)
                if isinstance(decided.job, Job):
                    job_type = decided.job.type
                label = await self._answer(lease, decided)
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

    def _count(self, kind: str, label: str) -> None:
        counter = self._counters.get((kind, label))
        if counter is None:
            counter = self._counters[(kind, label)] = self._metrics.jobs.labels(kind, label)
        counter.inc()

    async def _decide(self, lease: Lease) -> _Decided:
        """What becomes of one delivery: every way a job can go, in order."""
        delivery = lease.delivery
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
            return await self._claim_and_run(lease, job)
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
        now = self._clock.now()
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

    async def _claim_and_run(self, lease: Lease, job: Job) -> _Decided:
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
        lease.claimed(key)
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
        return await self._run(lease, job, attempt)

    async def _run(self, lease: Lease, job: Job, attempt: int) -> _Decided:
        key = job.idempotency_key
        context = HandlerContext(
            node_id=self.node_id, delivered=lease.delivery.delivered, attempt=attempt,
            http=self._http,
        )  # fmt: skip
        try:
            async with lease.running(self._config.job_timeout):
                result = await self._handlers[job.type](job, context)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and not task.cancelling():
                # the handler's own (a future it awaited was cancelled), not a stop: a
                # failure like any other, and the runner goes on
                if lease.lost:
                    return _Decided(Outcome.LOST_CLAIM, job, attempt=attempt)
                return await self._failed(job, attempt, RuntimeError("handler was cancelled"))
            # the worker's task is cancelled (its stop ran out): hand the job back, now
            await self._write(lambda: self._ledger.release(key=key), within=HAND_BACK_SECONDS)
            try:
                await lease.nak(1.0)
            except BusError as exc:
                log.warning("job %s not handed back: %s", job.job_id, exc)
            raise
        except Exception as exc:
            if lease.lost:
                return _Decided(Outcome.LOST_CLAIM, job, attempt=attempt)
            if lease.withdrawn:
                # the stop ran out of time: released with its attempt, for another node
                await self._write(lambda: self._ledger.release(key=key), within=HAND_BACK_SECONDS)
                return _Decided(Outcome.HANDED_BACK, job, attempt=attempt)
            return await self._failed(job, attempt, exc)
        if lease.lost:
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

    async def _answer(self, lease: Lease, decided: _Decided) -> str:
        """Send the one answer (and event) the plan gives; the metrics label."""
        delivery = lease.delivery
        outcome = decided.outcome
        step = plan(
            outcome, delays=self._delays, delivered=delivery.delivered,
            retry_in=decided.retry_in, held_for=decided.held_for,
        )  # fmt: skip
        label = outcome.value
        if step.event is not None:
            fields = self._event_fields(step, decided, delivery)
            if step.final and lease.key is not None and not lease.lost:
                # the claim is ours while its lease is kept: retry within one lease
                sent = await self._event_retried(step.event, decided.job, delivery, **fields)
            else:
                sent = await self._event(step.event, decided.job, delivery, **fields)
            if not sent and step.final:
                self._metrics.job_events_unsent.inc()
                step, label = (
                    unsent(delays=self._delays, delivered=delivery.delivered),
                    ("event-unsent"),
                )
        await send(lease, step)
        if label == outcome.value:
            self._noted(decided)
        return label

    def _event_fields(self, step: Plan, decided: _Decided, delivery: Message) -> dict[str, Any]:
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

    async def _write(
        self, operation: Callable[[], Awaitable[bool]], *, within: float | None = None
    ) -> bool | None:
        """A ledger write after the work is done, retried with jitter for up to `within`
        seconds (default: one lease, which the job's lease renews meanwhile): what the
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
        self, kind: EventKind, job: Job | Rejection | None, delivery: Message, **fields: Any
    ) -> bool:
        """A job's final event, retried with jitter for up to one lease while its lease
        keeps the job ours (a stream electing a new leader answers nothing for a
        few seconds); its message id makes a copy that did get stored harmless."""

        async def send() -> None:
            if not await self._event(kind, job, delivery, **fields):
                raise EventUnsent(kind.value)

        try:
            await self._persist(send, (EventUnsent,), within=self._lease)
        except (EventUnsent, TimeoutError):
            return False
        return True

    async def _persist(
        self,
        operation: Callable[[], Awaitable[object]],
        errors: tuple[type[Exception], ...],
        *,
        within: float,
    ) -> None:
        """`operation`, and only when it fails, again after a growing, jittered pause, all
        within `within` seconds: past them, the last error (TimeoutError for a try that
        did not end in time). No try starts that its pause would push past the end."""
        clock = self._clock
        ends = clock.now() + within
        tries = 0
        while True:
            try:
                async with asyncio.timeout(max(ends - clock.now(), 0.0)):
                    await operation()
                return
            except errors:
                pause = min(RETRY_MAX_PAUSE, RETRY_FIRST_PAUSE * 2**tries)
                pause *= random.uniform(0.5, 1.0)
                if clock.now() + pause >= ends:
                    raise
            tries += 1
            await clock.sleep(pause)

    async def _event(
        self, kind: EventKind, job: Job | Rejection | None, delivery: Message, **fields: Any
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


async def send(lease: Lease, step: Plan) -> None:
    """The answer `step` gives, through the lease: no `in_progress` follows it."""
    if step.verb is Verb.ACK:
        await lease.ack()
    elif step.verb is Verb.TERM:
        await lease.term()
    else:
        delay = step.delay * random.uniform(0.8, 1.0) if step.transient else step.delay
        await lease.nak(delay)
