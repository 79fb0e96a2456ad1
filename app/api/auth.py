"""Bearer-token checks: the operator token for status/admin routes, per-workload ping tokens.

A workload's ping token is hex HMAC-SHA256(PING_TOKEN_SECRET, workload name): the
manager can hand each workload its own token without storing any of them.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPBasic, HTTPBasicCredentials, HTTPBearer

from app.api.deps import SettingsDep
from app.domain.tokens import ping_token
from app.settings import Settings


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    return token.strip()


def _unauthorized(detail: str, challenge: str = "Bearer") -> HTTPException:
    return HTTPException(
        status_code=status.HTTP_401_UNAUTHORIZED,
        detail=detail,
        headers={"WWW-Authenticate": challenge},
    )


# declared for the OpenAPI document (its security schemes); the checks below read the
# header themselves, so a missing token is a 401 with the right challenge, never a 403
_BEARER = HTTPBearer(auto_error=False, description="The operator token (API_TOKEN)")
_BASIC = HTTPBasic(
    realm="workload manager",
    auto_error=False,
    description="Any user name, the operator token as password",
)
UNAUTHORIZED: dict[int | str, dict[str, str]] = {
    401: {
        "description": "Missing or invalid operator token; in production also when the "
        "node has no API_TOKEN (a worker-only node): the route is closed"
    }
}


# what the Basic credentials a browser caches for the page may do: read
SAFE_METHODS = frozenset({"GET", "HEAD"})

BearerScheme = Annotated[object, Depends(_BEARER)]
BasicCredentials = Annotated[HTTPBasicCredentials | None, Depends(_BASIC)]


def _check_operator(
    request: Request,
    settings: Settings,
    basic: HTTPBasicCredentials | None,
    challenge: str,
    what: str,
) -> None:
    expected = settings.api_token
    if expected is None:
        if settings.is_production:  # a worker-only node may run without one: closed
            raise _unauthorized("no API_TOKEN is set on this node: this route is closed", challenge)
        return
    if bearer(request) is None and basic is not None and request.method not in SAFE_METHODS:
        # a browser sends the Basic credentials it cached for the page with any request to
        # this origin, a cross-site form's POST included: they read, never act
        raise _unauthorized(
            "Basic credentials are accepted for reading only: send the operator token as a "
            "bearer token",
            challenge,
        )
    given = bearer(request) or (basic.password if basic is not None else None)
    if given is None:
        raise _unauthorized(f"missing {what}", challenge)
    if not hmac.compare_digest(given.encode(), expected.get_secret_value().encode()):
        raise _unauthorized(f"invalid {what}", challenge)


def require_api_token(
    request: Request, settings: SettingsDep, _: BearerScheme, basic: BasicCredentials
) -> None:
    """Dependency for status and admin routes. Without API_TOKEN they are open in
    development and closed (401) in production. The token comes as a bearer token, or, on
    GET and HEAD only, as the Basic password a browser cached for the page."""
    _check_operator(request, settings, basic, "Bearer", "bearer token")


PAGE_CHALLENGE = 'Basic realm="workload manager", charset="UTF-8"'


def require_page_token(
    request: Request, settings: SettingsDep, _: BearerScheme, basic: BasicCredentials
) -> None:
    """Dependency for the HTML status page: the same token, but a 401 challenges for
    Basic credentials, so a browser prompts for it (any user name, the token as password)."""
    _check_operator(request, settings, basic, PAGE_CHALLENGE, "operator token")


def check_ping_token(request: Request, settings: Settings, name: str) -> None:
    secret = settings.ping_token_secret
    if secret is None:
        if settings.is_production:  # a node that syncs nothing has no workloads to ping
            raise _unauthorized("no PING_TOKEN_SECRET is set on this node: pings are closed")
        return
    given = bearer(request)
    if given is None:
        raise _unauthorized("missing ping token")
    expected = ping_token(secret.get_secret_value(), name)
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise _unauthorized(f"invalid ping token for workload {name!r}")
