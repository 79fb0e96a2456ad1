"""Kubelet probes and the Prometheus endpoint; always open, never behind the API token."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.api.deps import MetricsDep, runtime
from app.api.schemas import Liveness, Readiness

router = APIRouter(tags=["probes"])


async def _not_ready(request: Request) -> list[str]:
    return runtime(request).not_ready_because()


@router.get("/healthz", response_model=Liveness, summary="The process serves HTTP")
async def healthz() -> Liveness:
    return Liveness(status="ok")


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "Not ready; reasons say why"}},
    summary="Started, scheduler running, critical components healthy",
)
async def readyz(reasons: Annotated[list[str], Depends(_not_ready)]) -> JSONResponse:
    body = Readiness(ready=not reasons, reasons=reasons)
    return JSONResponse(body.model_dump(), status_code=200 if body.ready else 503)


@router.get("/metrics", response_class=Response, summary="Prometheus metrics")
async def metrics(metrics: MetricsDep) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
