"""The soak's verdict and report: checks against the targets, tables, notes, JSON.

A check is met or not, never "about"; the exit code follows the checks. The tables are
the bench's format (bench.__main__.render_table), the JSON keeps every sample.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.soak_load import JobStats, PingStats
from bench.soak_observe import MB, LogScan, QuietReading, Sample, Scrape, activity, server_errors

RSS_GROWTH_TARGET_MB = 5.0
LEAKED_TASKS_TARGET = 0
SAMPLE_ROWS = 14  # rows of the resource table; the JSON has every sample
RSS_CHECK = "manager RSS growth (quiet, after warm-up -> end)"
TASKS_CHECK = "asyncio tasks leaked (quiet, end - after warm-up)"
TREND_MIN_SECONDS = 300.0  # a shorter measured phase makes a slope of noise


@dataclass(frozen=True)
class LedgerCheck:
    """Every job JetStream acked must be one completed ledger row."""

    published: int
    completed: int
    lost: list[str]  # acked keys without a completed row (first few)
    lost_count: int
    not_completed: dict[str, int]  # ledger status -> rows, for the soak's keys
    claimed_more_than_once: int
    unconfirmed_in_ledger: int  # rows whose publish the soak saw fail (the ack was lost)

    def as_dict(self) -> dict[str, Any]:
        return {
            "published": self.published,
            "completed": self.completed,
            "lost": self.lost_count,
            "lost_keys_first": self.lost,
            "not_completed_by_status": self.not_completed,
            "claimed_more_than_once": self.claimed_more_than_once,
            "completed_without_publish_ack": self.unconfirmed_in_ledger,
        }


@dataclass
class Outcome:
    """Everything a soak observed, before judging it."""

    config: dict[str, Any]
    samples: list[Sample]
    baseline: QuietReading
    final: QuietReading
    load_start_sample: Sample  # the first sample of the measured phase, under load
    load_end_sample: Sample  # the last one, under load
    start_scrape: Scrape | None
    end_scrape: Scrape | None
    pings: PingStats
    jobs: JobStats
    ledger: LedgerCheck
    drained: bool
    consumers: dict[str, dict[str, int]]
    converged: bool
    mismatched: dict[str, list[str]]  # name -> [desired, deployed] at the end
    bumped: int
    backend: dict[str, Any]
    kube: dict[str, Any]
    scrape_failures: dict[str, int]
    measured_seconds: float
    manager_exit: int | None = None
    log: LogScan = field(default_factory=LogScan)


@dataclass(frozen=True)
class Check:
    what: str
    target: str
    observed: str
    met: bool


def _mb(value: float) -> str:
    return f"{value / MB:.1f}"


def _met(check: Check) -> str:
    return "met" if check.met else "NOT MET"


def _signed(value: float, digits: int = 1) -> str:
    return f"{value:+.{digits}f}"


def _slope_mb_per_hour(samples: Sequence[Sample]) -> float | None:
    """Least-squares RSS trend over the measured phase: a leak shows as a steady slope."""
    points = [(s.t, s.rss_bytes / MB) for s in samples if s.phase == "measured"]
    if len(points) < 2 or points[-1][0] - points[0][0] < TREND_MIN_SECONDS:
        return None
    xs, ys = zip(*points, strict=True)
    slope, _ = statistics.linear_regression(xs, ys)
    return slope * 3600


def client_errors(o: Outcome) -> dict[str, int]:
    return {
        "pings without a 2xx": o.pings.failed,
        "job publishes without an ack": sum(o.jobs.failures.values()),
        "/metrics scrapes failed": sum(o.scrape_failures.values()),
        "backend: requests rejected (contract)": o.backend["rejected"],
        "backend: answers >= 400": o.backend["errors"],
        "kube API: unexpected answers": o.kube["errors"],
    }


def log_errors(o: Outcome) -> dict[str, int]:
    return {
        "log: ERROR/CRITICAL lines": o.log.error_lines,
        "log: Traceback lines": o.log.tracebacks,
    }


def checks(o: Outcome) -> list[Check]:
    growth = (o.final.rss_bytes - o.baseline.rss_bytes) / MB
    leaked = o.final.tasks_min - o.baseline.tasks_min
    server = server_errors(o.end_scrape) if o.end_scrape else {}
    errors = sum(server.values()) + sum(client_errors(o).values()) + sum(log_errors(o).values())
    down = sorted({c for s in o.samples for c in s.components_down})
    clean_exit = o.manager_exit in (0, -15)
    return [
        Check(RSS_CHECK, f"< {RSS_GROWTH_TARGET_MB} MB", f"{_signed(growth)} MB",
              growth < RSS_GROWTH_TARGET_MB),
        Check(TASKS_CHECK, f"{LEAKED_TASKS_TARGET}", f"{leaked:+d}",
              leaked <= LEAKED_TASKS_TARGET),
        Check("errors (manager counters + client side + log)", "0", str(errors),
              errors == 0 and o.end_scrape is not None),
        Check("jobs lost (JetStream acked, not completed in the ledger)", "0",
              f"{o.ledger.lost_count} of {o.ledger.published}",
              o.ledger.lost_count == 0 and o.ledger.completed == o.ledger.published),
        Check("job consumers drained at the end", "nothing pending or unacked",
              "yes" if o.drained else f"no: {o.consumers}", o.drained),
        Check("cluster converged to the desired versions at the end", "yes",
              "yes" if o.converged else f"no: {len(o.mismatched)} differ", o.converged),
        Check("components never down (component_up, every sample)", "none",
              ", ".join(down) or "none", not down),
        Check("manager stopped cleanly on SIGTERM", "exit 0 or -15", str(o.manager_exit),
              clean_exit),
    ]  # fmt: skip


def verdict(found: Sequence[Check]) -> tuple[bool, str]:
    missed = [c for c in found if not c.met]
    if not missed:
        return True, "SOAK PASSED: every target met, nothing lost"
    reasons = "; ".join(f"{c.what}: {c.observed} (target {c.target})" for c in missed)
    return False, f"SOAK FAILED: {reasons}"


# --- tables ------------------------------------------------------------------------------


def _targets_table(o: Outcome, found: Sequence[Check]) -> dict[str, Any]:
    b, f = o.baseline, o.final
    rows = [
        ["manager RSS, MB (quiet)", _mb(b.rss_bytes), _mb(f.rss_bytes),
         _signed((f.rss_bytes - b.rss_bytes) / MB), f"< {RSS_GROWTH_TARGET_MB} MB growth"],
        ["manager RSS, MB (under load)", _mb(o.load_start_sample.rss_bytes),
         _mb(o.load_end_sample.rss_bytes),
         _signed((o.load_end_sample.rss_bytes - o.load_start_sample.rss_bytes) / MB), "-"],
        ["asyncio tasks (quiet, min of reads)", str(b.tasks_min), str(f.tasks_min),
         f"{f.tasks_min - b.tasks_min:+d}", "0 leaked"],
        ["open file descriptors (quiet)", str(b.fds), str(f.fds), f"{f.fds - b.fds:+d}", "-"],
        ["threads (quiet)", str(b.threads), str(f.threads), f"{f.threads - b.threads:+d}", "-"],
        ["TCP sockets (quiet; change by peer)", str(sum(b.sockets.values())),
         str(sum(f.sockets.values())), _socket_change(b.sockets, f.sockets), "-"],
    ]  # fmt: skip
    slope = _slope_mb_per_hour(o.samples)
    if slope is not None:
        rows.append(["RSS trend over the measured phase", "-", "-", f"{slope:+.1f} MB/h", "-"])
    for c in found:
        if c.what not in (RSS_CHECK, TASKS_CHECK):  # shown with their numbers above
            rows.append([c.what, "-", "-", c.observed, f"{c.target}: {_met(c)}"])
    return {
        "title": "soak: targets",
        "columns": ["measure", "after warm-up", "at the end", "change", "target"],
        "rows": rows,
    }


def _socket_change(before: Mapping[str, int], after: Mapping[str, int]) -> str:
    changed = {
        peer: after.get(peer, 0) - before.get(peer, 0)
        for peer in sorted({*before, *after})
        if after.get(peer, 0) != before.get(peer, 0)
    }
    return ", ".join(f"{peer} {n:+d}" for peer, n in changed.items()) or "+0"


def _counts(values: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {int(v):,}" for k, v in values.items()) or "-"


def _traffic_table(o: Outcome) -> dict[str, Any]:
    seen = activity(o.end_scrape) if o.end_scrape else {}
    lat = o.pings.latency_ms()
    jobs = seen.get("jobs", {})
    syncs = seen.get("syncs", {})
    rows = [
        ["pings sent (client)", f"{o.pings.sent:,}",
         f"answers {_counts({str(k): v for k, v in sorted(o.pings.statuses.items())})}; "
         f"transport errors {sum(o.pings.errors.values())}; measured phase p50 / p99 / max "
         f"{lat['p50']} / {lat['p99']} / {lat['max']} ms"],
        ["pings accepted (manager)", f"{seen.get('pings_accepted', 0):,}",
         f"by status: {_counts(seen.get('pings_by_status', {}))}; "
         f"rejected: {_counts(seen.get('ping_rejections', {}))}"],
        ["jobs published (JetStream acked)", f"{o.ledger.published:,}",
         f"attempted {o.jobs.attempted:,}; failures {_counts(dict(o.jobs.failures))}; "
         f"by kind {_counts(dict(o.jobs.by_kind))}"],
        ["jobs completed (ledger)", f"{o.ledger.completed:,}",
         f"lost {o.ledger.lost_count}; claimed twice {o.ledger.claimed_more_than_once}; "
         f"worker outcomes: {_counts(jobs)}"],
        ["syncs done", f"{int(sum(syncs.values())):,}",
         f"by outcome: {_counts(syncs)}; actions: {_counts(seen.get('sync_actions', {}))}; "
         f"versions bumped {o.bumped}, reported to the backend {o.backend['versions']}"],
        ["reports", f"{int(sum(seen.get('reports', {}).values())):,}",
         f"by outcome: {_counts(seen.get('reports', {}))}; backend accepted "
         f"{o.backend['reports']}"],
        ["heartbeats", f"{int(sum(seen.get('heartbeats', {}).values())):,}",
         f"by outcome: {_counts(seen.get('heartbeats', {}))}"],
        ["backend requests", f"{o.backend['requests']:,}", _counts(o.backend["by_status"])],
        ["kube API requests", f"{o.kube['requests']:,}", _counts(o.kube["by_status"])],
        ["alerts", f"{int(sum(seen.get('alerts', {}).values())):,}",
         f"by outcome: {_counts(seen.get('alerts', {}))}"],
    ]  # fmt: skip
    return {
        "title": "soak: traffic (whole run)",
        "columns": ["what", "count", "detail"],
        "rows": rows,
    }


def _errors_table(o: Outcome) -> dict[str, Any]:
    server = server_errors(o.end_scrape) if o.end_scrape else {}
    rows = [[f"manager: {what}", str(n)] for what, n in server.items()]
    rows += [[what, str(n)] for what, n in client_errors(o).items()]
    rows += [[what, str(n)] for what, n in log_errors(o).items()]
    rows.append(["log: WARNING lines (not counted as errors)", str(o.log.levels["WARNING"])])
    return {"title": "soak: errors (whole run)", "columns": ["source", "count"], "rows": rows}


def _samples_table(o: Outcome) -> dict[str, Any]:
    samples = o.samples
    step = max(1, -(-len(samples) // SAMPLE_ROWS))
    shown = samples[::step]
    if samples and shown[-1] is not samples[-1]:
        shown.append(samples[-1])
    rows = []
    previous: Sample | None = None
    for s in shown:
        cpu = "-"
        if previous is not None and s.t > previous.t:
            cpu = f"{100 * (s.cpu_seconds - previous.cpu_seconds) / (s.t - previous.t):.0f}"
        rows.append(
            [
                f"{s.t:.0f}",
                s.phase,
                _mb(s.rss_bytes),
                str(s.tasks),
                str(s.fds),
                str(s.threads),
                cpu,
                str(s.errors),
            ]
        )
        previous = s
    return {
        "title": f"soak: the manager every ~{o.config['sample_seconds']:.0f} s "
        f"({len(shown)} of {len(samples)} samples)",
        "columns": ["t s", "phase", "RSS MB", "asyncio tasks", "fds", "threads",
                    "CPU % since prev row", "errors"],
        "rows": rows,
    }  # fmt: skip


def _notes(o: Outcome) -> list[str]:
    c = o.config
    notes = [
        f"load for {c['seconds']:.0f} s, the first {c['warmup_seconds']:.0f} s a warm-up: "
        f"{c['workloads']} workloads pinging every {c['ping_interval']:.0f} s (one HTTP client "
        f"each, jittered starts, {100 * 0.02:.0f}% of pings 'degraded'), {c['job_rate']:g} noop "
        f"jobs/s to JetStream (tier {c['tier']}, kinds online/offline/write in turn), "
        f"{c['bump_count']} desired versions bumped every {c['bump_seconds']:.0f} s; the manager "
        f"syncs every {c['sync_interval']:.0f} s and reports every "
        f"{c['report_interval']:.0f} s to the local backend (signatures checked), "
        "against a real kube-apiserver and deployment controller (kwok nodes; Deployment "
        "requests counted by the API server, without the controllers' UPDATE and WATCH), "
        "real PostgreSQL and nats-server.",
        "quiet readings: the load is paused (after the warm-up) or stopped (at the end), pings "
        "in flight answered, the job consumers drained, then "
        f"{c['quiet_seconds']:.0f} s of quiet; the asyncio task count is the minimum of "
        "10 reads of workload_manager_asyncio_tasks 0.5 s apart (a loop that happens to run, "
        "or the scrape, only adds). RSS growth and leaked tasks compare the two quiet "
        "readings; the under-load RSS row compares the first and last measured samples.",
        f"measured phase: {o.measured_seconds:.0f} s. Errors are whole-run totals (start-up, "
        "warm-up and shutdown included); the log is scanned after the manager has stopped. A "
        "logged exception counts as one ERROR line and one Traceback line.",
    ]
    if o.log.errors:
        notes.append("first ERROR/Traceback lines: " + " | ".join(o.log.errors[:5]))
    if o.log.warnings:
        top = "; ".join(f"{n}x {msg}" for msg, n in o.log.warnings.most_common(5))
        notes.append(f"most frequent WARNING lines (numbers masked): {top}")
    if o.ledger.lost:
        notes.append(f"lost job keys (first {len(o.ledger.lost)}): {', '.join(o.ledger.lost)}")
    if o.mismatched:
        first = list(o.mismatched.items())[:5]
        notes.append(f"not converged (desired, deployed): {first}")
    return notes


def build(o: Outcome) -> dict[str, Any]:
    found = checks(o)
    passed, message = verdict(found)
    return {
        "passed": passed,
        "verdict": message,
        "config": o.config,
        "checks": [c.__dict__ for c in found],
        "rss_mb": {
            "after_warmup_quiet": round(o.baseline.rss_bytes / MB, 2),
            "end_quiet": round(o.final.rss_bytes / MB, 2),
            "growth_quiet": round((o.final.rss_bytes - o.baseline.rss_bytes) / MB, 2),
            "measured_start_under_load": round(o.load_start_sample.rss_bytes / MB, 2),
            "measured_end_under_load": round(o.load_end_sample.rss_bytes / MB, 2),
            "trend_mb_per_hour": _slope_mb_per_hour(o.samples),
        },
        "asyncio_tasks": {
            "after_warmup": o.baseline.as_dict(),
            "end": o.final.as_dict(),
            "leaked": o.final.tasks_min - o.baseline.tasks_min,
        },
        "server_errors": server_errors(o.end_scrape) if o.end_scrape else None,
        "client_errors": client_errors(o),
        "log": o.log.as_dict(),
        "pings": o.pings.as_dict(),
        "jobs": o.jobs.as_dict() | {"ledger": o.ledger.as_dict()},
        "consumers_at_end": o.consumers,
        "converged": o.converged,
        "not_converged": o.mismatched,
        "versions_bumped": o.bumped,
        "manager_activity": activity(o.end_scrape) if o.end_scrape else None,
        "manager_activity_after_warmup": activity(o.start_scrape) if o.start_scrape else None,
        "backend": o.backend,
        "kube": o.kube,
        "manager_exit": o.manager_exit,
        "measured_seconds": round(o.measured_seconds, 1),
        "samples": [s.as_dict() for s in o.samples],
        "tables": [
            _targets_table(o, found),
            _traffic_table(o),
            _errors_table(o),
            _samples_table(o),
        ],
        "notes": _notes(o),
    }
