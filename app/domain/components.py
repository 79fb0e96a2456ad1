"""What each part of the manager is doing, for `/v1/status`, `/readyz` and alerts.

A component is on or off (and why), and records the outcome of its last attempts.
Times are passed in, so this stays a plain record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any


class ComponentState(StrEnum):
    OFF = "off"
    STARTING = "starting"
    OK = "ok"
    FAILING = "failing"


@dataclass
class Component:
    name: str
    enabled: bool
    reason: str
    critical: bool = False
    state: ComponentState = ComponentState.STARTING
    last_success_at: datetime | None = None
    last_failure_at: datetime | None = None
    last_error: str | None = None
    consecutive_failures: int = 0
    detail: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.enabled:
            self.state = ComponentState.OFF

    def switch_off(self, reason: str) -> None:
        self.enabled = False
        self.state = ComponentState.OFF
        self.reason = reason

    def succeeded(self, at: datetime, **detail: Any) -> None:
        self.state = ComponentState.OK
        self.last_success_at = at
        self.consecutive_failures = 0
        self.detail.update(detail)

    def failed(self, at: datetime, error: str, **detail: Any) -> None:
        self.state = ComponentState.FAILING
        self.last_failure_at = at
        self.last_error = error
        self.consecutive_failures += 1
        self.detail.update(detail)

    @property
    def healthy(self) -> bool:
        return not self.enabled or self.state is not ComponentState.FAILING

    def as_dict(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "state": self.state.value,
            "reason": self.reason,
            "last_success_at": self.last_success_at,
            "last_failure_at": self.last_failure_at,
            "last_error": self.last_error,
            "consecutive_failures": self.consecutive_failures,
            "detail": dict(self.detail),
        }
