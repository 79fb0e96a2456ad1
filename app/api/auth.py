"""Bearer-token checks: the operator token for status/admin routes, per-workload ping tokens.

A workload's ping token is hex HMAC-SHA256(PING_TOKEN_SECRET, workload name): the
manager can hand each workload its own token without storing any of them.
"""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request, status

from app.domain.tokens import ping_token
from app.services.runtime import Runtime


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    return token.strip()


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(
        status_code=status.HTTP_401_UNAUTHORIZED,
        detail=detail,
        headers={"WWW-Authenticate": "Bearer"},
    )


def runtime(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


def require_api_token(request: Request) -> None:
    """Dependency for status and admin routes; open when API_TOKEN is not set."""
    expected = runtime(request).settings.api_token
    if expected is None:
        return
    given = bearer(request)
    if given is None:
        raise _unauthorized("missing bearer token")
    if not hmac.compare_digest(given.encode(), expected.get_secret_value().encode()):
        raise _unauthorized("invalid bearer token")


def check_ping_token(request: Request, name: str) -> None:
    secret = runtime(request).settings.ping_token_secret
    if secret is None:
        return
    given = bearer(request)
    if given is None:
        raise _unauthorized("missing ping token")
    expected = ping_token(secret.get_secret_value(), name)
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise _unauthorized(f"invalid ping token for workload {name!r}")
