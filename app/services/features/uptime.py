"""Uptime: each workload's share of time healthy, counted and kept (the uptime record), and
workloads unhealthy for too long restarted (uptime management, on the sync's access)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, cast

from app.domain.uptime import SAVE_EVERY_SECONDS
from app.services.features.base import Decision, Off, On, Phase, Running, Spec, Step, Timer
from app.services.features.deps import Decisions, Deps, Shared
from app.settings import Settings

if TYPE_CHECKING:
    from app.domain.uptime import RestartPolicy
    from app.services.uptime import UptimeKeeper, UptimeRecorder

UPTIME_CONFIG_MAP = "workload-manager-uptime"


@dataclass(frozen=True)
class UptimeRecordConfig:
    file: Path  # where the record is kept outside a cluster
    config_map_namespace: str | None  # the manager's own namespace, in a cluster
    every: float  # how often the book's statuses are counted


@dataclass(kw_only=True)
class Recording(Running):
    recorder: UptimeRecorder


class _UptimeRecord(Spec[UptimeRecordConfig, Recording]):
    name = "uptime_record"

    def decide(
        self, settings: Settings, shared: Shared, earlier: Decisions
    ) -> Decision[UptimeRecordConfig]:
        return On(
            UptimeRecordConfig(
                file=settings.data_dir / "uptime.json",
                config_map_namespace=settings.pod_namespace,
                every=shared.watch_every,
            ),
            "counts each workload's share of time healthy (24 h, 7 d), saved every "
            f"{SAVE_EVERY_SECONDS:.0f} s and at shutdown",
        )

    async def open(self, config: UptimeRecordConfig, deps: Deps) -> Recording:
        """Kept in the ConfigMap `workload-manager-uptime` of the manager's own namespace
        when it runs in a cluster (it outlives the pod, a self-update included; on the
        shared client), else in DATA_DIR/uptime.json. What reading it found is recorded."""
        from app.services.uptime import FileStore, UptimeRecorder, UptimeStore

        path = config.file
        store: UptimeStore = FileStore(path)
        where, errors = f"file {path}", cast(tuple[type[Exception], ...], ())
        namespace = config.config_map_namespace
        cluster = deps.cluster_if_open()
        if cluster is not None and namespace is not None:
            from app.adapters.kube import KubeError
            from app.services.uptime import ConfigMapStore

            own = cluster.client.in_namespace(namespace)
            store, errors = ConfigMapStore(own, UPTIME_CONFIG_MAP), (KubeError,)
            where = f"ConfigMap {namespace}/{UPTIME_CONFIG_MAP}"
        every = config.every
        recorder = UptimeRecorder(store=store, where=where, errors=errors, max_step=3 * every)
        deps.component(self).record(datetime.now(UTC), await recorder.open())
        deps.uptime_record = recorder
        deps.book.set_uptime(recorder.shares)
        book = deps.book

        async def observe() -> None:
            recorder.observe(book.statuses())

        # what was counted since the last save, saved once the loops have stopped
        save = Step("uptime record", lambda _budget: deps.supervisor.run_now("uptime-save"), 2.0)
        return Recording(
            recorder=recorder,
            timers=[
                Timer("uptime-record", observe, every, 0.1, recorded=False),
                Timer(
                    "uptime-save",
                    recorder.save,
                    SAVE_EVERY_SECONDS,
                    SAVE_EVERY_SECONDS,
                    "uptime record save",
                ),
            ],
            stops={Phase.FINAL: save},
        )


@dataclass(frozen=True)
class UptimeConfig:
    policy: RestartPolicy
    every: float


@dataclass(kw_only=True)
class Keeping(Running):
    keeper: UptimeKeeper


class _Uptime(Spec[UptimeConfig, Keeping]):
    name = "uptime"

    def decide(
        self, settings: Settings, shared: Shared, earlier: Decisions
    ) -> Decision[UptimeConfig]:
        if not settings.uptime_restart_enabled:
            return Off("switched off by UPTIME_RESTART_ENABLED=false")
        from app.services.features.sync import SYNC

        sync = earlier.of(SYNC)
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
            UptimeConfig(policy, shared.watch_every),
            "rollout-restarts managed workloads unhealthy or stale for longer than "
            f"{settings.uptime_restart_after_seconds:.0f} s",
        )

    async def open(self, config: UptimeConfig, deps: Deps) -> Keeping | Off:
        """On the shared cluster client, with the sync's access (its role may patch the
        managed Deployments); its restarts are kept in the uptime record."""
        cluster = deps.cluster_if_open()
        if cluster is None or deps.syncer is None:
            return Off("needs the sync's cluster access, and the sync did not start")
        from app.adapters.kube import KubeError
        from app.services.uptime import UptimeKeeper

        record = deps.uptime_record.record if deps.uptime_record is not None else None
        keeper = UptimeKeeper(
            book=deps.book, kube=cluster.client, errors=(KubeError,),
            cluster_lock=deps.cluster_lock, alerts=deps.alerts, metrics=deps.metrics,
            policy=config.policy, record=record,
        )  # fmt: skip
        every = config.every
        return Keeping(
            keeper=keeper, timers=[Timer("uptime", keeper.check, every, every, "uptime management")]
        )


UPTIME_RECORD = _UptimeRecord()
UPTIME = _Uptime()
