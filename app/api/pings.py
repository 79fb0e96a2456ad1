"""`POST /v1/workloads/{name}/health`: workloads say how they are, every 5-10 s.

The body is parsed here, after the name and token checks, straight from bytes with
pydantic-core: an unauthenticated caller never gets its JSON parsed, and a ping costs
one validation. Errors use FastAPI's 422 shape, with the field at fault in `loc`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from app.api.auth import check_ping_token, runtime
from app.domain.health import Ping, is_workload_name
from app.services.workloads import BookFull

log = logging.getLogger(__name__)
router = APIRouter(tags=["workloads"])

_PING_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": Ping.model_json_schema()}},
    }
}


def _printable(value: Any) -> Any:
    """The offending input as the 422 can always encode it: invalid JSON comes back as raw
    bytes (maybe not UTF-8), and `Infinity` as a float JSON cannot carry."""
    if isinstance(value, bytes | bytearray):
        return bytes(value[:200]).decode("utf-8", "replace")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)[:200]
    return value


def _name_error(name: str) -> RequestValidationError:
    return RequestValidationError(
        [
            {
                "type": "value_error",
                "loc": ("path", "name"),
                "msg": "must be a DNS-1123 label: lower-case letters, digits and '-', "
                "at most 63 characters, starting and ending with a letter or digit",
                "input": name,
            }
        ]
    )


@router.post(
    "/v1/workloads/{name}/health",
    status_code=status.HTTP_204_NO_CONTENT,
    response_class=Response,
    openapi_extra=_PING_SCHEMA,
    responses={
        401: {"description": "Missing or invalid ping token"},
        413: {"description": "Body larger than the ping limit (16 KiB by default)"},
        422: {"description": "Invalid workload name or body; `loc` names the field"},
        429: {"description": "The node tracks the maximum number of workloads"},
    },
    summary="Record a workload's health ping",
)
async def post_ping(name: str, request: Request) -> Response:
    rt = runtime(request)
    metrics = rt.metrics
    if not is_workload_name(name):
        metrics.ping_rejections.labels("invalid").inc()
        raise _name_error(name)
    try:
        check_ping_token(request, name)
    except HTTPException:
        metrics.ping_rejections.labels("unauthorized").inc()
        raise
    body = await request.body()
    try:
        ping = Ping.model_validate_json(body)
    except ValidationError as exc:
        metrics.ping_rejections.labels("invalid").inc()
        raise RequestValidationError(
            [
                {**err, "loc": ("body", *err["loc"]), "input": _printable(err.get("input"))}
                for err in exc.errors(include_url=False)
            ]
        ) from None
    try:
        rt.book.record(name, ping)
    except BookFull:
        metrics.ping_rejections.labels("capacity").inc()
        log.warning("ping from %s refused: the node already tracks the maximum", name)
        raise HTTPException(
            status_code=status.HTTP_429_TOO_MANY_REQUESTS,
            detail=f"the node already tracks {rt.settings.max_tracked_workloads} workloads",
        ) from None
    metrics.pings.labels(name, ping.status.value).inc()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
