"""What a job's outcome comes to: exactly one JetStream answer and at most one event.

The worker (services/working.py) finds out what happened to a delivery — it was not a
job, it is not for this node, its key is held, it ran and failed — as an `Outcome`. The
one rule here, `plan`, maps each outcome to the answer JetStream gets (ack, nak with a
delay, or term) and the event the fleet sees, with its machine-readable `Code`. Nothing
else in the worker chooses an answer, so a path that answers twice, or not at all,
cannot hide in the flow. Everything here is pure; outcomes are strings only at the
metrics and event edge (their values).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from app.domain.jobs import EventKind


@dataclass(frozen=True)
class WorkerConfig:
    """The worker's settings (decided in app/services/components.py)."""

    tier: str
    concurrency: int
    batch: int
    ack_wait: float
    max_attempts: int
    max_deliveries: int
    backoff: tuple[float, ...]
    not_here_delay: float
    held_delay: float
    job_timeout: float
    fetch_wait: float = 1.0  # an active stream's fetch of a batch
    pull_wait: float = 30.0  # an idle stream's long poll for one (WORKER_PULL_WAIT_SECONDS)


class Outcome(StrEnum):
    """What happened to one delivery (the value is the metrics label)."""

    INVALID = "rejected"  # not a valid job/v1 (bytes, schema, subject)
    KEY_CONFLICT = "key-conflict"  # another job (type or payload) under a used key
    EXPIRED = "expired"  # its deadline passed before it ran
    HANDED_ON = "not-here"  # this node cannot run it; a live node can (or nobody can tell)
    UNROUTABLE = "unroutable"  # the registry has no live node that can run it
    DELIVERIES_SPENT = "deliveries-spent"  # delivered JOB_MAX_DELIVERIES times, never run
    HELD = "held"  # its key runs here or under a live lease elsewhere
    LEDGER_UNAVAILABLE = "ledger-error"  # the claim could not be asked
    DUPLICATE = "duplicate"  # completed before: answered from the ledger
    DUPLICATE_DEAD = "duplicate-dead"  # dead-lettered before
    STUCK = "stuck"  # claimed JOB_MAX_ATTEMPTS times before, never finished (crash, hang)
    COMPLETED = "completed"
    RETRYING = "retrying"  # a retryable failure with attempts left
    PERMANENT = "permanent"  # a permanent failure: dead-lettered
    ATTEMPTS_SPENT = "attempts-spent"  # a retryable failure on the last attempt
    LOST_CLAIM = "lost-claim"  # the ledger says another process holds the key now
    HANDED_BACK = "handed-back"  # fetched or running when the shutdown began


class Code(StrEnum):
    """The machine-readable reason an event carries (`code`), besides its text."""

    INVALID = "invalid"
    KEY_CONFLICT = "key-conflict"
    EXPIRED = "expired"
    RETRYING = "retrying"
    PERMANENT = "permanent"
    ATTEMPTS_SPENT = "attempts-spent"
    UNROUTABLE = "unroutable"
    DELIVERIES_SPENT = "deliveries-spent"
    STUCK = "stuck"
    COMPLETED = "completed"


class Verb(StrEnum):
    ACK = "ack"
    NAK = "nak"
    TERM = "term"


@dataclass(frozen=True, slots=True)
class Delays:
    """The NAK delays the plan chooses from (seconds)."""

    not_here: float
    held: float
    transient_cap: float = 60.0


@dataclass(frozen=True, slots=True)
class Plan:
    verb: Verb
    delay: float = 0.0  # for NAK
    event: EventKind | None = None
    code: Code | None = None
    # the event must be stored before the answer is sent: a term or ack without it would
    # lose the only trace of the job. An informational event (job.failed) goes best-effort.
    final: bool = False
    # a delay sized for an outage: the worker spreads it (jitter), so that the jobs handed
    # back together do not all come back at the same moment
    transient: bool = False


