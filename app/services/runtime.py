"""The running manager: what it is made of, and how it starts and stops.

`build_runtime` is synchronous and cheap (settings, key, in-memory book, metrics,
component table), so routes work the moment the app exists. `start_runtime` is the
composition root: it opens each component from `wiring` in the order their inputs
require, keeps what they return, starts the loops and the supervised tasks, and
registers `stop_runtime` to run first on the way out. `stop_runtime` is the whole
orderly shutdown under one deadline (`SHUTDOWN_GRACE_SECONDS`, counted from SIGTERM);
after it, the lifespan's AsyncExitStack closes the clients and the embedded servers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from pydantic import SecretStr

from app import __version__
from app.adapters.embedded import EmbeddedError, EmbeddedNats, EmbeddedPostgres
from app.adapters.signing import NodeSigner, load_config_file, load_private_key, node_id_for
from app.domain.components import Component, Outcome, Result
from app.domain.nats_servers import NatsServers
from app.domain.redaction import redact_text, redact_url
from app.domain.uptime import SAVE_EVERY_SECONDS
from app.metrics import Metrics
from app.services.alerting import Alerter
from app.services.components import DataServiceConfig, Decision, Plan, decide
from app.services.healthwatch import HealthWatch, OutageWatch
from app.services.reporting import Reporter
from app.services.scheduling import Scheduler
from app.services.supervision import Deadline, Supervisor, within
from app.services.wiring import (
    consumer_stats,
    local_profile,
    open_backend,
    open_cluster,
    open_matrix_room,
    open_registry,
    open_self_updater,
    open_syncer,
    open_uptime_keeper,
    open_uptime_recorder,
    open_worker,
)
from app.services.workloads import WorkloadBook
from app.settings import Settings

# The clients of switched-off components are never imported (kubernetes-asyncio alone is
# some 37 MiB): each `open_*` imports what it needs when its component is on.
if TYPE_CHECKING:
    from app.adapters.bus import JetStreamBus
    from app.adapters.registry import AsyncpgRegistry
    from app.services.heartbeating import Heartbeat
    from app.services.syncing import Syncer
    from app.services.updating import SelfUpdater
    from app.services.uptime import UptimeKeeper, UptimeRecorder
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
    supervisor: Supervisor
    shutdown: Deadline
    plan: Plan  # every component decided, with its config (app/services/components.py)
    components: dict[str, Component]
    alerts: Alerter
    started_at: float = field(default_factory=time.monotonic)
    started_wall: datetime = field(default_factory=lambda: datetime.now(UTC))
    # what start_runtime opened (None: off, or not started yet)
    reporter: Reporter | None = None
    health_watch: HealthWatch | None = None
    syncer: Syncer | None = None
    uptime: UptimeKeeper | None = None
    uptime_record: UptimeRecorder | None = None
    registry: AsyncpgRegistry | None = None
    heartbeat: Heartbeat | None = None
    updater: SelfUpdater | None = None
    worker: Worker | None = None
    bus: JetStreamBus | None = None
    cluster_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    started: bool = False
    stopping: bool = False

    @property
    def uptime_seconds(self) -> float:
        return time.monotonic() - self.started_at

    def not_ready_because(self) -> list[str]:
        """Why `/readyz` says 503: start-up unfinished, shutting down, the loops not
        running, a critical component failing. Empty: ready."""
        reasons: list[str] = []
        if not self.started:
            reasons.append("start-up has not finished")
        if self.stopping:
            reasons.append("shutting down")
        if not self.supervisor.scheduler.running:
            reasons.append("scheduler is not running")
        for name, component in self.components.items():
            if component.critical and not component.healthy:
                reasons.append(f"{name} is failing: {component.last_error}")
        return reasons


def build_runtime(settings: Settings, *, clock: Callable[[], float] = time.monotonic) -> Runtime:
    secret = settings.node_private_key
    key = load_private_key(
        inline=secret.get_secret_value() if secret else None,
        file=settings.node_private_key_file,
    )
    config_node_id: str | None = None
    config_path = settings.node_config_path if key is None else None
    if config_path is not None:
        # the original service's file: its key, and its node id unless NODE_ID is set
        from_config = load_config_file(config_path)
        key, config_node_id = from_config.key, from_config.node_id
        log.info(
            "node key from %s (private_key%s)",
            config_path,
            ", node_id" if config_node_id and not settings.node_id else "",
        )
    node_id = (
        settings.node_id
        or config_node_id
        or (node_id_for(key.public_key()) if key else socket.gethostname().lower())
    )
    signer = NodeSigner(node_id, key) if key else None
    metrics = Metrics()
    book = WorkloadBook(
        stale_after=settings.ping_stale_seconds,
        forget_after=settings.ping_forget_seconds,
        capacity=settings.max_tracked_workloads,
        on_forget=metrics.forget_workload,
        clock=clock,
    )
    plan = decide(settings, can_sign=signer is not None)
    components = plan.components()
    alerts = Alerter(
        node_id=node_id,
        metrics=metrics,
        window_seconds=settings.alert_window_seconds,
        deliver=plan.alerts.enabled,
    )
    runtime = Runtime(
        settings=settings,
        node_id=node_id,
        signer=signer,
        metrics=metrics,
        book=book,
        supervisor=Supervisor(
            scheduler=Scheduler(jitter_fraction=settings.scheduler_jitter_fraction),
            metrics=metrics,
            alerts=alerts,
        ),
        shutdown=Deadline(settings.shutdown_grace_seconds),
        plan=plan,
        components=components,
        alerts=alerts,
    )
    metrics.watch_state(
        workloads=book.counts,
        components=lambda: {n: c.healthy for n, c in components.items() if c.enabled},
        uptimes=book.uptimes,
    )
    return runtime


async def start_runtime(rt: Runtime, stack: AsyncExitStack) -> None:
    """Open every component, start the loops and tasks; `stop_runtime` runs first on exit.

    A start that fails part-way stops what it had started (the alert sender, the loops)
    before the exit stack closes the clients those use, then raises."""
    try:
        await _start(rt, stack)
    except BaseException:
        await _abandon_start(rt)
        raise
    stack.push_async_callback(stop_runtime, rt)
    rt.started = True


async def _abandon_start(rt: Runtime) -> None:
    """After a failed start: the tasks and loops it started, stopped within the shutdown
    grace; nothing is written to the registry (the node was not announced)."""
    deadline = rt.shutdown
    deadline.begin()
    rt.stopping = True
    await rt.supervisor.stop_loops(within=deadline.budget(cap=2.0, reserve=0.5))
    await rt.supervisor.stop_all(budget=deadline.budget(reserve=0.25))


async def _start(rt: Runtime, stack: AsyncExitStack) -> None:
    plan, components, settings = rt.plan, rt.components, rt.settings
    database_url, nats_url = await _start_data_services(rt, stack)

    room = open_matrix_room(plan.alerts, stack)
    if room is not None:
        rt.supervisor.start(
            "alert-sender", functools.partial(rt.alerts.deliver_to, room), restart=True,
            component=components["alerts"],
        )  # fmt: skip
        components["alerts"].record(datetime.now(UTC), Outcome.ok())

    backend = open_backend(plan.backend, rt.signer, stack)
    if plan.report.enabled:
        report = plan.report.config
        rt.reporter = Reporter(
            node_id=rt.node_id,
            book=rt.book,
            backend=backend if report.to_backend else None,
            metrics=rt.metrics,
            disk_path=report.data_dir if report.data_dir.exists() else report.data_dir.parent,
            started_at=rt.started_at,
        )
    cluster = await open_cluster(
        plan.cluster, [components["sync"], components["self_update"]], stack
    )
    rt.syncer = await open_syncer(
        plan.sync, components["sync"], backend=backend, cluster=cluster, book=rt.book,
        metrics=rt.metrics, cluster_lock=rt.cluster_lock,
    )  # fmt: skip
    rt.uptime_record = await open_uptime_recorder(
        plan.uptime_record.config, components["uptime_record"], cluster=cluster,
        every=plan.watch_every,
    )  # fmt: skip
    rt.book.set_uptime(rt.uptime_record.shares)
    rt.uptime = open_uptime_keeper(
        plan.uptime, components["uptime"], cluster=cluster, syncer=rt.syncer, book=rt.book,
        alerts=rt.alerts, metrics=rt.metrics, cluster_lock=rt.cluster_lock,
        record=rt.uptime_record.record,
    )  # fmt: skip
    # one profile of this node, which the registry stores and the worker matches jobs to
    # (made only for them: a node with neither loads no database or queue client)
    profile = None
    if plan.registry.enabled or plan.worker.enabled:
        version = cluster.client.server_version if cluster is not None else None
        profile = local_profile(plan.profile, rt.node_id, version)
    # the registry holds this instance's row: what PostgreSQL's ledger waits for
    registered = asyncio.Event()
    rt.heartbeat = await open_registry(
        plan.registry, components["registry"], stack, database_url=database_url,
        profile=profile, metrics=rt.metrics, on_registered=registered.set,
    )  # fmt: skip
    rt.registry = rt.heartbeat.registry if rt.heartbeat is not None else None
    opened = await open_worker(
        plan.worker, components["worker"], stack, nats_url=nats_url, auth=plan.nats_auth,
        registry=rt.registry, registered=registered.wait, node_id=rt.node_id, profile=profile,
        metrics=rt.metrics, alerts=rt.alerts, report=rt.supervisor.reporter(components["worker"]),
        connection=_reporter(rt, components["nats"]),
    )  # fmt: skip
    if opened is not None:
        rt.worker, rt.bus = opened
    rt.updater = await open_self_updater(
        plan.self_update, stack, cluster=cluster, metrics=rt.metrics, alerts=rt.alerts,
        cluster_lock=rt.cluster_lock,
    )  # fmt: skip

    _add_loops(rt)
    if rt.worker is not None:
        rt.supervisor.start(
            "job-worker", rt.worker.run, restart=True, component=components["worker"]
        )
    if rt.updater is not None:
        # finish an update or rollback a previous process began, without waiting for the
        # first scheduled check
        updater = rt.updater

        async def resume(_stopping: asyncio.Event) -> Outcome:
            return await updater.resume()

        rt.supervisor.start(
            "self-update-resume", resume, restart=False, component=components["self_update"]
        )
    rt.supervisor.start("clock-watch", rt.supervisor.scheduler.watch_clock, restart=True)
    rt.supervisor.start_loops()
    components["scheduler"].record(datetime.now(UTC), Outcome.ok())
    log.info(
        "workload manager %s started as node %s (%s); components on: %s",
        __version__,
        rt.node_id,
        settings.app_env.value,
        ", ".join(n for n, c in components.items() if c.enabled),
    )
    if settings.worker_only:
        log.info(
            "worker-only node: no NODE_SYSTEM_ENDPOINT and no DESIRED_STATE_DIR, so no sync "
            "and no report to a backend; the status routes are %s",
            "behind API_TOKEN" if settings.api_token is not None
            else "closed (401: no API_TOKEN is set)" if settings.is_production
            else "open (development, no API_TOKEN)",
        )  # fmt: skip


# a sync or heartbeats failing this many times in a row alert
ALERT_AFTER_FAILURES = 3


def _add_loops(rt: Runtime) -> None:
    """Every periodic loop, with the component its outcomes are recorded on."""
    plan, add, components = rt.plan, rt.supervisor.add_loop, rt.components
    watch = rt.health_watch = HealthWatch(book=rt.book, alerts=rt.alerts)
    every = plan.watch_every
    add("health-watch", watch.check, every=every, first_after=every)
    grace = plan.down_grace
    outages = OutageWatch(list(components.values()), rt.alerts, grace=grace)
    add("outage-watch", outages.check, every=min(5.0, grace / 2), first_after=min(5.0, grace / 2))
    record, book = rt.uptime_record, rt.book
    if record is not None:

        async def observe() -> None:
            record.observe(book.statuses())

        add("uptime-record", observe, every=every, first_after=0.1)
        add(
            "uptime-save", record.save, every=SAVE_EVERY_SECONDS, first_after=SAVE_EVERY_SECONDS,
            what="uptime record save", component=components["uptime_record"],
        )  # fmt: skip
    if rt.uptime is not None:
        add(
            "uptime", rt.uptime.check, every=every, first_after=every,
            what="uptime management", component=components["uptime"],
        )  # fmt: skip
    if rt.reporter is not None and plan.report.enabled:
        interval = plan.report.config.interval
        add(
            "report", rt.reporter.report_once, every=interval, first_after=min(5.0, interval),
            what="node report", component=components["report"],
        )  # fmt: skip
    if rt.heartbeat is not None and plan.registry.enabled:
        add(
            "heartbeat", _beat(rt.heartbeat, _reporter(rt, components["postgres"])),
            every=plan.registry.config.heartbeat_interval,
            first_after=0.1, what="registry heartbeat", component=components["registry"],
            alert_after=ALERT_AFTER_FAILURES,
        )  # fmt: skip
    if rt.bus is not None and plan.worker.enabled:
        tier = plan.worker.config.worker.tier
        add("consumer-stats", consumer_stats(rt.bus, rt.metrics, tier), every=15.0, first_after=5.0)
    if rt.syncer is not None and plan.sync.enabled:
        sync = plan.sync.config
        add(
            "sync", rt.syncer.run_scheduled, every=sync.interval,
            first_after=min(10.0, sync.interval), what="deployment sync",
            component=components["sync"], alert_after=ALERT_AFTER_FAILURES,
        )  # fmt: skip
        from app.adapters.kube import KubeError

        add(
            "cluster-view", rt.syncer.refresh_view, every=sync.refresh_interval,
            first_after=sync.refresh_interval, what="cluster view", outage=(KubeError,),
        )  # fmt: skip
    if rt.updater is not None and plan.self_update.enabled:
        interval = plan.self_update.config.interval
        add(
            "self-update", rt.updater.run_scheduled, every=interval,
            first_after=min(60.0, interval), what="self-update check",
            component=components["self_update"],
        )  # fmt: skip


def _reporter(rt: Runtime, component: Component) -> Callable[[Outcome], None]:
    """Where a state of `component` is reported; nowhere while it is off."""
    if not component.enabled:
        return lambda _outcome: None
    return rt.supervisor.reporter(component)


def _beat(
    heartbeat: Heartbeat, postgres: Callable[[Outcome], None]
) -> Callable[[], Awaitable[Outcome]]:
    """The heartbeat, whose every run also says whether PostgreSQL answers: its record in
    `/v1/status` and readiness is what it is now, not what the start's probe found."""

    async def beat() -> Outcome:
        outcome = await heartbeat.beat()
        answered = outcome.result is not Result.UNAVAILABLE
        postgres(Outcome.ok() if answered else Outcome.unavailable(outcome.error or "no answer"))
        return outcome

    return beat


