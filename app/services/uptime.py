"""Uptime management: restart the workloads that stay bad (the rule: app/domain/uptime.py),
and count each workload's share of time healthy over 24 h and 7 d, kept across restarts.

The `uptime` loop looks at the workload book, keeps when each workload turned bad, and
restarts a managed Deployment the rule says to restart, with a rollout restart. It waits
its turn on the cluster lock (a sync or a self-update in progress goes first), alerts
on each restart and once an hour per workload when a budget holds a restart back, and
shows each workload's reason in `/v1/status` (the `uptime` component).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from app.domain.components import Outcome
from app.domain.uptime import (
    DAY,
    HOUR,
    RESTARTABLE,
    WEEK,
    RestartPolicy,
    UptimeHistory,
    UptimeRecord,
    decide_restart,
)
from app.metrics import Metrics
from app.services.alerting import Alerter
from app.services.workloads import WorkloadBook

log = logging.getLogger(__name__)

# how long a restart waits for a sync or a self-update to let go of the cluster
CLUSTER_WAIT_SECONDS = 30.0


class Restarter(Protocol):
    async def restart(self, name: str, *, at: datetime) -> dict[str, Any]: ...


class UptimeKeeper:
    def __init__(
        self,
        *,
        book: WorkloadBook,
        kube: Restarter,
        errors: tuple[type[Exception], ...],
        cluster_lock: asyncio.Lock,
        alerts: Alerter,
        metrics: Metrics,
        policy: RestartPolicy,
        record: UptimeRecord | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """`record`: where restarts are kept across restarts of the manager (the uptime
        record, saved with it); the restarts of the last hour in it count against the
        budgets from the start."""
        self._book = book
        self._kube = kube
        self._errors = errors
        self._lock = cluster_lock
        self._alerts = alerts
        self._metrics = metrics
        self._policy = policy
        self._clock = clock
        self._bad_since: dict[str, float] = {}
        self._restarts: dict[str, list[float]] = {}
        self._node_restarts: list[float] = []
        self._last_restart_at: dict[str, str] = {}
        self._reasons: dict[str, str] = {}
        self._budget_alerted: dict[str, float] = {}
        self._record = record
        self._wall = wall
        if record is not None:
            self._recall(record)

    def _recall(self, record: UptimeRecord) -> None:
        now, wall = self._clock(), self._wall()
        for name, times in record.restarts_since(wall - HOUR).items():
            self._restarts[name] = [now - (wall - at) for at in times]
            self._node_restarts.extend(self._restarts[name])
            self._last_restart_at[name] = datetime.fromtimestamp(times[-1], UTC).isoformat()
        self._node_restarts.sort()

    async def check(self) -> Outcome:
        """One look: note who turned bad, restart whom the rule says, show the reasons.

        The book is looked at whoever holds the cluster; a restart waits for it (at most
        `CLUSTER_WAIT_SECONDS`, then the next tick tries again): the sync and the
        self-update run at the same cadence, and a check that skipped while either held
        the lock could skip every time."""
        now = self._clock()
        views = self._book.views()
        managed = self._book.managed()
        present = {view.name for view in views}
        self._forget(present, now)
        for view in views:
            if view.status in RESTARTABLE:
                self._bad_since.setdefault(view.name, now)
            else:
                self._bad_since.pop(view.name, None)
            if self._book.update_in_flight(view.name):
                # its update is being judged: a restart would blur the verdict
                self._bad_since.pop(view.name, None)
                self._reasons[view.name] = "an update is being judged: not restarted meanwhile"
                continue
            decision = decide_restart(
                view.status, managed=view.name in managed,
                bad_since=self._bad_since.get(view.name), now=now,
                workload_restarts=self._restarts.get(view.name, ()),
                node_restarts=self._node_restarts, policy=self._policy,
            )  # fmt: skip
            if decision.budget_spent:
                self._budget_spent(view.name, decision.reason, now)
            if decision.restart:
                await self._restart(view.name, decision.reason, now)
            elif decision.reason:
                self._reasons[view.name] = decision.reason
            else:
                self._reasons.pop(view.name, None)
        return self._shown(now)

    def _forget(self, present: set[str], now: float) -> None:
        """Workloads the book no longer holds, and restarts older than the hour, go."""
        for held in (self._bad_since, self._reasons, self._last_restart_at):
            for name in [n for n in held if n not in present]:
                del held[name]
        self._restarts = {
            name: kept
            for name, times in self._restarts.items()
            if (kept := [t for t in times if now - t < HOUR])
        }
        self._budget_alerted = {n: t for n, t in self._budget_alerted.items() if now - t < HOUR}
        self._node_restarts = [t for t in self._node_restarts if now - t < HOUR]

    @property
    def held(self) -> int:
        """Workload entries held, over all the keeper's maps."""
        maps = (self._bad_since, self._restarts, self._last_restart_at, self._reasons,
                self._budget_alerted)  # fmt: skip
        return sum(len(m) for m in maps)

    async def _restart(self, name: str, reason: str, now: float) -> None:
        try:
            async with asyncio.timeout(CLUSTER_WAIT_SECONDS):
                await self._lock.acquire()
        except TimeoutError:
            self._reasons[name] = f"{reason}; the cluster is busy (a sync or a self-update)"
            return
        at = datetime.now(UTC)
        try:
            await self._kube.restart(name, at=at)
        except self._errors as exc:
            self._metrics.workload_restarts.labels("failed").inc()
            self._reasons[name] = f"{reason}; the restart failed: {exc}"
            log.warning("restart of workload %s failed: %s", name, exc)
            return
        finally:
            self._lock.release()
        self._restarts.setdefault(name, []).append(now)
        self._restarts[name] = [t for t in self._restarts[name] if now - t < HOUR]
        self._node_restarts.append(now)
        self._bad_since[name] = now  # the next restart counts from this one
        if self._record is not None:
            self._record.restarted(name, at=at.timestamp())
        self._last_restart_at[name] = at.isoformat()
        self._reasons[name] = f"restarted: {reason}"
        self._metrics.workload_restarts.labels("restarted").inc()
        log.warning("workload %s restarted (rollout restart): %s", name, reason)
        self._alerts.alert(
            f"workload:{name}:restarted", f"workload {name} restarted by the manager: {reason}"
        )

    def _budget_spent(self, name: str, reason: str, now: float) -> None:
        last = self._budget_alerted.get(name)
        if last is not None and now - last < HOUR:
            return
        self._budget_alerted[name] = now
        self._metrics.workload_restarts.labels("budget-spent").inc()
        log.error("workload %s is not restarted again: %s", name, reason)
        self._alerts.alert(
            f"workload:{name}:restart-budget", f"workload {name} is not restarted again: {reason}"
        )

    def _shown(self, now: float) -> Outcome:
        workloads = {
            name: {
                "reason": self._reasons.get(name),
                "restarts_last_hour": len(
                    [t for t in self._restarts.get(name, ()) if now - t < HOUR]
                ),
                "last_restart_at": self._last_restart_at.get(name),
            }
            for name in sorted(set(self._reasons) | set(self._last_restart_at))
        }
        return Outcome.ok(workloads=workloads, node_restarts_last_hour=len(self._node_restarts))


