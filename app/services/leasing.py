"""A delivery held here, from its fetch until its answer: one `Lease` each.

A lease is the only owner of what keeps its delivery this process's: every ack_wait/3
it tells JetStream (`in_progress`) and, once the job is claimed, the idempotency ledger
(`renew`) that the delivery is still ours. A renewal the ledger refuses while the
handler runs means the lease ran out and another process took the key: the lease is
lost, and the handler's time is cut short (its effects are not ours). When the stop
runs out of time (`cut`), the lease withdraws the running handler the same way, and the
job is handed back. Nothing else writes a delivery's lease state: the runner that holds
the lease claims it (`claimed`), runs the handler inside it (`running`) and answers
through it (`ack`, `nak`, `term`); leaving its `async with` block ends the keeping.

The fetcher takes a lease the moment a delivery arrives (`Leases.take`), so a job that
waits in the queue for a runner is kept ours too, not handed out again meanwhile. A
lease's keeper is a task of the worker's task group, started at the lease's first tick
(a job answered sooner costs a timer, not a task) or at the cut.

Time comes from a `Clock`: the event loop's in the manager, a hand-driven one in the
worker's branch tests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.adapters.bus import BusError
from app.adapters.kv_ledger import LedgerUnavailable
from app.adapters.registry import RegistryUnavailable

log = logging.getLogger(__name__)

# tries of a ledger write or an event publish that fit in one lease: a request to a stream
# whose leader just died gets no answer until it times out, so each try gets a quarter of
# the lease, and the renewals get through as soon as a new leader answers
LEASE_TRIES = 4
# what a ledger raises when its store cannot be reached (PostgreSQL or JetStream)
LEDGER_ERRORS = (*RegistryUnavailable, LedgerUnavailable)


def lease_seconds(ack_wait: float) -> float:
    """A claim's lease: two ack waits (its lease renews it every third of one)."""
    return 2 * ack_wait


def request_timeout(ack_wait: float) -> float:
    """The most one ledger request or event publish may take: a quarter of the lease."""
    return lease_seconds(ack_wait) / LEASE_TRIES


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """The worker's time: how long to wait, and for what."""

    def now(self) -> float: ...

    def call_later(self, seconds: float, callback: Callable[[], None]) -> Cancellable: ...

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        """Until `event` is set (True) or `seconds` have passed (False)."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class LoopClock:
    """The event loop's clock."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def call_later(self, seconds: float, callback: Callable[[], None]) -> Cancellable:
        return asyncio.get_running_loop().call_later(seconds, callback)

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        if event.is_set():
            return True
        try:
            async with asyncio.timeout(max(seconds, 0.0)):
                await event.wait()
        except TimeoutError:
            return event.is_set()
        return True

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class Message(Protocol):
    """One delivered message and the four answers JetStream accepts
    (`app.adapters.bus.Delivery`)."""

    @property
    def subject(self) -> str: ...

    @property
    def data(self) -> bytes: ...

    @property
    def delivered(self) -> int: ...

    @property
    def stream_sequence(self) -> int: ...

    async def ack(self) -> None: ...

    async def nak(self, delay: float) -> None: ...

    async def term(self) -> None: ...

    async def in_progress(self) -> None: ...


class Renewals(Protocol):
    """What a lease asks of the idempotency ledger."""

    async def renew(self, *, key: str, lease_seconds: float) -> bool: ...


Spawn = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None]"]


@dataclass(frozen=True, slots=True)
class Terms:
    """What every lease of one worker run shares."""

    ledger: Renewals
    ack_wait: float
    clock: Clock
    # starts a lease's keeper as a task of the worker's task group
    spawn: Spawn
    # set once the stop has run out of time (`Leases.cut`): running handlers are withdrawn
    cut: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def interval(self) -> float:
        """How often a lease tells JetStream and the ledger: every third of the ack wait."""
        return max(self.ack_wait / 3, 0.1)


class Leases:
    """The leases of one worker run: taken at fetch, held until they end."""

    def __init__(self, terms: Terms) -> None:
        self._terms = terms
        self._held: set[Lease] = set()
        self.none_held = asyncio.Event()  # set while no delivery is held here
        self.none_held.set()

    def __len__(self) -> int:
        return len(self._held)

    def take(self, delivery: Message) -> Lease:
        """A lease on a delivery just fetched; it is kept ours from now until it ends."""
        lease = Lease(delivery, self._terms, self._ended)
        self._held.add(lease)
        self.none_held.clear()
        lease._arm()
        return lease

    def cut(self) -> None:
        """The stop ran out of time: each lease held withdraws its running job."""
        self._terms.cut.set()
        for lease in list(self._held):
            lease._wake()

    def _ended(self, lease: Lease) -> None:
        self._held.discard(lease)
        if not self._held:
            self.none_held.set()


