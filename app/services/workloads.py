"""The node's book of workloads: pings, the desired state and the cluster's view of each.

In memory by design: pings arrive every 5-10 s, so after a restart the book is whole
again within one ping interval, and the desired state and rollouts come back with the
first sync. The book is bounded (`max_tracked_workloads`) and forgets workloads that
neither ping nor appear in the desired state or the cluster for `ping_forget_seconds`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from app.domain.health import (
    Ping,
    PingRecord,
    Rollout,
    WorkloadStatus,
    derive_status,
    ping_age,
)
from app.domain.reports import UpdateView, WorkloadView
from app.domain.rollout import PingSeen, Trail

if TYPE_CHECKING:
    from app.services.last_good import Origin

# the ping answer's header naming a pending update (docs/rollout.md)
UPDATE_HEADER = "x-workload-update"


class BookFull(Exception):
    """A new workload name arrived while the book holds its maximum."""


@dataclass(frozen=True, slots=True)
class Deployed:
    """A managed Deployment as last seen in the cluster."""

    version: str | None
    rollout: Rollout


class WorkloadBook:
    def __init__(
        self,
        *,
        stale_after: float,
        forget_after: float,
        capacity: int,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        on_forget: Callable[[str], None] = lambda _name: None,
    ) -> None:
        """`on_forget(name)` is called for each workload the book forgets (its metric
        series go with it)."""
        self._on_forget = on_forget
        self._stale_after = stale_after
        self._forget_after = forget_after
        self._capacity = capacity
        self._clock = clock
        self._wall_clock = wall_clock
        self._pings: dict[str, PingRecord] = {}
        self._desired: dict[str, str] | None = None
        self._deployed: dict[str, Deployed] | None = None
        self._crashlooping: dict[str, str] = {}  # name -> why, from the last look at pods
        self._uptime: Callable[[str], tuple[float | None, float | None]] | None = None
        # the pings of workloads whose update is being judged, from its start (`watch`)
        self._trails: dict[str, Trail] = {}
        # each managed workload's update, as the last sync decided it (`set_updates`), and
        # the `x-workload-update` value of those with an update pending
        self._updates: dict[str, UpdateView] = {}
        self._notices: dict[str, bytes] = {}
        # where the desired state of the last sync came from (the report says it)
        self.desired_origin: Origin | None = None

    def record(self, name: str, ping: Ping) -> PingRecord:
        if name not in self._pings and len(self._pings) >= self._capacity:
            self.forget_silent()
            if len(self._pings) >= self._capacity:
                raise BookFull(name)
        entry = PingRecord(ping=ping, received_at=self._clock(), received_wall=self._wall_clock())
        self._pings[name] = entry
        if self._trails:  # an update is judged: its workload's pings are kept
            trail = self._trails.get(name)
            if trail is not None:
                at = datetime.fromtimestamp(entry.received_wall, UTC)
                trail.add(PingSeen(at, ping.status, ping.version))
        return entry

    def last_ping(self, name: str) -> PingRecord | None:
        return self._pings.get(name)

    def watch(self, names: set[str]) -> None:
        """Keep the pings of these workloads from now on (their updates are judged), and no
        longer those of the others."""
        for name in [n for n in self._trails if n not in names]:
            del self._trails[name]
        for name in names:
            self._trails.setdefault(name, Trail())

    def pings_seen(self, name: str) -> list[PingSeen]:
        """The pings kept for `name`'s judgement (`watch`), as `judge` reads them."""
        trail = self._trails.get(name)
        return trail.pings() if trail is not None else []

    def set_updates(self, updates: dict[str, UpdateView]) -> None:
        """Each managed workload's update, as the last sync decided it."""
        self._updates = dict(updates)
        self._notices.clear()  # the same dict: the ping fast path holds it (`notices`)
        self._notices.update(
            (name, f"version={view.target}; state={view.state}".encode())
            for name, view in updates.items()
            if view.pending
        )

    @property
    def notices(self) -> Mapping[str, bytes]:
        """The `x-workload-update` value of each workload with an update pending (one
        dict for the book's life, updated in place)."""
        return self._notices

    def update_notice(self, name: str) -> bytes | None:
        """The `x-workload-update` header value for a ping from `name`: an update pending."""
        return self._notices.get(name)

    def update_states(self) -> list[tuple[str, str]]:
        """(workload, update state) of every managed workload, for the metrics."""
        return sorted((name, view.state) for name, view in self._updates.items())

    def update_in_flight(self, name: str) -> bool:
        """Whether `name`'s update is applying or judged: uptime restarts leave it alone."""
        view = self._updates.get(name)
        return view is not None and view.in_flight

    def set_desired(self, versions: dict[str, str]) -> None:
        """The desired workloads and versions, as of the last sync that read them."""
        self._desired = dict(versions)

    def set_deployed(self, deployed: dict[str, Deployed]) -> None:
        """The managed Deployments, as of the last list of the cluster."""
        self._deployed = dict(deployed)

    def set_uptime(self, shares: Callable[[str], tuple[float | None, float | None]]) -> None:
        """Where each workload's share of time healthy (24 h, 7 d) comes from."""
        self._uptime = shares

    def uptimes(self) -> list[tuple[str, str, float]]:
        """(workload, window, share) for every workload with data, for the metrics."""
        found: list[tuple[str, str, float]] = []
        if self._uptime is None:
            return found
        for name in self.names():
            for window, value in zip(("24h", "7d"), self._uptime(name), strict=True):
                if value is not None:
                    found.append((name, window, value))
        return found

    def set_crashlooping(self, found: dict[str, str]) -> None:
        """The managed workloads with a pod in a crash loop, and why, as last seen."""
        self._crashlooping = dict(found)

    def managed(self) -> set[str]:
        """The workloads with a Deployment the manager manages, as of the last list."""
        return set(self._deployed or ())

    def names(self) -> list[str]:
        names = set(self._pings)
        names.update(self._desired or ())
        names.update(self._deployed or ())
        return sorted(names)

    def view(self, name: str) -> WorkloadView | None:
        if (
            name not in self._pings
            and name not in (self._desired or {})
            and name not in (self._deployed or {})
        ):
            return None
        return self._view(name, self._clock())

    def views(self) -> list[WorkloadView]:
        now = self._clock()
        return [self._view(name, now) for name in self.names()]

    def statuses(self) -> dict[str, str]:
        """Each workload's status now, without the rest of its view."""
        now = self._clock()
        return {name: self._status(name, now).value for name in self.names()}

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for view in self.views():
            counts[view.status] = counts.get(view.status, 0) + 1
        return counts

    def forget_silent(self) -> list[str]:
        """Drop pings silent for longer than `forget_after`; returns their names."""
        now = self._clock()
        gone = [n for n, r in self._pings.items() if now - r.received_at > self._forget_after]
        for name in gone:
            del self._pings[name]
            self._on_forget(name)
        return gone

    def _status(self, name: str, now: float) -> WorkloadStatus:
        deployed = (self._deployed or {}).get(name)
        return derive_status(
            self._pings.get(name),
            now=now,
            stale_after=self._stale_after,
            expected=name in (self._desired or {}) and self._deployed is not None,
            rollout=deployed.rollout if deployed else None,
            crashlooping=name in self._crashlooping,
        )

    def _view(self, name: str, now: float) -> WorkloadView:
        record = self._pings.get(name)
        deployed = (self._deployed or {}).get(name)
        desired_version = (self._desired or {}).get(name)
        status = self._status(name, now)
        crash = self._crashlooping.get(name) if status is WorkloadStatus.CRASHLOOPING else None
        day, week = self._uptime(name) if self._uptime is not None else (None, None)
        return WorkloadView(
            name=name,
            status=status.value,
            ping_age_seconds=ping_age(record, now=now),
            version=record.ping.version if record else None,
            message=crash or (record.ping.message if record else None),
            last_ping_at=(datetime.fromtimestamp(record.received_wall, tz=UTC) if record else None),
            desired_version=desired_version,
            deployed_version=deployed.version if deployed else None,
            rollout=deployed.rollout.phase.value if deployed else None,
            uptime_24h=day,
            uptime_7d=week,
            update=self._updates.get(name),
        )
