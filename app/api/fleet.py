"""The fleet as the capability registry sees it: live nodes and what they can do."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query

from app.api.auth import UNAUTHORIZED, require_api_token
from app.api.deps import RegistryDep
from app.api.params import single_valued, single_valued_integers
from app.domain.requirements import CAPABILITY_NAME

router = APIRouter(
    tags=["fleet"], dependencies=[Depends(require_api_token)], responses=UNAUTHORIZED
)

Liveness = Literal["online", "draining", "suspect", "offline"]


@router.get(
    "/v1/fleet/nodes",
    summary="Registered nodes with their liveness (judged by the database clock)",
    responses={503: {"description": "The registry is off or unreachable"}},
    dependencies=[
        Depends(single_valued("tier", "status", "capability")),
        Depends(single_valued_integers("limit")),
    ],
)
async def fleet_nodes(
    registry: RegistryDep,
    tier: Annotated[Literal["A", "B", "C"] | None, Query()] = None,
    status: Annotated[Liveness | None, Query(description="liveness, not the raw status")] = None,
    capability: Annotated[str | None, Query(pattern=CAPABILITY_NAME)] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> dict[str, Any]:
    from app.adapters.registry import RegistryUnavailable

    on = registry.on()
    try:
        nodes = await on.nodes(tier=tier, liveness=status, capability=capability, limit=limit)
    except RegistryUnavailable as exc:
        raise HTTPException(status_code=503, detail=f"registry unreachable: {exc}") from None
    return {"count": len(nodes), "nodes": nodes}
