"""The workload health watch: alerts on workloads that turn bad, and forgetting; and the
outage watch: alerts on the manager's own components that stay down.

A loop of its own (`health-watch`), independent of reporting: a node that sends no
reports (`REPORT_ENABLED=false`, no backend) still alerts when a workload turns
unhealthy, stale or failed, and still forgets workloads that went silent.
"""

from __future__ import annotations

from datetime import UTC, datetime

from app.domain.components import Component, outage_alerts
from app.domain.reports import WorkloadView
from app.services.alerting import Alerter
from app.services.workloads import WorkloadBook

BAD_STATUSES = frozenset({"unhealthy", "stale", "failed", "crashlooping"})
GOOD_STATUSES = frozenset({"healthy", "degraded"})


class HealthWatch:
    def __init__(self, *, book: WorkloadBook, alerts: Alerter) -> None:
        self._book = book
        self._alerts = alerts
        self._statuses: dict[str, str] = {}

    async def check(self) -> None:
        """One look at the book: forget the silent, alert on each change for the worse
        (and on recovery)."""
        self._book.forget_silent()
        self.alert_transitions(self._book.views())

    def alert_transitions(self, views: list[WorkloadView]) -> None:
        """One alert when a workload turns unhealthy, stale, failed or crashlooping, one
        when it recovers."""
        current = {view.name: view.status for view in views}
        for name, status in current.items():
            before = self._statuses.get(name)
            if status in BAD_STATUSES and before != status:
                self._alerts.alert(f"workload:{name}:{status}", f"workload {name} is {status}")
            elif before in BAD_STATUSES and status in GOOD_STATUSES:
                self._alerts.alert(
                    f"workload:{name}:recovered", f"workload {name} recovered ({status})"
                )
        self._statuses = current


class OutageWatch:
    """One alert when a component has been failing for the grace period (NATS lost, the
    registry's PostgreSQL down), one when it recovers (`outage_alerts`)."""

    def __init__(self, components: list[Component], alerts: Alerter, *, grace: float) -> None:
        self._components = components
        self._alerts = alerts
        self._grace = grace
        self._down: frozenset[str] = frozenset()

    async def check(self) -> None:
        raised, self._down = outage_alerts(
            self._components, self._down, now=datetime.now(UTC), grace=self._grace
        )
        for key, text in raised:
            self._alerts.alert(key, text)
