"""The components of the manager, each decided once from the settings.

`decide(settings, can_sign=...)` is the one place that reads the settings' switches: each
component is `On(config, reason)`, its config holding everything its opener in
`app/services/wiring.py` needs (the openers read no settings), or `Off(reason)`. The
composition root (`app/services/runtime.py`) opens what is on, in the order their inputs
require; `/v1/status` shows each one's reason. Table-tested in
tests/services/test_components.py.

What only the start can tell (a cluster that does not answer, an embedded server that does
not start, a registry that is not running) switches an `On` component off later, with its
reason, through `Component.switch_off`; that is the only decision left to the openers, and
the worker's ledger the only one with a fallback (`choose_ledger`, table-tested too).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from pydantic import SecretStr

from app.adapters.nats_auth import NatsAuth
from app.domain.components import Component, ComponentState
from app.domain.http_targets import AllowedTargets
from app.domain.nats_servers import NatsServers
from app.domain.redaction import redact_url
from app.domain.requirements import Tier
from app.domain.uptime import SAVE_EVERY_SECONDS
from app.settings import PLAIN_HTTP_RISKS, Settings

if TYPE_CHECKING:
    from app.domain.job_flow import WorkerConfig
    from app.domain.manifests import ManifestPolicy
    from app.domain.planning import SyncPolicy
    from app.domain.topology import Topology
    from app.domain.updates import UpdatePolicy, VersionFileKey
    from app.domain.uptime import RestartPolicy

C = TypeVar("C")
U = TypeVar("U")


@dataclass(frozen=True)
class On(Generic[C]):
    """The component runs, with this config; `reason` says what it will do."""

    config: C
    reason: str
    enabled: Literal[True] = True


@dataclass(frozen=True)
class Off:
    """The component does not run, and why."""

    reason: str
    enabled: Literal[False] = False


Decision = On[C] | Off


# --- the configs: plain data from the settings, one per component ---------------------


@dataclass(frozen=True)
class BackendConfig:
    """The signed client of the node-system backend (the report and the sync share it)."""

    base_url: str
    timeout: float
    attempts: int
    max_wait: float
    deadline: float
    max_response_bytes: int


@dataclass(frozen=True)
class DataServiceConfig(Generic[U]):
    """A data server: the configured URL, or an embedded server in `embedded_dir`."""

    url: U | None
    embedded_dir: Path | None


@dataclass(frozen=True)
class ReportConfig:
    interval: float
    to_backend: bool  # False: the report goes to the log and /v1/status only
    data_dir: Path  # its disk is reported (its parent's until it exists)


@dataclass(frozen=True)
class ClusterConfig:
    """The one Kubernetes client (the sync, the self-update, uptime management)."""

    kubeconfig: Path | None
    namespace: str
    timeout: float


@dataclass(frozen=True)
class FolderSourceConfig:
    directory: Path


@dataclass(frozen=True)
class BackendSourceConfig:
    endpoint: str


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


@dataclass(frozen=True)
class UptimeConfig:
    policy: RestartPolicy


@dataclass(frozen=True)
class UptimeRecordConfig:
    file: Path  # where the record is kept outside a cluster
    config_map_namespace: str | None  # the manager's own namespace, in a cluster


@dataclass(frozen=True)
class ProfileConfig:
    """What the node says of itself (the registry's row, the jobs' matching)."""

    tier: Tier
    region: str | None
    trust_zone: str | None
    capabilities: tuple[str, ...]
    data_dir: Path  # its disk is fingerprinted (the working directory's until it exists)


@dataclass(frozen=True)
class RegistryConfig:
    timeout: float
    pool_size: int
    migrations_dir: Path | None  # None: no migrations at start (production's init container)
    migrate_on_start: bool
    heartbeat_interval: float


LedgerHome = Literal["postgres", "jetstream"]


@dataclass(frozen=True)
class WorkerPlan:
    worker: WorkerConfig
    ledger: LedgerHome
    # JOB_LEDGER=auto: PostgreSQL's ledger when the registry runs, the JetStream bucket's
    # when it turns out not to (an embedded PostgreSQL that did not start)
    ledger_fallback: bool
    topology: Topology
    auto_init_streams: bool
    timeout: float
    http_timeout: float
    http_allowed_targets: AllowedTargets


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
    poll_interval: float
    interval: float


@dataclass(frozen=True)
class MatrixConfig:
    homeserver: str
    room_id: str
    token: SecretStr
    timeout: float


# What `/readyz` needs besides the API and the scheduler, when the settings turn it on:
# the node's own connections (PostgreSQL and the registry in it, NATS and the job worker on
# it). Not what depends on the backend (report, sync) or on a homeserver (alerts): their
# outage is not the node's, and failing readiness for it would roll back every node's new
# release at once.
READINESS = frozenset({"postgres", "registry", "nats", "worker"})


@dataclass(frozen=True)
class Plan:
    """Every component, decided; `components()` gives the records `/v1/status` shows."""

    report: Decision[ReportConfig]
    postgres: Decision[DataServiceConfig[SecretStr]]
    nats: Decision[DataServiceConfig[NatsServers]]
    sync: Decision[SyncConfig]
    registry: Decision[RegistryConfig]
    worker: Decision[WorkerPlan]
    uptime: Decision[UptimeConfig]
    uptime_record: On[UptimeRecordConfig]
    self_update: Decision[SelfUpdateConfig]
    alerts: Decision[MatrixConfig]
    # shared by components, not components themselves
    backend: BackendConfig | None  # the sync and the report, when it may sign
    cluster: ClusterConfig
    profile: ProfileConfig
    nats_auth: NatsAuth
    watch_every: float  # how often the workload book is looked at (health, uptime)
    down_grace: float  # how long a component fails before its one alert

    def decisions(self) -> dict[str, On[Any] | Off]:
        return {
            "report": self.report, "postgres": self.postgres, "nats": self.nats,
            "sync": self.sync, "registry": self.registry, "worker": self.worker,
            "uptime": self.uptime, "uptime_record": self.uptime_record,
            "self_update": self.self_update, "alerts": self.alerts,
        }  # fmt: skip

    def components(self) -> dict[str, Component]:
        """The status records, the API and the scheduler first (both critical), then every
        component; those of `READINESS` are critical when on."""
        records = {
            "api": Component("api", True, "serving", critical=True, state=ComponentState.OK),
            "scheduler": Component("scheduler", True, "runs the periodic loops", critical=True),
        }
        for name, decision in self.decisions().items():
            critical = decision.enabled and name in READINESS
            records[name] = Component(name, decision.enabled, decision.reason, critical=critical)
        return records


def decide(settings: Settings, *, can_sign: bool) -> Plan:
    """Every component, on with its config or off with why, from the settings alone (and
    whether there is a node key to sign with)."""
    embedded = settings.embedded_services and not settings.is_production
    backend = _backend(settings) if can_sign else None
    database = settings.database_url
    data_dir = settings.data_dir
    sync = _sync(settings, backend)
    registry = _registry(settings, database is not None or embedded)
    return Plan(
        report=_report(settings, can_sign),
        postgres=_data_service(database, embedded, data_dir / "postgres", "DATABASE_URL"),
        nats=_data_service(
            settings.nats_url,
            embedded,
            data_dir / "nats",
            "NATS_URL",
        ),
        sync=sync,
        registry=registry,
        worker=_worker(settings, registry_on=registry.enabled, embedded=embedded),
        uptime=_uptime(settings, sync),
        uptime_record=On(
            UptimeRecordConfig(
                file=data_dir / "uptime.json", config_map_namespace=settings.pod_namespace
            ),
            "counts each workload's share of time healthy (24 h, 7 d), saved every "
            f"{SAVE_EVERY_SECONDS:.0f} s and at shutdown",
        ),
        self_update=_self_update(settings),
        alerts=_alerts(settings),
        backend=backend,
        cluster=ClusterConfig(
            settings.kubeconfig, settings.managed_namespace, settings.kube_timeout_seconds
        ),
        profile=ProfileConfig(
            tier=settings.tier,
            region=settings.node_region,
            trust_zone=settings.node_trust_zone,
            capabilities=tuple(settings.node_capabilities),
            data_dir=data_dir,
        ),
        nats_auth=nats_auth_of(settings),
        watch_every=max(1.0, min(15.0, settings.ping_stale_seconds / 2)),
        down_grace=settings.component_down_grace_seconds,
    )


def nats_auth_of(settings: Settings) -> NatsAuth:
    """The NATS credentials the settings name (files only: the secrets stay in them)."""
    return NatsAuth(
        creds_file=settings.nats_creds_file, nkey_seed_file=settings.nats_nkey_seed_file,
        tls_ca_file=settings.nats_tls_ca_file, tls_cert_file=settings.nats_tls_cert_file,
        tls_key_file=settings.nats_tls_key_file,
    )  # fmt: skip


def choose_ledger(plan: WorkerPlan, *, registry_running: bool) -> LedgerHome | Off:
    """Where the worker keeps its idempotency ledger, once the start has shown whether the
    registry runs: the planned home, the JetStream bucket when JOB_LEDGER=auto planned
    PostgreSQL's and the registry is not running, or off when JOB_LEDGER=postgres."""
    if plan.ledger == "jetstream" or registry_running:
        return plan.ledger
    if plan.ledger_fallback:
        return "jetstream"
    return Off("JOB_LEDGER=postgres but the registry is not running")