# Of the grace period, this share (at most TAIL_CAP_SECONDS) is kept for what comes after
# the loops and the jobs: the final report, `offline` in the registry, closing clients.
TAIL_SHARE = 0.3
TAIL_CAP_SECONDS = 5.0


async def stop_runtime(rt: Runtime) -> None:
    """The orderly shutdown, every step within what is left of the one deadline.

    1. `draining` in the registry: the fleet routes around the node from now on.
    2. At once, side by side: the loop in progress (a sync mid-write) finishes or is
       cancelled; the jobs in flight finish or are handed back, nothing new starts.
    3. The uptime record saved; one last report. 4. `offline` in the registry. 5. The
       other supervised tasks (the alert sender's last messages). The exit stack then
       closes the clients.
    """
    deadline = rt.shutdown
    deadline.begin()
    rt.stopping = True
    if rt.worker is not None:
        rt.worker.begin_stop()  # nothing new starts from here on
    tail = min(TAIL_CAP_SECONDS, deadline.grace * TAIL_SHARE)
    log.info("shutting down within %.1f s", deadline.remaining())
    heartbeat = rt.heartbeat
    if heartbeat is not None:
        budget = deadline.budget(cap=2.0, reserve=tail)
        await heartbeat.mark("draining", within=budget)
    await asyncio.gather(
        rt.supervisor.stop_loops(within=deadline.budget(reserve=tail)), _drain_worker(rt, tail)
    )
    if rt.uptime_record is not None:  # what was counted since the last save
        await within(
            "uptime record", deadline.budget(cap=2.0, reserve=tail),
            functools.partial(rt.supervisor.run_now, "uptime-save"),
        )  # fmt: skip
    if rt.reporter is not None and rt.plan.report.enabled:
        await within(
            "final report", deadline.budget(cap=5.0, reserve=tail / 2),
            functools.partial(rt.supervisor.run_now, "report"),
        )  # fmt: skip
    if heartbeat is not None:
        await heartbeat.mark("offline", within=deadline.budget(cap=2.0, reserve=0.5))
    await rt.alerts.flush(within=deadline.budget(cap=2.0, reserve=0.5))
    await rt.supervisor.stop_all(budget=deadline.budget(reserve=0.25))
    log.info("shutdown steps done with %.1f s to spare", deadline.remaining())


