"""Building each component from its own dependencies and its slice of the settings.

Every `open_*` takes what the component needs, by name, and returns the component (or
None, with the reason written on its `Component`, when it is off or cannot start). It
registers the closing of what it opened on the `AsyncExitStack` it is given, and imports
its clients only once it knows the component is on, so a switched-off component costs no
memory. Nothing here reads or writes the runtime: `runtime.start_runtime` calls these in
the order their inputs require and keeps what they return.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from app.domain.components import Component, Outcome
from app.domain.redaction import redact_text
from app.domain.requirements import NodeProfile
from app.metrics import Metrics
from app.services.alerting import Alerter
from app.services.workloads import WorkloadBook
from app.settings import Settings

if TYPE_CHECKING:
    from app.adapters.backend import BackendClient
    from app.adapters.bus import JetStreamBus, NatsAuth
    from app.adapters.kube import KubeDeployments
    from app.adapters.matrix import MatrixRoom
    from app.adapters.signing import NodeSigner
    from app.domain.uptime import UptimeRecord
    from app.services.heartbeating import Heartbeat, LocalProfile
    from app.services.syncing import Syncer
    from app.services.updating import SelfUpdater
    from app.services.uptime import UptimeKeeper, UptimeRecorder
    from app.services.working import Worker

log = logging.getLogger(__name__)


def open_backend(
    settings: Settings, signer: NodeSigner | None, stack: AsyncExitStack
) -> BackendClient | None:
    """The signed backend client, when an endpoint and a key are configured."""
    if settings.node_system_endpoint is None or signer is None:
        return None
    from app.adapters.backend import BackendClient

    backend = BackendClient(
        base_url=settings.node_system_endpoint,
        signer=signer,
        timeout=settings.backend_timeout_seconds,
        attempts=settings.backend_retry_attempts,
        max_wait=settings.backend_retry_max_wait_seconds,
        deadline=settings.backend_deadline_seconds,
        max_response_bytes=settings.backend_max_response_bytes,
    )
    stack.push_async_callback(backend.aclose)
    return backend


def open_matrix_room(
    settings: Settings, component: Component, stack: AsyncExitStack
) -> MatrixRoom | None:
    if not component.enabled:
        return None
    from app.adapters.matrix import MatrixRoom

    assert settings.matrix_homeserver and settings.matrix_room_id and settings.matrix_access_token
    room = MatrixRoom(
        homeserver=settings.matrix_homeserver,
        room_id=settings.matrix_room_id,
        token=settings.matrix_access_token.get_secret_value(),
        timeout=settings.backend_timeout_seconds,
    )
    stack.push_async_callback(room.aclose)
    return room


@dataclass(frozen=True)
class Cluster:
    """The one Kubernetes client of the process (in the managed namespace; `in_namespace`
    gives it for another on the same pool), and where its configuration came from."""

    client: KubeDeployments
    source: str


async def open_cluster(
    settings: Settings, users: list[Component], stack: AsyncExitStack
) -> Cluster | None:
    """The Kubernetes client that every component on the cluster shares (the sync, the
    self-update, uptime management, the fingerprint's cluster version), closed with the
    lifespan. None when no user is on, or (each user switched off with the reason) when
    there is no cluster to talk to."""
    if not any(c.enabled for c in users):
        return None
    from app.adapters.kube import ClusterUnavailable, KubeDeployments, load_configuration

    try:
        configuration, source = await load_configuration(settings.kubeconfig)
    except ClusterUnavailable as exc:
        for component in users:
            if component.enabled:
                component.switch_off(str(exc))
        return None
    kube = KubeDeployments(
        configuration, namespace=settings.managed_namespace, timeout=settings.kube_timeout_seconds
    )
    stack.push_async_callback(kube.aclose)
    return Cluster(kube, source)


async def open_syncer(
    settings: Settings,
    component: Component,
    stack: AsyncExitStack,
    *,
    backend: BackendClient | None,
    cluster: Cluster | None,
    book: WorkloadBook,
    metrics: Metrics,
    cluster_lock: asyncio.Lock,
) -> Syncer | None:
    """The deployment syncer on the shared `cluster`, or None with the reason recorded on
    the sync component."""
    if not component.enabled or cluster is None:
        return None
    from app.adapters.desired_files import DesiredFiles
    from app.domain.manifests import Injection, ManifestPolicy
    from app.domain.planning import SyncPolicy
    from app.domain.pod_security import Level
    from app.domain.tokens import ping_token
    from app.services.syncing import BackendSource, DesiredSource, FolderSource, Syncer

    source: DesiredSource
    if backend is not None and settings.node_system_endpoint is not None:
        source = BackendSource(
            backend, settings.node_system_endpoint, max_workloads=settings.max_desired_workloads
        )
    elif settings.desired_state_dir is not None:
        source = FolderSource(
            DesiredFiles(settings.desired_state_dir), max_workloads=settings.max_desired_workloads
        )
    else:  # decided in decide_components: an enabled sync has one of the two
        raise AssertionError("sync enabled without a desired-state source")
    protected = (
        frozenset({settings.self_deployment_name})
        if settings.pod_namespace in (None, settings.managed_namespace)
        else frozenset()
    )
    secret = settings.ping_token_secret

    def injection_for(name: str) -> Injection:
        token = ping_token(secret.get_secret_value(), name) if secret else None
        return Injection(manager_url=settings.manager_url, ping_token=token)

    syncer = Syncer(
        source=source,
        kube=cluster.client,
        book=book,
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
            level=Level(settings.manifest_policy),
            max_replicas=settings.manifest_max_replicas,
            max_bytes=settings.manifest_max_bytes,
        ),
        injection_for=injection_for,
        concurrency=settings.sync_concurrency,
        metrics=metrics,
        cluster_lock=cluster_lock,
        deadline=settings.sync_deadline_seconds,
    )
    component.reason = redact_text(
        f"{source.description} -> namespace {settings.managed_namespace} via {cluster.source}"
    )
    return syncer


def nats_auth(settings: Settings) -> NatsAuth:
    """The NATS credentials the settings name (files only: the secrets stay in them)."""
    from app.adapters.bus import NatsAuth

    return NatsAuth(
        creds_file=settings.nats_creds_file, nkey_seed_file=settings.nats_nkey_seed_file,
        tls_ca_file=settings.nats_tls_ca_file, tls_cert_file=settings.nats_tls_cert_file,
        tls_key_file=settings.nats_tls_key_file,
    )  # fmt: skip


def _local_profile(
    settings: Settings, node_id: str, cluster_version: Callable[[], Awaitable[str]] | None
) -> LocalProfile:
    """The node's own profile: its settings and its hardware fingerprint (and the
    cluster's version, when there is one)."""
    from app.services.heartbeating import LocalProfile

    return LocalProfile(
        node_id=node_id, tier=settings.tier,
        region=settings.node_region, trust_zone=settings.node_trust_zone,
        capabilities=settings.node_capabilities,
        fingerprint=_fingerprint(settings, cluster_version),
    )  # fmt: skip


def _fingerprint(
    settings: Settings, cluster_version: Callable[[], Awaitable[str]] | None
) -> Callable[[], Awaitable[dict[str, Any]]]:
    """The node's hardware fingerprint (and the cluster's version, when there is one).

    The cluster's client is imported only when there is a cluster: kubernetes-asyncio
    costs some 37 MiB of RSS (44 without NATS, whose client imports aiohttp too), which
    a node without sync would pay for one exception class (bench/memory.py)."""
    from app.adapters import system

    disk = settings.data_dir if settings.data_dir.exists() else Path.cwd()

    async def fingerprint() -> dict[str, Any]:
        hardware = await asyncio.to_thread(system.fingerprint, disk)
        if cluster_version is not None:
            from app.adapters.kube import KubeError  # imported already: the cluster is on

            try:
                hardware["k3s_version"] = await cluster_version()
            except KubeError as exc:
                log.info("K3S version not in the fingerprint this time: %s", exc)
        return hardware

    return fingerprint


async def open_registry(
    settings: Settings,
    component: Component,
    stack: AsyncExitStack,
    *,
    database_url: str | None,
    node_id: str,
    metrics: Metrics,
    cluster_version: Callable[[], Awaitable[str]] | None,
) -> Heartbeat | None:
    """The registry pool, pending migrations (development), and the heartbeat.

    The registry's own shutdown steps (`draining`, then `offline`) belong to the runtime,
    which orders them around the other steps."""
    if not component.enabled or database_url is None:
        return None
    from app.adapters.registry import AsyncpgRegistry
    from app.domain.migrations import MigrationError
    from app.services import migrating
    from app.services.heartbeating import Heartbeat

    registry = AsyncpgRegistry(
        database_url,
        timeout=settings.database_timeout_seconds,
        max_connections=settings.database_pool_size,
    )
    await registry.open()
    stack.push_async_callback(registry.close)
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

    return Heartbeat(
        registry=registry,
        profile=_local_profile(settings, node_id, cluster_version),
        interval_seconds=settings.heartbeat_interval_seconds,
        metrics=metrics,
        retry_max_wait=min(5.0, settings.heartbeat_interval_seconds / 4),
        prepare=prepare,
    )


async def open_worker(
    settings: Settings,
    component: Component,
    stack: AsyncExitStack,
    *,
    nats_url: str | None,
    heartbeat: Heartbeat | None,
    node_id: str,
    metrics: Metrics,
    alerts: Alerter,
    report: Callable[[Outcome], None],
    cluster_version: Callable[[], Awaitable[str]] | None = None,
) -> tuple[Worker, JetStreamBus] | None:
    """The job worker and its bus, not yet running: the runtime starts `worker.run` as a
    supervised task (it connects inside it, so a NATS outage at start delays the worker,
    never the manager) and drains it on shutdown.

    The idempotency ledger is PostgreSQL's when the registry runs (JOB_LEDGER=auto or
    postgres), else the tier's JetStream bucket's; without a registry the node matches jobs
    against its own profile and cannot tell whether another node could run a job."""
    if not component.enabled or nats_url is None:
        return None
    on_postgres = heartbeat is not None and settings.job_ledger != "jetstream"
    if settings.job_ledger == "postgres" and heartbeat is None:
        component.switch_off("JOB_LEDGER=postgres but the registry is not running")
        return None
    from app.adapters.bus import BusError, JetStreamBus, inbox_prefix
    from app.adapters.kv_ledger import JetStreamLedger
    from app.adapters.kv_ledger import bucket as ledger_bucket
    from app.adapters.registry import AsyncpgLedger
    from app.adapters.workload_http import WorkloadHttp
    from app.services.handlers import load_handlers
    from app.services.streams import consumer_specs, init_streams
    from app.services.working import Ledger, Worker, WorkerConfig, request_timeout

    tier = settings.tier.value
    try:
        inbox = inbox_prefix(tier, node_id)  # the only inboxes the tier's NATS user may read
    except ValueError as exc:
        component.switch_off(str(exc))
        return None
    bus = JetStreamBus(
        nats_url, name=f"workload-manager/{node_id}", timeout=settings.backend_timeout_seconds,
        auth=nats_auth(settings), inbox_prefix=inbox,
    )  # fmt: skip
    http = WorkloadHttp(
        timeout=settings.http_job_timeout_seconds,
        allowed_targets=settings.http_job_allowed_targets or [settings.managed_namespace],
    )
    stack.push_async_callback(http.aclose)

    async def prepare() -> None:
        """Connect, make sure the topology exists, and, for PostgreSQL's ledger, wait for
        the node's registration (the ledger's schema exists by then). A subject NATS
        denies this node's credentials ends in NatsRefused naming it (the supervisor
        retries with backoff)."""
        if not bus.connected:
            await bus.connect()
        try:
            if settings.auto_init_streams:
                changes = await init_streams(bus, settings)
            else:
                changes = []
                for consumer in consumer_specs(settings, (tier,)):
                    changes.append((consumer.durable, await bus.ensure_consumer(consumer)))
        except BusError as exc:
            raise bus.explain(exc) from exc
        component.detail["topology"] = dict(changes)
        if kv_ledger is not None:  # made by init_streams (above, or by the operator)
            kv_ledger.bind(await bus.key_value(kv_ledger.bucket))

        if on_postgres:
            # the ledger's schema exists once the node is registered (migrations first);
            # a JetStream ledger needs no PostgreSQL, and waits for none
            assert heartbeat is not None
            await heartbeat.registered.wait()
        report(Outcome.ok(connected=True))

    claimant = uuid.uuid4().hex
    ledger: Ledger
    kv_ledger: JetStreamLedger | None = None
    if on_postgres:
        assert heartbeat is not None
        ledger = AsyncpgLedger(heartbeat.registry, node_id=node_id, claimant=claimant)
    else:
        # a lease (2 x ack wait) holds several tries of renewing it: else a failover of
        # the bucket's leader outlasts the lease and another node runs the job again
        ledger = kv_ledger = JetStreamLedger(
            tier=tier, node_id=node_id, claimant=claimant,
            timeout=min(
                settings.backend_timeout_seconds, request_timeout(settings.job_ack_wait_seconds)
            ),
        )  # fmt: skip
    component.detail["ledger"] = (
        "postgres" if on_postgres else f"jetstream bucket {ledger_bucket(tier)}"
    )
    if heartbeat is not None:
        profile: Callable[[], Awaitable[NodeProfile]] = heartbeat.profile
    else:
        profile = _local_profile(settings, node_id, cluster_version)

    worker = Worker(
        bus=bus,
        ledger=ledger,
        registry=heartbeat.registry if heartbeat is not None else None,
        node=profile,
        handlers=load_handlers(),
        http=http,
        config=WorkerConfig(
            tier=tier,
            concurrency=settings.worker_concurrency,
            batch=settings.job_fetch_batch,
            ack_wait=settings.job_ack_wait_seconds,
            max_attempts=settings.job_max_attempts,
            max_deliveries=settings.job_max_deliveries,
            backoff=tuple(settings.job_backoff_seconds),
            not_here_delay=settings.job_not_here_delay_seconds,
            held_delay=settings.job_held_delay_seconds,
            job_timeout=settings.job_timeout_seconds,
        ),
        metrics=metrics,
        report=report,
        alerts=alerts,
        prepare=prepare,
    )
    metrics.jobs_in_flight.set_function(lambda: worker.in_flight)
    return worker, bus


def open_uptime_keeper(
    settings: Settings,
    component: Component,
    *,
    cluster: Cluster | None,
    sync_running: bool,
    book: WorkloadBook,
    alerts: Alerter,
    metrics: Metrics,
    cluster_lock: asyncio.Lock,
    record: UptimeRecord | None,
) -> UptimeKeeper | None:
    """Uptime management on the shared `cluster` client, with the sync's access (its
    role may patch the managed Deployments): off when the sync does not run. Its restarts
    are kept in the uptime `record`."""
    if not component.enabled:
        return None
    if cluster is None or not sync_running:
        component.switch_off("needs the sync's cluster access, and the sync is off")
        return None
    from app.adapters.kube import KubeError
    from app.domain.uptime import RestartPolicy
    from app.services.uptime import UptimeKeeper

    policy = RestartPolicy(
        after_seconds=settings.uptime_restart_after_seconds,
        backoff_seconds=settings.uptime_restart_backoff_seconds,
        backoff_max_seconds=settings.uptime_restart_backoff_max_seconds,
        per_workload_per_hour=settings.uptime_restarts_per_workload_per_hour,
        per_node_per_hour=settings.uptime_restarts_per_node_per_hour,
    )
    return UptimeKeeper(
        book=book, kube=cluster.client, errors=(KubeError,), cluster_lock=cluster_lock,
        alerts=alerts, metrics=metrics, policy=policy, record=record,
    )  # fmt: skip


UPTIME_CONFIG_MAP = "workload-manager-uptime"


async def open_uptime_recorder(
    settings: Settings, component: Component, *, cluster: Cluster | None, every: float
) -> UptimeRecorder:
    """Each workload's share of time healthy, kept in the ConfigMap
    `workload-manager-uptime` of the manager's own namespace when it runs in a cluster
    (it outlives the pod, a self-update included; on the shared client), else in
    DATA_DIR/uptime.json. What reading it found is recorded on `component`."""
    from app.services.uptime import FileStore, UptimeRecorder, UptimeStore

    path = settings.data_dir / "uptime.json"
    store: UptimeStore = FileStore(path)
    where, errors = f"file {path}", cast(tuple[type[Exception], ...], ())
    if cluster is not None and settings.pod_namespace is not None:
        from app.adapters.kube import KubeError
        from app.services.uptime import ConfigMapStore

        own = cluster.client.in_namespace(settings.pod_namespace)
        store, errors = ConfigMapStore(own, UPTIME_CONFIG_MAP), (KubeError,)
        where = f"ConfigMap {settings.pod_namespace}/{UPTIME_CONFIG_MAP}"
    recorder = UptimeRecorder(store=store, where=where, errors=errors, max_step=3 * every)
    component.record(datetime.now(UTC), await recorder.open())
    return recorder


def consumer_stats(bus: JetStreamBus, metrics: Metrics, tier: str) -> Callable[[], Awaitable[None]]:
    from app.adapters.bus import BusError
    from app.domain.jobs import STREAMS, consumer_name

    async def collect() -> None:
        if not bus.connected:
            return
        for stream in STREAMS.values():
            try:
                state = await bus.consumer_state(stream, consumer_name(tier))
            except BusError as exc:  # a leader election, a reconnect: the next tick sees it
                log.warning("consumer state of %s not read: %s", stream, exc or type(exc).__name__)
                return
            metrics.consumer_pending.labels(stream).set(state["pending"])
            metrics.consumer_ack_pending.labels(stream).set(state["ack_pending"])

    return collect


async def open_self_updater(
    settings: Settings,
    component: Component,
    stack: AsyncExitStack,
    *,
    cluster: Cluster | None,
    metrics: Metrics,
    alerts: Alerter,
    cluster_lock: asyncio.Lock,
) -> SelfUpdater | None:
    """The self-updater on the shared `cluster` client, in the manager's own namespace."""
    if not component.enabled or cluster is None:
        return None
    assert settings.self_update_url is not None  # decided in decide_components
    from app.adapters.versions import VersionFile
    from app.domain.updates import UpdatePolicy
    from app.services.updating import SelfUpdater

    assert settings.pod_namespace is not None  # decided in decide_components
    kube = cluster.client.in_namespace(settings.pod_namespace)
    source = VersionFile(
        settings.self_update_url,
        timeout=settings.self_update_timeout_seconds,
        s3_endpoint=settings.self_update_s3_endpoint,
        public_key=settings.self_update_public_key,
        signature_url=settings.self_update_signature_url,
    )
    stack.push_async_callback(source.aclose)
    return SelfUpdater(
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
        metrics=metrics,
        cluster_lock=cluster_lock,
        alerts=alerts,
    )
