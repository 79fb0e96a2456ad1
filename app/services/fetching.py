"""The job worker's fetcher: the tier's job streams into the runners' bounded queue.

One loop per stream (MM_ONLINE, MM_OFFLINE, MM_WRITE) pulls from the tier's shared
durable consumer. It subscribes again after every reconnect of the bus, and after a
failed subscribe or fetch it waits out a growing, jittered pause that the stop cuts
short. Each delivery gets its lease the moment it arrives, then waits for a place in the
queue.

The queue has room for WORKER_CONCURRENCY jobs beyond those running. An idle stream
long-polls for one message, WORKER_PULL_WAIT_SECONDS at a time (tens of seconds: a job
that arrives meanwhile is delivered at once, so the wait costs no latency, and a fleet of
idle nodes sends a pull request per stream that often rather than every second); the
stop and a lost connection cut such a wait short. Once it delivers, it waits until the
queue has room for half a batch (JOB_FETCH_BATCH, or the queue's size when smaller) and
then fetches what the queue has room for, up to a batch, waiting at most a second. A
fetch then
brings several jobs in one round trip to the server, and the runners that take them
together claim, complete and answer them together (one ledger statement for their
claims, one for their completions); fetching one job each time one place came free would
cost a round trip per job and leave the runners each on its own. So idle streams cannot
keep a small WORKER_CONCURRENCY from the busy one, and the jobs delivered and unanswered
here stay bounded: those running, at most WORKER_CONCURRENCY queued, and at most one
fetch per stream waiting for a place.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from typing import Protocol

from app.adapters.bus import BusError
from app.domain.job_flow import WorkerConfig
from app.domain.jobs import consumer_name
from app.services.leasing import Clock, Lease, Leases, Message

log = logging.getLogger(__name__)

# how often a fetcher looks again while the bus is not connected
OFFLINE_LOOK_SECONDS = 0.2


class Subscription(Protocol):
    """A pull subscription to a durable consumer (`app.adapters.bus.PullSubscription`):
    `fetch` ends early, with what has come, once an event of `cut` is set."""

    async def fetch(
        self, batch: int, *, wait: float, cut: Sequence[asyncio.Event] = ()
    ) -> Sequence[Message]: ...

    async def unsubscribe(self) -> None: ...


class JobQueue(asyncio.Queue[Lease]):
    """The runners' queue: WORKER_CONCURRENCY places, and a fetcher can wait for room in
    it before it fetches."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize)
        self._taken = asyncio.Event()  # set whenever a runner takes a lease

    @property
    def room(self) -> int:
        return self.maxsize - self.qsize()

    def refill_at(self, batch: int) -> int:
        """The room a stream that delivers waits for before it fetches again: half a
        batch, or half the queue when that is smaller (at least one place)."""
        return max(1, min(batch, self.maxsize) // 2)

    async def wait_room(self, places: int) -> None:
        """Until the queue has room for `places` leases."""
        while self.room < places:
            self._taken.clear()
            await self._taken.wait()

    def _get(self) -> Lease:
        self._taken.set()
        return super()._get()


class Source(Protocol):
    """What the fetcher asks of the bus (`app.adapters.bus.JetStreamBus`)."""

    @property
    def connected(self) -> bool: ...

    @property
    def reconnects(self) -> int: ...

    @property
    def lost(self) -> asyncio.Event:
        """Set once the current connection is lost."""
        ...

    async def subscribe(self, *, stream: str, durable: str) -> Subscription: ...


def pause_seconds(failures: int) -> float:
    """The pause after `failures` failed subscribes or fetches in a row: growing up to
    30 s, jittered so that many nodes do not come back at once."""
    return min(30.0, 0.5 * 2.0 ** min(failures, 6)) * random.uniform(0.5, 1.0)


class Fetcher:
    """Fetches every job stream of the tier into one queue until the stop."""

    def __init__(
        self,
        *,
        bus: Source,
        config: WorkerConfig,
        clock: Clock,
        stop: asyncio.Event,
    ) -> None:
        self._bus = bus
        self._config = config
        self._clock = clock
        self._stop = stop
        # by stream: the failure of its last subscribe or fetch (until one succeeds), when
        # its last fetch returned, and whether it waits for room in the queue
        self.troubles: dict[str, str] = {}
        self.fetched_at: dict[str, float] = {}
        self.waiting: set[str] = set()

    async def fetch(self, stream: str, queue: JobQueue, leases: Leases) -> None:
        """Fetch from `stream` into `queue` until the stop; what a fetch brings after the
        stop began is queued too, and the runners hand it back."""
        bus = self._bus
        durable = consumer_name(self._config.tier)
        subscription: Subscription | None = None
        seen_reconnects = -1
        failures = 0
        active = False
        refill_at = queue.refill_at(self._config.batch)
        while not self._stop.is_set():
            if active and queue.room < refill_at:
                await self._wait_room(stream, queue, refill_at)
                continue
            if not bus.connected:
                await self._clock.wait(self._stop, OFFLINE_LOOK_SECONDS)
                continue
            if subscription is None or seen_reconnects != bus.reconnects:
                if subscription is not None:
                    await subscription.unsubscribe()
                    subscription = None
                try:
                    subscription = await bus.subscribe(stream=stream, durable=durable)
                except BusError as exc:
                    failures += 1
                    await self._pause(stream, f"subscribe to {stream}/{durable}", exc, failures)
                    continue
                seen_reconnects = bus.reconnects
            # an active stream takes what the queue has room for, waiting briefly; an idle
            # one long-polls for one; the stop or a lost connection ends either wait
            config = self._config
            size = max(1, min(config.batch, queue.room)) if active else 1
            wait = config.fetch_wait if active else max(config.fetch_wait, config.pull_wait)
            try:
                deliveries = await subscription.fetch(size, wait=wait, cut=(self._stop, bus.lost))
            except BusError as exc:
                failures += 1
                await subscription.unsubscribe()
                subscription = None
                await self._pause(stream, f"fetch from {stream}", exc, failures)
                continue
            failures = 0
            self.troubles.pop(stream, None)
            self.fetched_at[stream] = self._clock.now()
            active = bool(deliveries)
            leased = [leases.take(delivery) for delivery in deliveries]
            self.waiting.add(stream)
            try:
                for lease in leased:
                    await queue.put(lease)
            finally:
                self.waiting.discard(stream)
        if subscription is not None:
            await subscription.unsubscribe()

    async def _wait_room(self, stream: str, queue: JobQueue, places: int) -> None:
        self.waiting.add(stream)
        try:
            await queue.wait_room(places)
        finally:
            self.waiting.discard(stream)

    async def _pause(self, stream: str, what: str, exc: BaseException, failures: int) -> None:
        """A pause after a failure, kept as the stream's trouble; the stop ends it."""
        delay = pause_seconds(failures)
        log.warning("%s failed (%d in a row): %s; retrying in %.1f s", what, failures, exc, delay)
        self.troubles[stream] = f"{what}: {exc}"
        await self._clock.wait(self._stop, delay)
