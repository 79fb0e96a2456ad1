"""In-memory doubles of what the job worker talks to, for its branch tests: a clock that
moves only when the test moves it, a JetStream bus of job streams and an events stream,
and an idempotency ledger that keeps the ledger's rules (app/domain/ledger.py).

Each implements exactly the protocol the worker uses (`app.services.working.Bus`,
`app.services.leasing.Clock`, `app.services.working.Ledger`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from app.adapters.bus import Published
from app.adapters.kv_ledger import LedgerUnavailable
from app.domain.jobs import Job, job_subject
from app.domain.ledger import (
    RUNNING,
    Claim,
    LedgerRecord,
    decide_claim,
    decide_finish,
    decide_release,
    decide_renew,
)
from app.services.leasing import Message


class FakeClock:
    """Time that moves only when the test advances it: `advance` fires every timer (a
    wait's deadline, a `call_later`) whose time has come."""

    def __init__(self) -> None:
        self._now = 0.0
        self._timers: list[_Timer] = []

    def now(self) -> float:
        return self._now

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        if event.is_set():
            return True
        loop = asyncio.get_running_loop()
        timer = _Timer(self, self._now + max(seconds, 0.0))
        try:
            async with asyncio.timeout(None) as scope:

                def fire() -> None:
                    timer.cancel()  # once
                    scope.reschedule(loop.time())

                timer.fire = fire
                self._timers.append(timer)
                if timer.due <= self._now:
                    timer.fire()
                await event.wait()
        except TimeoutError:
            return event.is_set()
        finally:
            timer.cancel()
        return True

    def call_later(self, seconds: float, callback: Callable[[], None]) -> _Timer:
        timer = _Timer(self, self._now + max(seconds, 0.0))

        def fire() -> None:
            timer.cancel()
            callback()

        timer.fire = fire
        self._timers.append(timer)
        return timer

    async def sleep(self, seconds: float) -> None:
        await self.wait(asyncio.Event(), seconds)

    def advance(self, seconds: float) -> None:
        """Move time on; every wait whose deadline has come ends (once the loop runs)."""
        self._now += seconds
        for timer in list(self._timers):
            if timer.due <= self._now:
                timer.fire()

    def waits(self) -> list[float]:
        """The seconds left on every timer set."""
        return sorted(timer.due - self._now for timer in self._timers)


@dataclass(eq=False)
class _Timer:
    clock: FakeClock
    due: float
    fire: Callable[[], None] = lambda: None

    def cancel(self) -> None:
        if self in self.clock._timers:
            self.clock._timers.remove(self)


@dataclass(eq=False)
class FakeMessage:
    """A message in a job stream, with every delivery of it."""

    bus: FakeBus
    stream: str
    subject: str
    data: bytes
    sequence: int
    deliveries: list[FakeDelivery] = field(default_factory=list)

    def answers(self) -> list[tuple[str, float | None]]:
        """What each delivery was answered (None: not yet)."""
        return [d.answer for d in self.deliveries if d.answer is not None]


@dataclass(eq=False)
class FakeDelivery:
    """One delivery of a message (`app.services.leasing.Message`)."""

    message: FakeMessage
    delivered: int
    answer: tuple[str, float | None] | None = None
    touches: int = 0  # in_progress calls
    touched_after_answer: bool = False

    @property
    def subject(self) -> str:
        return self.message.subject

    @property
    def data(self) -> bytes:
        return self.message.data

    @property
    def stream_sequence(self) -> int:
        return self.message.sequence

    async def ack(self) -> None:
        self._answered(("ack", None))

    async def nak(self, delay: float) -> None:
        self._answered(("nak", delay))
        self.message.bus._back(self.message, delay, self.delivered + 1)

    async def term(self) -> None:
        self._answered(("term", None))

    async def in_progress(self) -> None:
        self.touches += 1
        if self.answer is not None:
            self.touched_after_answer = True

    def _answered(self, answer: tuple[str, float | None]) -> None:
        assert self.answer is None, f"answered twice: {self.answer} then {answer}"
        self.answer = answer


async def _relay(event: asyncio.Event, to: asyncio.Event) -> None:
    await event.wait()
    to.set()


class FakeSubscription:
    def __init__(self, bus: FakeBus, stream: str) -> None:
        self._bus = bus
        self._stream = stream
        self.closed = False

    async def fetch(
        self, batch: int, *, wait: float, cut: Sequence[asyncio.Event] = ()
    ) -> Sequence[Message]:
        """What is due in the stream, up to `batch`, as soon as something is; else nothing
        once `wait` seconds have passed on the clock, or an event of `cut` is set."""
        bus, clock = self._bus, self._bus.clock
        bus.waits.append(wait)
        if bus.stuck is not None:  # a fetch that does not come back until released
            await bus.stuck.wait()
        ends = clock.now() + wait
        arrived = bus._arrived.setdefault(self._stream, asyncio.Event())
        relays = [asyncio.ensure_future(_relay(event, arrived)) for event in cut]
        try:
            while True:
                due = bus._take(self._stream, batch)
                if due:
                    bus.fetched.append((self._stream, len(due)))
                    return due
                left = ends - clock.now()
                if left <= 0 or any(event.is_set() for event in cut):
                    return []
                soonest = bus._soonest(self._stream)
                span = left if soonest is None else min(left, max(soonest - clock.now(), 0.0))
                arrived.clear()
                await clock.wait(arrived, span)
        finally:
            for relay in relays:
                relay.cancel()

    async def unsubscribe(self) -> None:
        self.closed = True


class FakeBus:
    """Job streams (messages come back after a NAK's delay), and an events stream that
    keeps what is published to it, or refuses it."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.connected = True
        self.reconnects = 0
        self.lost = asyncio.Event()  # set when the connection is lost (the fetches' cut)
        self.waits: list[float] = []  # every fetch's wait, in order
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.refuse_events = False  # the events stream answers nothing (its leader is gone)
        self.event_tries = 0
        self.subscribe_failures = 0  # subscribes refused before the next one succeeds
        self.stuck: asyncio.Event | None = None  # set: fetches wait for it before anything
        self.subscriptions: list[FakeSubscription] = []
        self.messages: list[FakeMessage] = []  # every message published to a job stream
        self.fetched: list[tuple[str, int]] = []  # by fetch that brought any: stream, how many
        self._pending: dict[str, list[tuple[float, int, FakeMessage]]] = {}
        self._arrived: dict[str, asyncio.Event] = {}
        self._sequence = 0

    def add(
        self, job: Job | bytes, *, stream: str = "MM_WRITE", subject: str | None = None,
        delivered: int = 1,
    ) -> FakeMessage:  # fmt: skip
        """A message published to a job stream (the tier A write subject of its type)."""
        if isinstance(job, Job):
            data = json.dumps(job.model_dump(mode="json", by_alias=True, exclude_none=True))
            message_subject = subject or job_subject("write", "A", job.type)
            body = data.encode()
        else:
            message_subject, body = subject or "mm.write.A.noop", job
        self._sequence += 1
        message = FakeMessage(self, stream, message_subject, body, self._sequence)
        self.messages.append(message)
        self._back(message, 0.0, delivered)
        return message

    def _back(self, message: FakeMessage, delay: float, delivered: int) -> None:
        pending = self._pending.setdefault(message.stream, [])
        pending.append((self.clock.now() + delay, delivered, message))
        self._arrived.setdefault(message.stream, asyncio.Event()).set()

    def _take(self, stream: str, batch: int) -> list[Message]:
        pending = self._pending.get(stream, [])
        now = self.clock.now()
        due = sorted((entry for entry in pending if entry[0] <= now), key=lambda e: e[0])
        taken: list[Message] = []
        for entry in due[:batch]:
            pending.remove(entry)
            _, delivered, message = entry
            delivery = FakeDelivery(message, delivered)
            message.deliveries.append(delivery)
            taken.append(delivery)
        return taken

    def _soonest(self, stream: str) -> float | None:
        pending = self._pending.get(stream, [])
        return min((entry[0] for entry in pending), default=None)

    async def subscribe(self, *, stream: str, durable: str) -> FakeSubscription:
        assert durable == "wm-A"
        if self.subscribe_failures:
            self.subscribe_failures -= 1
            raise TimeoutError(f"no answer subscribing to {stream}")
        subscription = FakeSubscription(self, stream)
        self.subscriptions.append(subscription)
        return subscription

    def room(self, subject: str, msg_id: str | None = None) -> int:
        return 1024 * 1024

    async def publish(
        self,
        subject: str,
        body: dict[str, Any] | bytes,
        *,
        msg_id: str | None = None,
        within: float | None = None,
    ) -> Published:
        self.event_tries += 1
        if self.refuse_events:
            raise TimeoutError("no answer from the events stream")
        data = body if isinstance(body, dict) else json.loads(body)
        self.events.append((subject, data))
        return Published(seq=len(self.events), duplicate=False)

    def kinds(self, key: str | None = None) -> list[str]:
        """The kinds of the events published (job.completed, ...), of one key if given."""
        return [
            subject.split(".", 3)[3]
            for subject, body in self.events
            if key is None or body.get("idempotency_key") == key
        ]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [body for subject, body in self.events if subject.endswith(f".{kind}")]


class FakeLedger:
    """The idempotency ledger in a dict, by the ledger's own rules, on the fake clock."""

    def __init__(self, clock: FakeClock, *, claimant: str = "this-process") -> None:
        self._clock = clock
        self.claimant = claimant
        self.records: dict[str, LedgerRecord] = {}
        self.unavailable = False  # every request fails as an unreachable store's would
        self.renewals = 0
        self.stall_renewals: asyncio.Event | None = None  # renewals wait for it when given

    async def claim(
        self, *, key: str, job_id: str, job_type: str, fingerprint: str, lease_seconds: float
    ) -> tuple[Claim, float]:
        self._reachable()
        decision = decide_claim(
            self.records.get(key), now=self._clock.now(), job_id=job_id, job_type=job_type,
            fingerprint=fingerprint, node_id="node-a", claimant=self.claimant,
            lease_seconds=lease_seconds,
        )  # fmt: skip
        if decision.write is not None:
            self.records[key] = decision.write
        return decision.claim, decision.number

    async def renew(self, *, key: str, lease_seconds: float) -> bool:
        self.renewals += 1
        if self.stall_renewals is not None:
            await self.stall_renewals.wait()
        self._reachable()
        return self._store(
            key,
            decide_renew(
                self.records.get(key), now=self._clock.now(), claimant=self.claimant,
                lease_seconds=lease_seconds,
            ),
        )  # fmt: skip

    async def complete(self, *, key: str, result: Any) -> bool:
        self._reachable()
        after = decide_finish(
            self.records.get(key), claimant=self.claimant, status="completed", result=result
        )
        return self._store(key, after)

    async def fail(self, *, key: str, error: str, dead: bool) -> bool:
        self._reachable()
        status = "dead" if dead else "retrying"
        after = decide_finish(self.records.get(key), claimant=self.claimant, status=status,
                              error=error)  # fmt: skip
        return self._store(key, after)

    async def release(self, *, key: str) -> bool:
        self._reachable()
        return self._store(key, decide_release(self.records.get(key), claimant=self.claimant))

    def held_elsewhere(self, key: str, *, job: Job, seconds: float) -> None:
        """Another process holds `key` under a live lease for `seconds` more."""
        from app.domain.ledger import job_fingerprint

        self.records[key] = LedgerRecord(
            RUNNING, str(job.job_id), job.type, "node-b", "another-process", 1,
            self._clock.now() + seconds, fingerprint=job_fingerprint(job.type, job.payload),
        )  # fmt: skip

    def take_over(self, key: str) -> None:
        """Another process takes the key over (this one's lease ran out)."""
        self.records[key] = replace(self.records[key], claimant="another-process")

    def _store(self, key: str, after: LedgerRecord | None) -> bool:
        if after is None:
            return False
        self.records[key] = after
        return True

    def _reachable(self) -> None:
        if self.unavailable:
            raise LedgerUnavailable("the ledger's store does not answer")
