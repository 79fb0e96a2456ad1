"""The holds a Retry-After sets on a kind of call (app.adapters.bounded_http.Holds), on an
injected wall clock: a later hold is never shortened by an earlier-ending one, and a clock
stepped back never holds a call longer than the wait it was given."""

from __future__ import annotations

import pytest

from app.adapters.bounded_http import Holds

HOUR = 3600.0


@pytest.mark.parametrize(
    ("first", "second", "held_at_least"),
    [
        (3600.0, 5.0, 3600.0),  # a shorter answer in flight at once does not lift the hour
        (5.0, 600.0, 600.0),  # a longer one extends the hold
    ],
)
def test_the_later_of_two_holds_stands(first: float, second: float, held_at_least: float) -> None:
    """Two answers of one kind at once (manifests fetched side by side): the hold ends at
    the later of the two, whichever came first."""
    now = [1_000_000.0]
    holds = Holds(longest=HOUR, clock=lambda: now[0])
    holds.hold("manifests", first, unreachable=False)
    holds.hold("manifests", second, unreachable=False)
    now[0] += 60.0
    held = holds.held("manifests")
    assert held is not None and held.left >= held_at_least - 60.0


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
