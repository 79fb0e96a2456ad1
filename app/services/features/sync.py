"""The deployment sync: every 10 minutes the cluster's Deployments are made what the desired
state says (from the backend, or a folder in development), and every minute the view of
the cluster that the pings and the report read is refreshed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import SecretStr

from app.domain.redaction import redact_text, redact_url
from app.services.features.base import Decision, Off, On, Running, Spec, Timer
from app.services.features.deps import Cluster, Decisions, Deps, Shared, plain_http_note
from app.settings import Settings

if TYPE_CHECKING:
    from app.domain.manifests import Injection, ManifestPolicy
    from app.domain.planning import SyncPolicy
    from app.domain.rollout import UpdateTerms
    from app.services.last_good import LastGood
    from app.services.syncing import Syncer


@dataclass(frozen=True)
class FolderSourceConfig:
    directory: Path


@dataclass(frozen=True)
class LastGoodConfig:
    """DESIRED_STATE_PUBLIC_KEYS set: answers verified, the last good state stored in the
    ConfigMap of `namespace` (the manager's own), or in `file` outside a cluster."""

    keys: tuple[bytes, ...]
    namespace: str | None
    file: Path
    preload: Path | None
    budget: int


@dataclass(frozen=True)
class BackendSourceConfig:
    endpoint: str
    last_good: LastGoodConfig | None = None


@dataclass(frozen=True)
class SyncConfig:
    source: BackendSourceConfig | FolderSourceConfig
    namespace: str
    max_workloads: int
    policy: SyncPolicy
    manifest_policy: ManifestPolicy
    manager_url: str
    ping_token_secret: SecretStr | None
    concurrency: int
    deadline: float
    interval: float
    refresh_interval: float
    update_terms: UpdateTerms
    stale_after: float
    judge_interval: float
    # the bounds of an interval the backend asks for (X-Sync-Interval-Seconds)
    bounds: tuple[float, float] = (60.0, 3_600.0)


@dataclass(kw_only=True)
class Syncing(Running):
    syncer: Syncer
    cluster: Cluster


class _Sync(Spec[SyncConfig, Syncing]):
    name = "sync"

    def decide(
        self, settings: Settings, shared: Shared, earlier: Decisions
    ) -> Decision[SyncConfig]:
        if not settings.sync_enabled:
            return Off("switched off by SYNC_ENABLED=false")
        source: BackendSourceConfig | FolderSourceConfig
        backend = shared.backend
        if backend is not None:
            keys = settings.desired_state_public_keys
            last_good = None
            if keys is not None:
                last_good = LastGoodConfig(
                    keys=keys.keys,
                    namespace=settings.pod_namespace,
                    file=settings.data_dir / "desired-state.json",
                    preload=settings.desired_state_preload,
                    budget=settings.desired_state_store_bytes,
                )
            source = BackendSourceConfig(backend.base_url, last_good)
            signed = "signed " if keys is not None else ""
            reason = f"{signed}desired state from {redact_url(backend.base_url)}"
            reason += plain_http_note(settings, "NODE_SYSTEM_ENDPOINT")
        elif settings.desired_state_dir is not None:
            source = FolderSourceConfig(settings.desired_state_dir)
            reason = f"desired state from folder {settings.desired_state_dir}"
        else:
            return Off("no NODE_SYSTEM_ENDPOINT (with a key) and no DESIRED_STATE_DIR to sync from")
        from app.domain.manifests import MANAGER_POD_LABELS, ManifestPolicy
        from app.domain.planning import SyncPolicy
        from app.domain.pod_security import Level
        from app.domain.rollout import Judge, UpdateTerms

        # the manager's own Deployment, when it lives among the workloads it manages
        own = settings.pod_namespace in (None, settings.managed_namespace)
        config = SyncConfig(
            source=source,
            namespace=settings.managed_namespace,
            max_workloads=settings.max_desired_workloads,
            policy=SyncPolicy(
                max_deletes=settings.sync_max_deletes,
                max_delete_percent=settings.sync_max_delete_percent,
                protected=frozenset({settings.self_deployment_name}) if own else frozenset(),
            ),
            manifest_policy=ManifestPolicy(
                allow_privileged=settings.allow_privileged,
                allow_host_namespaces=settings.allow_host_namespaces,
                allow_host_path=settings.allow_host_path,
                allow_host_ports=settings.allow_host_ports,
                level=Level(settings.manifest_policy),
                max_replicas=settings.manifest_max_replicas,
                max_bytes=settings.manifest_max_bytes,
                # in the manager's own namespace, its Service would send pods that carry
                # its name the node's pings (with their tokens) and status calls
                reserved_pod_labels=MANAGER_POD_LABELS if own else (),
            ),
            manager_url=settings.manager_url,
            ping_token_secret=settings.ping_token_secret,
            concurrency=settings.sync_concurrency,
            deadline=settings.sync_deadline_seconds,
            interval=settings.sync_interval_seconds,
            refresh_interval=settings.cluster_refresh_seconds,
            update_terms=UpdateTerms(
                judge=Judge(settings.workload_update_judge),
                min_healthy_seconds=settings.workload_update_min_healthy_seconds,
                deadline_seconds=settings.workload_update_deadline_seconds,
                unhealthy_seconds=settings.workload_update_unhealthy_seconds,
                revert=settings.workload_update_revert,
                window=settings.workload_update_window,
                max_defer_seconds=settings.update_defer_max_seconds,
                defer_step_seconds=settings.update_defer_step_seconds,
            ),
            stale_after=settings.ping_stale_seconds,
            judge_interval=settings.update_judge_interval_seconds,
            bounds=(settings.sync_interval_min_seconds, settings.sync_interval_max_seconds),
        )
        return On(config, reason)

    async def open(self, config: SyncConfig, deps: Deps) -> Syncing | Off:
        """The syncer on the shared cluster client; off when there is no cluster."""
        cluster = await deps.cluster()
        if isinstance(cluster, Off):
            return cluster
        from app.adapters.desired_files import DesiredFiles
        from app.adapters.kube import KubeError
        from app.services.rollouts import RolloutConfig, Rollouts
        from app.services.syncing import BackendSource, DesiredSource, FolderSource, Syncer

        source: DesiredSource
        found = ""
        if isinstance(config.source, BackendSourceConfig):
            backend = deps.backend()
            # decided together: a backend source is planned only with a backend to sign for
            assert backend is not None
            last_good = None
            if config.source.last_good is not None:
                last_good, found = await _last_good(
                    config.source.last_good, cluster, backend.node_id, config.max_workloads
                )
            source = BackendSource(
                backend,
                config.source.endpoint,
                max_workloads=config.max_workloads,
                last_good=last_good,
            )
        else:
            source = FolderSource(
                DesiredFiles(config.source.directory), max_workloads=config.max_workloads
            )
        deps.component(self).reason = redact_text(
            f"{source.description} -> namespace {config.namespace} via {cluster.source}"
            + (f"; last good state: {found}" if found else "")
        )
        syncer = deps.syncer = Syncer(
            source=source,
            kube=cluster.client,
            book=deps.book,
            policy=config.policy,
            manifest_policy=config.manifest_policy,
            injection_for=_injection(config),
            concurrency=config.concurrency,
            metrics=deps.metrics,
            cluster_lock=deps.cluster_lock,
            deadline=config.deadline,
            rollouts=Rollouts(
                # the node's place in each rollout is computed from its id
                RolloutConfig(deps.node_id, config.update_terms, config.stale_after),
                book=deps.book,
                metrics=deps.metrics,
                alerts=deps.alerts,
            ),
        )
        every, refresh = config.interval, config.refresh_interval
        # the backend may ask for another interval (a folder asks nothing)
        steered = config.bounds if isinstance(config.source, BackendSourceConfig) else None
        return Syncing(
            syncer=syncer,
            cluster=cluster,
            timers=[
                Timer(
                    "sync",
                    syncer.run_scheduled,
                    every,
                    min(10.0, every),
                    "deployment sync",
                    spread=True,
                    bounds=steered,
                ),
                Timer(
                    "cluster-view",
                    syncer.refresh_view,
                    refresh,
                    refresh,
                    "cluster view",
                    outage=(KubeError,),
                    recorded=False,
                ),
                Timer(
                    "rollout",
                    syncer.run_rollout,
                    config.judge_interval,
                    config.judge_interval,
                    "update look",
                    outage=(KubeError,),
                    recorded=False,
                ),
            ],
        )


async def _last_good(
    config: LastGoodConfig, cluster: Cluster, node_id: str, max_workloads: int
) -> tuple[LastGood, str]:
    """The verifier and the store, read and verified at start; what reading found."""
    from app.adapters.desired_signature import DesiredStateVerifier
    from app.services.last_good import (
        ConfigMapStateStore,
        FileStateStore,
        LastGood,
        StateStore,
    )

    store: StateStore = FileStateStore(config.file)
    if config.namespace is not None:
        store = ConfigMapStateStore(cluster.client.in_namespace(config.namespace))
    last_good = LastGood(
        verifier=DesiredStateVerifier(config.keys),
        node_id=node_id,
        store=store,
        budget=config.budget,
        max_workloads=max_workloads,
    )
    return last_good, await last_good.open(config.preload)


def _injection(config: SyncConfig) -> Callable[[str], Injection]:
    from app.domain.manifests import Injection
    from app.domain.tokens import ping_token

    secret = config.ping_token_secret

    def injection_for(name: str) -> Injection:
        token = ping_token(secret.get_secret_value(), name) if secret else None
        return Injection(manager_url=config.manager_url, ping_token=token)

    return injection_for


SYNC = _Sync()
