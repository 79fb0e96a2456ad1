"""The node health report loop: read the book and the machine, build, sign and send.

With no backend configured (development), the report goes to the log and to
`/v1/status` only. A failed delivery is logged, counted and simply tried again at the
next tick with fresh data (or, after a Retry-After, once it passes): old reports are
never queued, since only the latest matters. The backend's answer may ask for another
interval (`X-Report-Interval-Seconds`), which the supervisor applies within bounds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app import __version__
from app.adapters import system
from app.domain.components import Cadence, Outcome
from app.domain.reports import build_report
from app.services.workloads import WorkloadBook

if TYPE_CHECKING:
    from app.adapters.backend import BackendClient

log = logging.getLogger(__name__)


class Reporter:
    def __init__(
        self,
        *,
        node_id: str,
        book: WorkloadBook,
        backend: BackendClient | None,
        disk_path: Path,
        started_at: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._node_id = node_id
        self._book = book
        self.backend = backend
        self._disk_path = disk_path
        self._started_at = started_at
        self._clock = clock
        self.last_report: dict[str, Any] | None = None

    def build(self) -> dict[str, Any]:
        origin = self._book.desired_origin
        now = datetime.now(UTC)
        return build_report(
            node_id=self._node_id,
            manager_version=__version__,
            uptime_seconds=self._clock() - self._started_at,
            reported_at=now,
            system=system.sample(self._disk_path),
            workloads=self._book.views(),
            desired=origin.as_dict(now) if origin is not None else None,
        )

    async def report_once(self) -> Outcome:
        """Build and deliver one report: OK when it was delivered (or logged locally)."""
        report = self.build()
        self.last_report = report
        if self.backend is None:
            log.info(
                "node report (no backend configured): %d workloads",
                len(report["workloads"]),
                extra={"report": report},
            )
            return Outcome.ok(target="log")
        from app.adapters.backend import REPORT, BackendError

        try:
            await self.backend.post_health(report)
        except BackendError as exc:
            return Outcome.failed(f"not delivered: {exc}").retrying(exc.retry_after)
        log.debug("node report delivered: %d workloads", len(report["workloads"]))
        # the interval the backend asked for in its answer (none: the configured one)
        asked = Cadence(self.backend.interval_asked(REPORT))
        return Outcome.ok(target="backend").paced(asked)
