"""What a feature of the manager is, and what it hands the composition root once it runs.

A feature is a module with one `Spec`: `decide(settings, shared, earlier)` says whether it runs
(`On(config, reason)`, its config a small view of the settings, or `Off(reason)`), and
`open(config, deps)` builds it from that config and what the features opened before it
provide, and returns its `Running` (or `Off`, when a fact only the start can tell
switches it off: no cluster, no PostgreSQL). A `Running` declares what the root runs for
it: its timers (periodic loops), its tasks, its `health()` (computed when asked, from
its live state), and its stop step for each phase of the shutdown. The root
(`app/services/runtime.py`) opens the specs in a declared order, hands every timer and
task to the supervisor, and runs the stop phases within the one deadline.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from app.domain.components import Outcome

if TYPE_CHECKING:
    from app.services.features.deps import Decisions, Deps, Shared
    from app.settings import Settings

C = TypeVar("C")
R = TypeVar("R", bound="Running")


@dataclass(frozen=True)
class On(Generic[C]):
    """The component runs, with this config; `reason` says what it will do."""

    config: C
    reason: str
    enabled: Literal[True] = True


@dataclass(frozen=True)
class Off:
    """The component does not run, and why."""

    reason: str
    enabled: Literal[False] = False


Decision = On[C] | Off

LoopBody = Callable[[], Awaitable[object]]
TaskBody = Callable[[Any], Awaitable[object]]  # given its `stopping` event


@dataclass(frozen=True)
class Timer:
    """A periodic loop: its body returns an `Outcome`, recorded by the supervisor (on the
    feature's component unless `recorded` is False), which also decides its next run."""

    name: str
    body: LoopBody
    every: float
    first_after: float = 1.0
    what: str | None = None  # how logs name it ("deployment sync")
    outage: tuple[type[Exception], ...] = ()  # errors that mean a dependency is down
    recorded: bool = True
    # a call to a shared service (the backend, PostgreSQL, the version file): its first
    # run comes a draw of STARTUP_SPREAD_SECONDS later (`Shared.startup`)
    spread: bool = False
    # the bounds of an interval the backend may ask for (None: `every` stays)
    bounds: tuple[float, float] | None = None


@dataclass(frozen=True)
class Task:
    """A long-lived task, `body(stopping)`, restarted with backoff when it fails (with
    `restart`); its failures are recorded on the feature's component."""

    name: str
    body: TaskBody
    restart: bool = True
    recorded: bool = True


class Phase(IntEnum):
    """The shutdown's phases, in order; each feature's steps of one phase run together."""

    ANNOUNCE = 1  # the fleet is told the node drains; nothing new starts
    QUIESCE = 2  # beside the loops' last runs: jobs in flight finish or go back
    FINAL = 3  # what was counted is saved, the last report sent
    DEPART = 4  # offline in the registry
    FLUSH = 5  # the last alerts sent


@dataclass(frozen=True)
class Step:
    """One stop step: `run(budget)` within `budget` seconds, at most `cap` of what is left."""

    name: str
    run: Callable[[float], Awaitable[object]]
    cap: float | None = None


@dataclass(kw_only=True)
class Running:
    """A feature once open: what the root runs and stops for it."""

    timers: list[Timer] = field(default_factory=list)
    tasks: list[Task] = field(default_factory=list)
    stops: dict[Phase, Step] = field(default_factory=dict)

    def health(self) -> Outcome | None:
        """The feature's state now, read from what it holds (a connection, its last
        fetch); None: its record is its runs' outcomes."""
        return None


class Spec(ABC, Generic[C, R]):
    """A feature: its name (its component's), whether readiness waits for it, how it is
    decided and how it is opened (abstract: a feature that lacks either is not made)."""

    name: str
    critical: bool = False  # in `/readyz` when on

    @abstractmethod
    def decide(self, settings: Settings, shared: Shared, earlier: Decisions) -> Decision[C]:
        """On or off from the settings, what all features share, and the decisions of the
        features before it."""

    @abstractmethod
    async def open(self, config: C, deps: Deps) -> R | Off:
        """The feature running (not yet started), or Off with what the start found."""

    def __repr__(self) -> str:
        return f"<feature {self.name}>"
