"""What a route may ask for: each part of the running manager as a typed dependency.

Routes name the parts they use (the workload book, the settings, the syncer) and get
them here; none is handed the whole runtime. A part that can be switched off comes as
`Switchable`: the route takes it with `.on()`, which refuses a switched-off part with a
503 and the reason its component gives, so every route says it the same way (after the
request's own parameters were checked: a bad query is a 422 whatever is on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Generic, TypeVar

from fastapi import Depends, HTTPException, Request

from app.domain.components import Component
from app.metrics import Metrics
from app.services.features.registry import REGISTRY
from app.services.features.sync import SYNC
from app.services.runtime import Runtime
from app.services.supervision import Supervisor
from app.services.workloads import WorkloadBook
from app.settings import Settings

if TYPE_CHECKING:
    from app.adapters.registry import AsyncpgRegistry
    from app.services.syncing import Syncer


T = TypeVar("T")


@dataclass(frozen=True)
class Switchable(Generic[T]):
    part: T | None
    component: Component

    def on(self) -> T:
        if self.part is None:
            detail = f"{self.component.name} is off: {self.component.reason}"
            raise HTTPException(status_code=503, detail=detail)
        return self.part


def runtime(request: Request) -> Runtime:
    """The runtime itself: for the composition of the status snapshot only."""
    rt: Runtime = request.app.state.runtime
    return rt


def _settings(request: Request) -> Settings:
    return runtime(request).settings


def _book(request: Request) -> WorkloadBook:
    return runtime(request).book


def _metrics(request: Request) -> Metrics:
    return runtime(request).metrics


def _supervisor(request: Request) -> Supervisor:
    return runtime(request).supervisor


def _components(request: Request) -> dict[str, Component]:
    return runtime(request).components


def _syncer(request: Request) -> Switchable[Syncer]:
    rt = runtime(request)
    running = rt.get(SYNC)
    return Switchable(running.syncer if running else None, rt.components[SYNC.name])


def _registry(request: Request) -> Switchable[AsyncpgRegistry]:
    rt = runtime(request)
    running = rt.get(REGISTRY)
    return Switchable(running.registry if running else None, rt.components[REGISTRY.name])


SettingsDep = Annotated[Settings, Depends(_settings)]
BookDep = Annotated[WorkloadBook, Depends(_book)]
MetricsDep = Annotated[Metrics, Depends(_metrics)]
SupervisorDep = Annotated[Supervisor, Depends(_supervisor)]
ComponentsDep = Annotated[dict[str, Component], Depends(_components)]
SyncerDep = Annotated[Switchable["Syncer"], Depends(_syncer)]
RegistryDep = Annotated[Switchable["AsyncpgRegistry"], Depends(_registry)]
