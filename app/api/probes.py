"""Kubelet probes and the Prometheus endpoint; always open, never behind the API token."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.api.auth import runtime
from app.api.schemas import Liveness, Readiness

router = APIRouter(tags=["probes"])


@router.get("/healthz", response_model=Liveness, summary="The process serves HTTP")
async def healthz() -> Liveness:
    return Liveness(status="ok")


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "Not ready; reasons say why"}},
    summary="Started, scheduler running, critical components healthy",
)
async def readyz(request: Request) -> JSONResponse:
    rt = runtime(request)
    reasons: list[str] = []
    if not rt.started:
        reasons.append("start-up has not finished")
    if rt.stopping:
        reasons.append("shutting down")
    if not rt.scheduler.running:
        reasons.append("scheduler is not running")
    for name, component in rt.components.items():
        if component.critical and not component.healthy:
            reasons.append(f"{name} is failing: {component.last_error}")
    body = Readiness(ready=not reasons, reasons=reasons)
    return JSONResponse(body.model_dump(), status_code=200 if body.ready else 503)


@router.get("/metrics", response_class=Response, summary="Prometheus metrics")
async def metrics(request: Request) -> Response:
    registry = runtime(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
