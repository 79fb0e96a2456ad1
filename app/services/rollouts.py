"""Safe rollout on the node: every managed workload's update state machine
(`app/domain/rollout_machine.py`), run by the syncs, with what it reads of the cluster and
the pings, and what it shows.

The sync asks `decide` for each desired workload that has a managed Deployment and
carries the step out (apply the new version, put the last good one back, hold, or only
keep the record); `landed` is told of each record that reached the Deployment. The record
lives on the Deployment (`RECORD_ANNOTATION`): a restarted manager reads it back on its
first sync and decides as the one before it would. In memory are only what the record
does not need: the pings of workloads being judged (the book's `watch`), when each
rollout was first seen complete at its generation (after a restart: from the first look
again, which only delays a verdict), and each judgement's progress (shown, not written).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from app.domain.desired import DesiredWorkload
from app.domain.health import RolloutPhase, rollout_of
from app.domain.manifests import VERSION_ANNOTATION
from app.domain.reports import UpdateView
from app.domain.rollout import (
    Observed,
    PingSeen,
    UpdateTerms,
    UpdateWindow,
    defer_lease,
    place,
    resolve_terms,
    seed_for,
    window_open,
)
from app.domain.rollout_machine import (
    RECORD_ANNOTATION,
    Action,
    Situation,
    Step,
    UpdateRecord,
    UpdateState,
    dump_record,
    load_record,
    next_step,
)
from app.metrics import Metrics
from app.services.alerting import Alerter
from app.services.workloads import WorkloadBook

log = logging.getLogger(__name__)

# states a look every UPDATE_JUDGE_INTERVAL_SECONDS can move on (the others wait for a
# new desired state: a wave or a halt changes only with it; `outside-window` is looked at
# once its window opens)
_TIMED = frozenset({UpdateState.DEFERRED, UpdateState.APPLYING})


@dataclass(frozen=True)
class RolloutConfig:
    node_id: str  # where this node places itself in each rollout
    terms: UpdateTerms  # the node's defaults (WORKLOAD_UPDATE_*, UPDATE_DEFER_*)
    stale_after: float  # PING_STALE_SECONDS: a deferring workload this silent lost its lease


class Rollouts:
    def __init__(
        self,
        config: RolloutConfig,
        *,
        book: WorkloadBook,
        metrics: Metrics,
        alerts: Alerter | None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._config = config
        self._book = book
        self._metrics = metrics
        self._alerts = alerts
        self.clock = clock
        self._records: dict[str, UpdateRecord] = {}  # as decided last
        self._written: dict[str, UpdateRecord] = {}  # as on the Deployment
        self._complete: dict[str, tuple[int, datetime]] = {}  # generation, first seen complete
        self._places: dict[str, float] = {}
        self._windows: dict[str, UpdateWindow] = {}  # of the workloads outside theirs

    # --- deciding

    def decide(
        self, workload: DesiredWorkload, live: Mapping[str, Any], *, crash: str | None
    ) -> Step:
        """The step for one desired workload whose managed Deployment is `live`."""
        now = self.clock()
        name = workload.name
        annotations = (live.get("metadata") or {}).get("annotations") or {}
        if name in self._written and RECORD_ANNOTATION not in annotations:
            # removed by hand (an operator's retry of a failed version): taken as running
            # its last good version, as a Deployment without a record always is
            log.info("workload %s: its update record was removed; starting afresh", name)
            self._written.pop(name)
            self._records.pop(name, None)
        if name not in self._written:
            stored, why = load_record(annotations.get(RECORD_ANNOTATION))
            if why is not None:
                log.warning("workload %s: %s", name, why)
            if stored is not None:
                self._written[name] = stored
                self._records.setdefault(name, stored)
        terms = resolve_terms(workload.update, self._config.terms)
        seen = self._observed(name, live, crash, now)
        last = self._book.last_ping(name)
        lease = None
        if last is not None and last.ping.defer_update_seconds:
            lease = defer_lease(
                at=datetime.fromtimestamp(last.received_wall, UTC),
                seconds=last.ping.defer_update_seconds,
                reason=last.ping.defer_reason,
                step_max=terms.defer_step_seconds,
            )
        situation = Situation(
            name=name,
            node_id=self._config.node_id,
            desired=workload.version,
            running=annotations.get(VERSION_ANNOTATION),
            terms=terms,
            stale_after=self._config.stale_after,
            rollout=workload.rollout,
            seen=seen,
            lease=lease,
            retry=workload.update.retry if workload.update is not None else None,
        )
        step = next_step(self._records.get(name), situation, now)
        if step.record.state is UpdateState.OUTSIDE_WINDOW and terms.window is not None:
            self._windows[name] = terms.window
        else:
            self._windows.pop(name, None)
        self._places[name] = place(
            seed_for(name, workload.version, workload.rollout), self._config.node_id
        )
        if step.action in (Action.APPLY, Action.REVERT):
            assert step.version is not None
            # what the record says once the Deployment runs it: written with the apply
            # (nothing is seen of it yet: what was seen is of the version it replaces)
            landed = replace(situation, running=step.version, seen=Observed())
            after = next_step(step.record, landed, now)
            step = replace(step, record=after.record, report=step.report or after.report)
        else:
            self._records[name] = step.record
        return step

    def _observed(
        self, name: str, live: Mapping[str, Any], crash: str | None, now: datetime
    ) -> Observed:
        rollout = rollout_of(live)
        record = self._records.get(name)
        applied_at = record.applied_at if record is not None else None
        if (
            rollout.phase is RolloutPhase.READY
            and rollout.observed_generation >= rollout.generation
        ):
            generation, since = self._complete.get(name, (rollout.generation, now))
            if generation != rollout.generation:
                since = now
            self._complete[name] = (rollout.generation, since)
            complete_since: datetime | None = since
        else:
            self._complete.pop(name, None)
            complete_since = None
        pings = self._book.pings_seen(name)
        if not pings:  # not judged yet: the latest ping settles an `auto` judge
            last = self._book.last_ping(name)
            if last is not None:
                at = datetime.fromtimestamp(last.received_wall, UTC)
                pings = [PingSeen(at, last.ping.status, last.ping.version)]
        return Observed(
            complete_since=complete_since,
            deadline_exceeded=rollout.deadline_exceeded and _exceeded_since(live, applied_at),
            crash_loop=crash,
            pings=pings,
        )

    # --- what was done

    def to_write(self, name: str) -> str | None:
        """The record's annotation value when the Deployment does not hold it yet."""
        record = self._records.get(name)
        if record is None:
            return None
        written = self._written.get(name)
        if written is None and _first_sight(record):
            return None  # what any first look would take again: nothing to keep
        if written is not None and replace(written, reason="") == replace(record, reason=""):
            return None
        return dump_record(record)

    def landed(self, name: str, record: UpdateRecord) -> None:
        """`record` reached the Deployment (with an apply, or on its own)."""
        self._records[name] = record
        self._written[name] = record

    def carried_out(self, step: Step, name: str) -> None:
        """Count a step's outcome and raise its alert, once it was carried out."""
        if step.report is not None:
            self._metrics.workload_updates.labels(step.report.outcome.value).inc()
        if step.action is Action.HOLD:
            self._metrics.workload_updates.labels("held").inc()
        if step.alert is not None and self._alerts is not None:
            record = step.record
            key = f"rollout:{name}:{record.attempted_version}:{record.state.value}"
            self._alerts.alert(key, step.alert)

    def current(self, name: str) -> str | None:
        """The record as decided last, as an apply writes it (it stays on the Deployment)."""
        record = self._records.get(name)
        return dump_record(record) if record is not None else None

    def versions_kept(self) -> set[tuple[str, str]]:
        """(workload, version) of each last good version: a revert's manifest."""
        return {(n, r.last_good_version) for n, r in self._records.items() if r.last_good_version}

    # --- what is shown

    def publish(self, desired: Iterable[str]) -> None:
        """Forget workloads no longer desired; show the rest (the book's views, status,
        report, metrics) and keep the pings of those being judged."""
        wanted = set(desired)
        for held in (self._records, self._written, self._complete, self._places, self._windows):
            for name in [n for n in held if n not in wanted]:
                del held[name]
        views = {
            name: UpdateView(
                target=record.target,
                state=record.state.value,
                since=record.since,
                reason=record.reason,
                place=self._places.get(name, 0.0),
                failed_versions=record.failed_versions,
                in_flight=record.in_flight,
            )
            for name, record in self._records.items()
        }
        self._book.set_updates(views)
        self._book.watch({n for n, r in self._records.items() if r.in_flight})

    def ticking(self) -> bool:
        """Whether an update is in flight, deferred, or outside a window that is open now:
        a look at the cluster every UPDATE_JUDGE_INTERVAL_SECONDS can move it on."""
        if any(r.in_flight or r.state in _TIMED for r in self._records.values()):
            return True
        now = self.clock()
        return any(window_open(window, now) for window in self._windows.values())

    def in_flight(self) -> bool:
        return any(r.in_flight for r in self._records.values())