async def _drain_worker(rt: Runtime, tail: float) -> None:
    worker, bus, deadline = rt.worker, rt.bus, rt.shutdown
    if worker is None or bus is None:
        return
    if bus.connected:
        await within(
            "node.draining event", deadline.budget(cap=1.0, reserve=tail), worker.announce_draining
        )
    # the jobs in flight; the consume loops end within one fetch wait meanwhile
    await worker.drain(within=deadline.budget(reserve=tail + 1.0))
    await rt.supervisor.stop("job-worker", budget=deadline.budget(cap=2.0, reserve=tail))
    if bus.connected:
        await within(
            "node.offline event", deadline.budget(cap=1.0, reserve=tail), worker.announce_offline
        )
    await bus.drain(within=deadline.budget(cap=3.0, reserve=tail / 2))


async def open_sync_only(rt: Runtime, stack: AsyncExitStack) -> Syncer | None:
    """The syncer alone, as the one-shot CLI and the sync tests use it."""
    plan = rt.plan
    cluster = await open_cluster(plan.cluster, [rt.components["sync"]], stack)
    return await open_syncer(
        plan.sync, rt.components["sync"], backend=open_backend(plan.backend, rt.signer, stack),
        cluster=cluster, book=rt.book, metrics=rt.metrics, cluster_lock=rt.cluster_lock,
    )  # fmt: skip


