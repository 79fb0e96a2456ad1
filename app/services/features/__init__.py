"""The features of the manager, one module each, and the order they are decided and opened
in: each one's inputs come before it (the data services before their users, the sync
before uptime management, the registry before the worker). Adding a feature is its module
and a line here. What a feature is: `base`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.domain.components import Component, ComponentState
from app.services.features.alerts import ALERTS
from app.services.features.base import Decision, Off, On, Spec
from app.services.features.data import NATS, POSTGRES
from app.services.features.deps import Decisions, Shared
from app.services.features.registry import REGISTRY
from app.services.features.report import REPORT
from app.services.features.self_update import SELF_UPDATE
from app.services.features.sync import SYNC
from app.services.features.uptime import UPTIME, UPTIME_RECORD
from app.services.features.worker import WORKER
from app.settings import Settings

FEATURES: tuple[Spec[Any, Any], ...] = (
    POSTGRES, NATS, ALERTS, REPORT, SYNC, SELF_UPDATE, UPTIME_RECORD, UPTIME, REGISTRY, WORKER,
)  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """Every feature decided, with what they share."""

    shared: Shared
    decisions: Decisions

    def of(self, spec: Spec[Any, Any]) -> Decision[Any]:
        return self.decisions.of(spec)

    def components(self) -> dict[str, Component]:
        """The status records: the API and the scheduler first (both critical), then each
        feature's, critical when on and its spec says readiness waits for it."""
        records = {
            "api": Component("api", True, "serving", critical=True, _state=ComponentState.OK),
            "scheduler": Component("scheduler", True, "runs the periodic loops", critical=True),
        }
        for spec, decision in self.decisions.made.items():
            critical = decision.enabled and spec.critical
            records[spec.name] = Component(
                spec.name, decision.enabled, decision.reason, critical=critical
            )
        return records


def decide(settings: Settings, *, can_sign: bool) -> Plan:
    """Every feature on with its config or off with why, from the settings alone (and
    whether there is a node key to sign with)."""
    shared = Shared.of(settings, can_sign=can_sign)
    decisions = Decisions()
    for spec in FEATURES:
        decisions.made[spec] = spec.decide(settings, shared, decisions)
    return Plan(shared, decisions)


__all__ = ["FEATURES", "Off", "On", "Plan", "decide"]