def _backend(settings: Settings) -> BackendConfig | None:
    if settings.node_system_endpoint is None:
        return None
    return BackendConfig(
        base_url=settings.node_system_endpoint,
        timeout=settings.backend_timeout_seconds,
        attempts=settings.backend_retry_attempts,
        max_wait=settings.backend_retry_max_wait_seconds,
        deadline=settings.backend_deadline_seconds,
        max_response_bytes=settings.backend_max_response_bytes,
    )


def _report(settings: Settings, can_sign: bool) -> Decision[ReportConfig]:
    if not settings.report_enabled:
        return Off("switched off by REPORT_ENABLED=false")
    endpoint = settings.node_system_endpoint
    config = ReportConfig(settings.report_interval_seconds, endpoint is not None, settings.data_dir)
    if endpoint is None:
        return On(config, "no NODE_SYSTEM_ENDPOINT: reports go to the log and /v1/status")
    if not can_sign:
        return Off(
            "NODE_SYSTEM_ENDPOINT is set but there is no NODE_PRIVATE_KEY, "
            "NODE_PRIVATE_KEY_FILE or ~/.config/lfgnode/config.yaml (NODE_CONFIG_FILE) "
            "to sign with"
        )
    return On(
        config,
        f"signed reports to {redact_url(endpoint)}" + _risk(settings, "NODE_SYSTEM_ENDPOINT"),
    )


