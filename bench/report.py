"""What every benchmark reports with: tables, units, percentiles, progress and checks.

A table is {"title", "columns", "rows"}; `render` draws it in plain text, the first
column left-aligned, the rest right-aligned.
"""

from __future__ import annotations

import math
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


def table(title: str, columns: str | Sequence[str], rows: Sequence[Any]) -> dict[str, Any]:
    """A table; `columns` may be one string split on "|"."""
    names = columns.split("|") if isinstance(columns, str) else list(columns)
    return {"title": title, "columns": names, "rows": [[str(c) for c in r] for r in rows]}


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
    """Print a result's tables and notes."""
    for t in result.get("tables", []):
        print()
        print(render(t))
    for note in result.get("notes", []):
        print(f"* {note}")


def num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def mib_over(value: float, base: float) -> str:
    return f"{(value - base) / MIB:+.1f}"


def mb(value: float) -> str:
    return f"{value / MB:.1f}"


def percent(part: float, whole: float) -> float:
    return round(100.0 * part / whole, 1) if whole > 0 else 0.0


def percentile(ordered: Sequence[float], q: float) -> float | None:
    """The nearest-rank q-th percentile (0-100) of sorted values."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def latency_ms(ordered: Sequence[float], scale: float = 1e-6) -> dict[str, float | None]:
    """p50, p99 and max of sorted latencies in ms (`scale`: ms per unit; ns by default)."""

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * scale, 3)

    return {
        "p50": ms(percentile(ordered, 50)),
        "p99": ms(percentile(ordered, 99)),
        "max": ms(ordered[-1] if ordered else None),
    }


def yes(met: bool | None) -> str:
    return {True: "yes", False: "NO", None: "-"}[met]
