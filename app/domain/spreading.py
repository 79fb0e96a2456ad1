"""Spreading a fleet's calls apart in time, so that nodes that start or lose a server
together do not come back together.

- **Reconnects** wait a capped exponential backoff with full jitter (the "full jitter" of
  AWS's Architecture Blog, "Exponential Backoff And Jitter"): before attempt n (0 for the
  first after a loss) a client sleeps a uniform draw from [0, min(cap, base x 2^n)). A
  thousand clients that lost one server at the same instant try again spread over the
  whole window, and the window grows while the server stays away, so the load of
  attempts on a server that comes back is bounded by the window, not by the fleet.
- **Lame duck**: a server going away announces it (`ldm` in its INFO); each client moves
  to another server after a uniform draw from [0, spread), not all at the announcement.
- **Start-up**: the first run of each of a node's calls to shared services (the heartbeat,
  the report, the sync, the self-update check, the worker's connection) comes a uniform
  draw from [0, spread) later than it would, so that a fleet restarted together (a
  rollout, a power cut) does not call the backend, PostgreSQL and NATS in the same
  second; every later run keeps its interval from there.

The draws come from an injected source of uniform numbers in [0, 1) (`random.random` in
the process), so tests choose them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

Draw = Callable[[], float]  # a uniform number in [0, 1)

# the exponent's bound: 2^30 x any sane base is past every cap
_MAX_EXPONENT = 30


def full_jitter(attempt: int, *, base: float, cap: float, draw: Draw) -> float:
    """The wait before reconnect attempt `attempt` (0: the first after the loss): a uniform
    draw from [0, min(cap, base x 2^attempt))."""
    window = min(cap, base * 2.0 ** min(max(attempt, 0), _MAX_EXPONENT))
    return draw() * window


@dataclass(frozen=True)
class ReconnectPolicy:
    """How a NATS client comes back: full-jitter waits from `base` up to `cap` seconds,
    never giving up; on a server's lame duck announcement it moves on after a draw from
    [0, `lame_duck_spread`)."""

    base: float = 1.0
    cap: float = 30.0
    lame_duck_spread: float = 10.0
    draw: Draw = field(default=random.random, compare=False)

    def wait(self, attempt: int) -> float:
        return full_jitter(attempt, base=self.base, cap=self.cap, draw=self.draw)

    def lame_duck_wait(self) -> float:
        return self.draw() * self.lame_duck_spread


@dataclass(frozen=True)
class StartupSpread:
    """Each first run of a call to a shared service comes `after(first_after)` seconds
    after the start: its own first delay plus a draw from [0, `seconds`)."""

    seconds: float = 0.0
    draw: Draw = field(default=random.random, compare=False)

    def offset(self) -> float:
        """A draw from [0, seconds): 0 when there is no spread."""
        return self.draw() * self.seconds if self.seconds > 0 else 0.0

    def after(self, first_after: float) -> float:
        return first_after + self.offset()
