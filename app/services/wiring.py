"""Building each component from its decision and its explicit dependencies.

Every `open_*` takes the component's decision (`On(config)` or `Off(reason)`, made once in
`app/services/components.py`; nothing here reads the settings) and what the component
needs from the others, by name, and returns the component, or None when it is off or
cannot start; only a fact of the start (no cluster, no registry) switches an `On`
component off here, with its reason. It registers the closing of what it opened on the
`AsyncExitStack` it is given, and imports its clients only once the component is on, so a
switched-off component costs no memory. Nothing here reads or writes the runtime:
`runtime.start_runtime` calls these in the order their inputs require and keeps what they
return.
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
from app.metrics import Metrics
from app.services.alerting import Alerter
from app.services.components import (
    BackendConfig,
    BackendSourceConfig,
    ClusterConfig,
    Decision,
    MatrixConfig,
    ProfileConfig,
    RegistryConfig,
    SelfUpdateConfig,
    SyncConfig,
    UptimeConfig,
    UptimeRecordConfig,
    WorkerPlan,
    choose_ledger,
    worker_reason,
)
from app.services.workloads import WorkloadBook

if TYPE_CHECKING:
    from app.adapters.backend import BackendClient
    from app.adapters.bus import JetStreamBus
    from app.adapters.kube import KubeDeployments
    from app.adapters.matrix import MatrixRoom
    from app.adapters.nats_auth import NatsAuth
    from app.adapters.registry import AsyncpgRegistry
    from app.adapters.signing import NodeSigner
    from app.domain.nats_servers import NatsServers
    from app.domain.uptime import UptimeRecord
    from app.services.heartbeating import Heartbeat
    from app.services.profile import LocalProfile
    from app.services.syncing import Syncer
    from app.services.updating import SelfUpdater
    from app.services.uptime import UptimeKeeper, UptimeRecorder
    from app.services.working import Worker

log = logging.getLogger(__name__)


def open_backend(
    config: BackendConfig | None, signer: NodeSigner | None, stack: AsyncExitStack
) -> BackendClient | None:
    """The signed backend client, when an endpoint and a key are configured."""
    if config is None or signer is None:
        return None
    from app.adapters.backend import BackendClient

    backend = BackendClient(
        base_url=config.base_url,
        signer=signer,
        timeout=config.timeout,
        attempts=config.attempts,
        max_wait=config.max_wait,
        deadline=config.deadline,
        max_response_bytes=config.max_response_bytes,
    )
    stack.push_async_callback(backend.aclose)
    return backend


def open_matrix_room(decision: Decision[MatrixConfig], stack: AsyncExitStack) -> MatrixRoom | None:
    if not decision.enabled:
        return None
    from app.adapters.matrix import MatrixRoom

    config = decision.config
    room = MatrixRoom(
        homeserver=config.homeserver,
        room_id=config.room_id,
        token=config.token.get_secret_value(),
        timeout=config.timeout,
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
    config: ClusterConfig, users: list[Component], stack: AsyncExitStack
) -> Cluster | None:
    """The Kubernetes client that every component on the cluster shares (the sync, the
    self-update, uptime management, the fingerprint's cluster version), closed with the
    lifespan. None when no user is on, or (each user switched off with the reason) when
    there is no cluster to talk to."""
    if not any(c.enabled for c in users):
        return None
    from app.adapters.kube import ClusterUnavailable, KubeDeployments, load_configuration

    try:
        configuration, source = await load_configuration(config.kubeconfig)
    except ClusterUnavailable as exc:
        for component in users:
            if component.enabled:
                component.switch_off(str(exc))
        return None
    kube = KubeDeployments(configuration, namespace=config.namespace, timeout=config.timeout)
    stack.push_async_callback(kube.aclose)
    return Cluster(kube, source)


async def open_syncer(
    decision: Decision[SyncConfig],
    component: Component,
    *,
    backend: BackendClient | None,
    cluster: Cluster | None,
    book: WorkloadBook,
    metrics: Metrics,
    cluster_lock: asyncio.Lock,
) -> Syncer | None:
    """The deployment syncer on the shared `cluster` (None: off, or no cluster, its
    reason recorded by `open_cluster`)."""
    if not decision.enabled or cluster is None:
        return None
    from app.adapters.desired_files import DesiredFiles
    from app.domain.manifests import Injection
    from app.domain.tokens import ping_token
    from app.services.syncing import BackendSource, DesiredSource, FolderSource, Syncer

    config = decision.config
    source: DesiredSource
    if isinstance(config.source, BackendSourceConfig):
        # decided together: a backend source is planned only with a backend to sign for
        assert backend is not None
        source = BackendSource(backend, config.source.endpoint, max_workloads=config.max_workloads)
    else:
        source = FolderSource(
            DesiredFiles(config.source.directory), max_workloads=config.max_workloads
        )
    secret = config.ping_token_secret

    def injection_for(name: str) -> Injection:
        token = ping_token(secret.get_secret_value(), name) if secret else None
        return Injection(manager_url=config.manager_url, ping_token=token)

    component.reason = redact_text(
        f"{source.description} -> namespace {config.namespace} via {cluster.source}"
    )
    return Syncer(
        source=source,
        kube=cluster.client,
        book=book,
        policy=config.policy,
        manifest_policy=config.manifest_policy,
        injection_for=injection_for,
        concurrency=config.concurrency,
        metrics=metrics,
        cluster_lock=cluster_lock,
        deadline=config.deadline,
    )


def local_profile(
    config: ProfileConfig, node_id: str, cluster_version: Callable[[], Awaitable[str]] | None
) -> LocalProfile:
    """The node's own profile, which the registry stores and jobs are matched against: its
    settings and its hardware fingerprint (and the cluster's version, when there is one)."""
    from app.services.profile import LocalProfile

    return LocalProfile(
        node_id=node_id, tier=config.tier,
        region=config.region, trust_zone=config.trust_zone,
        capabilities=list(config.capabilities),
        # the data directory's disk, else the working directory's (decided once, here)
        fingerprint=_fingerprint(
            config.data_dir if config.data_dir.exists() else Path.cwd(), cluster_version
        ),
    )  # fmt: skip


def _fingerprint(
    disk: Path, cluster_version: Callable[[], Awaitable[str]] | None
) -> Callable[[], Awaitable[dict[str, Any]]]:
    """The node's hardware fingerprint (and the cluster's version, when there is one).

    The cluster's client is imported only when there is a cluster: kubernetes-asyncio
    costs some 37 MiB of RSS (44 without NATS, whose client imports aiohttp too), which
    a node without sync would pay for one exception class (bench/memory.py)."""
    from app.adapters import system

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
    decision: Decision[RegistryConfig],
    component: Component,
    stack: AsyncExitStack,
    *,
    database_url: str | None,
    profile: LocalProfile | None,
    metrics: Metrics,
    on_registered: Callable[[], None],
) -> Heartbeat | None:
    """The registry pool, pending migrations (development), and the heartbeat, which calls
    `on_registered` each time the registry has this instance's row.

    The registry's own shutdown steps (`draining`, then `offline`) belong to the runtime,
    which orders them around the other steps."""
    if not decision.enabled:
        return None
    if database_url is None:
        component.switch_off("PostgreSQL is not running (see the postgres component)")
        return None
    assert profile is not None  # the root makes it whenever the registry or the worker is on
    from app.adapters.registry import AsyncpgRegistry
    from app.domain.migrations import MigrationError
    from app.services import migrating
    from app.services.heartbeating import Heartbeat

    config = decision.config
    registry = AsyncpgRegistry(
        database_url, timeout=config.timeout, max_connections=config.pool_size
    )
    await registry.open()
    stack.push_async_callback(registry.close)
    prepare = None
    if config.migrate_on_start:
        directory = migrating.migrations_dir(config.migrations_dir)

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
        profile=profile,
        interval_seconds=config.heartbeat_interval,
        metrics=metrics,
        retry_max_wait=min(5.0, config.heartbeat_interval / 4),
        prepare=prepare,
        on_registered=on_registered,
    )