# --- uptime: the share of time healthy, kept across restarts ----------------------------

UPTIME_KEY = "uptime.json"
CONFIG_MAP_DATA_LIMIT = 1_000_000  # bytes: 1 MiB less room for metadata


class UptimeStore(Protocol):
    async def load(self) -> Any: ...

    async def save(self, data: dict[str, Any]) -> None: ...


class ConfigMapStore:
    """The record in a ConfigMap of the manager's own namespace: it outlives the pod (a
    self-update replaces it) and needs no database, so every node with a cluster has it."""

    def __init__(self, kube: Any, name: str) -> None:
        self._kube = kube
        self.name = name

    async def load(self) -> Any:
        data = await self._kube.read_config_map(self.name)
        if not data or UPTIME_KEY not in data:
            return None
        return json.loads(data[UPTIME_KEY])

    async def save(self, data: dict[str, Any]) -> None:
        """Refuses (ValueError) a record the API server would refuse: an object is 1 MiB
        at most, its metadata included. The defaults' 700 workloads take about 520 KB;
        raising MAX_TRACKED_WORKLOADS or MAX_DESIRED_WORKLOADS far beyond can reach it."""
        text = json.dumps(data, separators=(",", ":"))
        if len(text) > CONFIG_MAP_DATA_LIMIT:
            raise ValueError(
                f"the record is {len(text)} bytes, more than a ConfigMap holds "
                f"({CONFIG_MAP_DATA_LIMIT}): too many workloads tracked"
            )
        await self._kube.write_config_map(self.name, {UPTIME_KEY: text})


