"""The node's book of workloads: last ping per workload, and the derived view of each.

In memory by design: pings arrive every 5-10 s, so after a restart the book is whole
again within one ping interval. The book is bounded (`max_tracked_workloads`) and
forgets workloads that have not pinged for `ping_forget_seconds`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

from app.domain.health import Ping, PingRecord, derive_status, ping_age
from app.domain.reports import WorkloadView


class BookFull(Exception):
    """A new workload name arrived while the book holds its maximum."""


class WorkloadBook:
    def __init__(
        self,
        *,
        stale_after: float,
        forget_after: float,
        capacity: int,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._stale_after = stale_after
        self._forget_after = forget_after
        self._capacity = capacity
        self._clock = clock
        self._wall_clock = wall_clock
        self._pings: dict[str, PingRecord] = {}

    def record(self, name: str, ping: Ping) -> PingRecord:
        if name not in self._pings and len(self._pings) >= self._capacity:
            self.forget_silent()
            if len(self._pings) >= self._capacity:
                raise BookFull(name)
        entry = PingRecord(ping=ping, received_at=self._clock(), received_wall=self._wall_clock())
        self._pings[name] = entry
        return entry

    def names(self) -> list[str]:
        return sorted(self._pings)

    def view(self, name: str) -> WorkloadView | None:
        record = self._pings.get(name)
        if record is None:
            return None
        return self._view(name, record, self._clock())

    def views(self) -> list[WorkloadView]:
        now = self._clock()
        return [self._view(name, self._pings[name], now) for name in sorted(self._pings)]

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for view in self.views():
            counts[view.status] = counts.get(view.status, 0) + 1
        return counts

    def forget_silent(self) -> int:
        """Drop workloads silent for longer than `forget_after`; returns how many."""
        now = self._clock()
        gone = [n for n, r in self._pings.items() if now - r.received_at > self._forget_after]
        for name in gone:
            del self._pings[name]
        return len(gone)

    def _view(self, name: str, record: PingRecord | None, now: float) -> WorkloadView:
        status = derive_status(record, now=now, stale_after=self._stale_after)
        return WorkloadView(
            name=name,
            status=status.value,
            ping_age_seconds=ping_age(record, now=now),
            version=record.ping.version if record else None,
            message=record.ping.message if record else None,
            last_ping_at=(datetime.fromtimestamp(record.received_wall, tz=UTC) if record else None),
        )
