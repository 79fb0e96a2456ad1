"""What importing the manager costs: `-X importtime` parsed, and RSS after each import.

Every measurement runs in a fresh interpreter. Import times are the fastest of a few runs
(after one to warm the .pyc and page caches); RSS is read from /proc/self/statm right after
the imports, so it counts what the import itself mapped and allocated.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent  # imported from this checkout (PYTHONPATH)
_RSS = ("\nimport os\nprint(int(open('/proc/self/statm').read().split()[1]) * "
        "os.sysconf('SC_PAGE_SIZE'))")  # fmt: skip
Entry = dict[str, Any]  # module, self_us, cumulative_us, depth, parent


def parse_importtime(stderr: str) -> list[Entry]:
    """One entry per imported module, in completion order, with the module that imported it."""
    rows = [line[12:].split("|") for line in stderr.splitlines()
            if line.startswith("import time:") and "[us]" not in line]  # fmt: skip
    entries: list[Entry] = []
    stack: list[tuple[int, str]] = []
    # importtime prints a module after its children; walking backwards, parents come first.
    for own, cumulative, raw in reversed([r for r in rows if len(r) == 3]):
        name = raw.strip()
        depth = max(0, (len(raw.rstrip()) - len(name) - 1) // 2)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        entries.append({"module": name, "self_us": int(own), "cumulative_us": int(cumulative),
                        "depth": depth, "parent": stack[-1][1] if stack else None})  # fmt: skip
        stack.append((depth, name))
    return entries[::-1]


def _python(*argv: str, env: Mapping[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], env={**env, "PYTHONPATH": str(REPO)}, cwd=cwd,
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip


def rss_after(statement: str, *, env: Mapping[str, str], cwd: Path) -> int:
    """RSS in bytes of a fresh interpreter right after running `statement`."""
    return int(_python("-c", statement + _RSS, env=env, cwd=cwd).stdout.split()[-1])


def package_costs(entries: Sequence[Entry]) -> list[Entry]:
    """Per top-level package, most expensive first: self and cumulative time, and the first
    module outside it that imported it (via)."""
    parents = {e["module"]: e["parent"] for e in entries}
    costs: dict[str, Entry] = {}
    for e in entries:  # completion order: outermost imports of a package in import order
        package = e["module"].split(".", 1)[0]
        cost = costs.setdefault(package, {"package": package, "cumulative_us": 0, "self_us": 0,
                                          "modules": 0})  # fmt: skip
        cost["self_us"] += e["self_us"]
        cost["modules"] += 1
        ancestor = e["parent"]
        while ancestor is not None and ancestor.split(".", 1)[0] != package:
            ancestor = parents.get(ancestor)
        if ancestor is None:  # not nested in its own package
            cost["cumulative_us"] += e["cumulative_us"]
            cost.setdefault("via", e["parent"])
    return sorted(costs.values(), key=lambda c: c["cumulative_us"], reverse=True)


def costs(module: str, steps: Sequence[tuple[str, str]], *, env: Mapping[str, str], cwd: Path,
          runs: int) -> Entry:  # fmt: skip
    """The fastest of `runs` timed imports of `module` (its top modules and third-party
    packages, each also imported alone), and RSS after each of `steps` (label, statement)."""
    _python("-c", f"import {module}", env=env, cwd=cwd)  # warm the caches
    timed = [parse_importtime(_python("-X", "importtime", "-c", f"import {module}", env=env,
                                      cwd=cwd).stderr) for _ in range(runs)]  # fmt: skip
    entries = min(timed, key=lambda found: sum(e["self_us"] for e in found))
    own = sys.stdlib_module_names | {module.split(".")[0]}
    packages = [p for p in package_costs(entries) if p["package"] not in own][:12]

    def ms(entry: Mapping[str, Any]) -> Entry:
        return {k: v for k, v in entry.items() if not k.endswith("_us")} | {
            k.replace("_us", "_ms"): round(v / 1000, 1) for k, v in entry.items() if "_us" in k
        }

    top = sorted(entries, key=lambda e: e["cumulative_us"], reverse=True)[:10]
    return {
        "total_ms": round(sum(e["self_us"] for e in entries) / 1000, 1), "modules": len(entries),
        "top_modules": [ms(e) for e in top], "top_packages": [ms(p) for p in packages],
        "rss_steps": [{"label": label, "statement": statement,
                       "rss_bytes": rss_after(statement, env=env, cwd=cwd)}
                      for label, statement in steps],
        "rss_package_alone": [{"package": p["package"], "rss_bytes": rss_after(
            f"import {p['package']}", env=env, cwd=cwd)} for p in packages],
    }  # fmt: skip
