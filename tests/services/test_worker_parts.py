"""The job worker's branches, against in-memory doubles of the bus and the ledger and a
clock the test moves (tests/support/worker_doubles.py): each path a delivery can take,
the lease's keeping and loss, the stop, and the fetcher's pauses, in milliseconds.

Nothing here sleeps: a test waits for a condition (a few turns of the event loop) or
moves the clock. tests/services/test_worker.py runs the same worker against a real
nats-server and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from app.adapters.workload_http import WorkloadHttp
from app.domain import components
from app.domain.job_flow import WorkerConfig
from app.domain.jobs import Job
from app.domain.ledger import LedgerRecord
from app.domain.requirements import NodeProfile, Requirements
from app.metrics import Metrics
from app.services.fetching import OFFLINE_LOOK_SECONDS
from app.services.handlers import HandlerContext, JobHandlers, noop
from app.services.streams import new_job
from app.services.working import HAND_BACK_SECONDS, STALE_FETCH_SECONDS, Worker, lease_seconds
from tests.support.worker_doubles import FakeBus, FakeClock, FakeLedger, FakeMessage

NODE = NodeProfile(
    node_id="node-a", tier="A", region="eu", trust_zone="z1", capabilities=["embeddings"]
)
CONFIG = WorkerConfig(
    tier="A", concurrency=2, batch=4, ack_wait=30.0, max_attempts=2, max_deliveries=5,
    backoff=(2.0, 4.0), not_here_delay=5.0, held_delay=3.0, job_timeout=600.0,
    fetch_wait=1.0, pull_wait=20.0,
)  # fmt: skip
KEEP = CONFIG.ack_wait / 3  # how often a lease tells JetStream and the ledger


async def until(check: Callable[[], bool], *, turns: int = 2000) -> None:
    """Until `check()` holds, letting the other tasks run; fails after `turns` turns of
    the event loop (no time passes on the test's clock meanwhile)."""
    for _ in range(turns):
        if check():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not met")


class Gate:
    """A handler that runs until the test opens its gate."""

    def __init__(self) -> None:
        self.started = 0
        self.cancelled = 0
        self.open = asyncio.Event()

    async def __call__(self, job: Job, context: HandlerContext) -> dict[str, Any]:
        self.started += 1
        try:
            await self.open.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return {"gate": True, "attempt": context.attempt}


class Turnstile:
    """A handler whose jobs finish one per permit the test lets through."""

    def __init__(self) -> None:
        self.started = 0
        self.permits = asyncio.Semaphore(0)

    async def __call__(self, job: Job, context: HandlerContext) -> dict[str, Any]:
        self.started += 1
        await self.permits.acquire()
        return {"turned": True}


class Registry:
    def __init__(self, nodes: list[NodeProfile]) -> None:
        self.nodes = nodes

    async def eligible(self, requirements: Requirements) -> list[NodeProfile]:
        return self.nodes


@dataclass
class World:
    clock: FakeClock
    bus: FakeBus
    ledger: FakeLedger
    worker: Worker
    metrics: Metrics
    config: WorkerConfig
    stopping: asyncio.Event
    task: asyncio.Task[None]
    gate: Gate
    turnstile: Turnstile

    def counted(self, kind: str, label: str) -> float:
        return float(self.metrics.jobs.labels(kind, label)._value.get())

    async def answered(self, message: FakeMessage, count: int = 1) -> None:
        await until(lambda: len(message.answers()) >= count)

    async def stopped(self) -> None:
        """The run returned: every fetch in flight ended (the stop cuts them short: no
        time passes on the clock)."""
        await asyncio.wait_for(self.task, timeout=5)


@asynccontextmanager
async def world(
    *, registry: Registry | None = None, subscribe_failures: int = 0, **config: Any
) -> AsyncIterator[World]:
    """A running worker on the doubles; stopped (and checked to end) on the way out.
    `subscribe_failures`: subscribes the bus refuses first."""
    clock = FakeClock()
    bus, ledger, metrics = FakeBus(clock), FakeLedger(clock), Metrics()
    bus.subscribe_failures = subscribe_failures
    settings = replace(CONFIG, **config)
    gate, turnstile = Gate(), Turnstile()

    async def node() -> NodeProfile:
        return NODE

    worker = Worker(
        bus=bus, ledger=ledger, registry=registry, node=node,
        handlers=JobHandlers(
            {"noop": noop, "gate": gate, "turn": turnstile}, cast(WorkloadHttp, None)
        ),
        config=settings, metrics=metrics, clock=clock,
    )  # fmt: skip
    stopping = asyncio.Event()
    task = asyncio.create_task(worker.run(stopping), name="worker-under-test")
    w = World(clock, bus, ledger, worker, metrics, settings, stopping, task, gate, turnstile)
    try:
        await until(lambda: bus.kinds() == ["node.online"])
        if not subscribe_failures:
            await until(lambda: len(bus.subscriptions) == 3)
        yield w
    finally:
        gate.open.set()
        for _ in range(len(bus.messages)):
            turnstile.permits.release()
        worker.begin_stop()
        await w.stopped()
    late = [d for m in bus.messages for d in m.deliveries if d.touched_after_answer]
    assert not late, "an in_progress went out after an answer"


def past() -> datetime:
    return datetime.now(UTC) - timedelta(seconds=1)


@dataclass(frozen=True)
class Case:
    """One delivery's path: the job, what the world is like, and what it comes to."""

    job: Callable[[], Job | bytes]
    answer: tuple[str, float | None]
    events: list[str]
    label: str
    code: str | None = None
    setup: Callable[[World, Job], None] = lambda w, job: None
    delivered: int = 1
    registry: Registry | None = None


def _held(w: World, job: Job) -> None:
    w.ledger.held_elsewhere(job.idempotency_key, job=job, seconds=7.0)


def _completed_before(w: World, job: Job) -> None:
    w.ledger.held_elsewhere(job.idempotency_key, job=job, seconds=7.0)
    record = w.ledger.records[job.idempotency_key]
    w.ledger.records[job.idempotency_key] = replace(
        record, status="completed", lease_until=None, result={"noop": True}
    )


def _other_payload_before(w: World, job: Job) -> None:
    w.ledger.records[job.idempotency_key] = LedgerRecord(
        "completed", "other", "noop", "node-b", "x", 1, None, fingerprint="another"
    )


def _stuck(w: World, job: Job) -> None:
    """Claimed as often as it may be attempted; the last holder's lease ran out."""
    w.ledger.held_elsewhere(job.idempotency_key, job=job, seconds=-1.0)
    record = w.ledger.records[job.idempotency_key]
    w.ledger.records[job.idempotency_key] = replace(record, attempts=CONFIG.max_attempts)


CASES = {
    "completed": Case(
        lambda: new_job("noop"), ("ack", None), ["job.completed"], "completed", "completed"
    ),
    "not json": Case(lambda: b"not json", ("term", None), ["job.rejected"], "rejected", "invalid"),
    "expired": Case(
        lambda: new_job("noop", deadline=past()),
        ("term", None),
        ["job.expired"],
        "expired",
        "expired",
    ),
    "permanent failure": Case(
        lambda: new_job("noop", payload={"fail": "permanent"}),
        ("term", None),
        ["job.dead"],
        "permanent",
        "permanent",
    ),
    "not here, no registry to ask": Case(
        lambda: new_job("noop", requirements={"capabilities": ["quantum"]}),
        ("nak", CONFIG.not_here_delay),
        [],
        "not-here",
    ),
    "not here, a live node can": Case(
        lambda: new_job("noop", requirements={"capabilities": ["quantum"]}),
        ("nak", CONFIG.not_here_delay),
        [],
        "not-here",
        registry=Registry([NODE]),
    ),
    "not here, no live node can": Case(
        lambda: new_job("noop", requirements={"capabilities": ["quantum"]}),
        ("term", None),
        ["job.dead"],
        "unroutable",
        "unroutable",
        registry=Registry([]),
    ),
    "no handler here": Case(
        lambda: new_job("made-up"), ("nak", CONFIG.not_here_delay), [], "not-here"
    ),
    "deliveries spent": Case(
        lambda: new_job("noop"),
        ("term", None),
        ["job.dead"],
        "deliveries-spent",
        "deliveries-spent",
        delivered=CONFIG.max_deliveries + 1,
    ),
    # looked at again once the holder's lease (7 s left) would have run out
    "held by another claimant": Case(
        lambda: new_job("noop"), ("nak", 7.0 + 0.5), [], "held", setup=_held
    ),
    "completed before": Case(
        lambda: new_job("noop"),
        ("ack", None),
        ["job.completed"],
        "duplicate",
        "completed",
        setup=_completed_before,
    ),
    "key used by another job": Case(
        lambda: new_job("noop"),
        ("term", None),
        ["job.rejected"],
        "key-conflict",
        "key-conflict",
        setup=_other_payload_before,
    ),
    "stuck": Case(
        lambda: new_job("noop"), ("term", None), ["job.dead"], "stuck", "stuck", setup=_stuck
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
async def test_one_delivery_comes_to_one_answer_and_its_event(case: Case) -> None:
    async with world(registry=case.registry) as w:
        job = case.job()
        if isinstance(job, Job):
            case.setup(w, job)
        message = w.bus.add(job, delivered=case.delivered)
        await w.answered(message)
        await until(lambda: w.counted(_kind(job), case.label) == 1)
    assert message.answers() == [case.answer]
    key = job.idempotency_key if isinstance(job, Job) else None
    assert w.bus.kinds(key) == (["node.online", *case.events] if key is None else case.events)
    if case.code is not None:
        (event,) = w.bus.of(case.events[0])
        assert event["code"] == case.code


def _kind(job: Job | bytes) -> str:
    if not isinstance(job, Job):
        return "invalid"
    return job.type if job.type in ("noop", "gate") else "unknown"


async def test_a_ledger_out_of_reach_hands_the_job_back_for_a_while() -> None:
    async with world() as w:
        w.ledger.unavailable = True
        message = w.bus.add(new_job("noop"))
        await w.answered(message)
        state = w.worker.state()  # fetching works: the ledger's outage is the registry's
        assert state is not None and state.succeeded, state
    ((verb, delay),) = message.answers()
    assert verb == "nak" and delay is not None
    assert 0.8 * CONFIG.held_delay <= delay <= CONFIG.held_delay  # spread by jitter
    assert w.bus.kinds() == ["node.online"]
    assert w.counted("noop", "ledger-error") == 1


async def test_a_failure_is_retried_after_its_backoff_step_then_completes() -> None:
    async with world() as w:
        job = new_job("noop", payload={"fail": "retryable", "fail_times": 1})
        message = w.bus.add(job)
        await w.answered(message)
        assert message.answers() == [("nak", CONFIG.backoff[0])]
        w.clock.advance(CONFIG.backoff[0])  # the message comes back
        await w.answered(message, 2)
    assert message.answers() == [("nak", CONFIG.backoff[0]), ("ack", None)]
    assert [d.delivered for d in message.deliveries] == [1, 2]
    assert w.bus.kinds(job.idempotency_key) == ["job.failed", "job.completed"]
    assert w.bus.of("job.failed")[0]["retry_in_seconds"] == CONFIG.backoff[0]
    record = w.ledger.records[job.idempotency_key]
    assert (record.status, record.attempts) == ("completed", 2)


async def test_the_last_attempt_that_fails_is_dead_lettered() -> None:
    async with world() as w:
        job = new_job("noop", payload={"fail": "retryable"})
        message = w.bus.add(job)
        await w.answered(message)
        w.clock.advance(CONFIG.backoff[0])
        await w.answered(message, 2)
    assert message.answers() == [("nak", CONFIG.backoff[0]), ("term", None)]
    assert w.bus.kinds(job.idempotency_key) == ["job.failed", "job.dead"]
    assert w.bus.of("job.dead")[0]["code"] == "attempts-spent"
    assert w.ledger.records[job.idempotency_key].status == "dead"


async def test_a_lease_lost_while_the_job_runs_stops_it_and_tells_nothing() -> None:
    async with world() as w:
        job = new_job("gate")
        message = w.bus.add(job)
        await until(lambda: w.gate.started == 1)
        w.ledger.take_over(job.idempotency_key)  # this process's lease ran out meanwhile
        w.clock.advance(KEEP)  # the lease renews, and is refused
        await w.answered(message)
        assert w.gate.cancelled == 1
    assert message.answers() == [("nak", CONFIG.held_delay)]
    assert w.bus.kinds(job.idempotency_key) == []
    assert w.counted("gate", "lost-claim") == 1
    assert w.ledger.records[job.idempotency_key].claimant == "another-process"


async def test_a_lease_keeps_a_running_job_and_a_queued_one_while_the_ledger_stalls() -> None:
    async with world(concurrency=1) as w:
        w.ledger.stall_renewals = asyncio.Event()
        running, queued = w.bus.add(new_job("gate")), w.bus.add(new_job("gate"))
        await until(lambda: w.gate.started == 1 and w.worker.in_flight == 2)

        def touches() -> list[int]:
            return [running.deliveries[0].touches, queued.deliveries[0].touches]

        w.clock.advance(KEEP)
        await until(lambda: touches() == [1, 1])
        w.clock.advance(KEEP)
        await until(lambda: touches() == [2, 2])
        # one renewal, still waiting for the ledger; the next in_progress went out anyway
        assert w.ledger.renewals == 1
        w.ledger.stall_renewals.set()
        w.gate.open.set()
        await w.answered(running)
        await w.answered(queued)
    assert running.answers() == queued.answers() == [("ack", None)]


async def test_an_event_the_stream_does_not_store_hands_the_job_back_until_it_does() -> None:
    async with world() as w:
        w.bus.refuse_events = True
        job = new_job("noop")
        message = w.bus.add(job)
        await until(lambda: w.bus.event_tries >= 2)  # the first try and its first retry
        # tried again for one lease, then handed back: it is not acked without its event
        w.clock.advance(lease_seconds(CONFIG.ack_wait))
        await w.answered(message)
        ((verb, delay),) = message.answers()
        assert verb == "nak" and delay is not None and delay <= CONFIG.held_delay
        assert w.counted("noop", "event-unsent") == 1
        assert w.metrics.job_events_unsent._value.get() == 1
        assert w.ledger.records[job.idempotency_key].status == "completed"
        w.bus.refuse_events = False
        w.clock.advance(CONFIG.held_delay)  # it comes back, and is answered from the ledger
        await w.answered(message, 2)
    assert message.answers()[1] == ("ack", None)
    assert w.bus.kinds(job.idempotency_key) == ["job.completed"]
    assert w.bus.of("job.completed")[0]["duplicate"] is True
    assert w.ledger.records[job.idempotency_key].attempts == 1


async def test_two_deliveries_of_one_key_in_one_fetch_run_once() -> None:
    async with world() as w:
        job = new_job("gate")
        first = w.bus.add(job)
        second = w.bus.add(job.model_copy(update={"job_id": new_job("gate").job_id}))
        await w.answered(second)
        assert second.answers() == [("nak", CONFIG.held_delay)]
        w.gate.open.set()
        await w.answered(first)
    assert first.answers() == [("ack", None)]
    assert w.gate.started == 1


async def test_the_stop_lets_a_running_job_finish_and_hands_back_what_waits() -> None:
    async with world(concurrency=1) as w:
        running, queued = w.bus.add(new_job("gate")), w.bus.add(new_job("gate"))
        await until(lambda: w.gate.started == 1 and w.worker.in_flight == 2)
        drain = asyncio.create_task(w.worker.drain(within=30.0))
        await until(lambda: queued.answers() != [])
        w.gate.open.set()
        await drain
        assert w.worker.in_flight == 0
        assert w.gate.cancelled == 0
    assert running.answers() == [("ack", None)]
    _handed_back(queued)


async def test_a_stop_that_runs_out_of_time_hands_back_the_running_job_and_the_queued() -> None:
    async with world(concurrency=1) as w:
        running, queued = w.bus.add(new_job("gate")), w.bus.add(new_job("gate"))
        await until(lambda: w.gate.started == 1 and w.worker.in_flight == 2)
        within = 10.0
        drain = asyncio.create_task(w.worker.drain(within=within))
        await until(lambda: any(left == within - HAND_BACK_SECONDS for left in w.clock.waits()))
        w.clock.advance(within - HAND_BACK_SECONDS)  # the jobs had their time
        await drain
        assert w.gate.cancelled == 1
        assert w.worker.in_flight == 0
    assert running.answers() == [("nak", 0.0)]
    _handed_back(queued)
    (record,) = w.ledger.records.values()
    assert (record.status, record.attempts, record.error) == (
        "retrying", 0, "released on shutdown",
    )  # fmt: skip
    assert w.counted("gate", "handed-back") == 1
    # handed back unread: counted without its type, as a delivery that is no job is
    assert w.counted("invalid", "handed-back") == len(queued.answers())


def _handed_back(message: FakeMessage) -> None:
    """Handed back at once, for another node, never run: a fetch in flight here when the
    stop began may bring it once more, and that delivery is handed back too."""
    assert 1 <= len(message.answers()) <= 2
    assert set(message.answers()) == {("nak", 0.0)}


async def test_the_supervisors_stopping_is_the_same_stop() -> None:
    async with world() as w:
        message = w.bus.add(new_job("gate"))
        await until(lambda: w.gate.started == 1)
        w.stopping.set()
        late = w.bus.add(new_job("noop"))
        w.clock.advance(CONFIG.fetch_wait)
        await w.answered(late)
        assert late.answers() == [("nak", 0.0)]  # fetched after the stop began: handed back
        assert not w.task.done()  # the running job is not left
        w.gate.open.set()
        await asyncio.wait_for(w.task, timeout=5)
    assert message.answers() == [("ack", None)]


async def test_a_failed_subscribe_waits_out_a_pause_that_the_stop_cuts_short() -> None:
    async with world(subscribe_failures=3) as w:  # one for each stream
        await until(lambda: len(w.clock.waits()) == 3)  # each fetcher pauses; nothing else
        state = w.worker.state()
        assert state is not None and state.result is components.Result.FAILED
        assert (state.error or "").count("subscribe to") == 3, state
        w.worker.begin_stop()  # the clock does not move: the stop ends the pauses
        await asyncio.wait_for(w.task, timeout=5)
    assert w.bus.subscriptions == []


async def test_after_a_pause_the_fetcher_subscribes_again_and_after_a_reconnect_too() -> None:
    clock_pause = 1.0  # the longest first pause (0.5 s x 2, jittered down)
    async with world(subscribe_failures=3) as w:
        await until(lambda: len(w.clock.waits()) == 3)
        assert len(w.bus.subscriptions) == 0
        w.clock.advance(clock_pause)
        await until(lambda: len(w.bus.subscriptions) == 3)
        # the connection is lost (which ends the long polls at once) and made again
        w.bus.lost.set()
        w.bus.lost = asyncio.Event()
        w.bus.reconnects += 1
        await until(lambda: len(w.bus.subscriptions) == 6)
        assert all(s.closed for s in w.bus.subscriptions[:3])
        message = w.bus.add(new_job("noop"))
        await w.answered(message)
    assert message.answers() == [("ack", None)]


async def test_a_fetch_brings_what_the_queue_has_room_for() -> None:
    """Once a stream delivers, it fetches up to a batch, no more than the queue takes."""
    async with world(concurrency=1, batch=4) as w:
        messages = [w.bus.add(new_job("gate")) for _ in range(5)]
        await until(lambda: w.gate.started == 1 and w.worker.in_flight == 2)
        # the first fetch polled for one; the next took the one place in the queue; the
        # stream fetches again once that place is free
        await _settled()
        assert sum(bool(m.deliveries) for m in messages) == 2
        assert w.worker.in_flight == 2
        w.gate.open.set()
        for message in messages:
            await w.answered(message)
    assert all(m.answers() == [("ack", None)] for m in messages)


async def test_a_full_queue_is_refilled_once_it_has_room_for_half_a_batch() -> None:
    """A stream that delivers does not fetch while the queue is full (a fetch per job
    would cost a round trip to the server per job, and hold a delivery besides): it waits
    until the queue has room for half a batch, then fetches that much at once."""
    async with world(concurrency=4, batch=4) as w:
        messages = [w.bus.add(new_job("turn")) for _ in range(12)]

        def delivered() -> int:
            return sum(len(m.deliveries) for m in messages)

        # four running, the queue's four places taken, and nothing fetched beyond them
        await until(lambda: w.turnstile.started == 4 and w.worker.in_flight >= 8)
        await _settled()
        assert delivered() == 8
        w.turnstile.permits.release()  # one job done: its runner takes one from the queue
        await until(lambda: w.turnstile.started == 5)
        await _settled()
        assert delivered() == 8  # one free place is not half a batch
        w.turnstile.permits.release()
        await until(lambda: w.turnstile.started == 6)
        await until(lambda: delivered() == 10)
        await _settled()
        assert delivered() == 10
        assert w.bus.fetched[-1] == ("MM_WRITE", 2)  # the two free places, in one fetch
        assert w.worker.in_flight == 8
        for _ in messages:
            w.turnstile.permits.release()
        for message in messages:
            await w.answered(message)
    assert all(m.answers() == [("ack", None)] for m in messages)


async def _settled(turns: int = 200) -> None:
    """Some turns of the event loop for whatever is to happen now (no time passes)."""
    for _ in range(turns):
        await asyncio.sleep(0)


async def test_the_worker_s_state_is_read_from_its_fetchers() -> None:
    """Ok while every stream's long poll comes back; unavailable, naming the stream, once
    one has not come back for the stale time; ok again when it does."""
    async with world() as w:
        w.clock.advance(CONFIG.pull_wait)  # the first long polls return empty
        await until(lambda: len(w.worker._fetcher.fetched_at) == 3)
        state = w.worker.state()
        assert state is not None and state.succeeded, state
        w.bus.stuck = released = asyncio.Event()
        w.clock.advance(CONFIG.pull_wait)  # the polls in flight return; the next hang
        await until(lambda: min(w.worker._fetcher.fetched_at.values()) == 2 * CONFIG.pull_wait)
        w.clock.advance(STALE_FETCH_SECONDS + CONFIG.pull_wait - 1)
        state = w.worker.state()
        assert state is not None and state.succeeded, state  # a long poll may take this long
        w.clock.advance(2)
        state = w.worker.state()
        assert state is not None and state.result is components.Result.UNAVAILABLE, state
        assert (state.error or "").startswith("no fetch from "), state
        w.bus.stuck = None
        released.set()
        await _settled()
        w.clock.advance(CONFIG.pull_wait)
        await until(lambda: bool((s := w.worker.state()) and s.succeeded))


async def test_an_idle_stream_long_polls_and_a_delivering_one_fetches_briefly() -> None:
    """WORKER_PULL_WAIT_SECONDS is the idle streams' wait; a stream that has just delivered
    fetches its batch with the short wait, and a job arriving during a long poll is
    delivered at once (no time passes)."""
    async with world(concurrency=1, batch=4) as w:
        assert w.bus.waits == [CONFIG.pull_wait] * 3
        messages = [w.bus.add(new_job("gate")) for _ in range(3)]
        await until(lambda: w.gate.started == 1)
        assert w.clock.now() == 0.0
        await until(lambda: CONFIG.fetch_wait in w.bus.waits)
        w.gate.open.set()
        for message in messages:
            await w.answered(message)


async def test_the_stop_cuts_a_long_poll_short() -> None:
    async with world() as w:
        await _settled()
        w.worker.begin_stop()
        await asyncio.wait_for(w.task, timeout=5)
        assert w.clock.now() == 0.0  # not one pull wait
        assert all(s.closed for s in w.bus.subscriptions)


async def test_a_lost_connection_cuts_a_long_poll_short() -> None:
    """A long poll on a lost connection would wait out its pull wait for nothing: the
    loss ends it, and the stream subscribes again once connected."""
    async with world() as w:
        await _settled()
        w.bus.connected = False
        w.bus.lost.set()
        await until(lambda: len(w.worker._fetcher.fetched_at) == 3)  # returned, at once
        assert w.clock.now() == 0.0
        w.bus.lost = asyncio.Event()
        w.bus.connected = True
        w.bus.reconnects += 1
        w.clock.advance(OFFLINE_LOOK_SECONDS)
        await until(lambda: len(w.bus.subscriptions) == 6)
        message = w.bus.add(new_job("noop"))
        await w.answered(message)
    assert message.answers() == [("ack", None)]


def _spread_worker(clock: FakeClock, bus: FakeBus, start_after: float) -> tuple[Worker, list[str]]:
    prepared: list[str] = []

    async def node() -> NodeProfile:
        return NODE

    async def prepare() -> None:
        prepared.append("connected")

    worker = Worker(
        bus=bus, ledger=FakeLedger(clock), registry=None, node=node,
        handlers=JobHandlers({"noop": noop}, cast(WorkloadHttp, None)), config=CONFIG,
        metrics=Metrics(), clock=clock, prepare=prepare, start_after=start_after,
    )  # fmt: skip
    return worker, prepared


async def test_the_worker_connects_after_its_start_up_spread() -> None:
    clock = FakeClock()
    bus = FakeBus(clock)
    worker, prepared = _spread_worker(clock, bus, start_after=7.5)
    stopping = asyncio.Event()
    task = asyncio.create_task(worker.run(stopping))
    await _settled()
    assert prepared == [] and bus.subscriptions == []
    clock.advance(7.4)
    await _settled()
    assert prepared == []
    clock.advance(0.1)
    await until(lambda: len(bus.subscriptions) == 3)
    assert prepared == ["connected"]
    stopping.set()
    await asyncio.wait_for(task, timeout=5)


async def test_a_stop_during_the_start_up_spread_ends_the_run_unconnected() -> None:
    clock = FakeClock()
    bus = FakeBus(clock)
    worker, prepared = _spread_worker(clock, bus, start_after=30.0)
    stopping = asyncio.Event()
    task = asyncio.create_task(worker.run(stopping))
    await _settled()
    stopping.set()
    await asyncio.wait_for(task, timeout=5)
    assert prepared == [] and bus.events == [] and clock.now() == 0.0
