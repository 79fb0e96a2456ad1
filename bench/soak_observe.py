"""Watching the manager from outside: its process (psutil), its /metrics and its log.

Only what an operator could see is used, so a soak number means the same as a dashboard
number: RSS, open file descriptors and threads from the kernel, counters and the asyncio
task gauge from the Prometheus endpoint, ERROR and Traceback lines from the log.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "workload_manager"
TASKS = f"{PREFIX}_asyncio_tasks"
QUIET_READS = 10  # gauge reads in a quiet reading; the minimum is taken
QUIET_READ_STEP = 0.5  # seconds between them
SCRAPE_TIMEOUT = 10.0
MB = 1_000_000

Labels = Mapping[str, str]
Where = Callable[[Labels], bool]


class Scrape:
    """One /metrics answer: samples by name, each with its labels."""

    def __init__(self, text: str) -> None:
        self.samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.samples.setdefault(sample.name, []).append(
                    (dict(sample.labels), float(sample.value))
                )

    def total(self, name: str, where: Where | None = None) -> float:
        return sum(v for labels, v in self.samples.get(name, []) if where is None or where(labels))

    def by(self, name: str, label: str, where: Where | None = None) -> dict[str, float]:
        counts: dict[str, float] = {}
        for labels, value in self.samples.get(name, []):
            if where is None or where(labels):
                key = labels.get(label, "")
                counts[key] = counts.get(key, 0.0) + value
        return {k: v for k, v in sorted(counts.items()) if v}

    def by_pair(self, name: str, first: str, second: str) -> dict[str, int]:
        """Non-zero samples keyed `first/second`, e.g. `sync/ok` for (loop, outcome)."""
        return {
            f"{labels[first]}/{labels[second]}": int(value)
            for labels, value in self.samples.get(name, [])
            if value
        }

    def value(self, name: str) -> float | None:
        found = self.samples.get(name)
        return found[0][1] if found else None


def _outcome_not(*ok: str) -> Where:
    return lambda labels: labels.get("outcome") not in ok


def _outcome_is(*bad: str) -> Where:
    return lambda labels: labels.get("outcome") in bad


# Server-side error counters: (what, counter, which samples). Every one must stay at 0.
ERROR_COUNTERS: tuple[tuple[str, str, Where | None], ...] = (
    ("scheduled loop runs that raised", f"{PREFIX}_scheduled_runs_total", _outcome_not("ok")),
    ("job deliveries not completed", f"{PREFIX}_jobs_total", _outcome_not("completed")),
    ("syncs not ok (partial, aborted)", f"{PREFIX}_syncs_total", _outcome_not("ok")),
    ("sync actions failed", f"{PREFIX}_sync_actions_total", _outcome_is("failed")),
    ("reports failed", f"{PREFIX}_reports_total", _outcome_is("failed")),
    ("heartbeats failed", f"{PREFIX}_heartbeats_total", _outcome_is("failed")),
    ("pings rejected", f"{PREFIX}_ping_rejections_total", None),
    ("alerts dropped", f"{PREFIX}_alerts_total", _outcome_is("dropped")),
)


def server_errors(scrape: Scrape) -> dict[str, int]:
    return {what: int(scrape.total(name, where)) for what, name, where in ERROR_COUNTERS}


def activity(scrape: Scrape) -> dict[str, Any]:
    """What the manager says it did: the counters by outcome, for the traffic table."""
    return {
        "pings_accepted": int(scrape.total(f"{PREFIX}_pings_total")),
        "pings_by_status": scrape.by(f"{PREFIX}_pings_total", "status"),
        "ping_rejections": scrape.by(f"{PREFIX}_ping_rejections_total", "reason"),
        "jobs": scrape.by(f"{PREFIX}_jobs_total", "outcome"),
        "syncs": scrape.by(f"{PREFIX}_syncs_total", "outcome"),
        "sync_actions": scrape.by_pair(f"{PREFIX}_sync_actions_total", "action", "outcome"),
        "reports": scrape.by(f"{PREFIX}_reports_total", "outcome"),
        "heartbeats": scrape.by(f"{PREFIX}_heartbeats_total", "outcome"),
        "scheduled_runs": scrape.by_pair(f"{PREFIX}_scheduled_runs_total", "loop", "outcome"),
        "alerts": scrape.by(f"{PREFIX}_alerts_total", "outcome"),
        "jobs_unroutable": int(scrape.total(f"{PREFIX}_jobs_unroutable_total")),
        "workloads_by_status": scrape.by(f"{PREFIX}_workloads", "status"),
    }


def components_down(scrape: Scrape) -> list[str]:
    return [
        labels.get("component", "?")
        for labels, value in scrape.samples.get(f"{PREFIX}_component_up", [])
        if value == 0
    ]


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

    def as_dict(self) -> dict[str, Any]:
        return {
            "t": round(self.t, 1),
            "phase": self.phase,
            "rss_mb": round(self.rss_bytes / MB, 2),
            "fds": self.fds,
            "threads": self.threads,
            "cpu_seconds": round(self.cpu_seconds, 2),
            "asyncio_tasks": self.tasks,
            "jobs_in_flight": self.jobs_in_flight,
            "components_down": list(self.components_down),
            "server_errors": self.errors,
        }


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
            "asyncio_tasks_min": self.tasks_min,
            "asyncio_tasks_seen": list(self.tasks_seen),
            "rss_mb": round(self.rss_bytes / MB, 2),
            "fds": self.fds,
            "threads": self.threads,
            "sockets_by_peer": self.sockets,
        }


class Probe:
    """The manager process and its /metrics, read from the soak's event loop."""

    def __init__(self, pid: int, url: str, peers: Mapping[int, str]) -> None:
        self._process = psutil.Process(pid)
        self._client = httpx.AsyncClient(base_url=url, timeout=SCRAPE_TIMEOUT)
        self._peers = peers  # port -> server name, for the socket breakdown
        self._port = httpx.URL(url).port
        self.started = time.monotonic()
        self.scrape_failures: Counter[str] = Counter()

    async def aclose(self) -> None:
        await self._client.aclose()

    def rss(self) -> int:
        rss: int = self._process.memory_info().rss
        return rss

    async def scrape(self) -> Scrape | None:
        try:
            response = await self._client.get("/metrics")
            response.raise_for_status()
        except httpx.HTTPError as exc:
            self.scrape_failures[type(exc).__name__] += 1
            return None
        return Scrape(response.text)

    async def sample(self, phase: str) -> tuple[Sample, Scrape | None]:
        scrape = await self.scrape()
        with self._process.oneshot():
            times = self._process.cpu_times()
            sample = Sample(
                t=time.monotonic() - self.started,
                phase=phase,
                rss_bytes=self.rss(),
                fds=self._process.num_fds(),
                threads=self._process.num_threads(),
                cpu_seconds=float(times.user + times.system),
                tasks=_int(scrape.value(TASKS)) if scrape else None,
                jobs_in_flight=_int(scrape.value(f"{PREFIX}_jobs_in_flight")) if scrape else None,
                components_down=tuple(components_down(scrape)) if scrape else (),
                errors=sum(server_errors(scrape).values()) if scrape else 0,
            )
        return sample, scrape

    async def quiet_reading(self) -> QuietReading:
        seen: list[int] = []
        for i in range(QUIET_READS):
            if i:
                await asyncio.sleep(QUIET_READ_STEP)
            scrape = await self.scrape()
            tasks = _int(scrape.value(TASKS)) if scrape else None
            if tasks is not None:
                seen.append(tasks)
        if not seen:
            raise RuntimeError(f"the manager exported no {TASKS} gauge in {QUIET_READS} scrapes")
        return QuietReading(
            tasks_min=min(seen),
            tasks_seen=tuple(seen),
            rss_bytes=self.rss(),
            fds=self._process.num_fds(),
            threads=self._process.num_threads(),
            sockets=self.sockets(),
        )

    def sockets(self) -> dict[str, int]:
        """TCP sockets of the manager by the server at the other end (or listening)."""
        counts: Counter[str] = Counter()
        for conn in self._process.net_connections(kind="tcp"):
            port: int | None = getattr(conn.raddr, "port", None)  # () when not connected
            if conn.status == psutil.CONN_LISTEN or port is None:
                counts["listening"] += 1
            elif conn.laddr.port == self._port:
                counts["incoming"] += 1  # pings, or the soak's own scrapes
            else:
                counts[self._peers.get(port, "other")] += 1
        return dict(sorted(counts.items()))


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


