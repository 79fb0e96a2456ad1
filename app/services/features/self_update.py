"""The self-update: the version file on S3 read every hour, the manager's own Deployment
patched to a newer published version, watched, and rolled back when it does not come up."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from app.domain.components import Outcome
from app.domain.redaction import redact_url
from app.services.features.base import Decision, Off, On, Running, Spec, Task, Timer
from app.services.features.deps import Decisions, Deps, Shared, plain_http_note
from app.settings import Settings

if TYPE_CHECKING:
    from app.domain.updates import UpdatePolicy, VersionFileKey
    from app.services.updating import SelfUpdater


@dataclass(frozen=True)
class SelfUpdateConfig:
    url: str
    timeout: float
    s3_endpoint: str | None
    public_key: VersionFileKey | None
    signature_url: str | None
    namespace: str
    deployment: str
    container: str
    policy: UpdatePolicy
    deadline: float
    min_healthy: float
    poll_interval: float
    interval: float
    retry_after_max: float = 3_600.0  # the longest a Retry-After holds the file's reads


@dataclass(kw_only=True)
class Updating(Running):
    updater: SelfUpdater


class _SelfUpdate(Spec[SelfUpdateConfig, Updating]):
    name = "self_update"

    def decide(
        self, settings: Settings, shared: Shared, earlier: Decisions
    ) -> Decision[SelfUpdateConfig]:
        if not settings.self_update_enabled:
            return Off("switched off by SELF_UPDATE_ENABLED=false")
        if settings.self_update_url is None:
            return Off("no SELF_UPDATE_URL set")
        if settings.pod_namespace is None:
            return Off("not running in a cluster (no POD_NAMESPACE from the downward API)")
        from app.domain.updates import UpdatePolicy

        config = SelfUpdateConfig(
            url=settings.self_update_url,
            timeout=settings.self_update_timeout_seconds,
            s3_endpoint=settings.self_update_s3_endpoint,
            public_key=settings.self_update_public_key,
            signature_url=settings.self_update_signature_url,
            namespace=settings.pod_namespace,
            deployment=settings.self_deployment_name,
            container=settings.self_container_name,
            policy=UpdatePolicy(
                repository=settings.self_image_repository,
                allow_prerelease=settings.self_update_allow_prerelease,
                window=settings.update_window,
            ),
            deadline=settings.self_update_deadline_seconds,
            min_healthy=settings.self_update_min_healthy_seconds,
            poll_interval=settings.self_update_poll_seconds,
            interval=settings.self_update_interval_seconds,
            retry_after_max=settings.retry_after_max_seconds,
        )
        return On(
            config,
            f"{redact_url(settings.self_update_url)} -> "
            f"{settings.pod_namespace}/{settings.self_deployment_name}"
            + plain_http_note(settings, "SELF_UPDATE_URL"),
        )

    async def open(self, config: SelfUpdateConfig, deps: Deps) -> Updating | Off:
        """The self-updater on the shared cluster client, in the manager's own namespace;
        off when there is no cluster."""
        cluster = await deps.cluster()
        if isinstance(cluster, Off):
            return cluster
        from app.adapters.versions import VersionFile
        from app.services.updating import SelfUpdater

        source = VersionFile(
            config.url,
            timeout=config.timeout,
            s3_endpoint=config.s3_endpoint,
            public_key=config.public_key,
            signature_url=config.signature_url,
            retry_after_max=config.retry_after_max,
        )
        deps.stack.push_async_callback(source.aclose)
        updater = SelfUpdater(
            source=source,
            kube=cluster.client.in_namespace(config.namespace),
            deployment=config.deployment,
            container=config.container,
            # placed in the version file's waves by the node's id, as the backend knows it
            policy=replace(config.policy, node_id=deps.node_id),
            deadline=config.deadline,
            min_healthy=config.min_healthy,
            poll_interval=config.poll_interval,
            metrics=deps.metrics,
            cluster_lock=deps.cluster_lock,
            alerts=deps.alerts,
        )

        async def resume(_stopping: asyncio.Event) -> Outcome:
            # finish an update or rollback a previous process began, without waiting for
            # the first scheduled check
            return await updater.resume()

        every = config.interval
        return Updating(
            updater=updater,
            timers=[
                Timer(
                    "self-update",
                    updater.run_scheduled,
                    every,
                    min(60.0, every),
                    "self-update check",
                    spread=True,
                ),
            ],
            tasks=[Task("self-update-resume", resume, restart=False)],
        )


SELF_UPDATE = _SelfUpdate()
