"""What every benchmark reports with: tables, targets, units, percentiles, progress, checks.

A table is {"title", "columns", "rows"} of strings. `table` formats the cells: a column
named "name{spec}" formats its numbers with that format spec (`{,.0f}`, `{.2f}`); None is
"-". A result's "targets" ({name: {"target", "measured", "met"}}) print as one more table.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

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
    if value is None:
        return "-"
    if spec and isinstance(value, int | float) and not isinstance(value, bool):
        return format(value, spec)
    return str(value)


def table(
    title: str, columns: str | Sequence[str], rows: Sequence[Sequence[Any]]
) -> dict[str, Any]:
    """A table; `columns` may be one string split on "|"."""
    names = columns.split("|") if isinstance(columns, str) else list(columns)
    parsed = [re.fullmatch(r"(.*?)(?:\{(.*)\})?", name, re.S) for name in names]
    specs = [(m[1], m[2] or "") if m else (name, "") for m, name in zip(parsed, names, strict=True)]
    return {
        "title": title,
        "columns": [name for name, _ in specs],
        "rows": [[cell(c, spec) for c, (_, spec) in zip(r, specs, strict=True)] for r in rows],
    }


def render(t: Mapping[str, Any]) -> str:
    columns: list[str] = t["columns"]
    rows = [[str(cell) for cell in row] for row in t["rows"]]
    widths = [max(len(columns[i]), *(len(r[i]) for r in rows)) for i in range(len(columns))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(cells)
        ).rstrip()

    rule = "-" * len(line(["-" * w for w in widths]))
    return "\n".join([t["title"], rule, line(columns), rule, *map(line, rows), rule])


def show(result: Mapping[str, Any]) -> None:
    """Print a result's tables, its targets and its notes."""
    tables = list(result.get("tables", []))
    if targets := result.get("targets"):
        rows = [[k, _flat(t["measured"]), t["target"], yes(t["met"])] for k, t in targets.items()]
        tables.append(table("targets", "target|measured|wanted|met", rows))
    for t in tables:
        print(f"\n{render(t)}")
    for note in result.get("notes", []):
        print(f"* {note}")


def _flat(value: Any) -> Any:
    """A mapping as "key: value, ..."; anything else as it is."""
    if isinstance(value, Mapping):
        return ", ".join(f"{k}: {_flat(v)}" for k, v in value.items())
    return value


def env_note(names: Sequence[str]) -> list[str]:
    """The note for settings this environment sets beyond what a benchmark passes."""
    return [f"settings also read from this environment (they change what is measured): "
            f"{', '.join(names)}"] if names else []  # fmt: skip


def noisy(phases: Mapping[str, float], limit: float) -> list[str]:
    """A note naming the phases where something else used more than `limit` % of a core."""
    busy = [f"{name} {value:.0f}%" for name, value in phases.items() if value > limit]
    return [f"NOISY: other work used the CPU during {', '.join(busy)} (% of a core): rerun "
            "on a quiet machine"] if busy else []  # fmt: skip


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def mib_over(value: float, base: float) -> str:
    return f"{(value - base) / MIB:+.1f}"


def percent(part: float, whole: float) -> float:
    return round(100.0 * part / whole, 1) if whole > 0 else 0.0


def percentile(ordered: Sequence[float], q: float) -> float | None:
    """The nearest-rank q-th percentile (0-100) of sorted values."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def latency_ms(ordered: Sequence[float], scale: float = 1e-6) -> dict[str, float | None]:
    """p50, p99 and max of sorted latencies in ms (`scale`: ms per unit; ns by default)."""
    found = {"p50": percentile(ordered, 50), "p99": percentile(ordered, 99)}
    found["max"] = ordered[-1] if ordered else None
    return {k: None if v is None else round(v * scale, 3) for k, v in found.items()}


def yes(met: bool | None) -> str:
    return {True: "yes", False: "NO", None: "-"}[met]
