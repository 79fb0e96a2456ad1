"""`POST /v1/workloads/{name}/health`: workloads say how they are, every 5-10 s.

The body is parsed here, after the name and token checks, straight from bytes with
pydantic-core: an unauthenticated caller never gets its JSON parsed, and a ping costs
one validation. Errors use FastAPI's 422 shape, with the field at fault in `loc`.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from app.api.auth import check_ping_token
from app.api.deps import BookDep, MetricsDep, SettingsDep
from app.domain.health import DNS1123_LABEL, Ping, is_workload_name
from app.services.workloads import UPDATE_HEADER, BookFull

log = logging.getLogger(__name__)
router = APIRouter(tags=["workloads"])


def _inline_refs(schema: Any, defs: dict[str, Any]) -> Any:
    """Pydantic's `#/$defs/...` references resolved in place: inside the OpenAPI document
    they would point at its root, where no `$defs` exist."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline_refs(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline_refs(item, defs) for item in schema]
    return schema


_PING_BODY = Ping.model_json_schema()
_PING_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": _inline_refs(_PING_BODY, _PING_BODY.get("$defs", {}))}
        },
    }
}
# documented, not enforced by the framework: the route checks the name itself, so an
# invalid one is counted among the rejections
WorkloadName = Annotated[
    str,
    Path(
        description="The workload's name, a DNS-1123 label",
        json_schema_extra={"pattern": DNS1123_LABEL.pattern, "maxLength": 63},
    ),
]


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
        204: {
            "description": "Recorded",
            "headers": {
                UPDATE_HEADER: {
                    "description": "Present while an update of this workload is pending: "
                    "`version=<target>; state=<waiting-wave|halted|outside-window|deferred|"
                    "applying>`",
                    "schema": {"type": "string"},
                }
            },
        },
    },
    summary="Record a workload's health ping",
)
async def post_ping(
    name: WorkloadName,
    request: Request,
    book: BookDep,
    metrics: MetricsDep,
    settings: SettingsDep,
) -> Response:
    if not is_workload_name(name):
        metrics.ping_rejections.labels("invalid").inc()
        raise _name_error(name)
    try:
        check_ping_token(request, settings, name)
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
        book.record(name, ping)
    except BookFull:
        metrics.ping_rejections.labels("capacity").inc()
        log.warning("ping from %s refused: the node already tracks the maximum", name)
        raise HTTPException(
            status_code=status.HTTP_429_TOO_MANY_REQUESTS,
            detail=f"the node already tracks {settings.max_tracked_workloads} workloads",
        ) from None
    metrics.count_ping(name, ping.status.value)
    notice = book.update_notice(name)
    headers = {UPDATE_HEADER: notice.decode()} if notice is not None else None
    return Response(status_code=status.HTTP_204_NO_CONTENT, headers=headers)