# Outcomes whose answer is final (term or ack), with the event and code each carries.
_FINAL: dict[Outcome, tuple[Verb, EventKind | None, Code | None]] = {
    Outcome.INVALID: (Verb.TERM, EventKind.REJECTED, Code.INVALID),
    Outcome.KEY_CONFLICT: (Verb.TERM, EventKind.REJECTED, Code.KEY_CONFLICT),
    Outcome.EXPIRED: (Verb.TERM, EventKind.EXPIRED, Code.EXPIRED),
    Outcome.UNROUTABLE: (Verb.TERM, EventKind.DEAD, Code.UNROUTABLE),
    Outcome.DELIVERIES_SPENT: (Verb.TERM, EventKind.DEAD, Code.DELIVERIES_SPENT),
    Outcome.STUCK: (Verb.TERM, EventKind.DEAD, Code.STUCK),
    Outcome.PERMANENT: (Verb.TERM, EventKind.DEAD, Code.PERMANENT),
    Outcome.ATTEMPTS_SPENT: (Verb.TERM, EventKind.DEAD, Code.ATTEMPTS_SPENT),
    # sent again (deduplicated by its message id) in case the first was never stored
    Outcome.DUPLICATE_DEAD: (Verb.TERM, EventKind.DEAD, None),
    Outcome.COMPLETED: (Verb.ACK, EventKind.COMPLETED, Code.COMPLETED),
    # the completion event again: a run whose event could not be stored was handed back,
    # and this is where the event gets out (the stream drops a copy it already has)
    Outcome.DUPLICATE: (Verb.ACK, EventKind.COMPLETED, Code.COMPLETED),
}

DEAD_LETTERS = frozenset(o for o, (_, event, _) in _FINAL.items() if event is EventKind.DEAD)


def plan(outcome: Outcome, *, delays: Delays, delivered: int, retry_in: float = 0.0,
         held_for: float = 0.0) -> Plan:  # fmt: skip
    """The one answer and event of `outcome`.

    `delivered` is JetStream's count for this delivery (it only sizes transient delays,
    never a budget); `retry_in` the backoff step of a RETRYING outcome; `held_for` the
    seconds left on the lease of the holder of a HELD key.
    """
    if outcome in _FINAL:
        verb, event, code = _FINAL[outcome]
        return Plan(verb, event=event, code=code, final=event is not None)
    if outcome is Outcome.RETRYING:
        return Plan(Verb.NAK, delay=retry_in, event=EventKind.FAILED, code=Code.RETRYING)
    if outcome is Outcome.HANDED_ON:
        return Plan(Verb.NAK, delay=delays.not_here)
    if outcome is Outcome.HELD:
        # look again once the holder's lease would have run out
        return Plan(Verb.NAK, delay=max(delays.held, held_for + 0.5))
    if outcome is Outcome.LOST_CLAIM:
        # the holder answers the job; this copy comes back and is answered from the ledger
        return Plan(Verb.NAK, delay=delays.held)
    if outcome is Outcome.LEDGER_UNAVAILABLE:
        return Plan(Verb.NAK, delay=transient_delay(delivered, delays), transient=True)
    if outcome is Outcome.HANDED_BACK:
        return Plan(Verb.NAK, delay=0.0)
    raise AssertionError(f"no plan for {outcome!r}")  # pragma: no cover - the table is total


def unsent(*, delays: Delays, delivered: int) -> Plan:
    """The answer instead of a final one when its event could not be stored: the message is
    handed back and decided again at its next delivery, when the event is sent again."""
    return Plan(Verb.NAK, delay=transient_delay(delivered, delays), transient=True)


def transient_delay(delivered: int, delays: Delays) -> float:
    """A NAK delay for an outage (ledger, events stream): the held delay, doubling with
    each delivery up to `transient_cap`, so a long outage costs few deliveries of the
    JOB_MAX_DELIVERIES bound and no attempt."""
    step = delays.held * float(2 ** min(max(delivered - 1, 0), 10))
    return min(step, max(delays.transient_cap, delays.held))
