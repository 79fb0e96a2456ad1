"""Operator actions: run a deployment sync now (or plan one with `dry_run`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query

from app.api.auth import UNAUTHORIZED, require_api_token
from app.api.deps import SupervisorDep, SyncerDep
from app.api.params import single_valued

router = APIRouter(
    tags=["admin"], dependencies=[Depends(require_api_token)], responses=UNAUTHORIZED
)


@router.post(
    "/v1/sync",
    summary="Run a deployment sync now; with dry_run, return the plan and change nothing",
    responses={
        409: {"description": "A sync or a self-update is already running"},
        503: {"description": "Sync is off; the detail says why"},
    },
    dependencies=[Depends(single_valued("dry_run"))],
)
async def post_sync(
    syncer: SyncerDep,
    supervisor: SupervisorDep,
    dry_run: Annotated[bool, Query(description="plan only")] = False,
) -> dict[str, Any]:
    from app.services.syncing import SyncBusy

    sync = syncer.on()
    try:
        outcome = await sync.sync(dry_run=dry_run)
    except SyncBusy as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from None
    if not dry_run:  # recorded as a scheduled sync is: the component, metrics, alerts
        supervisor.record("sync", sync.outcome_of(outcome))
    return outcome.as_dict()