async def open_self_update_only(rt: Runtime, stack: AsyncExitStack) -> SelfUpdater | None:
    """The self-updater alone, as `workload-manager self-update` and its tests use it."""
    plan = rt.plan
    cluster = await open_cluster(plan.cluster, [rt.components["self_update"]], stack)
    return await open_self_updater(
        plan.self_update, stack, cluster=cluster, metrics=rt.metrics, alerts=rt.alerts,
        cluster_lock=rt.cluster_lock,
    )  # fmt: skip


async def _start_data_services(
    rt: Runtime, stack: AsyncExitStack
) -> tuple[str | None, NatsServers | None]:
    """PostgreSQL's URL and nats-server's servers: the configured ones, or the embedded
    server's, started here (None: off, or it did not start); each probed once."""
    plan, components = rt.plan, rt.components
    database = await _data_service(
        plan.postgres, components["postgres"], EmbeddedPostgres, SecretStr, "PostgreSQL", stack
    )
    database_url = None if database is None else database.get_secret_value()
    nats_url = await _data_service(
        plan.nats, components["nats"], EmbeddedNats, _one_server, "nats-server", stack
    )
    await asyncio.gather(_probe_postgres(rt, database_url), _probe_nats(rt, nats_url))
    return database_url, nats_url


A = TypeVar("A")


