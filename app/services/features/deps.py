"""What the features share: decided once from the settings (`Shared`), the decisions made so
far (`Decisions`), and, at the start, what they are opened with (`Deps`): the node's own
parts, the clients more than one feature uses (opened by the first that asks, closed
with the lifespan), and what one feature hands a later one (the registry to the worker,
the sync to uptime management).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from app.adapters.nats_auth import NatsAuth
from app.domain.components import Component
from app.domain.requirements import Tier
from app.domain.spreading import ReconnectPolicy, StartupSpread
from app.metrics import Metrics
from app.services.alerting import Alerter
from app.services.features.base import Decision, Off, On, Spec
from app.services.supervision import Supervisor
from app.services.workloads import WorkloadBook
from app.settings import PLAIN_HTTP_RISKS, Settings

if TYPE_CHECKING:
    from app.adapters.backend import BackendClient
    from app.adapters.bus import JetStreamBus
    from app.adapters.kube import KubeDeployments
    from app.adapters.registry import AsyncpgRegistry
    from app.adapters.signing import NodeSigner
    from app.domain.nats_servers import NatsServers
    from app.services.heartbeating import Heartbeat
    from app.services.profile import LocalProfile
    from app.services.syncing import Syncer
    from app.services.uptime import UptimeRecorder

log = logging.getLogger(__name__)

C = TypeVar("C")


@dataclass(frozen=True)
class BackendConfig:
    """The signed client of the node-system backend (the report and the sync share it)."""

    base_url: str
    timeout: float
    attempts: int
    max_wait: float
    deadline: float
    max_response_bytes: int
    retry_after_max: float = 3_600.0  # the longest a Retry-After puts a loop off


@dataclass(frozen=True)
class ProfileConfig:
    """What the node says of itself (the registry's row, the jobs' matching)."""

    tier: Tier
    region: str | None
    trust_zone: str | None
    capabilities: tuple[str, ...]
    data_dir: Path  # its disk is fingerprinted (the working directory's until it exists)


@dataclass(frozen=True)
class Shared:
    """What more than one feature is decided with."""

    embedded: bool  # embedded PostgreSQL and nats-server when no URL is set
    can_sign: bool  # a node key to sign the backend's requests with
    backend: BackendConfig | None  # the sync's and the report's, when it may sign
    kubeconfig: Path | None
    namespace: str  # the managed namespace
    kube_timeout: float
    profile: ProfileConfig
    nats_auth: NatsAuth
    watch_every: float  # how often the workload book is looked at (health, uptime)
    down_grace: float  # how long a component fails before its one alert
    # DATABASE_URL goes through PgBouncer in transaction mode (DATABASE_POOLER)
    transaction_pooler: bool = False
    # the first run of each call to a shared service comes up to this much later
    startup: StartupSpread = field(default_factory=StartupSpread)
    nats_reconnect: ReconnectPolicy = field(default_factory=ReconnectPolicy)  # the bus's

    @classmethod
    def of(cls, settings: Settings, *, can_sign: bool) -> Shared:
        return cls(
            embedded=settings.embedded_services and not settings.is_production,
            can_sign=can_sign,
            backend=_backend(settings) if can_sign else None,
            kubeconfig=settings.kubeconfig,
            namespace=settings.managed_namespace,
            kube_timeout=settings.kube_timeout_seconds,
            profile=ProfileConfig(
                tier=settings.tier,
                region=settings.node_region,
                trust_zone=settings.node_trust_zone,
                capabilities=tuple(settings.node_capabilities),
                data_dir=settings.data_dir,
            ),
            nats_auth=nats_auth_of(settings),
            watch_every=max(1.0, min(15.0, settings.ping_stale_seconds / 2)),
            down_grace=settings.component_down_grace_seconds,
            transaction_pooler=settings.transaction_pooler,
            startup=StartupSpread(settings.startup_spread),
            nats_reconnect=ReconnectPolicy(
                base=settings.nats_reconnect_base_seconds,
                cap=settings.nats_reconnect_max_seconds,
                lame_duck_spread=settings.nats_lame_duck_spread_seconds,
            ),
        )


def nats_auth_of(settings: Settings) -> NatsAuth:
    """The NATS credentials the settings name (files only: the secrets stay in them)."""
    return NatsAuth(
        creds_file=settings.nats_creds_file, nkey_seed_file=settings.nats_nkey_seed_file,
        tls_ca_file=settings.nats_tls_ca_file, tls_cert_file=settings.nats_tls_cert_file,
        tls_key_file=settings.nats_tls_key_file,
    )  # fmt: skip


def plain_http_note(settings: Settings, name: str) -> str:
    """What a feature's reason says of its plain http:// setting: the risk, and who
    accepted it."""
    if name not in settings.plain_http():
        return ""
    accepted = " (accepted by ALLOW_PLAIN_HTTP)" if name in settings.allow_plain_http else ""
    return f"; {name} is plain http{accepted}: {PLAIN_HTTP_RISKS[name]}"


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
        retry_after_max=settings.retry_after_max_seconds,
    )


@dataclass
class Decisions:
    """Every feature's decision, by its spec, in the order they were made."""

    made: dict[Spec[Any, Any], Decision[Any]] = field(default_factory=dict)

    def of(self, spec: Spec[C, Any]) -> Decision[C]:
        decision: On[C] | Off = self.made[spec]
        return decision