# --- the log ----------------------------------------------------------------------------

# The text format: "%H:%M:%S LEVEL   logger: message" (app/logs.py TextFormatter)
_LINE = re.compile(r"^\d\d:\d\d:\d\d (?P<level>[A-Z]+)\s+(?P<logger>\S+): (?P<message>.*)$")
_NUMBERS = re.compile(r"\d+(\.\d+)?")
EXCERPT = 20  # lines of each kind kept for the report


@dataclass
class LogScan:
    lines: int = 0
    levels: Counter[str] = field(default_factory=Counter)
    tracebacks: int = 0
    errors: list[str] = field(default_factory=list)  # the first ERROR/CRITICAL/Traceback lines
    warnings: Counter[str] = field(default_factory=Counter)  # by message, numbers masked

    @property
    def error_lines(self) -> int:
        return self.levels["ERROR"] + self.levels["CRITICAL"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "lines": self.lines,
            "by_level": dict(self.levels),
            "error_lines": self.error_lines,
            "tracebacks": self.tracebacks,
            "first_errors": self.errors,
            "warnings_by_message": dict(self.warnings.most_common(EXCERPT)),
        }


def scan_log(path: Path) -> LogScan:
    scan = LogScan()
    if not path.exists():
        return scan
    with path.open(errors="replace") as log:
        for raw in log:
            line = raw.rstrip("\n")
            scan.lines += 1
            if line.startswith("Traceback (most recent call last)"):
                scan.tracebacks += 1
                if len(scan.errors) < EXCERPT:
                    scan.errors.append(line)
                continue
            match = _LINE.match(line)
            if match is None:
                continue
            level = match["level"]
            scan.levels[level] += 1
            if level in ("ERROR", "CRITICAL") and len(scan.errors) < EXCERPT:
                scan.errors.append(line)
            elif level == "WARNING":
                scan.warnings[f"{match['logger']}: {_NUMBERS.sub('N', match['message'])}"] += 1
    return scan