def _one_server(url: str) -> NatsServers:
    return NatsServers((url,))


async def _data_service(
    decision: Decision[DataServiceConfig[A]],
    component: Component,
    server: Callable[[Path], EmbeddedPostgres | EmbeddedNats],
    address: Callable[[str], A],
    label: str,
    stack: AsyncExitStack,
) -> A | None:
    """The configured address as it is, or the embedded server's, started here."""
    if not decision.enabled:
        return None
    config = decision.config
    if config.url is not None:
        return config.url
    assert config.embedded_dir is not None  # decided: a URL or an embedded server
    embedded = server(config.embedded_dir.resolve())
    try:
        await asyncio.to_thread(embedded.start)
    except (EmbeddedError, OSError) as exc:
        component.failed(datetime.now(UTC), f"embedded {label}: {exc}")
        return None
    stack.callback(embedded.stop)
    component.detail.update(embedded=True, pid=embedded.pid)
    return address(embedded.url)


async def _probe_postgres(rt: Runtime, url: str | None) -> None:
    if url is not None:
        await _probe(rt.components["postgres"], url, _postgres_version(url))


async def _postgres_version(url: str) -> dict[str, object]:
    from app.adapters import registry

    return {"server_version": await registry.server_version(url, connect_timeout=PROBE_TIMEOUT)}


async def _probe_nats(rt: Runtime, url: NatsServers | None) -> None:
    if url is not None:
        from app.adapters import bus

        auth = rt.plan.nats_auth
        await _probe(
            rt.components["nats"], str(url),
            bus.server_info(url, connect_timeout=PROBE_TIMEOUT, auth=auth),
        )  # fmt: skip


async def _probe(component: Component, url: str, check: Awaitable[dict[str, object]]) -> None:
    """Record whether a configured server answers; never raises."""
    shown = component.detail["url"] = redact_url(url)
    try:
        info = await check
    except Exception as exc:  # any failure to connect is reported, not raised
        # drivers may quote the URL they were given in their errors
        error = redact_text(f"{type(exc).__name__}: {exc}")
        component.failed(datetime.now(UTC), error)
        log.warning("%s at %s is not reachable: %s", component.name, shown, error)
    else:
        component.succeeded(datetime.now(UTC), **info)
