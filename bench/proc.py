"""Where the benchmarks read CPU and memory: the manager's own /metrics (the Prometheus
`process_*` collector) and, for the processes without one (PostgreSQL, nats-server, the
control plane, the bare floor), the kernel's /proc.
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Callable, Mapping
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families

Labels = Mapping[str, str]


class Metrics:
    """One /metrics answer: samples by name, each with its labels."""

    def __init__(self, text: str) -> None:
        self.samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))

    def total(self, name: str, where: Callable[[Labels], bool] | None = None) -> float:
        return sum(v for labels, v in self.samples.get(name, []) if where is None or where(labels))

    def by(self, name: str, *labels: str) -> dict[str, float]:
        """Non-zero sums keyed by the labels' values joined with "/" (e.g. `sync/ok`)."""
        counts: dict[str, float] = {}
        for found, value in self.samples.get(name, []):
            key = "/".join(found.get(label, "") for label in labels)
            counts[key] = counts.get(key, 0.0) + value
        return {k: v for k, v in sorted(counts.items()) if v}

    def value(self, name: str) -> float | None:
        found = self.samples.get(name)
        return found[0][1] if found else None


def status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (peak), RssAnon, RssFile in bytes and Threads, from /proc/<pid>/status."""
    values: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "Threads"):
            values[key] = int(value.split()[0]) * (1 if key == "Threads" else 1024)
    return values


def uss(pid: int) -> int:
    """Unique set size: the private pages (clean + dirty) of /proc/<pid>/smaps_rollup."""
    rows = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    return sum(int(r.split()[1]) * 1024 for r in rows if r.startswith(("Private_Clean:",
               "Private_Dirty:")))  # fmt: skip


def reset_peak(pid: int) -> None:
    """Start VmHWM over from the current RSS (clear_refs 5, Linux >= 4.0)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def cpu_seconds(pid: int, tree: bool = False) -> float:
    """User + system CPU seconds of a process; with `tree`, of its live descendants too and
    of the children it has reaped (a PostgreSQL backend that exited)."""
    total = 0.0
    with contextlib.suppress(OSError, psutil.Error):
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total = sum(map(int, fields[11 : 15 if tree else 13])) / os.sysconf("SC_CLK_TCK")
        if tree:
            total += sum(cpu_seconds(c.pid) for c in psutil.Process(pid).children(recursive=True))
    return total


def children_cpu() -> float:
    """User + system CPU seconds of the children this process has waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def machine_busy() -> tuple[float, float]:
    """The whole machine's busy CPU seconds (user, nice, system, irq, softirq) and steal."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq, getattr(t, "steal", 0.0)


class Meter:
    """CPU seconds of named sources since `start` (or since the meter was made)."""

    def __init__(self, **sources: Callable[[], float]) -> None:
        self.sources = sources
        self.start()

    def start(self) -> None:
        self._at = {name: read() for name, read in self.sources.items()}

    def spent(self) -> dict[str, float]:
        return {name: round(read() - self._at[name], 3) for name, read in self.sources.items()}
