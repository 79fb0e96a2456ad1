"""Self-update: move the manager's own Deployment to a newer published image, safely.

Every SELF_UPDATE_INTERVAL_SECONDS (with jitter) the own Deployment is read first: its
annotations record an update in flight (target version and image, previous image, start
time, confirmation), and a pure `pending_update` says what that update still owes. An owed
step is done before anything else, and without the version file: watching a rollout that
is still going (then confirming it or rolling it back), a rollback, or recording a rollback
that someone else already did. `resume()` does the same at start-up, so a restarted
manager finishes what the one before it began; and when nothing is owed but the own image
is below the highest version confirmed on this node (an install file re-applied over a
confirmed update, as K3S does with its auto-deploy folder at every start), it takes the
confirmed image again, as an update, without the version file (`reassertion`).

When nothing is owed, the version file is read (and, with a public key, its signature
verified) and a pure `decide_update` says noop, update or skip; it never takes a version
below the highest one confirmed on this node, which each confirmation records on the own
Deployment, so it outlives pods and managers. An update patches only the manager
container's image (the published one: a pinned digest is patched as such) and the
annotations; then the old pod (this one, still serving: maxUnavailable 0) watches the
rollout. Once the new ReplicaSet is available, and stayed so for the min healthy time
(SELF_UPDATE_MIN_HEALTHY_SECONDS, counted from when it was first seen available, which is
recorded on the Deployment so the manager that resumes the watch continues it), it writes
the confirmation (and raises the floor); if it is not available by the deadline
(counted from the recorded start), turns unavailable within the min healthy time, or the
Deployment reports ProgressDeadlineExceeded, the
previous image is put back and the version recorded as failed (skipped from then on).
The watch thus ends within the deadline plus the min healthy time. The version file's
`rollout` (waves, a halt) and SELF_UPDATE_WINDOW gate starting an update only. The
rollback is retried with jittered exponential backoff for up to the deadline; if it still
fails, the component fails naming it, an alert is raised, and the next check tries again.
Updates and syncs share one lock: they never overlap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

import stamina

from app import __version__
from app.adapters.kube import KubeDeployments, KubeError
from app.adapters.versions import VersionFile, VersionSourceError
from app.domain.components import Outcome
from app.domain.health import RolloutPhase, rollout_of
from app.domain.updates import (
    AVAILABLE_SINCE,
    FAILED_VERSIONS,
    PREVIOUS_IMAGE,
    TARGET_IMAGE,
    TARGET_VERSION,
    UPDATE_STARTED,
    VERSION_FILE_SERIAL,
    Choice,
    Owed,
    Pending,
    UpdateDecision,
    UpdateMarks,
    UpdatePolicy,
    VersionFileError,
    check_serial,
    confirmation,
    decide_update,
    healthy_span,
    parse_image,
    parse_version_file,
    pending_update,
    read_marks,
    reassertion,
    stamp,
)
from app.metrics import Metrics

if TYPE_CHECKING:
    from app.services.alerting import Alerter

log = logging.getLogger(__name__)

T = TypeVar("T")


class SelfUpdateBusy(RuntimeError):
    """A sync or another update holds the cluster lock."""


def _retryable(exc: Exception) -> bool:
    return isinstance(exc, KubeError) and exc.retryable


class SelfUpdater:
    def __init__(
        self,
        *,
        source: VersionFile,
        kube: KubeDeployments,
        deployment: str,
        container: str,
        policy: UpdatePolicy,
        deadline: float,
        poll_interval: float,
        metrics: Metrics,
        cluster_lock: asyncio.Lock,
        alerts: Alerter | None = None,
        min_healthy: float = 0.0,
    ) -> None:
        self._alerts = alerts
        self._source = source
        self._kube = kube
        self._deployment = deployment
        self._container = container
        self._policy = policy
        self._deadline = deadline
        self._min_healthy = min_healthy
        self._poll = poll_interval
        self._metrics = metrics
        self._lock = cluster_lock
        # Rollback retries: jittered exponential backoff from the poll interval (at most
        # 1 s) up to a tenth of the deadline, for at most the deadline in all.
        self._retry_initial = min(1.0, poll_interval)
        self._retry_max = max(self._retry_initial, deadline / 10)
        self._retry_budget = deadline
        self.last: dict[str, Any] | None = None

    async def check(self) -> UpdateDecision:
        """Read the own Deployment and the version file; decide. Changes nothing but the
        version file's serial recorded on the own Deployment (a file below it is refused).

        While the last update still owes a step (see `pending_update`), no new update is
        decided: the answer is a skip naming that step, and `last["decision"]` is the step.
        """
        decision, _pending, _own = await self._check()
        return decision

    async def _check(self) -> tuple[UpdateDecision, Pending, dict[str, Any]]:
        own = await self._own()
        marks = read_marks(_annotations(own))
        pending = self._pending(own, marks)
        current = self._current_version(own, marks)
        if pending.owed is not Owed.NOTHING:
            self.last = {
                "checked_at": datetime.now(UTC),
                "running": current,
                "published": None,
                "decision": pending.owed.value,
                "reason": f"update to {pending.version}: {pending.reason}",
                "failed_versions": sorted(marks.failed),
            }
            decision = UpdateDecision(
                Choice.SKIP,
                f"the update to {pending.version} still owes {pending.owed.value}: "
                f"{pending.reason}",
                pending.version,
            )
            return decision, pending, own
        content = await self._source.fetch()
        published = parse_version_file(content)
        check_serial(published, marks.serial)
        if published.serial is not None and published.serial != marks.serial:
            # recorded where the next manager reads it, so a stale copy cannot undo this one
            await self._kube.patch(
                self._deployment,
                {"metadata": {"annotations": {VERSION_FILE_SERIAL: str(published.serial)}}},
            )
        decision = decide_update(
            current=current, published=published, failed=marks.failed, policy=self._policy,
            now=datetime.now(UTC), highest=marks.highest,
        )  # fmt: skip
        self.last = {
            "checked_at": datetime.now(UTC),
            "running": current,
            "published": published.version,
            "decision": decision.choice.value,
            "reason": decision.reason,
            "failed_versions": sorted(marks.failed),
        }
        return decision, pending, own

    async def run_scheduled(self) -> Outcome:
        """One scheduled check, and the update or the owed step it leads to."""
        # A sync holds the shared lock for a moment at each of its intervals: a check that
        # skipped whenever it met one could skip every time (the same interval and no
        # jitter put both on the same ticks). It waits for the lock, up to its deadline.
        if not await self._lock_frees(self._deadline):
            return Outcome.skipped(f"a sync or an update ran for {self._deadline:.0f} s")
        try:
            decision, pending, own = await self._check()
        except (VersionSourceError, VersionFileError, KubeError) as exc:
            self._metrics.self_updates.labels("check-failed").inc()
            # nothing changed; after a Retry-After, the next check waits for it
            return Outcome.failed(str(exc)).retrying(getattr(exc, "retry_after", None))
        if pending.owed is not Owed.NOTHING:
            log.warning(
                "self-update to %s: %s owed: %s",
                pending.version, pending.owed.value, pending.reason,
            )  # fmt: skip
            if self._lock.locked():
                return Outcome.skipped(f"{pending.owed.value} deferred: a sync is running")
            return await self._settle(pending, own)
        checked = {"owed": None, **(self.last or {})}
        if decision.choice is not Choice.UPDATE:
            return Outcome.ok(**checked)
        try:
            # a sync that began while the version file was read is waited for
            settled = await self.update(decision, wait=self._deadline)
        except SelfUpdateBusy as exc:
            return Outcome.skipped(f"the update to {decision.version} deferred: {exc}", **checked)
        return settled.with_detail(**checked)

    async def _lock_frees(self, within: float) -> bool:
        """Wait until no sync or update holds the lock (without keeping it)."""
        if not self._lock.locked():
            return True
        try:
            async with asyncio.timeout(within), self._lock:
                return True
        except TimeoutError:
            return False

    async def resume(self) -> Outcome:
        """At start-up: finish what the own Deployment says the last update still owes.

        A skip when nothing is owed, else the outcome, its `update` detail "available",
        "rolled-back" or "rollback-failed". Waits for a sync that holds the cluster lock.
        Never raises for cluster errors: they are its outcome, and the scheduled checks
        try again. It may watch a rollout for up to the deadline and the min healthy
        time, so run it as a background task, not in the start-up path.
        """
        try:
            own = await self._own()
            marks = read_marks(_annotations(own))
            pending = self._pending(own, marks)
        except KubeError as exc:
            log.warning("self-update: cannot read the own Deployment at start: %s", exc)
            return Outcome.failed(f"the own Deployment not read at start: {exc}")
        if pending.owed is Owed.NOTHING:
            return await self._reassert(own, marks)
        log.warning(
            "self-update to %s: resuming, %s owed: %s",
            pending.version, pending.owed.value, pending.reason,
        )  # fmt: skip
        return await self._settle(pending, own)

    async def _reassert(self, own: dict[str, Any], marks: UpdateMarks) -> Outcome:
        """The confirmed image again when the own one is below it (`reassertion`)."""
        decision = reassertion(
            current=self._current_version(own, marks), highest=marks.highest,
            failed=marks.failed, repository=self._policy.repository,
        )  # fmt: skip
        if decision.choice is Choice.NOOP:
            return Outcome.skipped("nothing owed at start")
        if decision.choice is Choice.SKIP:
            log.warning("self-update: not re-asserting the confirmed version: %s", decision.reason)
            return Outcome.skipped(f"not re-asserting the confirmed version: {decision.reason}")
        log.warning("self-update: re-asserting at start: %s", decision.reason)
        try:
            return await self.update(decision)
        except SelfUpdateBusy:
            return Outcome.skipped("re-assertion deferred: a sync or an update is running")
        except KubeError as exc:
            log.warning("self-update: re-asserting %s failed: %s", decision.version, exc)
            return Outcome.failed(f"re-asserting {decision.version}: {exc}")

    async def update(self, decision: UpdateDecision, *, wait: float = 0.0) -> Outcome:
        """Apply and watch; the outcome's `update` detail is "available", "rolled-back"
        or "rollback-failed".

        A sync or an update holding the cluster lock is waited for up to `wait` seconds
        (none by default); SelfUpdateBusy when it still holds it then."""
        if self._lock.locked() and wait <= 0:
            raise SelfUpdateBusy("a sync or an update is running")
        try:
            async with asyncio.timeout(max(wait, 0.0) or None):
                await self._lock.acquire()
        except TimeoutError:
            raise SelfUpdateBusy(
                f"a sync or an update held the cluster lock for {wait:.0f} s"
            ) from None
        try:
            return await self._apply(decision)
        finally:
            self._lock.release()

    async def _apply(self, decision: UpdateDecision) -> Outcome:
        """Under the cluster lock: patch the own Deployment, then see the rollout through."""
        assert decision.image is not None and decision.version is not None
        own = await self._own()
        previous = self._container_image(own)
        log.warning("self-update: %s (image %s, was %s)", decision.reason, decision.image, previous)
        patched = await self._kube.patch(
            self._deployment,
            {
                "metadata": {"annotations": {
                    PREVIOUS_IMAGE: previous,
                    TARGET_VERSION: decision.version,
                    TARGET_IMAGE: decision.image,
                    UPDATE_STARTED: stamp(datetime.now(UTC)),
                    AVAILABLE_SINCE: None,
                }},
                "spec": self._images(own, decision.image, instead_of=previous),
            },
        )  # fmt: skip
        self._metrics.self_updates.labels("applied").inc()
        if self._alerts is not None:
            self._alerts.alert(f"self-update:applied:{decision.version}",
                               f"self-update applied: {decision.reason}")  # fmt: skip
        generation = int((patched.get("metadata") or {}).get("generation") or 0)
        pending = Pending(
            Owed.WATCH, decision.reason, decision.version, previous, self._deadline,
            decision.image,
        )  # fmt: skip
        return await self._see_through(pending, generation, read_marks(_annotations(own)))

    async def _settle(self, pending: Pending, own: dict[str, Any]) -> Outcome:
        """Do what the last update owes (WATCH, ROLLBACK or FINISH_ROLLBACK), under the lock."""
        async with self._lock:
            generation = int((own.get("metadata") or {}).get("generation") or 0)
            marks = read_marks(_annotations(own))
            if pending.owed is Owed.WATCH:
                return await self._see_through(pending, generation, marks)
            assert pending.version is not None and pending.previous_image is not None
            return await self._roll_back(
                pending.version, pending.previous_image, pending.reason, marks,
                put_image_back=pending.owed is Owed.ROLLBACK,
            )  # fmt: skip

    async def _see_through(self, pending: Pending, generation: int, marks: UpdateMarks) -> Outcome:
        """Watch an applied update to its end: confirm it once available (and, with a min
        healthy time, once it stayed so that long), or roll it back."""
        assert pending.version is not None and pending.previous_image is not None
        outcome, why, seen = await self._watch(generation, pending.remaining)
        if outcome == "available" and self._min_healthy > 0 and seen is not None:
            outcome, why = await self._stay_available(pending.version, seen)
        if outcome == "available":
            return await self._confirm(pending.version, pending.image, marks)
        return await self._roll_back(
            pending.version, pending.previous_image, why, marks, put_image_back=True
        )

    async def _watch(
        self, generation: int, budget: float
    ) -> tuple[str, str, dict[str, Any] | None]:
        """Read the rollout until it is done, failed, or `budget` seconds have passed (at
        least one read, so a finished rollout is seen even with no time left); with the
        own Deployment as read when it was available."""
        started = time.monotonic()
        while True:
            try:
                own = await self._own()
            except KubeError as exc:
                log.warning("self-update: cannot read the rollout: %s", exc)
            else:
                rollout = rollout_of(own)
                if rollout.observed_generation >= generation:
                    if rollout.phase is RolloutPhase.FAILED:
                        return "failed", "the Deployment reports ProgressDeadlineExceeded", None
                    if rollout.phase is RolloutPhase.READY:
                        return "available", "", own
            if time.monotonic() - started >= budget:
                why = f"the new pod was not available within {self._deadline:.0f} s"
                return "failed", why, None
            await asyncio.sleep(self._poll)

    async def _stay_available(self, version: str, own: dict[str, Any]) -> tuple[str, str]:
        """The min healthy time of an available update: "available" once the Deployment
        stayed available (the new ReplicaSet available, no ProgressDeadlineExceeded) for
        SELF_UPDATE_MIN_HEALTHY_SECONDS, "failed" as soon as it is not.

        The time starts when the update was first seen available, which the first manager
        to see it records on the Deployment (the old pod that watches is ended by the
        rollout itself: the new pod's own resume continues the same time from the mark).
        Reads that fail are retried: after the time and a deadline more without one, the
        update is taken as failed, as a rollout that could not be seen finishing is."""
        now = datetime.now(UTC)
        recorded = read_marks(_annotations(own)).available_since
        since, left = healthy_span(recorded, now=now, min_healthy=self._min_healthy)
        if recorded is None or recorded > now:
            try:
                await self._kube.patch(
                    self._deployment, {"metadata": {"annotations": {AVAILABLE_SINCE: stamp(now)}}}
                )
            except KubeError as exc:
                # the time still runs here; a manager that resumes starts it again
                log.warning("self-update to %s: the time it became available not recorded: %s",
                            version, exc)  # fmt: skip
        log.info("self-update to %s is available; confirmed once it stays so %.0f s more",
                 version, left)  # fmt: skip
        ends = time.monotonic() + left
        while True:
            try:
                own = await self._own()
            except KubeError as exc:
                log.warning("self-update: cannot read the rollout: %s", exc)
                if time.monotonic() >= ends + self._deadline:
                    return "failed", (
                        f"the rollout could not be read for {self._deadline:.0f} s after the "
                        f"{self._min_healthy:.0f} s the new pod must stay available"
                    )
            else:
                rollout = rollout_of(own)
                if rollout.unobserved and not rollout.deadline_exceeded:
                    # the available-since annotation just written moved the generation:
                    # the status says nothing until the controller has looked again
                    if time.monotonic() >= ends + self._deadline:
                        return "failed", (
                            f"the deployment controller did not observe the Deployment for "
                            f"{self._deadline:.0f} s after the {self._min_healthy:.0f} s the "
                            "new pod must stay available"
                        )
                elif rollout.phase is not RolloutPhase.READY:
                    after = (datetime.now(UTC) - since).total_seconds()
                    detail = (
                        "it reports ProgressDeadlineExceeded"
                        if rollout.phase is RolloutPhase.FAILED
                        else f"{rollout.available} of {rollout.replicas} available, "
                        f"{rollout.ready} ready"
                    )
                    return "failed", (
                        f"the Deployment became unavailable {after:.0f} s after the new pod "
                        f"was available, within the {self._min_healthy:.0f} s it must stay "
                        f"available ({detail})"
                    )
                elif time.monotonic() >= ends:  # seen available, by a status of now
                    return "available", ""
            wait = ends - time.monotonic()
            await asyncio.sleep(min(self._poll, wait) if wait > 0 else self._poll)

    async def _confirm(self, version: str, image: str | None, marks: UpdateMarks) -> Outcome:
        """Record the confirmation, and the highest confirmed version (the floor below
        which nothing is taken) when this one is higher, in one patch."""
        log.info("self-update to %s is available; confirmed", version)
        self._metrics.self_updates.labels("available").inc()
        confirmed = Outcome.ok(owed=None, confirmed=version, update="available")
        try:
            await self._kube.patch(
                self._deployment,
                {"metadata": {"annotations": confirmation(marks, version, image)}},
            )
        except KubeError as exc:
            # harmless: whichever manager runs next sees the finished rollout and confirms
            log.warning("self-update to %s: confirmation not recorded: %s", version, exc)
        return confirmed

    async def _roll_back(
        self, version: str, previous: str, why: str, marks: UpdateMarks, *, put_image_back: bool
    ) -> Outcome:
        """Put the previous image back (unless it is back already) and record the version
        as failed, in one patch, retried with backoff; "rolled-back" or "rollback-failed"."""
        failed = sorted(marks.failed | {version})
        patch: dict[str, Any] = {
            "metadata": {"annotations": {
                FAILED_VERSIONS: ",".join(failed), TARGET_VERSION: None, TARGET_IMAGE: None,
                UPDATE_STARTED: None, AVAILABLE_SINCE: None,
            }},
        }  # fmt: skip

        async def roll_back() -> dict[str, Any]:
            if put_image_back:
                own = await self._own()
                patch["spec"] = self._images(own, previous, instead_of=self._container_image(own))
            return await self._kube.patch(self._deployment, patch)

        try:
            await self._retrying(f"rollback of the update to {version}", roll_back)
        except KubeError as exc:
            self._metrics.self_updates.labels("rollback-failed").inc()
            message = (
                f"rollback of the update to {version} (back to {previous}) failed: {exc}; "
                f"the update had failed: {why}; the next check retries the rollback"
            )
            log.error("self-update: %s", message)
            return Outcome.failed(message, owed="rollback", update="rollback-failed").alerting(
                f"self-update:rollback-failed:{version}", f"self-update: {message}"
            )
        self._metrics.self_updates.labels("rolled-back").inc()
        log.error("self-update to %s rolled back to %s: %s", version, previous, why)
        return Outcome.failed(
            f"update to {version} rolled back: {why}", owed=None, update="rolled-back"
        ).alerting(
            f"self-update:rolled-back:{version}",
            f"self-update to {version} rolled back to {previous}: {why}",
        )

    async def _retrying(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """`call` (a Kubernetes request, which has its own timeout), retried on transient
        errors with jittered exponential backoff for at most the retry budget."""
        async for attempt in stamina.retry_context(
            on=_retryable,
            attempts=None,
            timeout=self._retry_budget,
            wait_initial=self._retry_initial,
            wait_max=self._retry_max,
            wait_jitter=self._retry_initial,
        ):
            with attempt:
                try:
                    return await call()
                except KubeError as exc:
                    if _retryable(exc):
                        log.warning(
                            "self-update: %s failed (attempt %d): %s; retrying in %.2f s or "
                            "more, for up to %.0f s in all",
                            what, attempt.num, exc, attempt.next_wait, self._retry_budget,
                            extra={"attempt": attempt.num, "next_wait": attempt.next_wait},
                        )  # fmt: skip
                    raise
        raise AssertionError("unreachable: stamina either returns or raises")

    def _pending(self, own: dict[str, Any], marks: UpdateMarks) -> Pending:
        return pending_update(
            marks=marks,
            image=self._container_image(own),
            rollout=rollout_of(own).phase,
            now=datetime.now(UTC),
            deadline=self._deadline,
            min_healthy=self._min_healthy,
        )

    async def _own(self) -> dict[str, Any]:
        own = await self._kube.get(self._deployment)
        if own is None:
            raise KubeError(
                f"the manager's own Deployment {self._kube.namespace}/{self._deployment} "
                "was not found"
            )
        return own

    def _images(self, own: dict[str, Any], image: str, *, instead_of: str) -> dict[str, Any]:
        """The spec patch that runs `image`: the manager container, and every init container
        that ran the manager's image with it (the install's `migrate`: the schema is
        migrated by the code that needs it, and put back with it)."""
        spec: dict[str, Any] = {"containers": [{"name": self._container, "image": image}]}
        init = [
            {"name": c["name"], "image": image}
            for c in own["spec"]["template"]["spec"].get("initContainers") or []
            if c.get("image") == instead_of and c.get("name")
        ]
        if init:
            spec["initContainers"] = init
        return {"template": {"spec": spec}}

    def _container_image(self, own: dict[str, Any]) -> str:
        for container in own["spec"]["template"]["spec"]["containers"]:
            if container.get("name") == self._container:
                return str(container["image"])
        raise KubeError(f"no container named {self._container!r} in the own Deployment")

    def _current_version(self, own: dict[str, Any], marks: UpdateMarks) -> str:
        """The image tag of the own container; for an image pinned by digest alone, the
        version a confirmed update set it for; else the package's."""
        image = self._container_image(own)
        tag = parse_image(image).tag
        if tag:
            return tag.removeprefix("v")
        if (
            marks.target_image == image
            and marks.target_version is not None
            and marks.confirmed_version == marks.target_version
        ):
            return marks.target_version.removeprefix("v")
        return __version__


def _annotations(own: dict[str, Any]) -> dict[str, str]:
    annotations: dict[str, str] = (own.get("metadata") or {}).get("annotations") or {}
    return annotations
