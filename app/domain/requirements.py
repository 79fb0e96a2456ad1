"""Job requirements against a node's profile: does this node satisfy them, and if not, why.

The same rules run in SQL (`eligible_workers`, migrations/0002) to find the live nodes
that could run a job; tests hold both to one table of cases.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

# A capability's name: ASCII letters, digits and -_.: (as NODE_CAPABILITIES accepts), at
# most 64; spelled out, since Python's \w takes any Unicode letter and the OpenAPI
# document's (JSON Schema's) does not
CAPABILITY_NAME = r"^[A-Za-z0-9_.:-]{1,64}$"
# A region's or trust zone's name in a job's requirements: the same characters and length.
# Every requirement is bounded because rejection and unroutable events echo them, and an
# event must stay far below NATS's max_payload (a 360 kB trust zone made one too big).
LOCATION_NAME = CAPABILITY_NAME
MAX_NAME_CHARS = 64
MAX_CAPABILITIES = 64

_Location = Annotated[str, Field(pattern=LOCATION_NAME, max_length=MAX_NAME_CHARS)]
_Capability = Annotated[str, Field(pattern=CAPABILITY_NAME, max_length=MAX_NAME_CHARS)]


class Tier(StrEnum):
    A = "A"
    B = "B"
    C = "C"


class HardwareRequirements(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu: bool | None = None
    min_memory_gb: float | None = Field(default=None, ge=0)
    min_cpu_count: int | None = Field(default=None, ge=0)


class Requirements(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tier: Annotated[list[Tier], Field(max_length=len(Tier))] | None = None
    region: _Location | None = None
    trust_zone: _Location | None = None
    hardware: HardwareRequirements = HardwareRequirements()
    capabilities: list[_Capability] = Field(default_factory=list, max_length=MAX_CAPABILITIES)


class NodeProfile(BaseModel):
    """What a node registers: the registry row, minus liveness."""

    model_config = ConfigDict(frozen=True)

    node_id: str
    tier: Tier
    region: str | None = None
    trust_zone: str | None = None
    hardware: dict[str, Any] = Field(default_factory=dict)
    capabilities: list[str] = Field(default_factory=list)


class Mismatch(StrEnum):
    TIER = "tier"
    REGION = "region"
    TRUST_ZONE = "trust_zone"
    GPU = "hardware.gpu"
    MEMORY = "hardware.min_memory_gb"
    CPU = "hardware.min_cpu_count"
    CAPABILITIES = "capabilities"


def match_requirements(requirements: Requirements, node: NodeProfile) -> list[Mismatch]:
    """Every requirement the node does not meet; empty when it can run the job."""
    misses: list[Mismatch] = []
    if requirements.tier is not None and node.tier not in requirements.tier:
        misses.append(Mismatch.TIER)
    if requirements.region is not None and node.region != requirements.region:
        misses.append(Mismatch.REGION)
    if requirements.trust_zone is not None and node.trust_zone != requirements.trust_zone:
        misses.append(Mismatch.TRUST_ZONE)
    hw = requirements.hardware
    if hw.gpu and node.hardware.get("gpu") is not True:
        misses.append(Mismatch.GPU)
    if hw.min_memory_gb is not None and _number(node.hardware.get("memory_gb")) < hw.min_memory_gb:
        misses.append(Mismatch.MEMORY)
    if hw.min_cpu_count is not None and _number(node.hardware.get("cpu_count")) < hw.min_cpu_count:
        misses.append(Mismatch.CPU)
    if not set(requirements.capabilities) <= set(node.capabilities):
        misses.append(Mismatch.CAPABILITIES)
    return misses


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else -1.0
