"""The running manager: what it is made of, and how it starts and stops.

`build_runtime` is synchronous and cheap (settings, key, in-memory book, metrics,
component table), so routes work the moment the app exists. `start_runtime` owns
every resource with I/O behind it and registers its cleanup on the lifespan's
AsyncExitStack, in an order that makes shutdown the mirror of start-up.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from app import __version__
from app.adapters.embedded import EmbeddedError, EmbeddedNats, EmbeddedPostgres
from app.adapters.signing import NodeSigner, load_private_key, node_id_for
from app.domain.components import Component, ComponentState
from app.metrics import Metrics
from app.services.alerting import Alerter
from app.services.reporting import Reporter
from app.services.scheduling import Scheduler
from app.services.wiring import (
    DEVELOPMENT_TIER,
    consumer_stats,
    open_registry,
    open_self_updater,
    open_syncer,
    open_worker,
)
from app.services.workloads import WorkloadBook
from app.settings import Settings, redact_url

# The clients of switched-off components are never imported (kubernetes-asyncio alone is
# some 60 MiB): each `open_*` below imports what it needs when its component is on.
if TYPE_CHECKING:
    from app.adapters.backend import BackendClient
    from app.adapters.bus import JetStreamBus
    from app.adapters.registry import AsyncpgRegistry
    from app.services.heartbeating import Heartbeat
    from app.services.syncing import Syncer
    from app.services.updating import SelfUpdater
    from app.services.working import Worker

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 5.0


@dataclass
class Runtime:
    settings: Settings
    node_id: str
    signer: NodeSigner | None
    metrics: Metrics
    book: WorkloadBook
    scheduler: Scheduler
    reporter: Reporter
    components: dict[str, Component]
    alerts: Alerter
    started_at: float = field(default_factory=time.monotonic)
    started_wall: datetime = field(default_factory=lambda: datetime.now(UTC))
    backend: BackendClient | None = None
    syncer: Syncer | None = None
    registry: AsyncpgRegistry | None = None
    heartbeat: Heartbeat | None = None
    updater: SelfUpdater | None = None
    worker: Worker | None = None
    bus: JetStreamBus | None = None
    cluster_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    database_url: str | None = None
    nats_url: str | None = None
    started: bool = False
    stopping: bool = False

    @property
    def uptime_seconds(self) -> float:
        return time.monotonic() - self.started_at


def _components(settings: Settings, signer: NodeSigner | None) -> dict[str, Component]:
    report_reason: str
    report_enabled = settings.report_enabled
    if not settings.report_enabled:
        report_reason = "switched off by REPORT_ENABLED=false"
    elif settings.node_system_endpoint is None:
        report_reason = "no NODE_SYSTEM_ENDPOINT: reports go to the log and /v1/status"
    elif signer is None:
        report_enabled = False
        report_reason = (
            "NODE_SYSTEM_ENDPOINT is set but there is no NODE_PRIVATE_KEY or "
            "NODE_PRIVATE_KEY_FILE to sign with"
        )
    else:
        report_reason = f"signed reports to {settings.node_system_endpoint}"
    embedded = settings.embedded_services and not settings.is_production

    def data_service(name: str, configured: str | None, variable: str) -> Component:
        if configured is not None:
            return Component(name, True, f"{variable} is set")
        if embedded:
            return Component(name, True, f"embedded server (no {variable} set)")
        return Component(name, False, f"no {variable} set and embedded servers are off")

    database = settings.database_url.get_secret_value() if settings.database_url else None
    return {
        "api": Component("api", True, "serving", critical=True, state=ComponentState.OK),
        "scheduler": Component("scheduler", True, "runs the periodic loops", critical=True),
        "report": Component("report", report_enabled, report_reason),
        "postgres": data_service("postgres", database, "DATABASE_URL"),
        "nats": data_service("nats", settings.nats_url, "NATS_URL"),
        "sync": _sync_component(settings, signer),
        "registry": _registry_component(settings, database, embedded),
        "worker": _worker_component(settings, database, embedded),
        "self_update": _self_update_component(settings),
        "alerts": _alerts_component(settings),
    }


def _alerts_component(settings: Settings) -> Component:
    missing = [
        name
        for name, value in (
            ("MATRIX_HOMESERVER", settings.matrix_homeserver),
            ("MATRIX_ROOM_ID", settings.matrix_room_id),
            ("MATRIX_ACCESS_TOKEN", settings.matrix_access_token),
        )
        if value is None
    ]
    if missing:
        return Component("alerts", False, f"{', '.join(missing)} not set: alerts go to the log")
    return Component(
        "alerts", True, f"Matrix room {settings.matrix_room_id} on {settings.matrix_homeserver}"
    )


def _registry_component(settings: Settings, database: str | None, embedded: bool) -> Component:
    if not settings.registry_enabled:
        return Component("registry", False, "switched off by REGISTRY_ENABLED=false")
    if database is None and not embedded:
        return Component("registry", False, "no DATABASE_URL (or CAPABILITY_REGISTRY) set")
    tier = settings.node_tier or DEVELOPMENT_TIER
    reason = f"tier {tier.value} in worker_capabilities, heartbeat every "
    reason += f"{settings.heartbeat_interval_seconds:g} s"
    if settings.node_tier is None:
        reason += " (NODE_TIER unset: tier C for development)"
    return Component("registry", True, reason)


def _worker_component(settings: Settings, database: str | None, embedded: bool) -> Component:
    if not settings.worker_enabled:
        return Component("worker", False, "switched off by WORKER_ENABLED=false")
    if settings.nats_url is None and not embedded:
        return Component("worker", False, "no NATS_URL set")
    if not settings.registry_enabled or (database is None and not embedded):
        return Component(
            "worker", False, "needs the registry's database for its idempotency ledger"
        )
    tier = (settings.node_tier or DEVELOPMENT_TIER).value
    return Component(
        "worker",
        True,
        f"consumer wm-{tier} on MM_ONLINE, MM_OFFLINE, MM_WRITE; "
        f"{settings.worker_concurrency} job(s) at a time",
    )


def _self_update_component(settings: Settings) -> Component:
    if not settings.self_update_enabled:
        return Component("self_update", False, "switched off by SELF_UPDATE_ENABLED=false")
    if settings.self_update_url is None:
        return Component("self_update", False, "no SELF_UPDATE_URL set")
    if settings.pod_namespace is None:
        return Component(
            "self_update",
            False,
            "not running in a cluster (no POD_NAMESPACE from the downward API)",
        )
    return Component(
        "self_update",
        True,
        f"{settings.self_update_url} -> {settings.pod_namespace}/{settings.self_deployment_name}",
    )


def _sync_component(settings: Settings, signer: NodeSigner | None) -> Component:
    if not settings.sync_enabled:
        return Component("sync", False, "switched off by SYNC_ENABLED=false")
    if settings.node_system_endpoint and signer:
        return Component("sync", True, f"desired state from {settings.node_system_endpoint}")
    if settings.desired_state_dir is not None:
        return Component("sync", True, f"desired state from folder {settings.desired_state_dir}")
    return Component(
        "sync", False, "no NODE_SYSTEM_ENDPOINT (with a key) and no DESIRED_STATE_DIR to sync from"
    )


def build_runtime(settings: Settings) -> Runtime:
    secret = settings.node_private_key
    key = load_private_key(
        inline=secret.get_secret_value() if secret else None,
        file=settings.node_private_key_file,
    )
    node_id = settings.node_id or (
        node_id_for(key.public_key()) if key else socket.gethostname().lower()
    )
    signer = NodeSigner(node_id, key) if key else None
    metrics = Metrics()
    book = WorkloadBook(
        stale_after=settings.ping_stale_seconds,
        forget_after=settings.ping_forget_seconds,
        capacity=settings.max_tracked_workloads,
    )
    components = _components(settings, signer)
    alerts = Alerter(node_id=node_id, metrics=metrics, window_seconds=settings.alert_window_seconds)
    reporter = Reporter(
        node_id=node_id,
        book=book,
        backend=None,
        component=components["report"],
        metrics=metrics,
        alerts=alerts,
        disk_path=settings.data_dir if settings.data_dir.exists() else settings.data_dir.parent,
        started_at=time.monotonic(),
    )
    runtime = Runtime(
        settings=settings,
        node_id=node_id,
        signer=signer,
        metrics=metrics,
        book=book,
        scheduler=Scheduler(metrics=metrics, jitter_fraction=settings.scheduler_jitter_fraction),
        reporter=reporter,
        components=components,
        alerts=alerts,
    )
    metrics.watch_state(
        workloads=book.counts,
        components=lambda: {n: c.healthy for n, c in components.items() if c.enabled},
    )
    return runtime


async def start_runtime(rt: Runtime, stack: AsyncExitStack) -> None:
    settings = rt.settings
    await _start_data_services(rt, stack)
    await _start_alerts(rt, stack)
    open_backend(rt, stack)

    if rt.components["report"].enabled:
        rt.reporter.backend = rt.backend
        rt.scheduler.add_loop(
            "report",
            rt.reporter.report_once,
            every=settings.report_interval_seconds,
            first_after=min(5.0, settings.report_interval_seconds),
        )
        stack.push_async_callback(_final_report, rt)

    heartbeat = await open_registry(rt, stack)
    if heartbeat is not None:
        rt.scheduler.add_loop(
            "heartbeat", heartbeat.beat, every=settings.heartbeat_interval_seconds, first_after=0.1
        )

    worker = await open_worker(rt, stack)
    if worker is not None and rt.bus is not None:
        rt.scheduler.add_loop("consumer-stats", consumer_stats(rt), every=15.0, first_after=5.0)

    syncer = await open_syncer(rt, stack)
    if syncer is not None:
        rt.scheduler.add_loop(
            "sync",
            syncer.run_scheduled,
            every=settings.sync_interval_seconds,
            first_after=min(10.0, settings.sync_interval_seconds),
        )
        rt.scheduler.add_loop(
            "cluster-view",
            syncer.refresh_view,
            every=settings.cluster_refresh_seconds,
            first_after=settings.cluster_refresh_seconds,
        )

    updater = await open_self_updater(rt, stack)
    if updater is not None:
        rt.scheduler.add_loop(
            "self-update",
            updater.run_scheduled,
            every=settings.self_update_interval_seconds,
            first_after=min(60.0, settings.self_update_interval_seconds),
        )

    rt.scheduler.start()
    rt.components["scheduler"].succeeded(datetime.now(UTC))
    # a run in progress may finish within half the grace period; the rest is for the
    # worker's drain, the registry's goodbye and the final report
    stack.push_async_callback(
        rt.scheduler.stop, within=min(10.0, settings.shutdown_grace_seconds / 2)
    )
    rt.started = True
    log.info(
        "workload manager %s started as node %s (%s); components on: %s",
        __version__,
        rt.node_id,
        settings.app_env.value,
        ", ".join(n for n, c in rt.components.items() if c.enabled),
    )


def open_backend(rt: Runtime, stack: AsyncExitStack) -> BackendClient | None:
    """The signed backend client, when an endpoint and a key are configured."""
    settings = rt.settings
    if settings.node_system_endpoint is None or rt.signer is None:
        return None
    from app.adapters.backend import BackendClient

    rt.backend = BackendClient(
        base_url=settings.node_system_endpoint,
        signer=rt.signer,
        timeout=settings.backend_timeout_seconds,
        attempts=settings.backend_retry_attempts,
        max_wait=settings.backend_retry_max_wait_seconds,
    )
    stack.push_async_callback(rt.backend.aclose)
    return rt.backend


async def _start_alerts(rt: Runtime, stack: AsyncExitStack) -> None:
    settings = rt.settings
    if not rt.components["alerts"].enabled:
        return
    from app.adapters.matrix import MatrixRoom

    assert settings.matrix_homeserver and settings.matrix_room_id and settings.matrix_access_token
    room = MatrixRoom(
        homeserver=settings.matrix_homeserver,
        room_id=settings.matrix_room_id,
        token=settings.matrix_access_token.get_secret_value(),
        timeout=settings.backend_timeout_seconds,
    )
    stack.push_async_callback(room.aclose)
    rt.alerts.room = room
    sender = asyncio.create_task(rt.alerts.deliver(), name="alert-sender")

    async def stop() -> None:
        await rt.alerts.flush(within=min(3.0, settings.shutdown_grace_seconds))
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)

    stack.push_async_callback(stop)
    rt.components["alerts"].succeeded(datetime.now(UTC))


async def _final_report(rt: Runtime) -> None:
    """One last report on the way out, bounded by the shutdown grace period."""
    budget = min(5.0, rt.settings.shutdown_grace_seconds)
    if budget <= 0:
        return
    try:
        await asyncio.wait_for(rt.reporter.report_once(), timeout=budget)
    except TimeoutError:
        log.warning("final report not delivered within %.1f s", budget)


async def _start_data_services(rt: Runtime, stack: AsyncExitStack) -> None:
    settings = rt.settings
    data_dir = settings.data_dir.resolve()
    pg_component, nats_component = rt.components["postgres"], rt.components["nats"]

    if settings.database_url is not None:
        rt.database_url = settings.database_url.get_secret_value()
    elif pg_component.enabled:
        pg = EmbeddedPostgres(data_dir / "postgres")
        try:
            await asyncio.to_thread(pg.start)
        except (EmbeddedError, OSError) as exc:
            pg_component.failed(datetime.now(UTC), f"embedded PostgreSQL: {exc}")
        else:
            stack.callback(pg.stop)
            rt.database_url = pg.url
            pg_component.detail.update(embedded=True, pid=pg.pid)

    if settings.nats_url is not None:
        rt.nats_url = settings.nats_url
    elif nats_component.enabled:
        server = EmbeddedNats(data_dir / "nats")
        try:
            await asyncio.to_thread(server.start)
        except (EmbeddedError, OSError) as exc:
            nats_component.failed(datetime.now(UTC), f"embedded nats-server: {exc}")
        else:
            stack.callback(server.stop)
            rt.nats_url = server.url
            nats_component.detail.update(embedded=True, pid=server.pid)

    await asyncio.gather(_probe_postgres(rt), _probe_nats(rt))


async def _probe_postgres(rt: Runtime) -> None:
    if rt.database_url is not None:
        url = rt.database_url
        await _probe(rt.components["postgres"], url, _postgres_version(url))


async def _postgres_version(url: str) -> dict[str, object]:
    from app.adapters import registry

    return {"server_version": await registry.server_version(url, connect_timeout=PROBE_TIMEOUT)}


async def _probe_nats(rt: Runtime) -> None:
    if rt.nats_url is not None:
        from app.adapters import bus

        url = rt.nats_url
        await _probe(
            rt.components["nats"], url, bus.server_info(url, connect_timeout=PROBE_TIMEOUT)
        )


async def _probe(component: Component, url: str, check: Awaitable[dict[str, object]]) -> None:
    """Record whether a configured server answers; never raises."""
    component.detail["url"] = redact_url(url)
    try:
        info = await check
    except Exception as exc:  # any failure to connect is reported, not raised
        component.failed(datetime.now(UTC), f"{type(exc).__name__}: {exc}")
        log.warning("%s at %s is not reachable: %s", component.name, component.detail["url"], exc)
    else:
        component.succeeded(datetime.now(UTC), **info)
