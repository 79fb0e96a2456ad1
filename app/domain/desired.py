"""The desired state of a node: which workloads, at which versions (CONTRACTS §2).

Parsed strictly where it matters (names, versions, duplicates, how many) and leniently
where the backend may grow (unknown fields are ignored). A response that does not parse
is a `DesiredStateError`, and a sync that gets one changes nothing on the node.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from app.domain.health import is_workload_name
from app.domain.rollout import RolloutSpec, UpdateSpec

# the MAX_DESIRED_WORKLOADS default
DEFAULT_MAX_WORKLOADS = 200

Version = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][\w.+-]*$")]


class DesiredStateError(ValueError):
    """The desired state could not be used; the message says which field."""


class DesiredWorkload(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    version: Version
    # what the backend last recorded as running here (its answer to the version PUTs);
    # advisory: a value that is not a version is read as unknown, never as an error
    reported_version: str | None = None
    # how an update to a new version is made and judged (app/domain/rollout.py); absent,
    # the node's defaults and every node at once
    update: UpdateSpec | None = None
    rollout: RolloutSpec | None = None
    # the SHA-256 (hex) of the exact bytes the manifest call answers for this version: a
    # signed state binds its manifests through it (app/domain/desired_trust.py)
    manifest_sha256: Annotated[str, Field(pattern=r"^[0-9a-fA-F]{64}$")] | None = None

    @field_validator("reported_version", mode="before")
    @classmethod
    def _advisory(cls, value: Any) -> str | None:
        if isinstance(value, str) and 0 < len(value) <= 128:
            return value
        return None

    @field_validator("name")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if not is_workload_name(value):
            raise ValueError("must be a DNS-1123 label")
        return value


class DesiredState(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    revision: str | None = None
    allow_empty: bool = False
    workloads: tuple[DesiredWorkload, ...]
    # a signed state's order and binding (app/domain/desired_trust.py): strictly
    # increasing per node, the node it is for, when the backend issued it
    serial: Annotated[int, Field(ge=0, le=2**63 - 1, strict=True)] | None = None
    node_id: Annotated[str, Field(min_length=1, max_length=255)] | None = None
    issued_at: AwareDatetime | None = None

    @field_validator("workloads")
    @classmethod
    def _unique(cls, value: tuple[DesiredWorkload, ...]) -> tuple[DesiredWorkload, ...]:
        seen: set[str] = set()
        for workload in value:
            if workload.name in seen:
                raise ValueError(f"workload {workload.name!r} is listed twice")
            seen.add(workload.name)
        return value

    def by_name(self) -> dict[str, DesiredWorkload]:
        return {w.name: w for w in self.workloads}


def parse_desired(data: Any, *, max_workloads: int = DEFAULT_MAX_WORKLOADS) -> DesiredState:
    """Validate a decoded response body; raise DesiredStateError naming the field. More
    than `max_workloads` workloads is refused whole, before any of them is read."""
    listed = data.get("workloads") if isinstance(data, dict) else None
    if isinstance(listed, list) and len(listed) > max_workloads:
        raise DesiredStateError(
            f"workloads: {len(listed)} workloads, more than MAX_DESIRED_WORKLOADS "
            f"({max_workloads}); refused whole"
        )
    try:
        return DesiredState.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise DesiredStateError(f"{where}: {first['msg']}") from None
