"""Every metric of the manager's own is in docs/metrics.md, under the name Prometheus sees."""

from __future__ import annotations

from pathlib import Path

from app.metrics import PREFIX, Metrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
SUFFIX = {"counter": "_total", "info": "_info"}


def exported_names() -> set[str]:
    metrics = Metrics()
    # the scrape-time state gauges, with a sample each
    metrics.watch_state(
        workloads=lambda: {"healthy": 1},
        components=lambda: {"api": True},
        uptimes=lambda: [("api", "24h", 1.0)],
    )
    return {
        family.name + SUFFIX.get(family.type, "")
        for family in metrics.registry.collect()
        if family.name.startswith(PREFIX)
    }


def test_every_metric_is_documented() -> None:
    doc = DOC.read_text()
    assert {name for name in exported_names() if f"`{name}`" not in doc} == set()
