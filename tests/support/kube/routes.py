"""The Starlette app: discovery documents, resource routing, recording and fault injection.

A single catch-all route dispatches on path segments so that every request, including
unknown paths, is recorded and answered with a Kubernetes `Status` body on error.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import patching, watch
from .faults import Control, RecordedRequest
from .meta import DEPLOYMENTS, NAMESPACES, ApiError, Kind, Obj, failure
from .store import Store

VERSION = {
    "major": "1",
    "minor": "32",
    "gitVersion": "v1.32.0-emulator",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2025-01-01T00:00:00Z",
    "goVersion": "go1.23.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}
_APPS_VERSION = {"groupVersion": "apps/v1", "version": "v1"}
_APPS_GROUP = {
    "name": "apps",
    "versions": [_APPS_VERSION],
    "preferredVersion": _APPS_VERSION,
}
_CORE_RESOURCES = {
    "kind": "APIResourceList",
    "groupVersion": "v1",
    "resources": [
        {
            "name": "namespaces",
            "singularName": "namespace",
            "namespaced": False,
            "kind": "Namespace",
            "verbs": ["create", "get", "list", "watch"],
            "shortNames": ["ns"],
        }
    ],
}
_APPS_RESOURCES = {
    "kind": "APIResourceList",
    "apiVersion": "v1",
    "groupVersion": "apps/v1",
    "resources": [
        {
            "name": "deployments",
            "singularName": "deployment",
            "namespaced": True,
            "kind": "Deployment",
            "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
            "shortNames": ["deploy"],
            "categories": ["all"],
        },
        {
            "name": "deployments/status",
            "singularName": "",
            "namespaced": True,
            "kind": "Deployment",
            "verbs": ["get", "patch", "update"],
        },
        {
            "name": "deployments/scale",
            "singularName": "",
            "namespaced": True,
            "group": "autoscaling",
            "version": "v1",
            "kind": "Scale",
            "verbs": ["get", "patch", "update"],
        },
    ],
}
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def build_app(store: Store, control: Control) -> Starlette:
    async def endpoint(request: Request) -> Response:
        method, path = request.method, request.url.path
        raw = await request.body()
        content_type = request.headers.get("content-type", "").split(";")[0].strip() or None
        epoch, interrupt = control.begin()
        delay = control.take_delay(method, path)
        # Waiting on an event lets reset() and stop() end an injected delay early; the
        # interrupted request is then dropped so it cannot touch the state of a later test.
        if delay and await asyncio.to_thread(interrupt.wait, delay):
            return JSONResponse(failure(503, "emulator reset while the request was delayed"), 503)
        fault = control.take_fault(method, path)
        headers = None
        stream: Response | None = None
        if fault is not None:
            headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after else None
            message = fault.message or f"injected fault for {method} {path}"
            code, body = fault.status, failure(fault.status, message)
        else:
            try:
                result = _dispatch(store, control, request, path, raw, content_type)
            except ApiError as exc:
                result = exc.code, exc.body
            if isinstance(result, Response):
                stream, (code, body) = result, (200, {})
            else:
                code, body = result
        control.record(
            RecordedRequest(
                method=method,
                path=path,
                query=dict(request.query_params.items()),
                content_type=content_type,
                status=code,
                body=_parse_lenient(raw, content_type),
            ),
            epoch,
        )
        return stream or JSONResponse(body, status_code=code, headers=headers)

    return Starlette(routes=[Route("/{path:path}", endpoint, methods=_METHODS)])


def _parse_lenient(raw: bytes, content_type: str | None) -> Any:
    if not raw:
        return None
    try:
        return _parse(raw, content_type)
    except ApiError:
        return raw.decode(errors="replace")


def _parse(raw: bytes, content_type: str | None) -> Any:
    try:
        if content_type and "yaml" in content_type:
            return yaml.safe_load(raw)
        return json.loads(raw)
    except (ValueError, yaml.YAMLError) as exc:
        raise ApiError(400, f"the request body could not be decoded: {exc}") from exc


def _not_found() -> ApiError:
    return ApiError(404, "the server could not find the requested resource")


def _method_not_allowed() -> ApiError:
    return ApiError(405, "the server does not allow this method on the requested resource")


def _list_target(parts: list[str]) -> tuple[Kind, str | None] | None:
    if parts == ["api", "v1", "namespaces"]:
        return NAMESPACES, None
    if parts == ["apis", "apps", "v1", "deployments"]:
        return DEPLOYMENTS, None
    if len(parts) == 6 and parts[:4] == ["apis", "apps", "v1", "namespaces"]:
        if parts[5] == "deployments":
            return DEPLOYMENTS, parts[4]
    return None


def _dispatch(
    store: Store,
    control: Control,
    request: Request,
    path: str,
    raw: bytes,
    content_type: str | None,
) -> tuple[int, Obj] | Response:
    parts = [part for part in path.split("/") if part]
    method = request.method
    query = request.query_params
    if method in ("GET", "HEAD"):
        discovery = _discovery(parts, request)
        if discovery is not None:
            return 200, discovery
    if method == "GET" and query.get("watch") in ("1", "t", "T", "true", "True", "TRUE"):
        target = _list_target(parts)
        if target is None:
            raise _not_found()
        return watch.respond(store, control, *target, dict(query.items()))
    dry_run = query.get("dryRun") == "All"

    if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
        if len(parts) == 3 and method == "GET":
            return 200, _list(store, NAMESPACES, None, request)
        if len(parts) == 3 and method == "POST":
            return 201, store.create(NAMESPACES, "", _parse(raw, content_type), dry_run=dry_run)
        if len(parts) == 4 and method == "GET":
            return 200, store.get(NAMESPACES, "", parts[3])
        raise _method_not_allowed()

    if parts == ["apis", "apps", "v1", "deployments"]:
        if method != "GET":
            raise _method_not_allowed()
        return 200, _list(store, DEPLOYMENTS, None, request)
    if parts[:4] != ["apis", "apps", "v1", "namespaces"] or len(parts) < 6 or len(parts) > 8:
        raise _not_found()
    ns, plural = parts[4], parts[5]
    if plural != "deployments" or (len(parts) == 8 and parts[7] not in ("status", "scale")):
        raise _not_found()
    if len(parts) == 6:
        if method == "GET":
            return 200, _list(store, DEPLOYMENTS, ns, request)
        if method == "POST":
            return 201, store.create(DEPLOYMENTS, ns, _parse(raw, content_type), dry_run=dry_run)
        raise _method_not_allowed()

    name = parts[6]
    subresource = parts[7] if len(parts) == 8 else None
    if method == "GET":
        if subresource == "scale":
            return 200, store.get_scale(ns, name)
        return 200, store.get(DEPLOYMENTS, ns, name)
    if method == "PUT":
        body = _parse(raw, content_type)
        return 200, store.replace(
            DEPLOYMENTS, ns, name, body, subresource=subresource, dry_run=dry_run
        )
    if method == "PATCH":
        if content_type not in patching.PATCH_TYPES:
            raise ApiError(415, f"the body of the request was in an unknown format: {content_type}")
        obj, created = store.patch(
            DEPLOYMENTS,
            ns,
            name,
            content_type,
            _parse(raw, content_type),
            field_manager=query.get("fieldManager"),
            subresource=subresource,
            dry_run=dry_run,
        )
        return (201 if created else 200), obj
    if method == "DELETE" and subresource is None:
        options = _parse(raw, content_type) if raw else None
        return 200, store.delete(DEPLOYMENTS, ns, name, options, dry_run=dry_run)
    raise _method_not_allowed()


def _list(store: Store, kind: Kind, ns: str | None, request: Request) -> Obj:
    query = request.query_params
    try:
        limit = int(query.get("limit") or 0)
    except ValueError as exc:
        raise ApiError(400, f"invalid limit: {query.get('limit')}") from exc
    return store.list(
        kind,
        ns,
        label_selector=query.get("labelSelector", ""),
        field_selector=query.get("fieldSelector", ""),
        limit=limit,
        continue_token=query.get("continue", ""),
    )


def _discovery(parts: list[str], request: Request) -> Obj | None:
    if parts == ["version"]:
        return VERSION
    if parts == ["api"]:
        address = f"{request.url.hostname}:{request.url.port}"
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": address}],
        }
    if parts == ["api", "v1"]:
        return _CORE_RESOURCES
    if parts == ["apis"]:
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [_APPS_GROUP]}
    if parts == ["apis", "apps"]:
        return {"kind": "APIGroup", "apiVersion": "v1", **_APPS_GROUP}
    if parts == ["apis", "apps", "v1"]:
        return _APPS_RESOURCES
    return None
