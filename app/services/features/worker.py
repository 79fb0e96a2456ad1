"""The job worker: JetStream durable consumers of the node's tier, each job's requirements
matched against the node's profile, run once (the idempotency ledger), answered (ACK, NAK
with a delay, TERM) and told as an event."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from app.domain.components import Outcome
from app.domain.http_targets import AllowedTargets
from app.services.features.base import Decision, Off, On, Phase, Running, Spec, Step, Task, Timer
from app.services.features.deps import Decisions, Deps, Shared
from app.services.supervision import Deadline, within
from app.settings import Settings

if TYPE_CHECKING:
    from app.adapters.bus import JetStreamBus
    from app.domain.job_flow import WorkerConfig
    from app.domain.topology import Topology
    from app.metrics import Metrics
    from app.services.working import Worker

log = logging.getLogger(__name__)

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


@dataclass(kw_only=True)
class Working(Running):
    worker: Worker
    bus: JetStreamBus
    prepared: bool = False  # connected, the topology there, the registration awaited

    def health(self) -> Outcome | None:
        """Unavailable while the bus is not connected, naming the server and the error
        (from the first attempt on); once connected and prepared, what its fetchers say
        (`Worker.state`: fetching, failing, or stuck). Until either is known, its task's
        record stands."""
        if not self.bus.connected:
            trouble = self.bus.trouble
            if trouble is None and not self.prepared:
                return None
            return Outcome.unavailable(trouble or "not connected", connected=False)
        return self.worker.state() if self.prepared else None


def choose_ledger(plan: WorkerPlan, *, registry_running: bool) -> LedgerHome | Off:
    """Where the worker keeps its idempotency ledger, once the start has shown whether the
    registry runs: the planned home, the JetStream bucket when JOB_LEDGER=auto planned
    PostgreSQL's and the registry is not running, or off when JOB_LEDGER=postgres."""
    if plan.ledger == "jetstream" or registry_running:
        return plan.ledger
    if plan.ledger_fallback:
        return "jetstream"
    return Off("JOB_LEDGER=postgres but the registry is not running")


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


