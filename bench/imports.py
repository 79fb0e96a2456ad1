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
from typing import Any

TIMEOUT = 120.0
REPO = Path(__file__).resolve().parent.parent  # imported from this checkout (PYTHONPATH)
_RSS = (
    "\nimport os\n"
    "print(int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE'))"
)


@dataclass(frozen=True)
class Entry:
    module: str
    self_us: int
    cumulative_us: int
    depth: int  # 0 for what the -c statement imported directly
    parent: str | None  # the module whose import pulled this one in

    @property
    def package(self) -> str:
        return self.module.split(".", 1)[0]


def parse_importtime(stderr: str) -> list[Entry]:
    rows: list[tuple[str, int, int, int]] = []
    for line in stderr.splitlines():
        fields = line.removeprefix("import time:").split("|")
        if not line.startswith("import time:") or "[us]" in line or len(fields) != 3:
            continue
        raw = fields[2].rstrip()
        name = raw.lstrip(" ")
        rows.append((name, int(fields[0]), int(fields[1]), max(0, (len(raw) - len(name) - 1) // 2)))
    # importtime prints a module after its children; walking backwards, parents come first.
    entries: list[Entry] = []
    stack: list[tuple[int, str]] = []
    for name, self_us, cumulative_us, depth in reversed(rows):
        while stack and stack[-1][0] >= depth:
            stack.pop()
        entries.append(Entry(name, self_us, cumulative_us, depth, stack[-1][1] if stack else None))
        stack.append((depth, name))
    return entries[::-1]


def _python(*argv: str, env: Mapping[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], env={**env, "PYTHONPATH": str(REPO)}, cwd=cwd,
                          capture_output=True, text=True, timeout=TIMEOUT, check=True)  # fmt: skip


def importtime(module: str, *, env: Mapping[str, str], cwd: Path, runs: int) -> list[Entry]:
    """The fastest of `runs` timed imports of `module` (after one untimed warm-up run)."""
    _python("-c", f"import {module}", env=env, cwd=cwd)
    timed = [parse_importtime(_python("-X", "importtime", "-c", f"import {module}", env=env,
                                      cwd=cwd).stderr) for _ in range(runs)]  # fmt: skip
    return min(timed, key=lambda entries: sum(e.self_us for e in entries))


def package_costs(entries: Sequence[Entry]) -> list[dict[str, Any]]:
    """Per top-level package, most expensive first: its own modules' time (self), its
    outermost imports with all they pulled in (cumulative) and the first module outside it
    that imported it (via)."""
    parents = {e.module: e.parent for e in entries}
    costs: dict[str, dict[str, Any]] = {}
    for e in entries:  # completion order: outermost imports of a package in import order
        cost = costs.setdefault(e.package, {"package": e.package, "cumulative_us": 0,
                                            "self_us": 0, "modules": 0})  # fmt: skip
        cost["self_us"] += e.self_us
        cost["modules"] += 1
        ancestor = e.parent
        while ancestor is not None and ancestor.split(".", 1)[0] != e.package:
            ancestor = parents.get(ancestor)
        if ancestor is None:  # not nested in its own package
            cost["cumulative_us"] += e.cumulative_us
            cost.setdefault("via", e.parent)
    return sorted(costs.values(), key=lambda c: c["cumulative_us"], reverse=True)


def rss_after(statement: str, *, env: Mapping[str, str], cwd: Path) -> int:
    """RSS in bytes of a fresh interpreter right after running `statement`."""
    return int(_python("-c", statement + _RSS, env=env, cwd=cwd).stdout.strip().splitlines()[-1])


def costs(module: str, steps: Sequence[tuple[str, str]], *, env: Mapping[str, str], cwd: Path,
          runs: int, top: int = 12) -> dict[str, Any]:  # fmt: skip
    """The import of `module` timed (the top modules and third-party packages), and RSS
    after each of `steps` (label, statement) and after each top package alone."""
    entries = importtime(module, env=env, cwd=cwd, runs=runs)
    own = sys.stdlib_module_names | {module.split(".")[0]}
    packages = [p for p in package_costs(entries) if p["package"] not in own][:top]

    def ms(us: int) -> float:
        return round(us / 1000, 1)

    return {
        "total_ms": ms(sum(e.self_us for e in entries)),
        "modules": len(entries),
        "top_modules": [
            {"module": e.module, "cumulative_ms": ms(e.cumulative_us), "self_ms": ms(e.self_us),
             "depth": e.depth, "parent": e.parent}
            for e in sorted(entries, key=lambda e: e.cumulative_us, reverse=True)[:10]
        ],
        "top_packages": [
            {"package": p["package"], "cumulative_ms": ms(p["cumulative_us"]),
             "self_ms": ms(p["self_us"]), "modules": p["modules"], "via": p["via"]}
            for p in packages
        ],
        "rss_steps": [{"label": label, "statement": statement,
                       "rss_bytes": rss_after(statement, env=env, cwd=cwd)}
                      for label, statement in steps],
        "rss_package_alone": [{"package": p["package"], "rss_bytes": rss_after(
            f"import {p['package']}", env=env, cwd=cwd)} for p in packages],
    }  # fmt: skip
