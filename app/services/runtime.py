"""The running manager: what it is made of, and how it starts and stops.

`build_runtime` is synchronous and cheap (settings, key, in-memory book, metrics, the
features decided), so routes work the moment the app exists. `start_runtime` is the
composition root: it opens the features (`app/services/features/`) in their declared
order, hands every timer and task they declare to the supervisor, and registers
`stop_runtime` to run first on the way out. `stop_runtime` runs the features' stop steps
phase by phase under one deadline (`SHUTDOWN_GRACE_SECONDS`, counted from SIGTERM);
after it, the lifespan's AsyncExitStack closes the clients and the embedded servers.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from app import __version__
from app.adapters.signing import NodeSigner, load_config_file, load_private_key, node_id_for
from app.domain.components import Component, Outcome
from app.metrics import Metrics
from app.services.alerting import Alerter
from app.services.features import FEATURES, Plan, decide
from app.services.features.base import Off, Phase, Running, Spec
from app.services.features.data import NATS, POSTGRES, answered
from app.services.features.deps import Deps
from app.services.healthwatch import HealthWatch, OutageWatch
from app.services.scheduling import Scheduler
from app.services.supervision import Deadline, Supervisor, within
from app.services.workloads import WorkloadBook
from app.settings import Settings

if TYPE_CHECKING:
    from app.services.syncing import Syncer
    from app.services.updating import SelfUpdater

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Running)


@dataclass
class Runtime:
    settings: Settings
    node_id: str
    signer: NodeSigner | None
    metrics: Metrics
    book: WorkloadBook
    supervisor: Supervisor
    shutdown: Deadline
    plan: Plan
    components: dict[str, Component]
    alerts: Alerter
    running: dict[Spec[Any, Any], Running] = field(default_factory=dict)
    # one change to the cluster at a time: the sync, the self-update, uptime restarts
    cluster_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    started_at: float = field(default_factory=time.monotonic)
    started_wall: datetime = field(default_factory=lambda: datetime.now(UTC))
    started: bool = False
    stopping: bool = False

    @property
    def uptime_seconds(self) -> float:
        return time.monotonic() - self.started_at

    def get(self, spec: Spec[Any, R]) -> R | None:
        """The running feature of `spec`; None while it is off or not opened."""
        found = self.running.get(spec)
        return found  # type: ignore[return-value]  # keyed by its own spec

    def refresh(self) -> None:
        """Each component's live state read now (`Component.refresh`)."""
        now = datetime.now(UTC)
        for component in self.components.values():
            component.refresh(now)

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
        self.refresh()
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
    from app.services.features.alerts import ALERTS

    plan = decide(settings, can_sign=signer is not None)
    components = plan.components()
    alerts = Alerter(
        node_id=node_id,
        metrics=metrics,
        window_seconds=settings.alert_window_seconds,
        deliver=plan.of(ALERTS).enabled,
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

    def healthy() -> dict[str, bool]:
        runtime.refresh()
        return {n: c.healthy for n, c in components.items() if c.enabled}

    metrics.watch_state(
        workloads=book.counts, components=healthy, uptimes=book.uptimes, updates=book.update_states
    )
    return runtime


async def start_runtime(rt: Runtime, stack: AsyncExitStack) -> None:
    """Open every feature, start the loops and tasks; `stop_runtime` runs first on exit.

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


def deps_of(rt: Runtime, stack: AsyncExitStack) -> Deps:
    return Deps(
        node_id=rt.node_id, signer=rt.signer, metrics=rt.metrics, book=rt.book,
        alerts=rt.alerts, supervisor=rt.supervisor, stack=stack, shared=rt.plan.shared,
        components=rt.components, started_at=rt.started_at, cluster_lock=rt.cluster_lock,
    )  # fmt: skip


async def open_feature(rt: Runtime, spec: Spec[Any, R], deps: Deps) -> R | None:
    """Open `spec` when it is on; a fact of the start that switches it off is recorded
    on its component with the reason."""
    decision = rt.plan.of(spec)
    if not decision.enabled:
        return None
    opened = await spec.open(decision.config, deps)
    component = rt.components[spec.name]
    if isinstance(opened, Off):
        component.switch_off(opened.reason)
        return None
    rt.running[spec] = opened
    component.live = opened.health
    return opened


async def _start(rt: Runtime, stack: AsyncExitStack) -> None:
    deps = deps_of(rt, stack)
    # both servers started before either is probed
    postgres = await open_feature(rt, POSTGRES, deps)
    nats = await open_feature(rt, NATS, deps)
    database = postgres.address if postgres is not None else None
    deps.database_url = database.get_secret_value() if database is not None else None
    deps.nats_url = nats.address if nats is not None else None
    await asyncio.gather(
        POSTGRES.probe(postgres, deps) if postgres is not None else _nothing(),
        NATS.probe(nats, deps) if nats is not None else _nothing(),
    )
    if postgres is not None:  # after the probe: what the registry's heartbeat finds
        postgres.watched_by = lambda: answered(deps.heartbeat.last) if deps.heartbeat else None
    if nats is not None:  # after the probe: what the job bus's connection says
        nats.watched_by = lambda: _connection(deps)
    for feature in FEATURES:
        if feature not in (POSTGRES, NATS):
            await open_feature(rt, feature, deps)
    _hand_over(rt)
    rt.supervisor.start_loops()
    rt.components["scheduler"].record(datetime.now(UTC), Outcome.ok())
    settings = rt.settings
    log.info(
        "workload manager %s started as node %s (%s); components on: %s",
        __version__,
        rt.node_id,
        settings.app_env.value,
        ", ".join(n for n, c in rt.components.items() if c.enabled),
    )
    if settings.worker_only:
        log.info(
            "worker-only node: no NODE_SYSTEM_ENDPOINT and no DESIRED_STATE_DIR, so no sync "
            "and no report to a backend; the status routes are %s",
            "behind API_TOKEN" if settings.api_token is not None
            else "closed (401: no API_TOKEN is set)" if settings.is_production
            else "open (development, no API_TOKEN)",
        )  # fmt: skip


async def _nothing() -> None:
    return None


def _connection(deps: Deps) -> Outcome | None:
    bus = deps.bus
    if bus is None:
        return None
    if bus.connected:
        return Outcome.ok(connected=True)
    trouble = bus.trouble
    return Outcome.unavailable(trouble, connected=False) if trouble else None


def _hand_over(rt: Runtime) -> None:
    """Every timer and task of every running feature to the supervisor, with the
    feature's component for their outcomes; and the root's own loops. A timer marked
    `spread` runs first a draw of the start-up spread later."""
    supervisor = rt.supervisor
    startup = rt.plan.shared.startup
    for spec, running in rt.running.items():
        component = rt.components[spec.name]
        for timer in running.timers:
            first = startup.after(timer.first_after) if timer.spread else timer.first_after
            supervisor.add_loop(
                timer.name, timer.body, every=timer.every, first_after=first,
                what=timer.what, outage=timer.outage,
                component=component if timer.recorded else None, bounds=timer.bounds,
            )  # fmt: skip
        for task in running.tasks:
            supervisor.start(
                task.name, task.body, restart=task.restart,
                component=component if task.recorded else None,
            )  # fmt: skip
    shared = rt.plan.shared
    watch = HealthWatch(book=rt.book, alerts=rt.alerts)
    every = shared.watch_every
    supervisor.add_loop("health-watch", watch.check, every=every, first_after=every)
    grace = shared.down_grace
    outages = OutageWatch(list(rt.components.values()), rt.alerts, grace=grace)
    look = min(5.0, grace / 2)
    supervisor.add_loop("outage-watch", outages.check, every=look, first_after=look)


# Of the grace period, this share (at most TAIL_CAP_SECONDS) is kept for what comes after
# the loops and the jobs: the final report, `offline` in the registry, closing clients.
TAIL_SHARE = 0.3
TAIL_CAP_SECONDS = 5.0


async def stop_runtime(rt: Runtime) -> None:
    """The orderly shutdown, every step within what is left of the one deadline.

    Phase by phase (`Phase`), the steps of one phase side by side: 1. the fleet is told
    (`draining` in the registry), no new job starts. 2. The loop in progress (a sync
    mid-write) finishes or is cancelled, and beside it the jobs in flight finish or are
    handed back. 3. The uptime record saved, one last report. 4. `offline` in the
    registry. 5. The last alerts. Then the supervised tasks still running; the exit stack
    closes the clients after.
    """
    deadline = rt.shutdown
    deadline.begin()
    rt.stopping = True
    tail = min(TAIL_CAP_SECONDS, deadline.grace * TAIL_SHARE)
    log.info("shutting down within %.1f s", deadline.remaining())
    reserve = {
        Phase.ANNOUNCE: tail, Phase.QUIESCE: tail, Phase.FINAL: tail / 2,
        Phase.DEPART: 0.5, Phase.FLUSH: 0.5,
    }  # fmt: skip
    for phase in Phase:
        steps = [r.stops[phase] for r in rt.running.values() if phase in r.stops]
        runs: list[Awaitable[object]] = [
            within(step.name, deadline.budget(cap=step.cap, reserve=reserve[phase]),
                   _given(step.run, deadline, step.cap, reserve[phase]))
            for step in steps
        ]  # fmt: skip
        if phase is Phase.QUIESCE:
            runs.append(rt.supervisor.stop_loops(within=deadline.budget(reserve=tail)))
        await asyncio.gather(*runs)
    await rt.supervisor.stop_all(budget=deadline.budget(reserve=0.25))
    log.info("shutdown steps done with %.1f s to spare", deadline.remaining())


def _given(
    run: Callable[[float], Any], deadline: Deadline, cap: float | None, reserve: float
) -> Callable[[], Any]:
    """The step, given the budget it has when it begins."""
    return lambda: run(deadline.budget(cap=cap, reserve=reserve))


async def open_sync_only(rt: Runtime, stack: AsyncExitStack) -> Syncer | None:
    """The syncer alone, as the one-shot CLI and the sync tests use it."""
    from app.services.features.sync import SYNC

    opened = await open_feature(rt, SYNC, deps_of(rt, stack))
    return opened.syncer if opened is not None else None


async def open_self_update_only(rt: Runtime, stack: AsyncExitStack) -> SelfUpdater | None:
    """The self-updater alone, as `workload-manager self-update` and its tests use it."""
    from app.services.features.self_update import SELF_UPDATE

    opened = await open_feature(rt, SELF_UPDATE, deps_of(rt, stack))
    return opened.updater if opened is not None else None
