"""Prometheus metrics, one registry per manager instance.

A registry per instance (not the global one) keeps tests and embedded uses isolated.
Gauges that describe current state (workloads by status, components up) are computed
at scrape time from the runtime, so they can never drift from `/v1/status`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, Literal, get_args

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app import __version__

PREFIX = "workload_manager"

# why the HTTP server refused or closed a connection before a request reached the app
HttpRefusal = Literal[
    "header-too-large",
    "header-timeout",
    "body-timeout",
    "trailer-too-large",
    "too-many-connections",
    "too-many-connections-from-client",
]
HTTP_REFUSALS: tuple[HttpRefusal, ...] = get_args(HttpRefusal)


class _StateCollector(Collector):
    def __init__(
        self,
        workloads: Callable[[], dict[str, int]],
        components: Callable[[], dict[str, bool]],
        uptimes: Callable[[], list[tuple[str, str, float]]],
        updates: Callable[[], list[tuple[str, str]]],
    ) -> None:
        self._workloads = workloads
        self._components = components
        self._uptimes = uptimes
        self._updates = updates

    def collect(self) -> Iterable[Metric]:
        by_status = GaugeMetricFamily(
            f"{PREFIX}_workloads", "Workloads by derived status.", labels=["status"]
        )
        for status, count in sorted(self._workloads().items()):
            by_status.add_metric([status], count)
        yield by_status
        uptime = GaugeMetricFamily(
            f"{PREFIX}_workload_uptime_ratio",
            "Share of time healthy or degraded over the window (24h, 7d); absent without data.",
            labels=["workload", "window"],
        )
        for name, window, value in self._uptimes():
            uptime.add_metric([name, window], value)
        yield uptime
        update = GaugeMetricFamily(
            f"{PREFIX}_workload_update_state",
            "1 for the state of each managed workload's update (current, waiting-wave, "
            "halted, outside-window, deferred, applying, judging, healthy, rolled-back, "
            "held-failed).",
            labels=["workload", "state"],
        )
        for name, state in self._updates():
            update.add_metric([name, state], 1.0)
        yield update
        up = GaugeMetricFamily(
            f"{PREFIX}_component_up",
            "1 when an enabled component is not failing, 0 when failing; absent when off.",
            labels=["component"],
        )
        for name, healthy in sorted(self._components().items()):
            up.add_metric([name], 1.0 if healthy else 0.0)
        yield up
        tasks = GaugeMetricFamily(
            f"{PREFIX}_asyncio_tasks",
            "Asyncio tasks alive in the manager's event loop; a steady climb is a leak.",
        )
        try:
            tasks.add_metric([], len(asyncio.all_tasks()))
        except RuntimeError:  # collected outside the event loop: no sample
            pass
        yield tasks


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        Info(f"{PREFIX}_build", "Build of the running manager.", registry=self.registry).info(
            {"version": __version__}
        )
        self.pings = Counter(
            f"{PREFIX}_pings_total",
            "Accepted health pings by workload and reported status.",
            ["workload", "status"],
            registry=self.registry,
        )
        # the ping counter children by workload, so a forgotten workload's series go
        self._ping_children: dict[tuple[str, str], Any] = {}
        self.ping_rejections = Counter(
            f"{PREFIX}_ping_rejections_total",
            "Rejected health pings by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.http_refusals = Counter(
            f"{PREFIX}_http_refusals_total",
            "Connections the HTTP server refused or closed for its own bounds (before a "
            "request reached the application, or, for body-timeout, while it waited for "
            "the body), by reason.",
            ["reason"],
            registry=self.registry,
        )
        for reason in HTTP_REFUSALS:  # every reason from the start: 0, not absent
            self.http_refusals.labels(reason)
        self.loop_duration = Histogram(
            f"{PREFIX}_loop_duration_seconds",
            "Time one run of a periodic loop took (a report, a sync, a heartbeat), retries "
            "included, by loop.",
            ["loop"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.job_runs = Counter(
            f"{PREFIX}_scheduled_runs_total",
            "Scheduled loop runs by loop and outcome.",
            ["loop", "outcome"],
            registry=self.registry,
        )
        self.sync_actions = Counter(
            f"{PREFIX}_sync_actions_total",
            "Per-workload sync actions by kind (create, update, delete, noop, hold) and outcome.",
            ["action", "outcome"],
            registry=self.registry,
        )
        self.desired_serial = Gauge(
            f"{PREFIX}_desired_state_serial",
            "Serial of the signed desired state the sync enforces (absent when unsigned).",
            registry=self.registry,
        )
        self.desired_offline = Gauge(
            f"{PREFIX}_desired_state_offline",
            "1 while the backend fails and the last good state stored on the node stands in.",
            registry=self.registry,
        )
        self.desired_refused = Counter(
            f"{PREFIX}_desired_state_refused_total",
            "Desired-state answers and manifests refused as not signed for this node, out of "
            "order, or not matching their signed digest, by what (answer, manifest).",
            ["what"],
            registry=self.registry,
        )
        for what in ("answer", "manifest"):
            self.desired_refused.labels(what)
        self.jobs = Counter(
            f"{PREFIX}_jobs_total",
            "Job deliveries by job type and outcome (completed, retrying, dead, rejected, "
            "expired, refused, not-here, held, duplicate, ...).",
            ["type", "outcome"],
            registry=self.registry,
        )
        self.job_duration = Histogram(
            f"{PREFIX}_job_duration_seconds",
            "Time from delivery to answer, by job type.",
            ["type"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=self.registry,
        )
        self.jobs_unroutable = Counter(
            f"{PREFIX}_jobs_unroutable_total",
            "Jobs the registry says no live node can run.",
            registry=self.registry,
        )
        self.job_events_unsent = Counter(
            f"{PREFIX}_job_events_unsent_total",
            "Final job events (dead, rejected, expired) the stream did not acknowledge; "
            "the job was handed back to be decided again instead of terminated.",
            registry=self.registry,
        )
        self.jobs_in_flight = Gauge(
            f"{PREFIX}_jobs_in_flight", "Jobs running on this node now.", registry=self.registry
        )
        self.consumer_pending = Gauge(
            f"{PREFIX}_consumer_pending_messages",
            "Messages in the tier's consumer not yet delivered, by stream.",
            ["stream"],
            registry=self.registry,
        )
        self.consumer_ack_pending = Gauge(
            f"{PREFIX}_consumer_ack_pending_messages",
            "Messages delivered and not yet answered (by any node of the tier), by stream.",
            ["stream"],
            registry=self.registry,
        )
        self.self_updates = Counter(
            f"{PREFIX}_self_updates_total",
            "Self-update steps by outcome (applied, available, rolled-back, rollback-failed, "
            "check-failed).",
            ["outcome"],
            registry=self.registry,
        )
        self.workload_updates = Counter(
            f"{PREFIX}_workload_updates_total",
            "Workload update outcomes: applied, healthy, rolled_back, held (both versions "
            "failed, or nowhere to go back to).",
            ["outcome"],
            registry=self.registry,
        )
        self.workload_restarts = Counter(
            f"{PREFIX}_workload_restarts_total",
            "Rollout restarts made by uptime management, by outcome (restarted, failed, "
            "budget-spent).",
            ["outcome"],
            registry=self.registry,
        )
        self.alerts = Counter(
            f"{PREFIX}_alerts_total",
            "Alerts by outcome (raised, suppressed, delivered, undelivered, dropped).",
            ["outcome"],
            registry=self.registry,
        )
        self.up_since = Gauge(
            f"{PREFIX}_start_time_seconds",
            "Unix time the manager started.",
            registry=self.registry,
        )
        self.up_since.set_to_current_time()

    def count_ping(self, workload: str, status: str) -> None:
        child = self._ping_children.get((workload, status))
        if child is None:
            child = self._ping_children[(workload, status)] = self.pings.labels(workload, status)
        child.inc()

    def forget_workload(self, workload: str) -> None:
        """Drop a forgotten workload's series (the book bounds how many there are)."""
        for key in [k for k in self._ping_children if k[0] == workload]:
            del self._ping_children[key]
            self.pings.remove(*key)

    def watch_state(
        self,
        *,
        workloads: Callable[[], dict[str, int]],
        components: Callable[[], dict[str, bool]],
        uptimes: Callable[[], list[tuple[str, str, float]]] = list,
        updates: Callable[[], list[tuple[str, str]]] = list,
    ) -> None:
        self.registry.register(_StateCollector(workloads, components, uptimes, updates))