class FileStore:
    """The record in a file of DATA_DIR, for a manager outside a cluster."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def load(self) -> Any:
        try:
            text = await asyncio.to_thread(self.path.read_text)
        except FileNotFoundError:
            return None
        return json.loads(text)

    async def save(self, data: dict[str, Any]) -> None:
        def write() -> None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_suffix(".partial")
            partial.write_text(json.dumps(data, separators=(",", ":")))
            partial.replace(self.path)

        await asyncio.to_thread(write)


class UptimeRecorder:
    """Counts each workload's healthy time from the statuses it is shown, saves the record
    when asked and only when it changed, and answers its share over the last 24 h and 7 d.

    It does not read the workload book, and has no component of its own: the composition
    root shows it the book's statuses (the `uptime-record` loop) and calls `save` (the
    `uptime-save` loop, every SAVE_EVERY_SECONDS, and once more at shutdown), whose
    returned outcome the supervisor records on the `uptime_record` component."""

    def __init__(
        self,
        *,
        store: UptimeStore,
        where: str,
        errors: tuple[type[Exception], ...],
        max_step: float,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._where = where  # where the record is kept, said in /v1/status
        self._outage: tuple[type[Exception], ...] = errors  # the store's server is down
        self._errors: tuple[type[Exception], ...] = (*errors, OSError, ValueError)
        self._max_step = max_step
        self._wall = wall
        self.record = UptimeRecord()
        self._last: float | None = None
        self._saved: dict[str, Any] | None = None  # what the store holds, as far as known

    async def open(self) -> Outcome:
        """Read the saved record; a missing one starts empty, a garbled or unreadable one
        too (a failure, said in the log and `/v1/status`, until the next save replaces it).
        A version 1 record is read and written back in the compact form at the next save."""
        try:
            data = await self._store.load()
            if data is not None:
                self.record = UptimeRecord.from_json(data)
            self._saved = data if data is not None else self.record.to_json()
        except self._errors as exc:
            log.warning("uptime record not read, starting empty: %s", exc)
            return self._failure(exc, f"not read, started empty: {exc}")
        return Outcome.ok(uptime_record="read", kept_in=self._where)

    def shares(self, name: str) -> tuple[float | None, float | None]:
        now = self._wall()
        return (
            self.record.share(name, now=now, window=DAY),
            self.record.share(name, now=now, window=WEEK),
        )

    def history(self, name: str) -> UptimeHistory:
        return self.record.history(name, now=self._wall())

    def observe(self, statuses: Mapping[str, str]) -> None:
        """Count the time since the last look in the statuses seen now. A look after a gap
        longer than `max_step` (a stopped process, a wall clock that jumped) counts
        nothing: it starts counting again."""
        now = self._wall()
        last, self._last = self._last, now
        if last is not None and 0 < now - last <= self._max_step:
            self.record.observe(dict(statuses), start=last, end=now)

    async def save(self) -> Outcome:
        """Write the record if it differs from what the store holds; a failed write keeps
        it in memory, to be written at the next save."""
        now = self._wall()
        self.record.prune(now=now)
        data = self.record.to_json()
        if data == self._saved:
            return Outcome.ok(uptime_record="saved", kept_in=self._where)
        try:
            await self._store.save(data)
        except self._errors as exc:
            return self._failure(exc, f"not saved (kept in memory): {exc}")
        self._saved = data
        return Outcome.ok(uptime_record="saved", kept_in=self._where)

    def _failure(self, exc: Exception, note: str) -> Outcome:
        made = Outcome.unavailable if isinstance(exc, self._outage) else Outcome.failed
        return made(str(exc) or type(exc).__name__, uptime_record=note, kept_in=self._where)
