"""This node's own profile: what the registry stores and jobs are matched against.

Kept apart from the heartbeat so that a node without a registry (a worker-only node)
builds it without importing the database client.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from app.domain.requirements import NodeProfile, Tier

FINGERPRINT_EVERY_SECONDS = 600.0


class LocalProfile:
    """This node's profile, as jobs are matched against it and the registry stores it:
    the settings' tier, region, trust zone and capabilities, and a hardware fingerprint
    refreshed every 10 minutes. A node without a registry matches jobs against it too."""

    def __init__(
        self,
        *,
        node_id: str,
        tier: Tier,
        region: str | None,
        trust_zone: str | None,
        capabilities: list[str],
        fingerprint: Callable[[], Awaitable[dict[str, Any]]],
    ) -> None:
        self.node_id = node_id
        self.tier = tier
        self._region = region
        self._trust_zone = trust_zone
        self._capabilities = capabilities
        self._fingerprint = fingerprint
        self._profile: NodeProfile | None = None
        self._profile_at = 0.0

    async def __call__(self) -> NodeProfile:
        if self._profile is None or time.monotonic() - self._profile_at > FINGERPRINT_EVERY_SECONDS:
            hardware = await self._fingerprint()
            derived = {"gpu"} if hardware.get("gpu") else set()
            self._profile = NodeProfile(
                node_id=self.node_id,
                tier=self.tier,
                region=self._region,
                trust_zone=self._trust_zone,
                hardware=hardware,
                capabilities=sorted(set(self._capabilities) | derived),
            )
            self._profile_at = time.monotonic()
        return self._profile
