"""The soak's verdict and report: checks against the targets, tables, notes, JSON.

A check is met or not, never "about"; the exit code follows the checks. The JSON keeps
every sample.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.proc import Labels, Metrics
from bench.report import MB, mb, table

PREFIX = "workload_manager"
RSS_GROWTH_TARGET_MB = 5.0
LEAKED_TASKS_TARGET = 0
SAMPLE_ROWS = 14  # rows of the resource table; the JSON has every sample
RSS_CHECK = "manager RSS growth (quiet, after warm-up -> end)"
TASKS_CHECK = "asyncio tasks leaked (quiet, end - after warm-up)"
TREND_MIN_SECONDS = 300.0  # a shorter measured phase makes a slope of noise


def _not(*ok: str) -> Callable[[Labels], bool]:
    return lambda labels: labels.get("outcome") not in ok


def _is(*bad: str) -> Callable[[Labels], bool]:
    return lambda labels: labels.get("outcome") in bad


# Server-side error counters: (what, counter, which samples). Every one must stay at 0.
ERROR_COUNTERS: tuple[tuple[str, str, Callable[[Labels], bool] | None], ...] = (
    # skipped (the cluster lock held elsewhere) and cancelled (shutdown) attempted nothing
    (
        "scheduled loop runs failed, raised or unavailable",
        f"{PREFIX}_scheduled_runs_total",
        _is("failed", "error", "unavailable"),
    ),
    ("job deliveries not completed", f"{PREFIX}_jobs_total", _not("completed")),
    ("syncs not ok (partial, aborted)", f"{PREFIX}_syncs_total", _not("ok")),
    ("sync actions failed", f"{PREFIX}_sync_actions_total", _is("failed")),
    ("reports failed", f"{PREFIX}_reports_total", _is("failed")),
    ("heartbeats failed", f"{PREFIX}_heartbeats_total", _is("failed")),
    ("pings rejected", f"{PREFIX}_ping_rejections_total", None),
    ("alerts dropped", f"{PREFIX}_alerts_total", _is("dropped")),
)


def server_errors(m: Metrics) -> dict[str, int]:
    return {what: int(m.total(name, where)) for what, name, where in ERROR_COUNTERS}


def activity(m: Metrics) -> dict[str, Any]:
    """What the manager says it did: the counters by outcome, for the traffic table."""

    def by(name: str, *labels: str) -> dict[str, float]:
        return m.by(f"{PREFIX}_{name}", *labels)

    return {
        "pings_accepted": int(m.total(f"{PREFIX}_pings_total")),
        "pings_by_status": by("pings_total", "status"),
        "ping_rejections": by("ping_rejections_total", "reason"),
        "jobs": by("jobs_total", "outcome"),
        "syncs": by("syncs_total", "outcome"),
        "sync_actions": by("sync_actions_total", "action", "outcome"),
        "reports": by("reports_total", "outcome"),
        "heartbeats": by("heartbeats_total", "outcome"),
        "scheduled_runs": by("scheduled_runs_total", "loop", "outcome"),
        "alerts": by("alerts_total", "outcome"),
        "jobs_unroutable": int(m.total(f"{PREFIX}_jobs_unroutable_total")),
        "workloads_by_status": by("workloads", "status"),
    }


@dataclass(frozen=True)
class Sample:
    """The manager every ~10 s: process facts and the gauges that would show a leak."""

    t: float  # seconds since the load started
    phase: str  # warm-up | measured | quiet | drain
    rss_bytes: int
    fds: int
    threads: int
    cpu_seconds: float
    tasks: int | None
    jobs_in_flight: int | None
    components_down: tuple[str, ...]
    errors: int  # server-side error counters, summed
    pings: int  # accepted by the manager so far

    def as_dict(self) -> dict[str, Any]:
        return {
            "t": round(self.t, 1), "phase": self.phase, "rss_mb": round(self.rss_bytes / MB, 2),
            "fds": self.fds, "threads": self.threads, "cpu_seconds": round(self.cpu_seconds, 2),
            "asyncio_tasks": self.tasks, "jobs_in_flight": self.jobs_in_flight,
            "components_down": list(self.components_down), "server_errors": self.errors,
        }  # fmt: skip


@dataclass(frozen=True)
class QuietReading:
    """The manager with no load: the asyncio task gauge's minimum over a few seconds (a loop
    that happens to run, or the scrape itself, only ever adds), and the process facts."""

    tasks_min: int
    tasks_seen: tuple[int, ...]
    rss_bytes: int
    fds: int
    threads: int
    sockets: dict[str, int]  # the manager's TCP sockets by peer, to explain an fd change

    def as_dict(self) -> dict[str, Any]:
        return {
            "asyncio_tasks_min": self.tasks_min, "asyncio_tasks_seen": list(self.tasks_seen),
            "rss_mb": round(self.rss_bytes / MB, 2), "fds": self.fds, "threads": self.threads,
            "sockets_by_peer": self.sockets,
        }  # fmt: skip


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
            "published": self.published, "completed": self.completed, "lost": self.lost_count,
            "lost_keys_first": self.lost, "not_completed_by_status": self.not_completed,
            "claimed_more_than_once": self.claimed_more_than_once,
            "completed_without_publish_ack": self.unconfirmed_in_ledger,
        }  # fmt: skip


@dataclass
class Outcome:
    """Everything a soak observed, before judging it."""

    config: dict[str, Any]
    samples: list[Sample]
    baseline: QuietReading
    final: QuietReading
    load_start_sample: Sample  # the first sample of the measured phase, under load
    load_end_sample: Sample  # the last one, under load
    start_scrape: Metrics | None
    end_scrape: Metrics | None
    warmup_pings: dict[str, Any]  # wrk's summaries (bench/load/pings.lua)
    pings: dict[str, Any]  # the measured phase's
    jobs: dict[str, Any]
    job_failures: dict[str, int]
    job_kinds: dict[str, int]
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
    log: dict[str, Any] = field(default_factory=dict)

    def ping_stats(self) -> dict[str, Any]:
        """Both wrk runs: sent, failed, by status, transport errors; latency measured only."""
        runs = (self.warmup_pings, self.pings)
        statuses: dict[str, int] = {}
        for run in runs:
            for status, n in run["statuses"].items():
                statuses[status] = statuses.get(status, 0) + n
        transport = {k: sum(r[k] for r in runs) for k in ("connect", "read", "write", "timeout")}
        bad = sum(n for s, n in statuses.items() if not 200 <= int(s) < 300)
        return {
            "sent": sum(statuses.values()) + sum(transport.values()),
            "failed": bad + sum(transport.values()),
            "statuses": dict(sorted(statuses.items())),
            "transport_errors": {k: v for k, v in transport.items() if v},
            "latency_ms_measured_phase": {
                k: round(self.pings["latency_us"][k] / 1000, 2) for k in ("p50", "p99", "max")
            },
        }


@dataclass(frozen=True)
class Check:
    what: str
    target: str
    observed: str
    met: bool


def _slope_mb_per_hour(samples: Sequence[Sample]) -> float | None:
    """Least-squares RSS trend over the measured phase: a leak shows as a steady slope."""
    points = [(s.t, s.rss_bytes / MB) for s in samples if s.phase == "measured"]
    if len(points) < 2 or points[-1][0] - points[0][0] < TREND_MIN_SECONDS:
        return None
    xs, ys = zip(*points, strict=True)
    return statistics.linear_regression(xs, ys)[0] * 3600


def client_errors(o: Outcome) -> dict[str, int]:
    return {
        "pings without a 2xx": o.ping_stats()["failed"],
        "job publishes without an ack": sum(o.job_failures.values()),
        "/metrics scrapes failed": sum(o.scrape_failures.values()),
        "backend: requests rejected (contract)": o.backend["rejected"],
        "backend: answers >= 400": o.backend["errors"],
        "kube API: unexpected answers": o.kube["errors"],
    }


def log_errors(o: Outcome) -> dict[str, int]:
    return {"log: ERROR/CRITICAL lines": o.log.get("error_lines", 0),
            "log: Traceback lines": o.log.get("tracebacks", 0)}  # fmt: skip


def checks(o: Outcome) -> list[Check]:
    growth = (o.final.rss_bytes - o.baseline.rss_bytes) / MB
    leaked = o.final.tasks_min - o.baseline.tasks_min
    server = server_errors(o.end_scrape) if o.end_scrape else {}
    errors = sum(server.values()) + sum(client_errors(o).values()) + sum(log_errors(o).values())
    down = sorted({c for s in o.samples for c in s.components_down})
    return [
        Check(RSS_CHECK, f"< {RSS_GROWTH_TARGET_MB} MB", f"{growth:+.1f} MB",
              growth < RSS_GROWTH_TARGET_MB),
        Check(TASKS_CHECK, f"{LEAKED_TASKS_TARGET}", f"{leaked:+d}", leaked <= LEAKED_TASKS_TARGET),
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
              o.manager_exit in (0, -15)),
    ]  # fmt: skip


def verdict(found: Sequence[Check]) -> tuple[bool, str]:
    missed = [c for c in found if not c.met]
    if not missed:
        return True, "SOAK PASSED: every target met, nothing lost"
    reasons = "; ".join(f"{c.what}: {c.observed} (target {c.target})" for c in missed)
    return False, f"SOAK FAILED: {reasons}"


# --- tables ------------------------------------------------------------------------------


def _change(before: Mapping[str, int], after: Mapping[str, int]) -> str:
    changed = {p: after.get(p, 0) - before.get(p, 0) for p in sorted({*before, *after})}
    return ", ".join(f"{p} {n:+d}" for p, n in changed.items() if n) or "+0"


def _counts(values: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {int(v):,}" for k, v in values.items()) or "-"


def _tables(o: Outcome, found: Sequence[Check]) -> list[dict[str, Any]]:
    b, f, s0, s1 = o.baseline, o.final, o.load_start_sample, o.load_end_sample
    targets: list[list[Any]] = [
        ["manager RSS, MB (quiet)", mb(b.rss_bytes), mb(f.rss_bytes),
         f"{(f.rss_bytes - b.rss_bytes) / MB:+.1f}", f"< {RSS_GROWTH_TARGET_MB} MB growth"],
        ["manager RSS, MB (under load)", mb(s0.rss_bytes), mb(s1.rss_bytes),
         f"{(s1.rss_bytes - s0.rss_bytes) / MB:+.1f}", "-"],
        ["asyncio tasks (quiet, min of reads)", b.tasks_min, f.tasks_min,
         f"{f.tasks_min - b.tasks_min:+d}", "0 leaked"],
        ["open file descriptors (quiet)", b.fds, f.fds, f"{f.fds - b.fds:+d}", "-"],
        ["threads (quiet)", b.threads, f.threads, f"{f.threads - b.threads:+d}", "-"],
        ["TCP sockets (quiet; change by peer)", sum(b.sockets.values()),
         sum(f.sockets.values()), _change(b.sockets, f.sockets), "-"],
    ]  # fmt: skip
    if (slope := _slope_mb_per_hour(o.samples)) is not None:
        targets.append(["RSS trend over the measured phase", "-", "-", f"{slope:+.1f} MB/h", "-"])
    targets += [[c.what, "-", "-", c.observed, f"{c.target}: {'met' if c.met else 'NOT MET'}"]
                for c in found if c.what not in (RSS_CHECK, TASKS_CHECK)]  # fmt: skip
    seen = activity(o.end_scrape) if o.end_scrape else {}
    p, lat = o.ping_stats(), o.ping_stats()["latency_ms_measured_phase"]
    syncs = seen.get("syncs", {})
    traffic = [
        ["pings sent (client, wrk)", f"{p['sent']:,}",
         f"answers {_counts(p['statuses'])}; transport errors "
         f"{sum(p['transport_errors'].values())}; measured phase p50 / p99 / max "
         f"{lat['p50']} / {lat['p99']} / {lat['max']} ms"],
        ["pings accepted (manager)", f"{seen.get('pings_accepted', 0):,}",
         f"by status: {_counts(seen.get('pings_by_status', {}))}; "
         f"rejected: {_counts(seen.get('ping_rejections', {}))}"],
        ["jobs published (JetStream acked)", f"{o.ledger.published:,}",
         f"attempted {o.jobs['attempted']:,}; failures {_counts(o.job_failures)}; "
         f"by kind {_counts(o.job_kinds)}"],
        ["jobs completed (ledger)", f"{o.ledger.completed:,}",
         f"lost {o.ledger.lost_count}; claimed twice {o.ledger.claimed_more_than_once}; "
         f"worker outcomes: {_counts(seen.get('jobs', {}))}"],
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
    server = server_errors(o.end_scrape) if o.end_scrape else {}
    errors: list[list[Any]] = [[f"manager: {what}", n] for what, n in server.items()]
    errors += [[what, n] for what, n in (client_errors(o) | log_errors(o)).items()]
    warnings = o.log.get("by_level", {}).get("WARNING", 0)
    errors.append(["log: WARNING lines (not counted as errors)", warnings])
    step = max(1, -(-len(o.samples) // SAMPLE_ROWS))
    shown = o.samples[::step]
    if o.samples and shown[-1] is not o.samples[-1]:
        shown.append(o.samples[-1])
    rows: list[list[Any]] = []
    for prev, s in zip([None, *shown], shown, strict=False):
        cpu = "-"
        if prev is not None and s.t > prev.t:
            cpu = f"{100 * (s.cpu_seconds - prev.cpu_seconds) / (s.t - prev.t):.0f}"
        rows.append([f"{s.t:.0f}", s.phase, mb(s.rss_bytes), s.tasks, s.fds, s.threads, cpu,
                     s.errors])  # fmt: skip
    return [
        table("soak: targets", "measure|after warm-up|at the end|change|target", targets),
        table("soak: traffic (whole run)", "what|count|detail", traffic),
        table("soak: errors (whole run)", "source|count", errors),
        table(f"soak: the manager every ~{o.config['sample_seconds']:.0f} s ({len(shown)} of "
              f"{len(o.samples)} samples; RSS, CPU, fds from its /metrics)",
              "t s|phase|RSS MB|asyncio tasks|fds|threads|CPU % since prev row|errors", rows),
    ]  # fmt: skip


def _notes(o: Outcome) -> list[str]:
    c = o.config
    notes = [
        f"load for {c['seconds']:.0f} s, the first {c['warmup_seconds']:.0f} s a warm-up: "
        f"{c['workloads']} workloads pinging every {c['ping_interval']:.0f} s (wrk, one "
        f"connection each, a new one per ping, 2% of pings 'degraded'), {c['job_rate']:g} "
        f"noop jobs/s to JetStream (tier {c['tier']}, kinds online/offline/write in turn), "
        f"{c['bump_count']} desired versions bumped every {c['bump_seconds']:.0f} s; the "
        f"manager syncs every {c['sync_interval']:.0f} s and reports every "
        f"{c['report_interval']:.0f} s to the local backend (signatures checked), against a "
        "real kube-apiserver and deployment controller (kwok nodes; Deployment requests "
        "counted by the API server, without the controllers' UPDATE and WATCH), real "
        "PostgreSQL and nats-server.",
        "quiet readings: the load is paused (after the warm-up) or stopped (at the end), the "
        f"job consumers drained, then {c['quiet_seconds']:.0f} s of quiet; the asyncio task "
        "count is the minimum of 10 reads of workload_manager_asyncio_tasks 0.5 s apart. RSS "
        "growth and leaked tasks compare the two quiet readings; the under-load RSS row "
        "compares the first and last measured samples.",
        f"measured phase: {o.measured_seconds:.0f} s. Errors are whole-run totals (start-up, "
        "warm-up and shutdown included); the log is scanned after the manager has stopped. A "
        "logged exception counts as one ERROR line and one Traceback line.",
    ]
    if o.log.get("first_errors"):
        notes.append("first ERROR/Traceback lines: " + " | ".join(o.log["first_errors"][:5]))
    if warnings := list(o.log.get("warnings_by_message", {}).items())[:5]:
        notes.append("most frequent WARNING lines (numbers masked): "
                     + "; ".join(f"{n}x {msg}" for msg, n in warnings))  # fmt: skip
    if o.ledger.lost:
        notes.append(f"lost job keys (first {len(o.ledger.lost)}): {', '.join(o.ledger.lost)}")
    if o.mismatched:
        notes.append(f"not converged (desired, deployed): {list(o.mismatched.items())[:5]}")
    return notes


def build(o: Outcome) -> dict[str, Any]:
    found = checks(o)
    passed, message = verdict(found)
    b, f = o.baseline, o.final
    return {
        "passed": passed,
        "verdict": message,
        "config": o.config,
        "checks": [c.__dict__ for c in found],
        "rss_mb": {
            "after_warmup_quiet": round(b.rss_bytes / MB, 2),
            "end_quiet": round(f.rss_bytes / MB, 2),
            "growth_quiet": round((f.rss_bytes - b.rss_bytes) / MB, 2),
            "measured_start_under_load": round(o.load_start_sample.rss_bytes / MB, 2),
            "measured_end_under_load": round(o.load_end_sample.rss_bytes / MB, 2),
            "trend_mb_per_hour": _slope_mb_per_hour(o.samples),
        },
        "asyncio_tasks": {
            "after_warmup": b.as_dict(),
            "end": f.as_dict(),
            "leaked": f.tasks_min - b.tasks_min,
        },
        "server_errors": server_errors(o.end_scrape) if o.end_scrape else None,
        "client_errors": client_errors(o),
        "log": o.log,
        "pings": o.ping_stats() | {"wrk": {"warm_up": o.warmup_pings, "measured": o.pings}},
        "jobs": o.jobs | {"ledger": o.ledger.as_dict()},
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
        "tables": _tables(o, found),
        "notes": _notes(o),
    }
