"""Opening the optional components: registry, job worker, deployment sync, self-update.

Each `open_*` returns None, with the reason on its component, when the component is off
or cannot start; otherwise it builds the component, registers its cleanup on the
lifespan's AsyncExitStack and returns it. Each imports its clients only once it knows
the component is on, so a switched-off component costs no memory.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.domain.components import Component
from app.domain.requirements import Tier

if TYPE_CHECKING:
    from app.adapters.kube import KubeDeployments
    from app.services.heartbeating import Heartbeat
    from app.services.runtime import Runtime
    from app.services.syncing import Syncer
    from app.services.updating import SelfUpdater
    from app.services.working import Worker

log = logging.getLogger(__name__)

DEVELOPMENT_TIER = Tier.C


async def open_registry(rt: Runtime, stack: AsyncExitStack) -> Heartbeat | None:
    """The registry pool, pending migrations (development), and the heartbeat.

    Shutdown marks the node `draining` first and `offline` last, so whatever stops in
    between (jobs, the last report) happens while the fleet already routes around it.
    """
    settings = rt.settings
    component = rt.components["registry"]
    if not component.enabled or rt.database_url is None:
        return None
    from app.adapters import system
    from app.adapters.kube import KubeError
    from app.adapters.registry import AsyncpgRegistry
    from app.domain.migrations import MigrationError
    from app.services import migrating
    from app.services.heartbeating import Heartbeat

    registry = AsyncpgRegistry(
        rt.database_url,
        timeout=settings.database_timeout_seconds,
        max_connections=settings.database_pool_size,
    )
    await registry.open()
    stack.push_async_callback(registry.close)
    rt.registry = registry
    prepare = None
    if settings.migrates_on_start:
        directory = migrating.migrations_dir(settings.migrations_dir)

        async def prepare() -> None:
            try:
                applied = await migrating.migrate(registry, directory)
            except MigrationError as exc:
                component.failed(datetime.now(UTC), f"migrations refused: {exc}")
                log.error("migrations from %s refused: %s", directory, exc)
                raise
            component.detail["migrations_applied_at_start"] = [m.filename for m in applied]

    disk = settings.data_dir if settings.data_dir.exists() else Path.cwd()

    async def fingerprint() -> dict[str, Any]:
        hardware = await asyncio.to_thread(system.fingerprint, disk)
        if rt.syncer is not None:  # the cluster client exists once sync has started
            try:
                hardware["k3s_version"] = await rt.syncer.kube.server_version()
            except KubeError as exc:
                log.info("K3S version not in the fingerprint this time: %s", exc)
        return hardware

    heartbeat = Heartbeat(
        registry=registry,
        node_id=rt.node_id,
        tier=settings.node_tier or DEVELOPMENT_TIER,
        region=settings.node_region,
        trust_zone=settings.node_trust_zone,
        capabilities=settings.node_capabilities,
        fingerprint=fingerprint,
        interval_seconds=settings.heartbeat_interval_seconds,
        component=component,
        metrics=rt.metrics,
        retry_max_wait=min(5.0, settings.heartbeat_interval_seconds / 4),
        prepare=prepare,
        alerts=rt.alerts,
    )
    rt.heartbeat = heartbeat
    budget = min(5.0, settings.shutdown_grace_seconds)
    stack.push_async_callback(heartbeat.mark, "offline", within=budget)
    stack.push_async_callback(heartbeat.mark, "draining", within=budget)
    return heartbeat


async def open_worker(rt: Runtime, stack: AsyncExitStack) -> Worker | None:
    """The job worker as a supervised task; it connects to NATS inside the task, so a
    NATS outage at start delays the worker, never the manager."""
    settings = rt.settings
    component = rt.components["worker"]
    if not component.enabled or rt.nats_url is None:
        return None
    from app.adapters.bus import JetStreamBus
    from app.adapters.registry import AsyncpgLedger
    from app.adapters.workload_http import WorkloadHttp
    from app.services.handlers import load_handlers
    from app.services.streams import consumer_specs, init_streams
    from app.services.working import Worker, WorkerConfig

    if rt.registry is None or rt.heartbeat is None:
        component.switch_off("the registry is not running: no idempotency ledger")
        return None
    tier = (settings.node_tier or DEVELOPMENT_TIER).value
    bus = JetStreamBus(
        rt.nats_url, name=f"workload-manager/{rt.node_id}", timeout=settings.backend_timeout_seconds
    )
    http = WorkloadHttp(
        timeout=settings.http_job_timeout_seconds,
        allowed_suffixes=tuple(settings.http_job_allowed_suffixes),
    )
    stack.push_async_callback(http.aclose)
    worker = Worker(
        bus=bus,
        ledger=AsyncpgLedger(rt.registry),
        registry=rt.registry,
        node=rt.heartbeat.profile,
        handlers=load_handlers(),
        http=http,
        config=WorkerConfig(
            tier=tier,
            concurrency=settings.worker_concurrency,
            batch=settings.job_fetch_batch,
            ack_wait=settings.job_ack_wait_seconds,
            max_deliver=settings.job_max_deliver,
            backoff=tuple(settings.job_backoff_seconds),
            not_here_delay=settings.job_not_here_delay_seconds,
            held_delay=settings.job_held_delay_seconds,
            job_timeout=settings.job_timeout_seconds,
        ),
        metrics=rt.metrics,
        component=component,
        alerts=rt.alerts,
    )
    rt.worker, rt.bus = worker, bus
    rt.metrics.jobs_in_flight.set_function(lambda: worker.in_flight)

    async def start_and_run() -> None:
        if not bus.connected:
            await bus.connect()
        if settings.auto_init_streams:
            changes = await init_streams(bus, settings)
        else:
            changes = []
            for consumer in consumer_specs(settings, (tier,)):
                changes.append((consumer.durable, await bus.ensure_consumer(consumer)))
        component.detail["topology"] = dict(changes)
        # no jobs before the node is registered: the ledger's schema exists by then
        await heartbeat.registered.wait()
        component.succeeded(datetime.now(UTC), connected=True)
        await worker.run()

    heartbeat = rt.heartbeat
    supervisor = asyncio.create_task(
        _supervise("worker", start_and_run, component), name="job-worker"
    )

    async def drain() -> None:
        grace = max(rt.settings.shutdown_grace_seconds - 5.0, 1.0)
        await heartbeat.mark("draining", within=min(5.0, grace))
        if bus.connected:
            await worker.announce_draining()
        await worker.stop(grace=grace)
        # the fetch loops notice the stop within one fetch wait and unsubscribe cleanly;
        # cancelling one mid-fetch would leave a pull request that stalls the drain
        _done, pending = await asyncio.wait({supervisor}, timeout=5.0)
        for task in pending:
            task.cancel()
        await asyncio.gather(supervisor, return_exceptions=True)
        await bus.drain()

    stack.push_async_callback(drain)
    return worker


async def _supervise(name: str, body: Callable[[], Awaitable[None]], component: Component) -> None:
    """Run a long-lived task; restart it with backoff if it dies, never silently."""
    failures = 0
    while True:
        try:
            await body()
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failures += 1
            delay = min(60.0, 2.0**failures) * random.uniform(0.5, 1.0)
            component.failed(datetime.now(UTC), f"{type(exc).__name__}: {exc}")
            log.exception("%s crashed (%d in a row); restarting in %.1f s", name, failures, delay)
            await asyncio.sleep(delay)


def consumer_stats(rt: Runtime) -> Callable[[], Awaitable[None]]:
    from app.domain.jobs import STREAMS, consumer_name

    async def collect() -> None:
        if rt.bus is None or not rt.bus.connected:
            return
        tier = (rt.settings.node_tier or DEVELOPMENT_TIER).value
        for stream in STREAMS.values():
            state = await rt.bus.consumer_state(stream, consumer_name(tier))
            rt.metrics.consumer_pending.labels(stream).set(state["pending"])
            rt.metrics.consumer_ack_pending.labels(stream).set(state["ack_pending"])

    return collect


async def open_self_updater(rt: Runtime, stack: AsyncExitStack) -> SelfUpdater | None:
    settings = rt.settings
    component = rt.components["self_update"]
    if not component.enabled or settings.self_update_url is None:
        return None
    from app.adapters.versions import VersionFile
    from app.domain.updates import UpdatePolicy
    from app.services.updating import SelfUpdater

    assert settings.pod_namespace is not None
    opened = await _cluster_client(rt, stack, component, namespace=settings.pod_namespace)
    if opened is None:
        return None
    kube, _source = opened
    source = VersionFile(settings.self_update_url, timeout=settings.self_update_timeout_seconds)
    stack.push_async_callback(source.aclose)
    rt.updater = SelfUpdater(
        source=source,
        kube=kube,
        deployment=settings.self_deployment_name,
        container=settings.self_container_name,
        policy=UpdatePolicy(
            repository=settings.self_image_repository,
            allow_prerelease=settings.self_update_allow_prerelease,
            window=settings.update_window,
        ),
        deadline=settings.self_update_deadline_seconds,
        poll_interval=settings.self_update_poll_seconds,
        component=component,
        metrics=rt.metrics,
        cluster_lock=rt.cluster_lock,
        alerts=rt.alerts,
    )
    return rt.updater


async def open_syncer(rt: Runtime, stack: AsyncExitStack) -> Syncer | None:
    """The deployment syncer, or None with the reason recorded on the sync component."""
    settings = rt.settings
    component = rt.components["sync"]
    if not component.enabled:
        return None
    from app.adapters.desired_files import DesiredFiles
    from app.domain.manifests import Injection, ManifestPolicy
    from app.domain.planning import SyncPolicy
    from app.domain.tokens import ping_token
    from app.services.syncing import BackendSource, DesiredSource, FolderSource, Syncer

    source: DesiredSource
    if rt.backend is not None and settings.node_system_endpoint is not None:
        source = BackendSource(rt.backend, settings.node_system_endpoint)
    elif settings.desired_state_dir is not None:
        source = FolderSource(DesiredFiles(settings.desired_state_dir))
    else:
        component.switch_off("no desired-state source")
        return None
    opened = await _cluster_client(rt, stack, component, namespace=settings.managed_namespace)
    if opened is None:
        return None
    kube, cluster_source = opened
    protected = (
        frozenset({settings.self_deployment_name})
        if settings.pod_namespace in (None, settings.managed_namespace)
        else frozenset()
    )
    secret = settings.ping_token_secret

    def injection_for(name: str) -> Injection:
        token = ping_token(secret.get_secret_value(), name) if secret else None
        return Injection(manager_url=settings.manager_url, ping_token=token)

    rt.syncer = Syncer(
        source=source,
        kube=kube,
        book=rt.book,
        policy=SyncPolicy(
            max_deletes=settings.sync_max_deletes,
            max_delete_percent=settings.sync_max_delete_percent,
            protected=protected,
        ),
        manifest_policy=ManifestPolicy(
            allow_privileged=settings.allow_privileged,
            allow_host_namespaces=settings.allow_host_namespaces,
            allow_host_path=settings.allow_host_path,
            allow_host_ports=settings.allow_host_ports,
        ),
        injection_for=injection_for,
        concurrency=settings.sync_concurrency,
        metrics=rt.metrics,
        component=component,
        cluster_lock=rt.cluster_lock,
        alerts=rt.alerts,
    )
    component.reason = (
        f"{source.description} -> namespace {settings.managed_namespace} via {cluster_source}"
    )
    return rt.syncer


async def _cluster_client(
    rt: Runtime, stack: AsyncExitStack, component: Component, *, namespace: str
) -> tuple[KubeDeployments, str] | None:
    """A Deployments client for one namespace, closed with the lifespan; None (and the
    component switched off with the reason) when there is no cluster to talk to."""
    from app.adapters.kube import ClusterUnavailable, KubeDeployments, load_configuration

    try:
        configuration, source = await load_configuration(rt.settings.kubeconfig)
    except ClusterUnavailable as exc:
        component.switch_off(str(exc))
        return None
    kube = KubeDeployments(
        configuration, namespace=namespace, timeout=rt.settings.kube_timeout_seconds
    )
    stack.push_async_callback(kube.aclose)
    return kube, source
