"""Deployment sync: read the desired state and the cluster, plan, apply, record.

One sync: fetch the desired state (ETag: unchanged costs a 304), list the managed
Deployments, plan with the pure `plan_sync`, fetch manifests only for creates and
updates (cached by name and version), prepare them, apply with bounded concurrency,
then tell the backend the versions now applied. A desired state that cannot be read or
parsed ends the sync before anything touches the cluster. One workload's failure never
blocks the others; a 409 re-reads that Deployment and plans it again, up to REPLANS (5)
attempts in all with jittered waits.

A sync as a whole ends within its deadline (SYNC_DEADLINE_SECONDS): past it, what is in
flight is cancelled (each cluster write is one request, atomic on the API server: it
landed or it did not, and the next sync plans from what is there), the sync is recorded
as aborted with every workload's result (done, or not done), and the cluster lock is
free. Once one manifest fetch has run out the backend's deadline, the sync asks for no
more manifests: a backend that trickles one answer trickles the next.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import stamina

from app.adapters.backend import (
    DESIRED,
    NOT_MODIFIED,
    BackendClient,
    BackendDeadlineError,
    BackendError,
    BackendHeld,
    parse_json,
)
from app.adapters.desired_files import DesiredFiles, DesiredFilesError
from app.adapters.kube import KubeConflict, KubeDeployments, KubeError, KubeNotFound
from app.domain.components import Cadence, Outcome
from app.domain.desired import (
    DEFAULT_MAX_WORKLOADS,
    DesiredState,
    DesiredStateError,
    parse_desired,
)
from app.domain.desired_trust import TrustError
from app.domain.health import crashlooping_workloads, rollout_of
from app.domain.manifests import (
    MANAGED_SELECTOR,
    Injection,
    ManifestPolicy,
    ManifestRejected,
    check_size,
    prepare_manifest,
)
from app.domain.planning import Action, ActionKind, LiveDeployment, SyncPolicy, plan_sync
from app.domain.rollout_machine import RECORD_ANNOTATION, Step, dump_record
from app.domain.rollout_machine import Action as StepAction
from app.metrics import Metrics
from app.services.last_good import LastGood, Origin
from app.services.rollouts import Rollouts
from app.services.workloads import Deployed, WorkloadBook

log = logging.getLogger(__name__)

DEFAULT_DEADLINE_SECONDS = 300.0
# re-reads after a resourceVersion conflict before the workload's update counts as failed
REPLANS = 5

SOURCE_ERRORS = (BackendError, DesiredStateError, DesiredFilesError, TrustError)
MAX_REPORT_REASON = 256


class DesiredSource(Protocol):
    description: str

    async def desired(self) -> DesiredState: ...

    async def manifest(self, name: str, version: str) -> Any: ...

    async def applied(self, name: str, report: VersionReport) -> None: ...

    def origin(self) -> Origin:
        """Where the desired state last returned came from."""
        ...

    @property
    def cadence(self) -> Cadence | None:
        """What the last answer asked of the sync's interval; None: no answer to say it
        (a folder, or the backend did not answer)."""
        ...

    async def settle(self, keep: set[tuple[str, str]]) -> None:
        """After a sync: keep what it applied (the last good state's store)."""
        ...


class BackendSource:
    """The backend's desired state, with the last answer kept for `If-None-Match`.

    With a `LastGood` (DESIRED_STATE_PUBLIC_KEYS set), each answer is verified and ordered
    before it is parsed, each manifest is checked against its signed digest, and while the
    backend fails (a transport error, a 5xx, its deadline: `BackendError.unreachable`) the
    last good state stored on the node stands in for it: `origin()` then says so, and the
    sync deletes nothing and reports no versions until the backend answers again."""

    def __init__(
        self,
        backend: BackendClient,
        endpoint: str,
        *,
        max_workloads: int = DEFAULT_MAX_WORKLOADS,
        last_good: LastGood | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._backend = backend
        self._max_workloads = max_workloads
        self._last_good = last_good
        self._clock = clock
        self._etag: str | None = None
        self._cached: DesiredState | None = None
        self._offline_since: datetime | None = None
        self._offline_reason: str | None = None
        self._cadence: Cadence | None = None
        # the Retry-After of the failure the stored state stands in for: the sync asks
        # again when it has passed (None once an answer came)
        self.retry_after: float | None = None
        self.description = f"backend {endpoint}"
        if last_good is not None:
            self.description += " (signed)"

    @property
    def offline(self) -> bool:
        return self._offline_since is not None

    @property
    def backend(self) -> BackendClient:
        return self._backend

    @property
    def cadence(self) -> Cadence | None:
        return self._cadence

    async def desired(self) -> DesiredState:
        self._cadence = None
        state = await self._desired()
        if not self.offline:  # an answer came: what it asked of the interval
            self._cadence = Cadence(self._backend.interval_asked(DESIRED))
        return state

    async def _desired(self) -> DesiredState:
        last_good = self._last_good
        if last_good is None:
            etag, body = await self._backend.get_desired(self._etag if self._cached else None)
            if body is NOT_MODIFIED and self._cached is not None:
                return self._cached
            state = parse_desired(body, max_workloads=self._max_workloads)
            self._etag, self._cached = etag, state
            return state
        try:
            etag, answer = await self._backend.get_desired_signed(
                self._etag if self._cached else None
            )
        except BackendError as exc:
            if not exc.unreachable or last_good.state is None:
                raise
            if self._offline_since is None:
                log.warning(
                    "backend unreachable: syncing to the last good state (serial %s): %s",
                    last_good.accepted.serial if last_good.accepted else "?", exc,
                )  # fmt: skip
            self._offline_since = self._offline_since or self._clock()
            self._offline_reason = str(exc)
            self.retry_after = exc.retry_after
            return last_good.state
        self.retry_after = None
        if self._offline_since is not None:
            log.warning("backend answers again (unreachable since %s)", self._offline_since)
        self._offline_since = self._offline_reason = None
        if answer is NOT_MODIFIED and self._cached is not None:
            return self._cached
        state = last_good.take(answer)
        self._etag, self._cached = etag, state
        return state

    async def manifest(self, name: str, version: str) -> Any:
        last_good = self._last_good
        if last_good is None:
            return await self._backend.get_manifest(name, version)
        raw = last_good.stored_manifest(name, version)
        if raw is None:
            raw = await self._backend.get_manifest_bytes(name, version)
            last_good.check_manifest(name, version, raw)
        return parse_json(raw, f"manifest of {name} {version}")

    async def applied(self, name: str, report: VersionReport) -> None:
        if self.offline:  # owed still: told once the backend answers again
            raise ReportDeferred("not reported: the backend is unreachable")
        await self._backend.put_version(name, report.body())

    def origin(self) -> Origin:
        last_good = self._last_good
        if last_good is None:
            return Origin("backend")
        accepted = last_good.accepted
        return Origin(
            "last good" if self.offline else "backend",
            serial=accepted.serial if accepted else None,
            stored_at=last_good.stored_at,
            offline_since=self._offline_since,
            reason=self._offline_reason,
            store_note=last_good.note or None,
        )

    async def settle(self, keep: set[tuple[str, str]]) -> None:
        if self._last_good is not None:
            await self._last_good.save(keep)


class ReportDeferred(BackendError):
    """A version report kept for later: the backend is away (no call was made)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, unreachable=True)


class FolderSource:
    def __init__(self, files: DesiredFiles, *, max_workloads: int = DEFAULT_MAX_WORKLOADS) -> None:
        self._files = files
        self._max_workloads = max_workloads
        self.description = files.description

    async def desired(self) -> DesiredState:
        return parse_desired(await self._files.load_desired(), max_workloads=self._max_workloads)

    async def manifest(self, name: str, version: str) -> Any:
        return await self._files.load_manifest(name, version)

    async def applied(self, name: str, report: VersionReport) -> None:
        await self._files.record_applied(name, report.body())

    def origin(self) -> Origin:
        return Origin("folder")

    @property
    def cadence(self) -> Cadence | None:
        return None

    async def settle(self, keep: set[tuple[str, str]]) -> None:
        return None


@dataclass(frozen=True, slots=True)
class VersionReport:
    """A version PUT: `version` runs now (`applied_at`); `outcome` says what became of
    the update (`applied`, judged `healthy`, or `rolled_back` from `attempted_version`
    for `reason`)."""

    version: str
    at: datetime
    outcome: str = "applied"
    attempted_version: str | None = None
    reason: str | None = None

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "version": self.version,
            "applied_at": self.at.astimezone(UTC).isoformat().replace("+00:00", "Z"),
            "outcome": self.outcome,
        }
        if self.attempted_version is not None:
            body["attempted_version"] = self.attempted_version
        if self.reason:
            body["reason"] = self.reason[:MAX_REPORT_REASON]
        return body


class SyncBusy(RuntimeError):
    """A sync or a self-update is already changing the cluster."""


class FetchSkipped(RuntimeError):
    """A manifest not asked for: the backend already missed its deadline in this sync."""


@dataclass
class WorkloadResult:
    name: str
    action: str
    outcome: str  # planned | applied | unchanged | held | failed
    version: str | None = None
    from_version: str | None = None
    reason: str = ""
    error: str | None = None


@dataclass
class SyncOutcome:
    started_at: datetime
    dry_run: bool
    fetched: bool = True  # False: a look with the desired state last read (rollout steps)
    finished_at: datetime | None = None
    duration_seconds: float = 0.0
    revision: str | None = None
    aborted: str | None = None
    retry_after: float | None = None  # what the backend's Retry-After asked for
    cadence: Cadence | None = None  # what the desired state's answer asked of the interval
    # where the desired state came from (`Origin.as_dict`): the backend, or the last good
    # state stored on the node while the backend is away
    source: dict[str, Any] | None = None
    results: list[WorkloadResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.aborted is None and not any(r.outcome == "failed" for r in self.results)

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for result in self.results:
            key = result.action if result.outcome != "failed" else "failed"
            if result.outcome == "held":
                key = "hold"
            counts[key] = counts.get(key, 0) + 1
        return counts

    def as_dict(self) -> dict[str, Any]:
        return {
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "duration_seconds": round(self.duration_seconds, 3),
            "dry_run": self.dry_run,
            "fetched": self.fetched,
            "revision": self.revision,
            "source": self.source,
            "ok": self.ok,
            "aborted": self.aborted,
            "counts": self.counts(),
            "results": [asdict(r) for r in self.results],
        }


class Syncer:
    def __init__(
        self,
        *,
        source: DesiredSource,
        kube: KubeDeployments,
        book: WorkloadBook,
        policy: SyncPolicy,
        manifest_policy: ManifestPolicy,
        injection_for: Callable[[str], Injection],
        concurrency: int,
        metrics: Metrics,
        cluster_lock: asyncio.Lock,
        deadline: float = DEFAULT_DEADLINE_SECONDS,
        rollouts: Rollouts | None = None,
    ) -> None:
        self._deadline = deadline
        self.rollouts = rollouts
        # the desired state as last read: the rollout's looks between syncs decide from it
        self._desired: DesiredState | None = None
        # this sync's drift of Deployments whose new version is held back (`_take_step`)
        self._drift: dict[str, str] = {}
        self.source = source
        self.kube = kube
        self._book = book
        self._policy = policy
        self._manifest_policy = manifest_policy
        self._injection_for = injection_for
        self._concurrency = concurrency
        self._metrics = metrics
        self._lock = cluster_lock
        # raw manifests by (name, version); one over MANIFEST_MAX_BYTES is kept as its hold
        self._manifests: dict[tuple[str, str], Any] = {}
        # version reports owed to the backend, and the last version it confirmed, per workload
        self._unreported: dict[str, VersionReport] = {}
        self._reported: dict[str, str] = {}
        # why the owed reports wait, while a Retry-After holds the version PUTs
        self._reports_held: str | None = None
        # the longest Retry-After a manifest fetch of this sync met: the sync's next run
        self._held_for: float | None = None
        # the backend's `reported_version`s as last learned
        self._backend_view: dict[str, str] = {}
        self.last: SyncOutcome | None = None
        # the last sync that wrote to the cluster or failed: after it, syncs are usually
        # no-ops, and an operator asking "what changed?" needs this one
        self.last_change: SyncOutcome | None = None
        # the sync running (one at a time, under the lock): what it is doing, for the
        # reason given at its deadline; the workload whose manifest fetch missed the
        # backend's deadline; the results not reached when it ended early
        self._stage = ""
        self._missed: str | None = None
        self._undone: list[WorkloadResult] = []

    async def refresh_view(self) -> None:
        """Read the managed Deployments' rollout state and their pods' crash loops into
        the book (two lists, no writes). Not part of a sync: a steady-state sync stays
        one list of Deployments."""
        objects = await self.kube.list_managed(MANAGED_SELECTOR)
        self._book.set_deployed(_deployed(objects))
        try:
            pods = await self.kube.list_pods()
        except KubeError as exc:  # e.g. an older Role without `list pods`: the rest still works
            log.warning("crash loops not checked: %s", exc)
            return
        self._book.set_crashlooping(crashlooping_workloads(objects, pods))

    async def run_scheduled(self) -> Outcome:
        if self._lock.locked():
            return Outcome.skipped("another sync or a self-update is running")
        return self.outcome_of(await self.sync())

    def outcome_of(self, sync: SyncOutcome) -> Outcome:
        """A sync as the supervisor records it on the `sync` component; the versions
        applied and not told to the backend yet (retried by the next syncs) with it."""
        owed: dict[str, Any] = {
            "versions_not_reported": {n: r.version for n, r in sorted(self._unreported.items())}
        }
        if self._unreported and self._reports_held is not None:
            owed["versions_waiting"] = self._reports_held  # "Retry-After until …"
        if sync.dry_run:
            return Outcome.skipped("a dry run changes nothing", **owed)
        if sync.aborted is not None:
            # an answer read before the sync ended early still sets the interval
            return (
                Outcome.failed(sync.aborted, **owed).paced(sync.cadence).retrying(sync.retry_after)
            )
        failed = [r for r in sync.results if r.outcome == "failed"]
        if failed:
            return (
                Outcome.failed(
                    f"{len(failed)} workload(s) failed: "
                    + "; ".join(f"{r.name}: {r.error}" for r in failed[:3]),
                    **owed,
                )
                .paced(sync.cadence)
                .retrying(sync.retry_after)
            )
        return (
            Outcome.ok(revision=sync.revision, counts=sync.counts(), **owed)
            .paced(sync.cadence)
            .retrying(sync.retry_after)
        )

    async def run_rollout(self) -> Outcome:
        """A look between syncs while an update is in flight or waits on time (a window, a
        deferral): the same sync, from the desired state last read (no backend call)."""
        if self.rollouts is None or self._desired is None or not self.rollouts.ticking():
            return Outcome.skipped("no update in flight")
        if self._lock.locked():
            return Outcome.skipped("another sync or a self-update is running")
        return self.outcome_of(await self.sync(fetch=False))

    async def sync(self, *, dry_run: bool = False, fetch: bool = True) -> SyncOutcome:
        """One sync; `fetch=False` decides from the desired state last read."""
        if self._lock.locked():
            raise SyncBusy("a sync or a self-update is already running")
        async with self._lock:
            outcome = SyncOutcome(
                started_at=datetime.now(UTC),
                dry_run=dry_run,
                fetched=fetch or self._desired is None,
            )
            started = time.monotonic()
            self._stage, self._missed, self._undone = "", None, []
            self._held_for = None
            limit = asyncio.timeout(self._deadline)
            try:
                async with limit:
                    await self._sync(outcome)
            except asyncio.CancelledError:
                self._abort(outcome, "cancelled before it finished (by shutdown or by its caller)")
                raise
            except TimeoutError as exc:
                if not limit.expired():
                    self._crashed(outcome, exc)
                else:
                    self._abort(
                        outcome,
                        f"deadline of {self._deadline:g} s (SYNC_DEADLINE_SECONDS) passed "
                        f"{self._stage}",
                    )
            except Exception as exc:
                self._crashed(outcome, exc)
            finally:
                if outcome.retry_after is None:  # a manifest's Retry-After, if any
                    outcome.retry_after = self._held_for
                outcome.finished_at = datetime.now(UTC)
                outcome.duration_seconds = time.monotonic() - started
                self._record(outcome)
            return outcome

    def _abort(self, outcome: SyncOutcome, why: str) -> None:
        """The sync ended before it finished: why, and the workloads it did not reach."""
        if self._undone:
            done = len(outcome.results) - len(self._undone)
            why += f"; {done} of {len(outcome.results)} workload(s) done, the rest not"
        outcome.aborted = why
        for result in self._undone:
            result.error = f"not done: {why}"
            self._metrics.sync_actions.labels(result.action, result.outcome).inc()

    def _crashed(self, outcome: SyncOutcome, exc: Exception) -> None:
        # a bug outside the per-workload actions: recorded as a failed sync, and the
        # traceback reaches Sentry through the log
        self._abort(outcome, f"sync crashed: {type(exc).__name__}: {exc}")
        log.error("sync crashed", exc_info=exc)

    async def _sync(self, outcome: SyncOutcome) -> None:
        self._stage = "while reading the desired state, nothing changed"
        if outcome.fetched or self._desired is None:
            try:
                desired = await self.source.desired()
            except SOURCE_ERRORS as exc:
                if isinstance(exc, TrustError):
                    self._metrics.desired_refused.labels("answer").inc()
                    log.warning("desired state refused: %s", exc)
                outcome.aborted = f"desired state unavailable, nothing changed: {exc}"
                outcome.retry_after = getattr(exc, "retry_after", None)
                return
            self._desired = desired
            outcome.cadence = self.source.cadence
            # the stored state stood in for an answer with a Retry-After: ask again then
            outcome.retry_after = getattr(self.source, "retry_after", None)
        else:
            desired = self._desired
        outcome.revision = desired.revision
        origin = self.source.origin()
        outcome.source = origin.as_dict(outcome.started_at)
        self._book.desired_origin = origin
        offline = origin.offline_since is not None
        self._metrics.desired_offline.set(1 if offline else 0)
        if origin.serial is not None:
            self._metrics.desired_serial.set(origin.serial)
        if not offline:
            self._learn_reported(desired)
        self._stage = "while listing Deployments, nothing changed"
        try:
            objects = await self.kube.list_managed(MANAGED_SELECTOR)
        except KubeError as exc:
            outcome.aborted = f"cannot list Deployments, nothing changed: {exc}"
            return
        self._book.set_desired({w.name: w.version for w in desired.workloads})
        self._book.set_deployed(_deployed(objects))
        live = [LiveDeployment.from_object(o) for o in objects]
        plan = plan_sync(desired, live, self._policy)
        if offline:  # the stored state is enforced, never used to delete
            plan = [_kept_offline(a) if a.kind is ActionKind.DELETE else a for a in plan]
        self._forget_manifests(desired)
        steps = {} if outcome.dry_run else await self._decide_updates(desired, objects)

        semaphore = asyncio.Semaphore(self._concurrency)
        done: dict[str, WorkloadResult] = {}

        async def run(action: Action) -> None:
            async with semaphore:
                done[action.name] = await self._carry_out(
                    action, desired, dry_run=outcome.dry_run, landed=done,
                    step=steps.get(action.name),
                )  # fmt: skip

        # A task group, not gather: every action has ended (or been cancelled and
        # awaited) when it exits, so no write of this sync lands after it returns.
        # `_carry_out` turns every error into that workload's result, so nothing
        # escapes the group but a cancellation (the sync's deadline is one).
        self._stage = "while carrying out the plan"
        try:
            async with asyncio.TaskGroup() as group:
                for action in plan:
                    group.create_task(run(action), name=f"sync-{action.name}")
        finally:
            outcome.results = [done.get(a.name) or self._not_done(a) for a in plan]
            if self.rollouts is not None and not outcome.dry_run:
                self.rollouts.publish(desired.by_name())
        if not outcome.dry_run:
            self._stage = "while storing the last good state"
            keep = {(w.name, w.version) for w in desired.workloads}
            if self.rollouts is not None:
                keep |= self.rollouts.versions_kept()
            await self.source.settle(keep)
        self._stage = "after the plan was carried out, while re-reading rollout state"
        if not outcome.dry_run and any(r.outcome == "applied" for r in outcome.results):
            try:
                self._book.set_deployed(_deployed(await self.kube.list_managed(MANAGED_SELECTOR)))
            except KubeError as exc:
                log.warning("could not refresh rollout state after the sync: %s", exc)

    async def _decide_updates(
        self, desired: DesiredState, objects: list[dict[str, Any]]
    ) -> dict[str, Step]:
        """The update step of each desired workload with a managed Deployment (a create
        is an install, not an update: its version is the first last good one)."""
        rollouts = self.rollouts
        if rollouts is None:
            return {}
        crash: dict[str, str] = {}
        if rollouts.in_flight():  # a crash loop fails a judgement: looked at now
            try:
                crash = crashlooping_workloads(objects, await self.kube.list_pods())
            except KubeError as exc:
                log.warning("crash loops not checked for the updates judged: %s", exc)
            else:
                self._book.set_crashlooping(crash)
        live = {LiveDeployment.from_object(o).name: o for o in objects}
        steps: dict[str, Step] = {}
        self._drift = {}
        for workload in desired.workloads:
            obj = live.get(workload.name)
            if obj is None or workload.name in self._policy.protected:
                continue
            current = LiveDeployment.from_object(obj)
            if current.managed and current.deleting_since is None:
                steps[workload.name] = rollouts.decide(
                    workload, obj, crash=crash.get(workload.name)
                )
                if current.drift is not None and current.version != workload.version:
                    self._drift[workload.name] = current.drift
        return steps

    def _not_done(self, action: Action) -> WorkloadResult:
        """A workload the sync did not finish before it ended; its error is set then."""
        result = _result_of(action, "failed")
        self._undone.append(result)
        return result

    async def _carry_out(
        self,
        action: Action,
        desired: DesiredState,
        *,
        dry_run: bool,
        landed: dict[str, WorkloadResult],
        step: Step | None = None,
    ) -> WorkloadResult:
        """The action's result; put in `landed` as soon as its outcome is known, so that a
        sync cut short by its deadline while telling the backend the version still
        records the write that landed."""
        result = _result_of(action, "unchanged")
        try:
            if action.kind is ActionKind.HOLD:
                result.outcome = "held"
            elif action.kind is ActionKind.DELETING:
                pass  # deleted already; the cluster finishes it once its finalizers go
            elif step is not None and action.kind in (ActionKind.UPDATE, ActionKind.NOOP):
                await self._take_step(action, step, result, desired, landed)
            elif action.kind is ActionKind.NOOP:
                landed[action.name] = result
                if not dry_run:
                    self._owe_unconfirmed(action)
                    await self._report_pending(action.name)
            elif action.kind is ActionKind.DELETE:
                result.outcome = "planned" if dry_run else await self._delete(action, desired)
            else:
                assert action.version is not None
                manifest = await self._prepared(action.name, action.version)
                if dry_run:
                    result.outcome = "planned"
                else:
                    result.outcome, result.reason = await self._apply(action, manifest, desired)
                    landed[action.name] = result
                    if result.outcome == "applied":
                        self._owe(action.name, VersionReport(action.version, datetime.now(UTC)))
                        await self._report_pending(action.name)
        except ManifestRejected as exc:
            result.outcome, result.action, result.reason = "held", "hold", str(exc)
        except (*SOURCE_ERRORS, KubeError, FetchSkipped) as exc:
            result.outcome, result.error = "failed", str(exc)
            if isinstance(exc, BackendError) and exc.retry_after is not None:
                self._held_for = max(self._held_for or 0.0, exc.retry_after)
            if isinstance(exc, TrustError):
                self._metrics.desired_refused.labels("manifest").inc()
                log.warning("manifest refused: %s", exc)
        except Exception as exc:
            # a bug (in preparation, planning or an adapter): this workload fails, named,
            # the others go on, and the traceback reaches Sentry through the log
            result.outcome, result.error = "failed", f"{type(exc).__name__}: {exc}"
            log.error(
                "sync of %s (%s) failed unexpectedly", action.name, action.kind.value, exc_info=exc
            )
        self._metrics.sync_actions.labels(result.action, result.outcome).inc()
        return result

    async def _take_step(
        self,
        action: Action,
        step: Step,
        result: WorkloadResult,
        desired: DesiredState,
        landed: dict[str, WorkloadResult],
    ) -> None:
        """Carry out a workload's update step (`app/services/rollouts.py`)."""
        rollouts = self.rollouts
        assert rollouts is not None
        name, record = action.name, step.record
        if step.action in (StepAction.APPLY, StepAction.REVERT):
            assert step.version is not None
            manifest = await self._prepared(name, step.version, record=dump_record(record))
            if step.action is StepAction.REVERT:
                result.action, result.version = "revert", step.version
            result.reason = record.reason
            result.outcome, why = await self._apply_step(name, manifest, action)
            landed[name] = result
            if result.outcome != "applied":
                result.reason = why
                return
            rollouts.landed(name, record)
        else:
            if action.kind is ActionKind.UPDATE and action.from_version == action.version:
                # the running version drifted: put its spec back, the record with it
                assert action.version is not None
                manifest = await self._prepared(name, action.version, record=dump_record(record))
                result.outcome, result.reason = await self._apply(action, manifest, desired)
                if result.outcome == "applied":
                    rollouts.landed(name, record)
            elif action.kind is ActionKind.UPDATE:  # the new version waits, or failed here
                result.outcome, result.reason = "held", f"{record.state}: {record.reason}"
                drift = self._drift.get(name)
                if drift is not None and action.from_version and not record.in_flight:
                    # the version it runs meanwhile drifted: that version's spec back
                    manifest = await self._prepared(
                        name, action.from_version, record=dump_record(record)
                    )
                    if (await self._apply_step(name, manifest, action))[0] == "applied":
                        rollouts.landed(name, record)
                        result.outcome, result.version = "applied", action.from_version
                        result.reason = (
                            f"drift of {action.from_version}: {drift}; {action.version} "
                            f"{result.reason}"
                        )
            elif record.in_flight:
                result.reason = f"{record.state}: {record.reason}"
            landed[name] = result
        if step.report is not None:
            report = step.report
            self._owe(
                name,
                VersionReport(report.version, datetime.now(UTC), report.outcome.value,
                              report.attempted_version, report.reason),
            )  # fmt: skip
        elif action.kind is ActionKind.NOOP:
            self._owe_unconfirmed(action)
        rollouts.carried_out(step, name)
        value = rollouts.to_write(name)
        if value is not None:
            await self.kube.annotate(name, {RECORD_ANNOTATION: value})
            rollouts.landed(name, record)
        await self._report_pending(name)

    async def _apply_step(
        self, name: str, manifest: dict[str, Any], planned: Action
    ) -> tuple[str, str]:
        """Apply an update step's manifest on the Deployment as it was planned from; on a
        conflict re-read it and apply again while it still runs the version the step was
        decided from (the deployment controller's status writes conflict), REPLANS times.
        Anything else changed meanwhile: nothing applied, decided again at the next look."""
        resource_version = planned.resource_version
        async for attempt in _conflict_retries():
            with attempt:
                if attempt.num > 1:
                    current = await self.kube.get(name)
                    live = LiveDeployment.from_object(current) if current is not None else None
                    if (
                        live is None
                        or not live.managed
                        or live.deleting_since is not None
                        or live.version != planned.from_version
                    ):
                        return "unchanged", "changed meanwhile: decided again at the next look"
                    resource_version = live.resource_version
                await self.kube.apply(_with_resource_version(manifest, resource_version))
                return "applied", ""
        raise AssertionError("unreachable")  # the last conflict is raised by stamina

    async def _prepared(
        self, name: str, version: str, *, record: str | None = None
    ) -> dict[str, Any]:
        """The manifest of `name` at `version`, prepared; with the update record (the
        current one unless given: an apply keeps it on the Deployment)."""
        key = (name, version)
        raw = self._manifests.get(key)
        if raw is None:
            if self._missed is not None:
                raise FetchSkipped(f"skipped: the backend missed its deadline on {self._missed}")
            try:
                raw = await self.source.manifest(name, version)
            except BackendDeadlineError:
                self._missed = self._missed or name
                raise
            try:
                check_size(raw, self._manifest_policy.max_bytes)
            except ManifestRejected as exc:
                raw = exc
            self._manifests[key] = raw
        if isinstance(raw, ManifestRejected):
            raise ManifestRejected(str(raw))
        manifest = prepare_manifest(
            raw,
            name=name,
            version=version,
            namespace=self.kube.namespace,
            policy=self._manifest_policy,
            injection=self._injection_for(name),
        )
        if record is None and self.rollouts is not None:
            record = self.rollouts.current(name)
        if record:
            manifest["metadata"]["annotations"][RECORD_ANNOTATION] = record
        return manifest

    async def _apply(
        self, action: Action, manifest: dict[str, Any], desired: DesiredState
    ) -> tuple[str, str]:
        """Create or update; on 409 (or a create that finds the name taken) re-read and plan
        it again, REPLANS attempts in all (`_conflict_retries`)."""
        if action.kind is ActionKind.CREATE:
            existing = await self.kube.get(action.name)
            if existing is not None:
                return await self._replan(action.name, existing, desired, manifest)
            await self.kube.apply(manifest)
            return "applied", action.reason
        conditional = _with_resource_version(manifest, action.resource_version)
        try:
            await self.kube.apply(conditional)
        except KubeConflict:
            current = await self.kube.get(action.name)
            if current is None:
                await self.kube.apply(manifest)
                return "applied", f"{action.reason} (re-created: it was deleted meanwhile)"
            return await self._replan(action.name, current, desired, manifest)
        return "applied", action.reason

    async def _replan(
        self, name: str, current: dict[str, Any], desired: DesiredState, manifest: dict[str, Any]
    ) -> tuple[str, str]:
        """Plan one workload again from its re-read state and apply that, with the new
        resourceVersion. A real deployment controller writes status (and so a new
        resourceVersion) several times during a rollout, so a conflict can repeat: each
        one waits a moment (jittered, growing) and re-reads, up to REPLANS times."""
        async for attempt in _conflict_retries():
            with attempt:
                if attempt.num > 1:
                    reread = await self.kube.get(name)
                    if reread is None:
                        await self.kube.apply(manifest)
                        return "applied", "re-created: it was deleted meanwhile"
                    current = reread
                (again,) = plan_sync(
                    DesiredState(revision=desired.revision, workloads=(desired.by_name()[name],)),
                    [LiveDeployment.from_object(current)],
                    self._policy,
                )
                if again.kind is ActionKind.NOOP:
                    return "unchanged", "already as desired when re-read"
                if again.kind is ActionKind.HOLD:
                    return "held", again.reason
                await self.kube.apply(_with_resource_version(manifest, again.resource_version))
                return "applied", f"{again.reason} (after a conflict)"
        raise AssertionError("unreachable")  # the last conflict is raised by stamina

    async def _delete(self, action: Action, desired: DesiredState) -> str:
        """Delete with the planned resourceVersion as a precondition; on a conflict wait a
        moment, re-read it and delete only if it is still managed and still not desired,
        up to REPLANS times (the deployment controller's status writes repeat conflicts)."""
        resource_version = action.resource_version
        async for attempt in _conflict_retries():
            with attempt:
                if attempt.num > 1:
                    current = await self.kube.get(action.name)
                    if current is None:
                        return "applied"
                    live = LiveDeployment.from_object(current)
                    if not live.managed or action.name in desired.by_name():
                        return "held"
                    resource_version = live.resource_version
                try:
                    await self.kube.delete(action.name, resource_version=resource_version)
                except KubeNotFound:
                    return "applied"
                return "applied"
        raise AssertionError("unreachable")  # the last conflict is raised by stamina

    def _owe_unconfirmed(self, action: Action) -> None:
        """A Deployment already at its desired version that the backend has not confirmed
        from this process: an apply whose answer timed out may still have landed, and
        after a restart nothing is known. Tell it (the PUT is idempotent)."""
        version = action.version
        if version is not None and self._reported.get(action.name) != version:
            if action.name not in self._unreported:
                self._owe(action.name, VersionReport(version, datetime.now(UTC)))

    def _owe(self, name: str, report: VersionReport) -> None:
        """A version report to send (replacing one not sent yet: the latest says more)."""
        self._unreported[name] = report

    def _learn_reported(self, desired: DesiredState) -> None:
        """What the backend says it recorded (`reported_version`) counts as confirmed: a
        sync after a restart PUTs only where that differs from what is applied, instead
        of once per workload (nodes x workloads PUTs after a fleet-wide self-update).
        Without the field nothing is learned and unconfirmed versions are PUT as before.
        The same answer is learned once: a desired state served again (304) is older than
        the PUTs made since it was read."""
        view = {
            w.name: w.reported_version for w in desired.workloads if w.reported_version is not None
        }
        if view == self._backend_view:
            return
        self._backend_view = view
        for name, known in view.items():
            self._reported[name] = known
            owed = self._unreported.get(name)
            if owed is not None and owed.outcome == "applied" and owed.version == known:
                del self._unreported[name]  # an outcome beyond `applied` is still told

    async def _report_pending(self, name: str) -> None:
        """Tell the backend an applied version; kept and retried by later syncs on failure."""
        report = self._unreported.get(name)
        if report is None:
            return
        try:
            await self.source.applied(name, report)
        except SOURCE_ERRORS as exc:
            # kept, and said once: the backend is away, or its Retry-After holds the PUTs
            quiet = isinstance(exc, ReportDeferred | BackendHeld)
            level = logging.DEBUG if quiet else logging.WARNING
            log.log(level, "version %s of %s not reported yet: %s", report.version, name, exc)
            until = exc.until if isinstance(exc, BackendError) else None
            if until is not None:
                shown = until.isoformat(timespec="seconds").replace("+00:00", "Z")
                self._reports_held = f"Retry-After until {shown}"
            return
        self._reports_held = None
        if self._unreported.get(name) is report:
            del self._unreported[name]
        self._reported[name] = report.version

    def _forget_manifests(self, desired: DesiredState) -> None:
        keep = {(w.name, w.version) for w in desired.workloads}
        if self.rollouts is not None:  # the last good versions, for a revert
            keep |= self.rollouts.versions_kept()
        for key in [k for k in self._manifests if k not in keep]:
            del self._manifests[key]
        names = {w.name for w in desired.workloads}
        for name in [n for n in self._reported if n not in names]:
            del self._reported[name]
        for name in [n for n in self._unreported if n not in names]:
            del self._unreported[name]  # the backend no longer desires it: nothing owed

    def _record(self, outcome: SyncOutcome) -> None:
        if outcome.dry_run:
            return
        self.last = outcome
        if not outcome.ok or any(r.outcome == "applied" for r in outcome.results):
            self.last_change = outcome
        if outcome.ok:  # a failed one is logged and counted by the supervisor, which records it
            counts = outcome.counts()
            # a judge's look that only looked (held, unchanged) is not worth a line
            quiet = ("unchanged",) if outcome.fetched else ("unchanged", "held")
            changed = any(r.outcome not in quiet for r in outcome.results)
            level = logging.INFO if changed else logging.DEBUG
            log.log(level, "sync done in %.2f s: %s", outcome.duration_seconds, counts)


def _kept_offline(action: Action) -> Action:
    return Action(
        ActionKind.HOLD,
        action.name,
        version=action.version,
        from_version=action.from_version,
        reason="not deleted: the backend is unreachable and the last good state never deletes",
        resource_version=action.resource_version,
    )


def _result_of(action: Action, outcome: str) -> WorkloadResult:
    return WorkloadResult(
        name=action.name,
        action=action.kind.value,
        outcome=outcome,
        version=action.version,
        from_version=action.from_version,
        reason=action.reason,
    )


def _conflict_retries() -> Any:
    """Attempts for a write that meets resourceVersion conflicts: jittered exponential
    waits (0.2 s, then up to 2 s), REPLANS attempts in all."""
    return stamina.retry_context(
        on=KubeConflict, attempts=REPLANS, wait_initial=0.2, wait_max=2.0, wait_jitter=0.3,
        timeout=None,
    )  # fmt: skip


def _with_resource_version(
    manifest: dict[str, Any], resource_version: str | None
) -> dict[str, Any]:
    if resource_version is None:
        return manifest
    metadata = {**manifest["metadata"], "resourceVersion": resource_version}
    return {**manifest, "metadata": metadata}


def _deployed(objects: list[dict[str, Any]]) -> dict[str, Deployed]:
    deployed: dict[str, Deployed] = {}
    for obj in objects:
        live = LiveDeployment.from_object(obj)
        deployed[live.name] = Deployed(version=live.version, rollout=rollout_of(obj))
    return deployed