class _Worker(Spec[WorkerPlan, Working]):
    name = "worker"
    critical = True

    def decide(
        self, settings: Settings, shared: Shared, earlier: Decisions
    ) -> Decision[WorkerPlan]:
        if not settings.worker_enabled:
            return Off("switched off by WORKER_ENABLED=false")
        if settings.nats_url is None and not shared.embedded:
            return Off("no NATS_URL set")
        from app.services.features.registry import REGISTRY

        registry_on = earlier.of(REGISTRY).enabled
        if settings.job_ledger == "postgres" and not registry_on:
            return Off("JOB_LEDGER=postgres but there is no registry database")
        from app.domain.job_flow import WorkerConfig
        from app.domain.topology import Topology

        ledger: LedgerHome = (
            "postgres" if registry_on and settings.job_ledger != "jetstream" else "jetstream"
        )
        plan = WorkerPlan(
            worker=WorkerConfig(
                tier=settings.tier.value,
                concurrency=settings.worker_concurrency,
                batch=settings.job_fetch_batch,
                ack_wait=settings.job_ack_wait_seconds,
                max_attempts=settings.job_max_attempts,
                max_deliveries=settings.job_max_deliveries,
                backoff=tuple(settings.job_backoff_seconds),
                not_here_delay=settings.job_not_here_delay_seconds,
                held_delay=settings.job_held_delay_seconds,
                job_timeout=settings.job_timeout_seconds,
                pull_wait=settings.worker_pull_wait_seconds,
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
                job_consumer_max_waiting=settings.job_consumer_max_waiting,
                ledger_ttl_seconds=settings.ledger_ttl_seconds,
            ),
            auto_init_streams=settings.auto_init_streams,
            timeout=settings.backend_timeout_seconds,
            http_timeout=settings.http_job_timeout_seconds,
            http_allowed_targets=settings.http_job_allowed_targets
            or AllowedTargets.namespace(settings.managed_namespace),
        )
        return On(plan, worker_reason(plan, ledger))

    async def open(self, plan: WorkerPlan, deps: Deps) -> Working | Off:
        """The worker and its bus, not yet running: its task connects inside it, so a NATS
        outage at start delays the worker, never the manager.

        The idempotency ledger is where `choose_ledger` says: PostgreSQL's when the
        registry runs, else the tier's JetStream bucket's. On PostgreSQL's ledger the
        worker waits for the node's registration (the ledger's schema exists by then)
        before it takes a job."""
        if deps.nats_url is None:
            return Off("nats-server is not running (see the nats component)")
        home = choose_ledger(plan, registry_running=deps.registry is not None)
        if isinstance(home, Off):
            return home
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
            inbox = inbox_prefix(tier, deps.node_id)  # the only inboxes the tier may read
        except ValueError as exc:
            return Off(str(exc))
        component = deps.component(self)
        bus = deps.bus = JetStreamBus(
            deps.nats_url, name=f"workload-manager/{deps.node_id}", timeout=plan.timeout,
            auth=deps.shared.nats_auth, inbox_prefix=inbox,
            reconnect=deps.shared.nats_reconnect,
        )  # fmt: skip
        http = WorkloadHttp(timeout=plan.http_timeout, allowed_targets=plan.http_allowed_targets)
        deps.stack.push_async_callback(http.aclose)
        claimant = uuid.uuid4().hex
        ledger: Ledger
        kv_ledger: JetStreamLedger | None = None
        if home == "postgres":
            assert deps.registry is not None  # choose_ledger: only with a registry
            ledger = AsyncpgLedger(deps.registry, node_id=deps.node_id, claimant=claimant)
            component.facts["ledger"] = "postgres"
        else:
            # a lease (2 x ack wait) holds several tries of renewing it: else a failover of
            # the bucket's leader outlasts the lease and another node runs the job again
            ledger = kv_ledger = JetStreamLedger(
                tier=tier, node_id=deps.node_id, claimant=claimant,
                timeout=min(plan.timeout, request_timeout(plan.worker.ack_wait)),
            )  # fmt: skip
            component.facts["ledger"] = f"jetstream bucket {ledger_bucket(tier)}"
        component.reason = worker_reason(plan, home)
        registered = deps.registered

        async def prepare() -> None:
            """Connect, make sure the topology exists, and, for PostgreSQL's ledger, wait
            for the node's registration. A subject NATS denies this node's credentials
            ends in NatsRefused naming it (the supervisor retries with backoff)."""
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
            component.facts["topology"] = dict(changes)
            if kv_ledger is not None:  # made by init_streams (above, or by the operator)
                kv_ledger.bind(await bus.key_value(kv_ledger.bucket))
            if home == "postgres":
                await registered.wait()  # a JetStream ledger waits for no PostgreSQL
            running.prepared = True

        worker = Worker(
            bus=bus, ledger=ledger, node=deps.profile(), registry=deps.registry,
            handlers=JobHandlers(load_handlers(), http), config=plan.worker,
            metrics=deps.metrics, alerts=deps.alerts, prepare=prepare,
            start_after=deps.shared.startup.offset(),  # its connection, spread
        )  # fmt: skip
        deps.metrics.jobs_in_flight.set_function(lambda: worker.in_flight)
        running = Working(
            worker=worker,
            bus=bus,
            tasks=[Task("job-worker", worker.run)],
            timers=[
                Timer(
                    "consumer-stats",
                    _consumer_stats(bus, deps.metrics, tier),
                    15.0,
                    5.0,
                    recorded=False,
                ),
            ],
            stops={
                Phase.ANNOUNCE: Step("job intake", _stop_intake(worker), None),
                Phase.QUIESCE: Step("jobs in flight", _drain(worker, bus, deps), None),
            },
        )
        return running


def _stop_intake(worker: Worker) -> Callable[[float], Awaitable[None]]:
    async def stop(_budget: float) -> None:
        worker.begin_stop()  # nothing new starts from here on

    return stop


def _drain(worker: Worker, bus: JetStreamBus, deps: Deps) -> Callable[[float], Awaitable[None]]:
    """The jobs in flight finish or go back, within the step's budget: the node's
    `draining` event, the jobs, the task, the `offline` event, the connection."""

    async def drain(budget: float) -> None:
        left = Deadline(budget)
        left.begin()
        if bus.connected:
            await within("node.draining event", left.budget(cap=1.0, reserve=2.0),
                         worker.announce_draining)  # fmt: skip
        await worker.drain(within=left.budget(reserve=2.0))
        await deps.supervisor.stop("job-worker", budget=left.budget(cap=2.0, reserve=1.0))
        if bus.connected:
            await within("node.offline event", left.budget(cap=1.0, reserve=0.5),
                         worker.announce_offline)  # fmt: skip
        await bus.drain(within=left.budget(cap=3.0))

    return drain


def _consumer_stats(
    bus: JetStreamBus, metrics: Metrics, tier: str
) -> Callable[[], Awaitable[None]]:
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


WORKER = _Worker()
