"""Resource kinds, Kubernetes `Status` bodies and the error that carries them to HTTP.

Messages, reasons and `details` mimic kube-apiserver so that client code branching on
`ApiException.status` / `reason` behaves as it would against a real cluster.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]

_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    kind: str
    plural: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """`deployments.apps`, as the real server names a resource in messages."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified_kind(self) -> str:
        return f"{self.kind}.{self.group}" if self.group else self.kind


DEPLOYMENTS = Kind("apps", "v1", "Deployment", "deployments", namespaced=True)
NAMESPACES = Kind("", "v1", "Namespace", "namespaces", namespaced=False)


@dataclass(frozen=True)
class Cause:
    """One field error of a 422 Invalid response."""

    field: str
    reason: str  # FieldValueRequired, FieldValueInvalid, FieldValueForbidden
    message: str

    def text(self) -> str:
        return f"{self.field}: {self.message}"


def timestamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def failure(code: int, message: str, reason: str | None = None, details: Obj | None = None) -> Obj:
    body: Obj = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or _REASONS.get(code, "Unknown"),
        "code": code,
    }
    if details:
        body["details"] = details
    return body


class ApiError(Exception):
    """Raised anywhere in the emulator; the HTTP layer turns it into a Status response."""

    def __init__(
        self, code: int, message: str, *, reason: str | None = None, details: Obj | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.body = failure(code, message, reason, details)


def _details(kind: Kind, name: str) -> Obj:
    details: Obj = {"name": name, "kind": kind.plural}
    if kind.group:
        details["group"] = kind.group
    return details


def bad_request(message: str) -> ApiError:
    return ApiError(400, message)


def not_found(kind: Kind, name: str) -> ApiError:
    return ApiError(404, f'{kind.qualified} "{name}" not found', details=_details(kind, name))


def already_exists(kind: Kind, name: str) -> ApiError:
    return ApiError(
        409,
        f'{kind.qualified} "{name}" already exists',
        reason="AlreadyExists",
        details=_details(kind, name),
    )


def conflict(kind: Kind, name: str, why: str | None = None) -> ApiError:
    why = why or (
        "the object has been modified; please apply your changes to the latest version "
        "and try again"
    )
    return ApiError(
        409,
        f'Operation cannot be fulfilled on {kind.qualified} "{name}": {why}',
        reason="Conflict",
        details=_details(kind, name),
    )


def invalid(kind: Kind, name: str, causes: list[Cause]) -> ApiError:
    texts = [cause.text() for cause in causes]
    summary = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    details: Obj = {
        "name": name,
        "kind": kind.kind,
        "causes": [{"reason": c.reason, "message": c.message, "field": c.field} for c in causes],
    }
    if kind.group:
        details["group"] = kind.group
    return ApiError(422, f'{kind.qualified_kind} "{name}" is invalid: {summary}', details=details)
