"""Status for the backend and operators: the node, its components and every workload.

Everything the snapshot says passes through the one redaction (`app.domain.redaction`):
a component's reason, error and detail may name a configured URL or quote an error that
does, and neither a URL's password or token nor a secret query parameter is ever shown.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request

from app import __version__
from app.api.auth import UNAUTHORIZED, require_api_token
from app.api.deps import BookDep, runtime
from app.api.schemas import (
    AlertInfo,
    ComponentInfo,
    LoopInfo,
    NodeInfo,
    ReportInfo,
    Status,
    SyncInfo,
    TaskInfo,
    WorkloadInfo,
    WorkloadList,
)
from app.domain.health import is_workload_name
from app.domain.redaction import redact_text, scrub
from app.domain.reports import WorkloadView
from app.services.features.report import REPORT
from app.services.features.sync import SYNC
from app.services.runtime import Runtime

router = APIRouter(
    tags=["status"], dependencies=[Depends(require_api_token)], responses=UNAUTHORIZED
)


def _workload(view: WorkloadView) -> WorkloadInfo:
    fields = asdict(view)
    fields["update"] = view.update.as_dict() if view.update is not None else None
    return WorkloadInfo(**scrub(fields))


def build_status(rt: Runtime) -> Status:
    """One snapshot of everything the node knows; the JSON route and the HTML page both
    render it, so they cannot disagree."""
    reporting, syncing = rt.get(REPORT), rt.get(SYNC)
    last = reporting.reporter.last_report if reporting is not None else None
    syncer = syncing.syncer if syncing is not None else None
    rt.refresh()
    return Status(
        node=NodeInfo(
            id=rt.node_id,
            version=__version__,
            env=rt.settings.app_env.value,
            started_at=rt.started_wall,
            uptime_seconds=round(rt.uptime_seconds, 3),
            managed_namespace=rt.settings.managed_namespace,
        ),
        components={
            name: ComponentInfo(**scrub(component.as_dict()))
            for name, component in rt.components.items()
        },
        tasks={name: TaskInfo(**scrub(task)) for name, task in rt.supervisor.status().items()},
        loops={name: LoopInfo(**scrub(loop)) for name, loop in rt.supervisor.loops().items()},
        workloads=[_workload(v) for v in rt.book.views()],
        report=ReportInfo(
            interval_seconds=rt.supervisor.interval("report")
            or rt.settings.report_interval_seconds,
            next_at=rt.supervisor.next_run("report"),
            last_reported_at=last["reported_at"] if last else None,
            last_workload_count=len(last["workloads"]) if last else None,
        ),
        sync=SyncInfo(
            interval_seconds=rt.supervisor.interval("sync") or rt.settings.sync_interval_seconds,
            next_at=rt.supervisor.next_run("sync"),
            last=scrub(syncer.last.as_dict()) if syncer and syncer.last else None,
            last_change=(
                scrub(syncer.last_change.as_dict()) if syncer and syncer.last_change else None
            ),
            desired=(
                scrub(syncer.source.origin().as_dict(datetime.now(UTC)))
                if syncer and syncer.last
                else None
            ),
        ),
        alerts=[
            AlertInfo(at=a.at, key=a.key, text=redact_text(a.text))
            for a in reversed(rt.alerts.recent)
        ],
    )


async def _snapshot(request: Request) -> Status:
    """On the event loop (an async dependency): the live states are read there."""
    return build_status(runtime(request))


StatusDep = Annotated[Status, Depends(_snapshot)]


@router.get(
    "/v1/status", response_model=Status, summary="Node, components, workloads, recent alerts"
)
async def get_status(status: StatusDep) -> Status:
    return status


@router.get("/v1/workloads", response_model=WorkloadList, summary="Every known workload")
async def list_workloads(book: BookDep) -> WorkloadList:
    return WorkloadList(workloads=[_workload(v) for v in book.views()])


@router.get(
    "/v1/workloads/{name}",
    response_model=WorkloadInfo,
    responses={404: {"description": "No such workload"}},
    summary="One workload",
)
async def get_workload(name: str, book: BookDep) -> WorkloadInfo:
    view = book.view(name) if is_workload_name(name) else None
    if view is None:
        raise HTTPException(status_code=404, detail=f"no workload named {name!r}")
    return _workload(view)