async def open_worker(
    decision: Decision[WorkerPlan],
    component: Component,
    stack: AsyncExitStack,
    *,
    nats_url: NatsServers | None,
    auth: NatsAuth,
    registry: AsyncpgRegistry | None,
    registered: Callable[[], Awaitable[object]],
    node_id: str,
    profile: LocalProfile | None,
    metrics: Metrics,
    alerts: Alerter,
    report: Callable[[Outcome], None],
    connection: Callable[[Outcome], None] | None = None,
) -> tuple[Worker, JetStreamBus] | None:
    """The job worker and its bus, not yet running: the runtime starts `worker.run` as a
    supervised task (it connects inside it, so a NATS outage at start delays the worker,
    never the manager) and drains it on shutdown.

    The idempotency ledger is where `choose_ledger` says: PostgreSQL's when the registry
    runs (JOB_LEDGER=auto or postgres), else the tier's JetStream bucket's. On PostgreSQL's
    ledger the worker waits for `registered` (the registry holds this instance's row, and
    the ledger's schema exists) before it takes a job. Without a registry the node matches
    jobs against its own profile and cannot tell whether another node could run a job.

    Every change of the bus's connection is reported as it happens, on the worker
    (`report`) and on NATS's own record (`connection`): unavailable while it cannot
    connect or has lost the server, naming it and the error; ok once connected."""
    if not decision.enabled:
        return None
    if nats_url is None:
        component.switch_off("nats-server is not running (see the nats component)")
        return None
    assert profile is not None  # the root makes it whenever the registry or the worker is on
    plan = decision.config
    home = choose_ledger(plan, registry_running=registry is not None)
    if not isinstance(home, str):
        component.switch_off(home.reason)
        return None
    from app.adapters.bus import BusError, JetStreamBus, inbox_prefix
    from app.adapters.kv_ledger import JetStreamLedger
    from app.adapters.kv_ledger import bucket as ledger_bucket
    from app.adapters.registry import AsyncpgLedger
    from app.adapters.workload_http import WorkloadHttp
    from app.services.handlers import JobHandlers, load_handlers
    from app.services.streams import consumer_specs, init_streams
    from app.services.working import Ledger, Worker, request_timeout

    tier = plan.worker.tier
    try:
        inbox = inbox_prefix(tier, node_id)  # the only inboxes the tier's NATS user may read
    except ValueError as exc:
        component.switch_off(str(exc))
        return None

    prepared = False  # the worker is ok once prepared, and again after each reconnect

    def connection_changed(why: str | None) -> None:
        if why is None:
            outcome = Outcome.ok(connected=True)
        else:
            outcome = Outcome.unavailable(why, connected=False)
        if why is not None or prepared:
            report(outcome)
        if connection is not None:
            connection(outcome)

    bus = JetStreamBus(
        nats_url, name=f"workload-manager/{node_id}", timeout=plan.timeout,
        auth=auth, inbox_prefix=inbox, on_change=connection_changed,
    )  # fmt: skip
    http = WorkloadHttp(timeout=plan.http_timeout, allowed_targets=plan.http_allowed_targets)
    stack.push_async_callback(http.aclose)

    async def prepare() -> None:
        """Connect, make sure the topology exists, and, for PostgreSQL's ledger, wait for
        the node's registration (the ledger's schema exists by then). A subject NATS
        denies this node's credentials ends in NatsRefused naming it (the supervisor
        retries with backoff)."""
        if not bus.connected:
            await bus.connect()
        try:
            if plan.auto_init_streams:
                changes = await init_streams(bus, plan.topology)
            else:
                changes = []
                for consumer in consumer_specs(plan.topology, (tier,)):
                    changes.append((consumer.durable, await bus.ensure_consumer(consumer)))
        except BusError as exc:
            raise bus.explain(exc) from exc
        component.detail["topology"] = dict(changes)
        if kv_ledger is not None:  # made by init_streams (above, or by the operator)
            kv_ledger.bind(await bus.key_value(kv_ledger.bucket))
        if home == "postgres":
            # a JetStream ledger needs no PostgreSQL, and waits for none
            await registered()
        nonlocal prepared
        prepared = True
        report(Outcome.ok(connected=True))

    claimant = uuid.uuid4().hex
    ledger: Ledger
    kv_ledger: JetStreamLedger | None = None
    if home == "postgres":
        assert registry is not None  # choose_ledger: PostgreSQL's only with a registry
        ledger = AsyncpgLedger(registry, node_id=node_id, claimant=claimant)
        component.detail["ledger"] = "postgres"
    else:
        # a lease (2 x ack wait) holds several tries of renewing it: else a failover of
        # the bucket's leader outlasts the lease and another node runs the job again
        ledger = kv_ledger = JetStreamLedger(
            tier=tier, node_id=node_id, claimant=claimant,
            timeout=min(plan.timeout, request_timeout(plan.worker.ack_wait)),
        )  # fmt: skip
        component.detail["ledger"] = f"jetstream bucket {ledger_bucket(tier)}"
    component.reason = worker_reason(plan, home)

    worker = Worker(
        bus=bus,
        ledger=ledger,
        node=profile,
        registry=registry,
        handlers=JobHandlers(load_handlers(), http),
        config=plan.worker,
        metrics=metrics,
        report=report,
        alerts=alerts,
        prepare=prepare,
    )
    metrics.jobs_in_flight.set_function(lambda: worker.in_flight)
    return worker, bus


