"""The idempotency ledger against a real PostgreSQL: one holder per key, same node included."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from app.adapters.registry import AsyncpgLedger, AsyncpgRegistry, Claim
from app.services import migrating
from tests.support.databases import MIGRATIONS


@pytest.fixture
async def registry(database: str) -> AsyncIterator[AsyncpgRegistry]:
    reg = AsyncpgRegistry(database, timeout=5, max_connections=8)
    await reg.open()
    await migrating.migrate(reg, MIGRATIONS)
    yield reg
    await reg.close()


def ledger(registry: AsyncpgRegistry, claimant: str, node_id: str = "node-1") -> AsyncpgLedger:
    return AsyncpgLedger(registry, node_id=node_id, claimant=claimant)


async def claim(ledger: AsyncpgLedger, key: str, lease: float = 30.0) -> Claim:
    result, _left = await ledger.claim(
        key=key, job_id="00000000-0000-4000-8000-000000000001", job_type="noop",
        lease_seconds=lease,
    )  # fmt: skip
    return result


@pytest.mark.parametrize("node_ids", [("node-1", "node-1"), ("node-1", "node-2")])
async def test_concurrent_claims_of_one_key_have_one_winner(
    registry: AsyncpgRegistry, node_ids: tuple[str, str]
) -> None:
    ledgers = [ledger(registry, f"process-{i}", node) for i, node in enumerate(node_ids)]
    for round_ in range(20):
        key = f"race-{round_}"
        results = await asyncio.gather(*(claim(each, key) for each in ledgers))
        assert sorted(results) == sorted([Claim.CLAIMED, Claim.HELD]), (key, results)


async def test_only_the_claimant_finishes_renews_or_releases(registry: AsyncpgRegistry) -> None:
    holder, twin = ledger(registry, "holder"), ledger(registry, "twin")
    assert await claim(holder, "k") is Claim.CLAIMED
    assert await claim(twin, "k") is Claim.HELD
    assert not await twin.renew(key="k", lease_seconds=30)
    assert not await twin.complete(key="k", result={"by": "twin"})
    assert not await twin.release(key="k")
    assert await holder.renew(key="k", lease_seconds=30)
    assert await holder.complete(key="k", result={"by": "holder"})
    assert await claim(twin, "k") is Claim.COMPLETED


async def test_an_expired_lease_is_taken_over_and_the_old_holder_loses_it(
    registry: AsyncpgRegistry,
) -> None:
    old, new = ledger(registry, "old"), ledger(registry, "new")
    assert await claim(old, "k", lease=0.0) is Claim.CLAIMED
    assert await claim(new, "k") is Claim.CLAIMED
    assert not await old.complete(key="k", result=None), "a lost lease cannot finish the job"
    assert await new.fail(key="k", error="boom", dead=False)
    assert await claim(old, "k") is Claim.CLAIMED, "a retrying key is claimed again"


async def test_a_released_key_is_claimed_at_once(registry: AsyncpgRegistry) -> None:
    first, second = ledger(registry, "first"), ledger(registry, "second")
    assert await claim(first, "k") is Claim.CLAIMED
    assert await first.release(key="k")
    assert await claim(second, "k") is Claim.CLAIMED
    dead = ledger(registry, "third")
    assert await second.fail(key="k", error="bad", dead=True)
    assert await claim(dead, "k") is Claim.DEAD
