"""The PrometheusRule and the Grafana dashboard only use metrics the manager exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.services.runtime import build_runtime
from app.settings import Settings

MONITORING = Path(__file__).resolve().parents[2] / "k8s" / "monitoring"
METRIC = re.compile(r"\b((?:workload_manager|process)_[a-z_]+)")


def exported_names() -> set[str]:
    """Every metric a running manager exports, the scrape-time state gauges included."""
    runtime = build_runtime(Settings(_env_file=None, embedded_services=False))
    names: set[str] = set()
    for family in runtime.metrics.registry.collect():
        names.add(family.name)
        names.update(
            f"{family.name}{suffix}"
            for suffix in ("_total", "_bucket", "_count", "_sum", "_created", "_info")
        )
    return names


def rule_docs() -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((MONITORING / "prometheusrule.yaml").read_text()))


def rules() -> list[dict[str, Any]]:
    return [rule for doc in rule_docs() for g in doc["spec"]["groups"] for rule in g["rules"]]


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((MONITORING / "dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_every_rule_is_complete_and_uses_real_metrics(rule: dict[str, Any]) -> None:
    assert rule["alert"].startswith("WorkloadManager")
    assert rule["labels"]["severity"] in ("warning", "critical")
    assert rule["annotations"]["summary"]
    used = set(METRIC.findall(rule["expr"]))
    assert used and used <= exported_names(), used - exported_names()


def test_every_dashboard_query_uses_real_metrics() -> None:
    exprs = dashboard_exprs()
    assert len(exprs) >= 10
    for expr in exprs:
        used = set(METRIC.findall(expr))
        assert used and used <= exported_names(), (expr, used - exported_names())


def test_rule_resource_shape() -> None:
    (doc,) = rule_docs()
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert doc["kind"] == "PrometheusRule"
    assert doc["metadata"]["namespace"] == "workload-manager"


def test_the_service_monitor_scrapes_the_manager_service() -> None:
    monitor = yaml.safe_load((MONITORING / "servicemonitor.yaml").read_text())
    service = yaml.safe_load((MONITORING.parent / "service.yaml").read_text())
    assert monitor["kind"] == "ServiceMonitor"
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]
    assert endpoint["path"] == "/metrics"
    kustomization = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    assert "servicemonitor.yaml" in kustomization["resources"]