def _data_service(
    configured: U | None, embedded: bool, directory: Path, variable: str
) -> Decision[DataServiceConfig[U]]:
    if configured is not None:
        return On(DataServiceConfig(configured, None), f"{variable} is set")
    if embedded:
        return On(DataServiceConfig(None, directory), f"embedded server (no {variable} set)")
    return Off(f"no {variable} set and embedded servers are off")


def _sync(settings: Settings, backend: BackendConfig | None) -> Decision[SyncConfig]:
    if not settings.sync_enabled:
        return Off("switched off by SYNC_ENABLED=false")
    source: BackendSourceConfig | FolderSourceConfig
    if backend is not None:
        source = BackendSourceConfig(backend.base_url)
        reason = f"desired state from {redact_url(backend.base_url)}"
        reason += _risk(settings, "NODE_SYSTEM_ENDPOINT")
    elif settings.desired_state_dir is not None:
        source = FolderSourceConfig(settings.desired_state_dir)
        reason = f"desired state from folder {settings.desired_state_dir}"
    else:
        return Off("no NODE_SYSTEM_ENDPOINT (with a key) and no DESIRED_STATE_DIR to sync from")
    from app.domain.manifests import MANAGER_POD_LABELS, ManifestPolicy
    from app.domain.planning import SyncPolicy
    from app.domain.pod_security import Level

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
            # in the manager's own namespace, its Service would send pods that carry its
            # name the node's pings (with their tokens) and status calls
            reserved_pod_labels=MANAGER_POD_LABELS if own else (),
        ),
        manager_url=settings.manager_url,
        ping_token_secret=settings.ping_token_secret,
        concurrency=settings.sync_concurrency,
        deadline=settings.sync_deadline_seconds,
        interval=settings.sync_interval_seconds,
        refresh_interval=settings.cluster_refresh_seconds,
    )
    return On(config, reason)


def _uptime(settings: Settings, sync: Decision[SyncConfig]) -> Decision[UptimeConfig]:
    if not settings.uptime_restart_enabled:
        return Off("switched off by UPTIME_RESTART_ENABLED=false")
    if not sync.enabled:
        return Off(f"needs the sync's cluster access, and the sync is off ({sync.reason})")
    from app.domain.uptime import RestartPolicy

    policy = RestartPolicy(
        after_seconds=settings.uptime_restart_after_seconds,
        backoff_seconds=settings.uptime_restart_backoff_seconds,
        backoff_max_seconds=settings.uptime_restart_backoff_max_seconds,
        per_workload_per_hour=settings.uptime_restarts_per_workload_per_hour,
        per_node_per_hour=settings.uptime_restarts_per_node_per_hour,
    )
    return On(
        UptimeConfig(policy),
        "rollout-restarts managed workloads unhealthy or stale for longer than "
        f"{settings.uptime_restart_after_seconds:.0f} s",
    )


def _registry(settings: Settings, has_database: bool) -> Decision[RegistryConfig]:
    if not settings.registry_enabled:
        return Off("switched off by REGISTRY_ENABLED=false")
    if not has_database:
        return Off(
            "no DATABASE_URL (or CAPABILITY_REGISTRY) set: capabilities are not registered; "
            "jobs are matched against this node's own profile"
        )
    reason = f"tier {settings.tier.value} in worker_capabilities, heartbeat every "
    reason += f"{settings.heartbeat_interval_seconds:g} s"
    if settings.node_tier is None:
        reason += " (NODE_TIER unset: tier C for development)"
    migrate = settings.migrates_on_start
    config = RegistryConfig(
        timeout=settings.database_timeout_seconds,
        pool_size=settings.database_pool_size,
        migrations_dir=settings.migrations_dir,
        migrate_on_start=migrate,
        heartbeat_interval=settings.heartbeat_interval_seconds,
    )
    return On(config, reason)


