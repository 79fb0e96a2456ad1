"""What each part of the manager is doing, for `/v1/status`, `/readyz` and alerts.

A component is on or off (and why), and records the outcome of its last attempts.
A run of a loop (a sync, a report, a heartbeat) ends in an `Outcome`, which the
supervision module records on the component, in the metrics and in the alerts, as
controller-runtime's reconcile result is handled by its controller, not by each
reconciler. A component with a live state (a connection) is read through `live` each
time its state is asked for, at the time its `clock` gives (tests pass their own).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from types import MappingProxyType
from typing import Any

_EMPTY: Mapping[str, Any] = MappingProxyType({})


class Result(StrEnum):
    """How one run ended; the value is the `outcome` label of `scheduled_runs_total`
    (where a body that raised, a bug, is `error` instead)."""

    OK = "ok"
    FAILED = "failed"  # the run did its work and it failed (the backend said 502)
    UNAVAILABLE = "unavailable"  # a dependency is down: a state, not a crash
    SKIPPED = "skipped"  # nothing was attempted this time (busy, deferred)


@dataclass(frozen=True)
class Cadence:
    """What an answer said of its loop's interval: the `seconds` it asked for, or None
    when it asked for none (the loop goes back to its configured interval)."""

    seconds: float | None


@dataclass(frozen=True)
class Outcome:
    """What one run returns: how it ended, why, what `/v1/status` shows of it, and the
    events to alert on (key, text) whatever the result."""

    result: Result
    error: str | None = None
    detail: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    alerts: tuple[tuple[str, str], ...] = ()
    # when the loop should run next, in seconds, instead of at its interval: a backend's
    # Retry-After, capped and jittered (None: the supervisor's policy)
    retry_in: float | None = None
    # the interval the backend's answer asked for from now on (None: no answer, nothing
    # said; `Cadence(None)`: an answer without one, back to the configured interval)
    cadence: Cadence | None = None

    @classmethod
    def ok(cls, **detail: Any) -> Outcome:
        return cls(Result.OK, detail=detail)

    @classmethod
    def failed(cls, error: str, **detail: Any) -> Outcome:
        return cls(Result.FAILED, error, detail)

    @classmethod
    def unavailable(cls, error: str, **detail: Any) -> Outcome:
        return cls(Result.UNAVAILABLE, error, detail)

    @classmethod
    def skipped(cls, why: str, **detail: Any) -> Outcome:
        return cls(Result.SKIPPED, why, detail)

    @property
    def succeeded(self) -> bool:
        return self.result is Result.OK

    def with_detail(self, **detail: Any) -> Outcome:
        """This outcome with `detail` under its own (its own wins)."""
        return replace(self, detail={**detail, **self.detail})

    def alerting(self, key: str, text: str) -> Outcome:
        return replace(self, alerts=(*self.alerts, (key, text)))

    def retrying(self, seconds: float | None) -> Outcome:
        """This outcome, asking for the loop's next run in `seconds` (None: as it was)."""
        return self if seconds is None else replace(self, retry_in=max(0.0, seconds))

    def paced(self, cadence: Cadence | None) -> Outcome:
        """This outcome, saying what the answer asked of the loop's interval."""
        return self if cadence is None else replace(self, cadence=cadence)


class ComponentState(StrEnum):
    OFF = "off"
    STARTING = "starting"
    OK = "ok"
    FAILING = "failing"


@dataclass
class Component:
    """One component's record: on or off and why, the facts its start found (`facts`),
    and its state, from its runs' outcomes or, for one with a live state (a connection),
    from `live`, asked each time the record is read (`refresh`)."""

    name: str
    enabled: bool
    reason: str
    critical: bool = False
    _state: ComponentState = ComponentState.STARTING
    last_success_at: datetime | None = None
    last_failure_at: datetime | None = None
    last_error: str | None = None
    consecutive_failures: int = 0
    facts: dict[str, Any] = field(default_factory=dict)  # what the start found
    last_detail: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)  # the last run's
    failing_since: datetime | None = None  # the first failure since it last succeeded
    live: Callable[[], Outcome | None] | None = None
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC), repr=False)

    @property
    def state(self) -> ComponentState:
        """The state now: a live one is read first (`refresh`)."""
        if self.live is not None:
            self.refresh(self.clock())
        return self._state

    def __post_init__(self) -> None:
        if not self.enabled:
            self._state = ComponentState.OFF

    @property
    def detail(self) -> dict[str, Any]:
        """The facts of the start, and the last run's detail over them."""
        return {**self.facts, **self.last_detail}

    def switch_off(self, reason: str) -> None:
        self.enabled = False
        self._state = ComponentState.OFF
        self.reason = reason
        self.failing_since = None
        self.live = None

    def succeeded(self, at: datetime, **detail: Any) -> None:
        self._state = ComponentState.OK
        self.last_success_at = at
        self.consecutive_failures = 0
        self.failing_since = None
        self.last_detail = detail

    def failed(self, at: datetime, error: str, **detail: Any) -> None:
        if self._state is not ComponentState.FAILING:
            self.failing_since = at
        self._state = ComponentState.FAILING
        self.last_failure_at = at
        self.last_error = error
        self.consecutive_failures += 1
        self.last_detail = detail

    def record(self, at: datetime, outcome: Outcome) -> None:
        """A run's outcome: OK succeeds, FAILED and UNAVAILABLE fail, SKIPPED leaves the
        state as it was; its detail describes this run and replaces the last one's."""
        if outcome.result is Result.OK:
            self.succeeded(at, **outcome.detail)
        elif outcome.result is Result.SKIPPED:
            self.last_detail = outcome.detail
        else:
            self.failed(at, outcome.error or outcome.result.value, **outcome.detail)

    def refresh(self, at: datetime) -> None:
        """The state now, for a component with a live state: what `live` says, recorded
        when it differs from the record (a change of state or of error), so the times
        say when it changed."""
        if self.live is None or not self.enabled:
            return
        outcome = self.live()
        if outcome is None or outcome.result is Result.SKIPPED:
            return
        if outcome.result is Result.OK:
            if self._state is not ComponentState.OK:
                self.succeeded(at, **outcome.detail)
        elif self._state is not ComponentState.FAILING or self.last_error != outcome.error:
            self.failed(at, outcome.error or outcome.result.value, **outcome.detail)

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
            "failing_since": self.failing_since,
            "detail": self.detail,
        }


def outage_alerts(
    components: list[Component], alerted: frozenset[str], *, now: datetime, grace: float
) -> tuple[list[tuple[str, str]], frozenset[str]]:
    """The alerts to raise now (key, text), and which components are then alerted as down:
    one when an enabled component has been failing for `grace` seconds or more, one when a
    component alerted as down is no longer failing (recovered, or switched off)."""
    raised: list[tuple[str, str]] = []
    down = set(alerted)
    for component in components:
        component.refresh(now)
        name, since = component.name, component.failing_since
        failing = component.enabled and component.state is ComponentState.FAILING
        if failing and since is not None and name not in down:
            lasted = (now - since).total_seconds()
            if lasted >= grace:
                why = component.last_error or "failing"
                raised.append((f"{name}:down", f"{name} down for {lasted:.0f} s: {why}"))
                down.add(name)
        elif not failing and name in down:
            state = "off" if not component.enabled else component.state.value
            raised.append((f"{name}:recovered", f"{name} recovered ({state})"))
            down.discard(name)
    return raised, frozenset(down)
