"""What importing the manager costs: `-X importtime` parsed, and RSS after each import.

Every measurement runs in a fresh interpreter. Import times are the fastest of a few
runs (after one to warm the .pyc and page caches); RSS is read from /proc/self/statm
right after the imports, so it counts what the import itself mapped and allocated.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

TIMEOUT = 120.0
REPO = Path(__file__).resolve().parent.parent  # imported from this checkout (PYTHONPATH)
_RSS_SUFFIX = (
    "\nimport os as _os\n"
    "print(int(open('/proc/self/statm').read().split()[1]) * _os.sysconf('SC_PAGE_SIZE'))\n"
)


@dataclass(frozen=True)
class ImportEntry:
    name: str
    self_us: int
    cumulative_us: int
    depth: int  # 0 for what the -c statement imported directly
    parent: str | None  # the module whose import pulled this one in

    @property
    def package(self) -> str:
        return self.name.split(".", 1)[0]


def parse_importtime(stderr: str) -> list[ImportEntry]:
    rows: list[tuple[str, int, int, int]] = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "[us]" in line:
            continue
        fields = line[len("import time:") :].split("|")
        if len(fields) != 3:
            continue
        raw_name = fields[2].rstrip()
        name = raw_name.lstrip(" ")
        depth = max(0, (len(raw_name) - len(name) - 1) // 2)
        rows.append((name, int(fields[0]), int(fields[1]), depth))
    # importtime prints a module after its children; walking backwards, parents come first.
    entries: list[ImportEntry] = []
    stack: list[tuple[int, str]] = []
    for name, self_us, cumulative_us, depth in reversed(rows):
        while stack and stack[-1][0] >= depth:
            stack.pop()
        entries.append(
            ImportEntry(name, self_us, cumulative_us, depth, stack[-1][1] if stack else None)
        )
        stack.append((depth, name))
    entries.reverse()
    return entries


def importtime(module: str, *, env: Mapping[str, str], cwd: Path, runs: int) -> list[ImportEntry]:
    """The fastest of `runs` timed imports of `module` (after one untimed warm-up run)."""
    best: list[ImportEntry] = []
    best_total = -1
    for attempt in range(runs + 1):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", f"import {module}"],
            env={**env, "PYTHONPATH": str(REPO)},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=True,
        )
        if attempt == 0:
            continue
        entries = parse_importtime(proc.stderr)
        total = sum(e.self_us for e in entries)
        if best_total < 0 or total < best_total:
            best, best_total = entries, total
    return best


def top_modules(entries: Sequence[ImportEntry], count: int) -> list[ImportEntry]:
    return sorted(entries, key=lambda e: e.cumulative_us, reverse=True)[:count]


@dataclass(frozen=True)
class PackageCost:
    package: str
    self_us: int  # time in the package's own modules
    cumulative_us: int  # the package's outermost imports, with everything they pulled in
    modules: int
    via: str | None  # the first module outside the package that imported it


def package_costs(entries: Sequence[ImportEntry]) -> list[PackageCost]:
    """Per top-level package, most expensive first (by cumulative time)."""
    parents = {e.name: e.parent for e in entries}
    totals: dict[str, list[int]] = {}  # package -> [self, cumulative, modules]
    via: dict[str, str | None] = {}
    for entry in entries:  # completion order: outermost imports of a package in import order
        total = totals.setdefault(entry.package, [0, 0, 0])
        total[0] += entry.self_us
        total[2] += 1
        if not _nested_in_own_package(entry, parents):
            total[1] += entry.cumulative_us
            via.setdefault(entry.package, entry.parent)
    costs = [PackageCost(name, t[0], t[1], t[2], via.get(name)) for name, t in totals.items()]
    return sorted(costs, key=lambda c: c.cumulative_us, reverse=True)


def _nested_in_own_package(entry: ImportEntry, parents: Mapping[str, str | None]) -> bool:
    ancestor = entry.parent
    while ancestor is not None:
        if ancestor.split(".", 1)[0] == entry.package:
            return True
        ancestor = parents.get(ancestor)
    return False


def rss_after(statement: str, *, env: Mapping[str, str], cwd: Path) -> int:
    """RSS in bytes of a fresh interpreter right after running `statement`."""
    proc = subprocess.run(
        [sys.executable, "-c", statement + _RSS_SUFFIX],
        env=dict(env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=True,
    )
    return int(proc.stdout.strip().splitlines()[-1])
