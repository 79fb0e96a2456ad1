"""The holds a Retry-After sets on a kind of call (app.adapters.bounded_http.Holds), on an
injected wall clock: a later hold is never shortened by an earlier-ending one, and a clock
stepped back never holds a call longer than the wait it was given."""

from __future__ import annotations

from app.adapters.bounded_http import Holds

HOUR = 3600.0


def test_a_shorter_retry_after_does_not_lift_a_longer_hold() -> None:
    """Two answers of one kind in flight at once (manifests fetched side by side): the
    second's `Retry-After: 5` must not end the first's hour."""
    now = [1_000_000.0]
    holds = Holds(longest=HOUR, clock=lambda: now[0])
    holds.hold("manifests", 3600.0, unreachable=False)
    holds.hold("manifests", 5.0, unreachable=False)
    now[0] += 60.0
    held = holds.held("manifests")
    assert held is not None and held.left >= 3600.0 - 60.0


def test_a_longer_retry_after_extends_a_hold() -> None:
    now = [1_000_000.0]
    holds = Holds(longest=HOUR, clock=lambda: now[0])
    holds.hold("report", 5.0, unreachable=False)
    holds.hold("report", 600.0, unreachable=False)
    now[0] += 60.0
    held = holds.held("report")
    assert held is not None and held.left >= 600.0 - 60.0


def test_a_clock_stepped_back_holds_no_longer_than_the_wait() -> None:
    """NTP steps the wall clock back six hours during a 60 s hold: the call is held at
    most the 60 s (and its jitter) it was given, not six hours more."""
    now = [1_000_000.0]
    holds = Holds(longest=HOUR, clock=lambda: now[0])
    wait = holds.hold("report", 60.0, unreachable=False)
    now[0] -= 6 * HOUR
    held = holds.held("report")
    assert held is not None and held.left <= wait
    now[0] += wait + 0.001  # the hold is over once its own time has passed
    assert holds.held("report") is None