@dataclass(frozen=True)
class Cluster:
    """The one Kubernetes client of the process (in the managed namespace; `in_namespace`
    gives it for another on the same pool), and where its configuration came from."""

    client: KubeDeployments
    source: str


@dataclass
class Deps:
    """What a feature is opened with. The node's parts are set by the root; the rest is
    filled in by the features in their order (None: not opened, or off)."""

    node_id: str
    signer: NodeSigner | None
    metrics: Metrics
    book: WorkloadBook
    alerts: Alerter
    supervisor: Supervisor
    stack: AsyncExitStack
    shared: Shared
    components: dict[str, Component]
    started_at: float  # the process's start, on the monotonic clock
    cluster_lock: asyncio.Lock
    # the data services' URLs (embedded or configured; None: off or not started)
    database_url: str | None = None
    nats_url: NatsServers | None = None
    # handed on: the registry to the worker, the sync and the uptime record to uptime
    registry: AsyncpgRegistry | None = None
    heartbeat: Heartbeat | None = None  # PostgreSQL's health is its last beat's answer
    registered: asyncio.Event = field(default_factory=asyncio.Event)
    bus: JetStreamBus | None = None  # NATS's health is its connection
    syncer: Syncer | None = None
    uptime_record: UptimeRecorder | None = None
    _backend: BackendClient | None = None
    _cluster: Cluster | Off | None = None
    _profile: LocalProfile | None = None

    def component(self, spec: Spec[Any, Any]) -> Component:
        """The status record of `spec`'s feature: its facts, and its reason once the start
        has told more."""
        return self.components[spec.name]

    def backend(self) -> BackendClient | None:
        """The signed backend client, when an endpoint and a key are configured."""
        config = self.shared.backend
        if self._backend is None and config is not None and self.signer is not None:
            from app.adapters.backend import BackendClient

            self._backend = BackendClient(
                base_url=config.base_url,
                signer=self.signer,
                timeout=config.timeout,
                attempts=config.attempts,
                max_wait=config.max_wait,
                deadline=config.deadline,
                max_response_bytes=config.max_response_bytes,
                retry_after_max=config.retry_after_max,
            )
            self.stack.push_async_callback(self._backend.aclose)
        return self._backend

    async def cluster(self) -> Cluster | Off:
        """The Kubernetes client every feature on the cluster shares (the sync, the
        self-update, uptime management, the fingerprint's cluster version), opened by the
        first that asks; Off, with why, when there is no cluster to talk to."""
        if self._cluster is None:
            from app.adapters.kube import ClusterUnavailable, KubeDeployments, load_configuration

            shared = self.shared
            try:
                configuration, source = await load_configuration(shared.kubeconfig)
            except ClusterUnavailable as exc:
                self._cluster = Off(str(exc))
            else:
                kube = KubeDeployments(
                    configuration, namespace=shared.namespace, timeout=shared.kube_timeout
                )
                self.stack.push_async_callback(kube.aclose)
                self._cluster = Cluster(kube, source)
        return self._cluster

    def cluster_if_open(self) -> Cluster | None:
        """The cluster client, when a feature before has opened it."""
        return self._cluster if isinstance(self._cluster, Cluster) else None

    def profile(self) -> LocalProfile:
        """The node's own profile, which the registry stores and the worker matches jobs
        to: its settings and its hardware fingerprint (and the cluster's version, when
        there is a cluster). Made for the first that asks: a node with neither loads no
        database or queue client."""
        if self._profile is None:
            from app.services.profile import LocalProfile

            config = self.shared.profile
            cluster = self.cluster_if_open()
            self._profile = LocalProfile(
                node_id=self.node_id, tier=config.tier,
                region=config.region, trust_zone=config.trust_zone,
                capabilities=list(config.capabilities),
                # the data directory's disk, else the working directory's (decided here)
                fingerprint=_fingerprint(
                    config.data_dir if config.data_dir.exists() else Path.cwd(),
                    cluster.client.server_version if cluster is not None else None,
                ),
            )  # fmt: skip
        return self._profile


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