def _worker(settings: Settings, *, registry_on: bool, embedded: bool) -> Decision[WorkerPlan]:
    if not settings.worker_enabled:
        return Off("switched off by WORKER_ENABLED=false")
    if settings.nats_url is None and not embedded:
        return Off("no NATS_URL set")
    if settings.job_ledger == "postgres" and not registry_on:
        return Off("JOB_LEDGER=postgres but there is no registry database")
    from app.domain.job_flow import WorkerConfig
    from app.domain.topology import Topology

    tier = settings.tier.value
    ledger: LedgerHome = (
        "postgres" if registry_on and settings.job_ledger != "jetstream" else "jetstream"
    )
    plan = WorkerPlan(
        worker=WorkerConfig(
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
        ledger=ledger,
        ledger_fallback=settings.job_ledger == "auto",
        topology=Topology(
            nats_stream_max_age_seconds=settings.nats_stream_max_age_seconds,
            nats_duplicate_window_seconds=settings.nats_duplicate_window_seconds,
            nats_stream_replicas=settings.nats_stream_replicas,
            job_stream_retention=settings.job_stream_retention,
            job_ack_wait_seconds=settings.job_ack_wait_seconds,
            job_max_ack_pending=settings.job_max_ack_pending,
            ledger_ttl_seconds=settings.ledger_ttl_seconds,
        ),
        auto_init_streams=settings.auto_init_streams,
        timeout=settings.backend_timeout_seconds,
        http_timeout=settings.http_job_timeout_seconds,
        http_allowed_targets=settings.http_job_allowed_targets
        or AllowedTargets.namespace(settings.managed_namespace),
    )
    return On(plan, worker_reason(plan, ledger))


def worker_reason(plan: WorkerPlan, home: LedgerHome) -> str:
    """What the worker does, with where its ledger is (`home`, once the start chose it)."""
    tier = plan.worker.tier
    where = (
        "ledger in PostgreSQL"
        if home == "postgres"
        else f"ledger in the JetStream bucket JOB_LEDGER_{tier}"
    )
    if home != plan.ledger:
        where += " (JOB_LEDGER=auto, and the registry is not running)"
    return (
        f"consumer wm-{tier} on MM_ONLINE, MM_OFFLINE, MM_WRITE; "
        f"{plan.worker.concurrency} job(s) at a time; {where}"
    )


def _self_update(settings: Settings) -> Decision[SelfUpdateConfig]:
    if not settings.self_update_enabled:
        return Off("switched off by SELF_UPDATE_ENABLED=false")
    if settings.self_update_url is None:
        return Off("no SELF_UPDATE_URL set")
    if settings.pod_namespace is None:
        return Off("not running in a cluster (no POD_NAMESPACE from the downward API)")
    from app.domain.updates import UpdatePolicy

    window: tuple[time, time] | None = settings.update_window
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
            window=window,
        ),
        deadline=settings.self_update_deadline_seconds,
        poll_interval=settings.self_update_poll_seconds,
        interval=settings.self_update_interval_seconds,
    )
    return On(
        config,
        f"{redact_url(settings.self_update_url)} -> "
        f"{settings.pod_namespace}/{settings.self_deployment_name}"
        + _risk(settings, "SELF_UPDATE_URL"),
    )


def _risk(settings: Settings, name: str) -> str:
    """What a component's reason says of its plain http:// setting: the risk, and who
    accepted it."""
    if name not in settings.plain_http():
        return ""
    accepted = " (accepted by ALLOW_PLAIN_HTTP)" if name in settings.allow_plain_http else ""
    return f"; {name} is plain http{accepted}: {PLAIN_HTTP_RISKS[name]}"


def _alerts(settings: Settings) -> Decision[MatrixConfig]:
    homeserver, room, token = (
        settings.matrix_homeserver, settings.matrix_room_id, settings.matrix_access_token
    )  # fmt: skip
    if homeserver is None or room is None or token is None:
        missing = [
            name
            for name, value in (
                ("MATRIX_HOMESERVER", homeserver),
                ("MATRIX_ROOM_ID", room),
                ("MATRIX_ACCESS_TOKEN", token),
            )
            if value is None
        ]
        return Off(f"{', '.join(missing)} not set: alerts go to the log")
    return On(
        MatrixConfig(homeserver, room, token, settings.backend_timeout_seconds),
        f"Matrix room {room} on {redact_url(homeserver)}",
    )