def open_uptime_keeper(
    decision: Decision[UptimeConfig],
    component: Component,
    *,
    cluster: Cluster | None,
    syncer: Syncer | None,
    book: WorkloadBook,
    alerts: Alerter,
    metrics: Metrics,
    cluster_lock: asyncio.Lock,
    record: UptimeRecord | None,
) -> UptimeKeeper | None:
    """Uptime management on the shared `cluster` client, with the sync's access (its
    role may patch the managed Deployments): off when the sync did not start. Its restarts
    are kept in the uptime `record`."""
    if not decision.enabled:
        return None
    if cluster is None or syncer is None:
        component.switch_off("needs the sync's cluster access, and the sync did not start")
        return None
    from app.adapters.kube import KubeError
    from app.services.uptime import UptimeKeeper

    return UptimeKeeper(
        book=book, kube=cluster.client, errors=(KubeError,), cluster_lock=cluster_lock,
        alerts=alerts, metrics=metrics, policy=decision.config.policy, record=record,
    )  # fmt: skip


UPTIME_CONFIG_MAP = "workload-manager-uptime"


async def open_uptime_recorder(
    config: UptimeRecordConfig, component: Component, *, cluster: Cluster | None, every: float
) -> UptimeRecorder:
    """Each workload's share of time healthy, kept in the ConfigMap
    `workload-manager-uptime` of the manager's own namespace when it runs in a cluster
    (it outlives the pod, a self-update included; on the shared client), else in
    DATA_DIR/uptime.json. What reading it found is recorded on `component`."""
    from app.services.uptime import FileStore, UptimeRecorder, UptimeStore

    path = config.file
    store: UptimeStore = FileStore(path)
    where, errors = f"file {path}", cast(tuple[type[Exception], ...], ())
    namespace = config.config_map_namespace
    if cluster is not None and namespace is not None:
        from app.adapters.kube import KubeError
        from app.services.uptime import ConfigMapStore

        own = cluster.client.in_namespace(namespace)
        store, errors = ConfigMapStore(own, UPTIME_CONFIG_MAP), (KubeError,)
        where = f"ConfigMap {namespace}/{UPTIME_CONFIG_MAP}"
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
    decision: Decision[SelfUpdateConfig],
    stack: AsyncExitStack,
    *,
    cluster: Cluster | None,
    metrics: Metrics,
    alerts: Alerter,
    cluster_lock: asyncio.Lock,
) -> SelfUpdater | None:
    """The self-updater on the shared `cluster` client, in the manager's own namespace."""
    if not decision.enabled or cluster is None:
        return None
    from app.adapters.versions import VersionFile
    from app.services.updating import SelfUpdater

    config = decision.config
    source = VersionFile(
        config.url,
        timeout=config.timeout,
        s3_endpoint=config.s3_endpoint,
        public_key=config.public_key,
        signature_url=config.signature_url,
    )
    stack.push_async_callback(source.aclose)
    return SelfUpdater(
        source=source,
        kube=cluster.client.in_namespace(config.namespace),
        deployment=config.deployment,
        container=config.container,
        policy=config.policy,
        deadline=config.deadline,
        poll_interval=config.poll_interval,
        metrics=metrics,
        cluster_lock=cluster_lock,
        alerts=alerts,
    )
