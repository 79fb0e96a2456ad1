"""The node health report: every minute, the node and each workload's status, signed and
sent to the backend (or, with no backend configured, to the log and `/v1/status`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.domain.redaction import redact_url
from app.services.features.base import Decision, Off, On, Phase, Running, Spec, Step, Timer
from app.services.features.deps import Decisions, Deps, Shared, plain_http_note
from app.services.reporting import Reporter
from app.settings import Settings


@dataclass(frozen=True)
class ReportConfig:
    interval: float
    to_backend: bool  # False: the report goes to the log and /v1/status only
    data_dir: Path  # its disk is reported (its parent's until it exists)
    # the bounds of an interval the backend asks for (X-Report-Interval-Seconds)
    bounds: tuple[float, float] = (30.0, 900.0)


@dataclass(kw_only=True)
class Reporting(Running):
    reporter: Reporter


class _Report(Spec[ReportConfig, Reporting]):
    name = "report"

    def decide(
        self, settings: Settings, shared: Shared, earlier: Decisions
    ) -> Decision[ReportConfig]:
        if not settings.report_enabled:
            return Off("switched off by REPORT_ENABLED=false")
        endpoint = settings.node_system_endpoint
        config = ReportConfig(
            settings.report_interval_seconds, endpoint is not None, settings.data_dir,
            (settings.report_interval_min_seconds, settings.report_interval_max_seconds),
        )  # fmt: skip
        if endpoint is None:
            return On(config, "no NODE_SYSTEM_ENDPOINT: reports go to the log and /v1/status")
        if not shared.can_sign:
            return Off(
                "NODE_SYSTEM_ENDPOINT is set but there is no NODE_PRIVATE_KEY, "
                "NODE_PRIVATE_KEY_FILE or ~/.config/lfgnode/config.yaml (NODE_CONFIG_FILE) "
                "to sign with"
            )
        return On(
            config,
            f"signed reports to {redact_url(endpoint)}"
            + plain_http_note(settings, "NODE_SYSTEM_ENDPOINT"),
        )

    async def open(self, config: ReportConfig, deps: Deps) -> Reporting:
        reporter = Reporter(
            node_id=deps.node_id,
            book=deps.book,
            backend=deps.backend() if config.to_backend else None,
            disk_path=config.data_dir if config.data_dir.exists() else config.data_dir.parent,
            started_at=deps.started_at,
        )
        every = config.interval
        report = Timer(
            "report", reporter.report_once, every, min(5.0, every), "node report", spread=True,
            bounds=config.bounds if config.to_backend else None,
        )  # fmt: skip
        # one last report once the jobs are done (the node says it is going)
        final = Step("final report", lambda _budget: deps.supervisor.run_now("report"), cap=5.0)
        return Reporting(reporter=reporter, timers=[report], stops={Phase.FINAL: final})


REPORT = _Report()