def _first_sight(record: UpdateRecord) -> bool:
    """A record that says only what runs (its version the last good one): a Deployment
    without a record reads as the same, so a steady state writes nothing."""
    return (
        record.state is UpdateState.CURRENT
        and not record.failed_versions
        and record.attempted_version is None
        and record.deferred_since is None
    )


def _exceeded_since(live: Mapping[str, Any], applied_at: datetime | None) -> bool:
    """Whether the Deployment's ProgressDeadlineExceeded is about the spec applied at
    `applied_at`. The controller keeps the condition, times and all, from a version before
    until the new one makes progress, so a revert's first looks would see the failed
    version's deadline. The condition's time is in whole seconds and at least a second
    after its apply (progressDeadlineSeconds >= 1); one from before a revert's apply is
    at most that apply's second."""
    if applied_at is None:
        return True
    status = live.get("status") or {}
    for condition in status.get("conditions") or ():
        if isinstance(condition, Mapping) and condition.get("reason") == "ProgressDeadlineExceeded":
            stamp = condition.get("lastTransitionTime") or condition.get("lastUpdateTime")
            try:
                at = datetime.fromisoformat(str(stamp))
            except ValueError:
                return True
            floor = applied_at.replace(microsecond=0)
            return (at - floor).total_seconds() >= 1
    return True