class Lease:
    """One delivery held here until its answer (see the module's docstring)."""

    __slots__ = (
        "_answered", "_ended", "_keeper", "_lost", "_on_end", "_renewing", "_scope",
        "_terms", "_timer", "_withdrawn", "delivery", "key",
    )  # fmt: skip

    def __init__(self, delivery: Message, terms: Terms, on_end: Callable[[Lease], None]) -> None:
        self.delivery = delivery
        self.key: str | None = None  # the idempotency key, once claimed here
        self._terms = terms
        self._on_end = on_end
        # the keeper starts at the first tick (most jobs are answered long before) or at
        # the cut: a job answered within a third of the ack wait costs no task
        self._timer: Cancellable | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._scope: asyncio.Timeout | None = None  # the running handler's time limit
        self._lost = False  # the ledger gave the claim to another process
        self._withdrawn = False  # the stop ran out of time while it was held
        # set as the answer is sent: an `in_progress` after a NAK would take the message
        # back from redelivery and hold it for a backoff step (up to the last, minutes)
        self._answered = False
        self._renewing = False
        self._ended = False

    @property
    def lost(self) -> bool:
        """The ledger refused a renewal while the handler ran: another process has the key."""
        return self._lost

    @property
    def withdrawn(self) -> bool:
        """The stop ran out of time: the job is to be handed back, not finished."""
        return self._withdrawn

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        self.end()

    def end(self) -> None:
        """Stop keeping the delivery ours (answered, or left to JetStream's ack wait)."""
        if self._ended:
            return
        self._ended = True
        if self._timer is not None:
            self._timer.cancel()
        if self._keeper is not None:
            self._keeper.cancel()
        self._on_end(self)

    def claimed(self, key: str) -> None:
        """The ledger gave this process the key: its lease is renewed from now on."""
        self.key = key

    @asynccontextmanager
    async def running(self, limit: float) -> AsyncIterator[None]:
        """The handler's time: at most `limit` seconds, cut short (TimeoutError) when the
        lease is lost or withdrawn meanwhile."""
        async with asyncio.timeout(limit) as scope:
            self._scope = scope
            if self._withdrawn:
                scope.reschedule(asyncio.get_running_loop().time())
            try:
                yield
            finally:
                self._scope = None

    async def ack(self) -> None:
        self._answered = True
        await self.delivery.ack()

    async def nak(self, delay: float) -> None:
        self._answered = True
        await self.delivery.nak(delay)

    async def term(self) -> None:
        self._answered = True
        await self.delivery.term()

    def _arm(self) -> None:
        self._timer = self._terms.clock.call_later(self._terms.interval, self._wake)

    def _wake(self) -> None:
        """Start the keeper (its first tick, or the cut), once."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._keeper is None and not self._ended:
            self._keeper = self._terms.spawn(self._keep())

    async def _keep(self) -> None:
        """Every ack_wait/3 until the lease ends: `in_progress`, and a renewal once claimed;
        at the cut, the running job withdrawn. The renewals run beside the loop, one at a
        time and each within a request timeout: a ledger that stalls must not hold the
        next `in_progress` back past the ack wait (JetStream would hand the running job
        out again)."""
        terms = self._terms
        # the renewals are this loop's children: ending the lease stops them, and one that
        # fails unexpectedly fails the worker's task group, as any of its tasks would
        async with asyncio.TaskGroup() as renewals:
            while True:
                if terms.cut.is_set() and not self._withdrawn:
                    self._withdraw()
                if not self._answered:
                    await self._touch()
                    key = self.key
                    if key is not None and not self._lost and not self._renewing:
                        self._renewing = True
                        renewals.create_task(self._renew(key), name="job-lease-renewal")
                if self._withdrawn:
                    await terms.clock.sleep(terms.interval)
                else:
                    await terms.clock.wait(terms.cut, terms.interval)

    async def _touch(self) -> None:
        try:
            # no await between the check of `answered` and this: the two go out in order
            await self.delivery.in_progress()
        except BusError as exc:
            log.warning("in_progress for a job failed: %s", exc)

    async def _renew(self, key: str) -> None:
        ack_wait = self._terms.ack_wait
        try:
            async with asyncio.timeout(request_timeout(ack_wait)):
                renewed = await self._terms.ledger.renew(
                    key=key, lease_seconds=lease_seconds(ack_wait)
                )
        except LEDGER_ERRORS as exc:
            log.warning("lease renewal for job %s failed: %s", key, exc)
            return
        finally:
            self._renewing = False
        # refused while the handler runs: another process took the key. Once it has run,
        # a refusal is this process's own completion or failure having landed
        if not renewed and self._scope is not None:
            self._lost = True
            self._scope.reschedule(asyncio.get_running_loop().time())  # its effects are not ours

    def _withdraw(self) -> None:
        self._withdrawn = True
        if self._scope is not None:
            self._scope.reschedule(asyncio.get_running_loop().time())
