"""What every benchmark reports with: tables, targets, units, percentiles, progress, checks.

A table is {"title", "columns", "rows"} of strings; a column named "name{spec}" formats its
numbers with that format spec, None shows as "-". A result's "targets" ({name: {"target",
"measured", "met"}}) print as one more table.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

Json = dict[str, Any]
MIB = 1024 * 1024
MB = 1_000_000


class CheckFailed(Exception):
    """The world after a phase is not what the numbers would claim: report it, not them."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def say(benchmark: str, message: str) -> None:
    """Progress on stderr, so stdout is only the report."""
    print(f"  [{benchmark}] {message}", file=sys.stderr, flush=True)


def cell(value: Any, spec: str = "") -> str:
    if isinstance(value, Mapping):  # "key: value, ..."
        return ", ".join(f"{k}: {cell(v, spec)}" for k, v in value.items())
    if spec and isinstance(value, int | float) and not isinstance(value, bool):
        return format(value, spec)
    return "-" if value is None else str(value)


def table(
    title: str, columns: str | Sequence[str], rows: Sequence[Sequence[Any]]
) -> dict[str, Any]:
    names = columns.split("|") if isinstance(columns, str) else list(columns)
    specs = [n[:-1].partition("{")[::2] if n.endswith("}") else (n, "") for n in names]
    cells = [[cell(c, spec) for c, (_, spec) in zip(r, specs, strict=True)] for r in rows]
    return {"title": title, "columns": [name for name, _ in specs], "rows": cells}


def render(t: Mapping[str, Any]) -> str:
    columns, rows = t["columns"], t["rows"]
    widths = [max(len(columns[i]), *(len(r[i]) for r in rows)) for i in range(len(columns))]

    def line(cells: Sequence[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs).rstrip()

    rule = "-" * len(line(["-" * w for w in widths]))
    return "\n".join([t["title"], rule, line(columns), rule, *map(line, rows), rule])


def show(result: Mapping[str, Any]) -> None:
    """Print a result's tables, its targets and its notes."""
    tables = list(result.get("tables", []))
    if targets := result.get("targets"):
        rows = [[k, t["measured"], t["target"], yes(t["met"])] for k, t in targets.items()]
        tables.append(table("targets", "target|measured|wanted|met", rows))
    for t in tables:
        print(f"\n{render(t)}")
    for note in result.get("notes", []):
        print(f"* {note}")


def env_note(names: Sequence[str]) -> list[str]:
    """The note for settings this environment sets beyond what a benchmark passes."""
    return [f"settings also read from this environment (they change what is measured): "
            f"{', '.join(names)}"] if names else []  # fmt: skip


def noisy(phases: Mapping[str, float], limit: float) -> list[str]:
    """The note naming the phases where other work used more than `limit` % of a core."""
    busy = ", ".join(f"{name} {value:.0f}%" for name, value in phases.items() if value > limit)
    return [f"NOISY: other work used the CPU during {busy} (% of a core): rerun on a quiet "
            "machine"] if busy else []  # fmt: skip


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def mib_over(value: float, base: float) -> str:
    return f"{(value - base) / MIB:+.1f}"


def percent(part: float, whole: float) -> float:
    return round(100.0 * part / whole, 1) if whole > 0 else 0.0


def latency_ms(ordered: Sequence[float], scale: float = 1e-6) -> dict[str, float | None]:
    """Nearest-rank p50, p99 and the max of sorted latencies, in ms (`scale`: ms per unit)."""
    n = len(ordered)
    found = {k: ordered[min(n - 1, max(0, math.ceil(q * n) - 1))] if n else None
             for k, q in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))}  # fmt: skip
    return {k: None if v is None else round(v * scale, 3) for k, v in found.items()}


def yes(met: bool | None) -> str:
    return {True: "yes", False: "NO", None: "-"}[met]
