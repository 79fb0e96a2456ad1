"""Self-update: move the manager's own Deployment to a newer published image, safely.

Every SELF_UPDATE_INTERVAL_SECONDS (with jitter) the version file is read and a pure
`decide_update` says noop, update or skip. An update patches only the manager
container's image, recording the previous image and the target version in annotations;
then the old pod (this one, still serving: maxUnavailable 0) watches the rollout. If the
new ReplicaSet is not available by the deadline, or the Deployment reports
ProgressDeadlineExceeded, the previous image is put back and the version is recorded as
failed (an annotation, so it survives restarts) and skipped from then on. Updates and
syncs share one lock: they never overlap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from app import __version__
from app.adapters.kube import KubeDeployments, KubeError
from app.adapters.versions import VersionFile, VersionSourceError
from app.domain.components import Component
from app.domain.health import RolloutPhase, rollout_of
from app.domain.updates import (
    Choice,
    UpdateDecision,
    UpdatePolicy,
    VersionFileError,
    decide_update,
    parse_version_file,
    split_image,
)
from app.metrics import Metrics

if TYPE_CHECKING:
    from app.services.alerting import Alerter

log = logging.getLogger(__name__)

PREVIOUS_IMAGE = "workload-manager.io/previous-image"
TARGET_VERSION = "workload-manager.io/update-target"
FAILED_VERSIONS = "workload-manager.io/failed-versions"


class SelfUpdateBusy(RuntimeError):
    """A sync or another update holds the cluster lock."""


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
        component: Component,
        metrics: Metrics,
        cluster_lock: asyncio.Lock,
        alerts: Alerter | None = None,
    ) -> None:
        self._alerts = alerts
        self._source = source
        self._kube = kube
        self._deployment = deployment
        self._container = container
        self._policy = policy
        self._deadline = deadline
        self._poll = poll_interval
        self._component = component
        self._metrics = metrics
        self._lock = cluster_lock
        self.last: dict[str, Any] | None = None

    async def check(self) -> UpdateDecision:
        """Read the version file and the own Deployment; decide. Changes nothing."""
        content = await self._source.fetch()
        published = parse_version_file(content)
        own = await self._own()
        current = self._current_version(own)
        failed = _failed_versions(own)
        decision = decide_update(
            current=current, published=published, failed=failed, policy=self._policy,
            now=datetime.now(UTC),
        )  # fmt: skip
        self.last = {
            "checked_at": datetime.now(UTC),
            "running": current,
            "published": published.version,
            "decision": decision.choice.value,
            "reason": decision.reason,
            "failed_versions": sorted(failed),
        }
        return decision

    async def run_scheduled(self) -> None:
        if self._lock.locked():
            log.info("self-update check skipped: a sync or an update is running")
            return
        now = datetime.now(UTC)
        try:
            decision = await self.check()
        except (VersionSourceError, VersionFileError, KubeError) as exc:
            self._component.failed(now, str(exc))
            self._metrics.self_updates.labels("check-failed").inc()
            log.warning("self-update check failed, nothing changed: %s", exc)
            return
        self._component.succeeded(now, **(self.last or {}))
        if decision.choice is Choice.UPDATE:
            await self.update(decision)

    async def update(self, decision: UpdateDecision) -> str:
        """Apply and watch; returns "available", "rolled-back" or "failed"."""
        if self._lock.locked():
            raise SelfUpdateBusy("a sync or an update is running")
        async with self._lock:
            assert decision.image is not None and decision.version is not None
            own = await self._own()
            previous = self._container_image(own)
            log.warning(
                "self-update: %s (image %s, was %s)", decision.reason, decision.image, previous
            )
            patched = await self._kube.patch(
                self._deployment,
                {
                    "metadata": {"annotations": {PREVIOUS_IMAGE: previous,
                                                 TARGET_VERSION: decision.version}},
                    "spec": {"template": {"spec": {"containers": [
                        {"name": self._container, "image": decision.image}]}}},
                },
            )  # fmt: skip
            self._metrics.self_updates.labels("applied").inc()
            if self._alerts is not None:
                self._alerts.alert(f"self-update:applied:{decision.version}",
                                   f"self-update applied: {decision.reason}")  # fmt: skip
            generation = int((patched.get("metadata") or {}).get("generation") or 0)
            outcome, why = await self._watch(generation)
            if outcome == "available":
                log.info(
                    "self-update to %s is available; this pod will be replaced", decision.version
                )
                self._metrics.self_updates.labels("available").inc()
                return outcome
            await self._roll_back(previous, decision.version, why, own)
            return "rolled-back"

    async def _watch(self, generation: int) -> tuple[str, str]:
        started = time.monotonic()
        while time.monotonic() - started < self._deadline:
            await asyncio.sleep(self._poll)
            try:
                own = await self._own()
            except KubeError as exc:
                log.warning("self-update: cannot read the rollout: %s", exc)
                continue
            rollout = rollout_of(own)
            if rollout.observed_generation < generation:
                continue
            if rollout.phase is RolloutPhase.FAILED:
                return "failed", "the Deployment reports ProgressDeadlineExceeded"
            if rollout.phase is RolloutPhase.READY:
                return "available", ""
        return "failed", f"the new pod was not available within {self._deadline:.0f} s"

    async def _roll_back(self, previous: str, version: str, why: str, own: dict[str, Any]) -> None:
        failed = sorted(_failed_versions(own) | {version})
        await self._kube.patch(
            self._deployment,
            {
                "metadata": {"annotations": {FAILED_VERSIONS: ",".join(failed),
                                             TARGET_VERSION: None}},
                "spec": {"template": {"spec": {"containers": [
                    {"name": self._container, "image": previous}]}}},
            },
        )  # fmt: skip
        self._metrics.self_updates.labels("rolled-back").inc()
        self._component.failed(datetime.now(UTC), f"update to {version} rolled back: {why}")
        log.error("self-update to %s rolled back to %s: %s", version, previous, why)
        if self._alerts is not None:
            self._alerts.alert(
                f"self-update:rolled-back:{version}",
                f"self-update to {version} rolled back to {previous}: {why}",
            )

    async def _own(self) -> dict[str, Any]:
        own = await self._kube.get(self._deployment)
        if own is None:
            raise KubeError(
                f"the manager's own Deployment {self._kube.namespace}/{self._deployment} "
                "was not found"
            )
        return own

    def _container_image(self, own: dict[str, Any]) -> str:
        for container in own["spec"]["template"]["spec"]["containers"]:
            if container.get("name") == self._container:
                return str(container["image"])
        raise KubeError(f"no container named {self._container!r} in the own Deployment")

    def _current_version(self, own: dict[str, Any]) -> str:
        """The image tag of the own container when it is a version, else the package's."""
        _repository, tag = split_image(self._container_image(own))
        if tag and not tag.startswith("sha256:"):
            return tag.removeprefix("v")
        return __version__


def _failed_versions(own: dict[str, Any]) -> frozenset[str]:
    raw = ((own.get("metadata") or {}).get("annotations") or {}).get(FAILED_VERSIONS, "")
    return frozenset(v for v in raw.split(",") if v)
