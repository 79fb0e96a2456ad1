"""What uptime management holds per workload stays bounded as workloads come and go (a
node's workloads churn for months between restarts of the manager). No cluster: these
workloads only ping, so none is restarted."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

from app.domain.health import Ping, PingStatus
from app.domain.uptime import RestartPolicy
from app.metrics import Metrics
from app.services.alerting import Alerter
from app.services.uptime import UptimeKeeper
from app.services.workloads import WorkloadBook

POLICY = RestartPolicy(
    after_seconds=180, backoff_seconds=300, backoff_max_seconds=3600,
    per_workload_per_hour=2, per_node_per_hour=10,
)  # fmt: skip


class NoCluster:
    async def restart(self, name: str, *, at: datetime) -> dict[str, Any]:
        raise AssertionError(f"{name} is not managed: never restarted")


async def test_workloads_that_are_gone_are_forgotten() -> None:
    mono = [0.0]
    book = WorkloadBook(stale_after=5, forget_after=10, capacity=50, clock=lambda: mono[0])
    keeper = UptimeKeeper(
        book=book, kube=NoCluster(), errors=(), cluster_lock=asyncio.Lock(),
        alerts=Alerter(node_id="n1", metrics=Metrics(), window_seconds=60), metrics=Metrics(),
        policy=POLICY, clock=lambda: mono[0],
    )  # fmt: skip
    for i in range(300):
        book.record(f"w{i}", Ping(status=PingStatus.UNHEALTHY))
        outcome = await keeper.check()
        assert f"w{i}" in outcome.detail["workloads"]  # its reason: not managed
        mono[0] += 11.0
        book.forget_silent()
    outcome = await keeper.check()
    assert outcome.detail["workloads"] == {}
    assert keeper.held == 0
