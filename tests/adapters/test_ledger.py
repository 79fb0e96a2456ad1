"""The idempotency ledger's contract, run over every ledger the worker can use: PostgreSQL
(`AsyncpgLedger`) and a JetStream key-value bucket (`JetStreamLedger`), each against a real
server. One holder per key (the same node id included), leases that expire, only the
claimant renews or finishes, finished keys answer later deliveries."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

import nats
import pytest
from nats.js import api

from app.adapters.embedded import EmbeddedNats, EmbeddedPostgres
from app.adapters.kv_ledger import JetStreamLedger, LedgerUnavailable, key_name
from app.adapters.kv_ledger import bucket as ledger_bucket
from app.adapters.registry import AsyncpgLedger, AsyncpgRegistry
from app.domain.ledger import Claim
from app.services import migrating
from app.services.working import Ledger
from tests.support.databases import MIGRATIONS, fresh_database

# a ledger for (claimant, node id) on one shared store
MakeLedger = Callable[..., Ledger]


@pytest.fixture(params=["postgres", "jetstream"])
async def make_ledger(
    request: pytest.FixtureRequest,
    postgres_server: EmbeddedPostgres,
    nats_server: EmbeddedNats,
) -> AsyncIterator[MakeLedger]:
    if request.param == "postgres":
        async with fresh_database(postgres_server.url) as url:
            registry = AsyncpgRegistry(url, timeout=5, max_connections=8)
            await registry.open()
            await migrating.migrate(registry, MIGRATIONS)

            def on_postgres(claimant: str, node_id: str = "node-1") -> Ledger:
                return AsyncpgLedger(registry, node_id=node_id, claimant=claimant)

            yield on_postgres
            await registry.close()
        return
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    bucket = f"LEDGER_TEST_{uuid.uuid4().hex[:8]}"
    kv = await js.create_key_value(api.KeyValueConfig(bucket=bucket, history=1, ttl=3600))

    def on_jetstream(claimant: str, node_id: str = "node-1") -> Ledger:
        return JetStreamLedger(kv, tier="A", node_id=node_id, claimant=claimant, timeout=5)

    yield on_jetstream
    await js.delete_key_value(bucket)
    await nc.close()


JOB = "00000000-0000-4000-8000-000000000001"


async def claim(ledger: Ledger, key: str, lease: float = 30.0) -> Claim:
    result, _left = await ledger.claim(
        key=key, job_id=JOB, job_type="noop",
        lease_seconds=lease,
    )  # fmt: skip
    return result


@pytest.mark.parametrize("node_ids", [("node-1", "node-1"), ("node-1", "node-2")])
async def test_concurrent_claims_of_one_key_have_one_winner(
    make_ledger: MakeLedger, node_ids: tuple[str, str]
) -> None:
    ledgers = [make_ledger(f"process-{i}", node) for i, node in enumerate(node_ids)]
    for round_ in range(20):
        key = f"race-{round_}"
        results = await asyncio.gather(*(claim(each, key) for each in ledgers))
        assert sorted(results) == sorted([Claim.CLAIMED, Claim.HELD]), (key, results)


async def test_claims_and_completions_made_together_each_get_their_own_answer(
    make_ledger: MakeLedger,
) -> None:
    """What a fetch of many jobs does at once (PostgreSQL sends them as one statement):
    every key answered for itself, a key given twice in the same turn claimed once, a
    finished key and a held one in the same batch as new ones."""
    ledger, other = make_ledger("batch"), make_ledger("other")
    assert await claim(other, "held-by-other") is Claim.CLAIMED
    assert await claim(ledger, "done-before") is Claim.CLAIMED
    assert await ledger.complete(key="done-before", result={"n": 0})
    fresh = [f"fresh-{i}" for i in range(30)]
    keys = [*fresh, "fresh-0", "held-by-other", "done-before"]
    results = await asyncio.gather(*(claim(ledger, key) for key in keys))
    assert results[:30] == [Claim.CLAIMED] * 30
    assert results[30:] == [Claim.HELD, Claim.HELD, Claim.COMPLETED], "fresh-0 claimed once"
    done = await asyncio.gather(
        *(ledger.complete(key=key, result={"key": key}) for key in [*fresh, "held-by-other"])
    )
    assert done == [True] * 30 + [False], "only the claimant finishes"
    again = await asyncio.gather(*(claim(other, key) for key in fresh))
    assert again == [Claim.COMPLETED] * 30


async def test_the_first_claim_is_number_one_and_a_held_key_says_how_long(
    make_ledger: MakeLedger,
) -> None:
    first, second = make_ledger("first"), make_ledger("second")
    assert await first.claim(key="k", job_id=JOB, job_type="noop", lease_seconds=30) == (
        Claim.CLAIMED, 1.0,
    )  # fmt: skip
    held, left = await second.claim(key="k", job_id=JOB, job_type="noop", lease_seconds=30)
    assert held is Claim.HELD and 20 < left <= 30


async def test_only_the_claimant_finishes_renews_or_releases(make_ledger: MakeLedger) -> None:
    holder, twin = make_ledger("holder"), make_ledger("twin")
    assert await claim(holder, "k") is Claim.CLAIMED
    assert await claim(twin, "k") is Claim.HELD
    assert not await twin.renew(key="k", lease_seconds=30)
    assert not await twin.complete(key="k", result={"by": "twin"})
    assert not await twin.release(key="k")
    assert await holder.renew(key="k", lease_seconds=30)
    assert await holder.complete(key="k", result={"by": "holder"})
    assert await claim(twin, "k") is Claim.COMPLETED


async def test_an_expired_lease_is_taken_over_and_the_old_holder_loses_it(
    make_ledger: MakeLedger,
) -> None:
    old, new = make_ledger("old"), make_ledger("new")
    assert await claim(old, "k", lease=0.0) is Claim.CLAIMED
    taken, number = await new.claim(key="k", job_id=JOB, job_type="noop", lease_seconds=30)
    assert (taken, number) == (Claim.CLAIMED, 2.0), "the second claim of the key"
    assert not await old.complete(key="k", result=None), "a lost lease cannot finish the job"
    assert await new.fail(key="k", error="boom", dead=False)
    assert await claim(old, "k") is Claim.CLAIMED, "a retrying key is claimed again"


async def test_a_released_key_is_claimed_at_once(make_ledger: MakeLedger) -> None:
    first, second = make_ledger("first"), make_ledger("second")
    assert await claim(first, "k") is Claim.CLAIMED
    assert await first.release(key="k")
    assert await claim(second, "k") is Claim.CLAIMED
    dead = make_ledger("third")
    assert await second.fail(key="k", error="bad", dead=True)
    assert await claim(dead, "k") is Claim.DEAD


async def test_any_idempotency_key_is_stored(make_ledger: MakeLedger) -> None:
    """Keys are free text up to 255 characters (spaces, dots, slashes, non-ASCII)."""
    ledger = make_ledger("one")
    for key in ("order 42/eu.west", "ключ-ü*>", "x" * 255):
        assert await claim(ledger, key) is Claim.CLAIMED, key
        assert await ledger.complete(key=key, result={"ok": True})
        assert await claim(make_ledger("two"), key) is Claim.COMPLETED, key


async def test_a_garbled_bucket_record_is_an_error_not_a_run(nats_server: EmbeddedNats) -> None:
    """Something else wrote the key: the ledger refuses to guess (the worker hands the job
    back), it never treats the key as free."""
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    bucket = f"LEDGER_TEST_{uuid.uuid4().hex[:8]}"
    kv = await js.create_key_value(api.KeyValueConfig(bucket=bucket, history=1))
    try:
        ledger = JetStreamLedger(kv, tier="A", node_id="n", claimant="c", timeout=5)
        await kv.put(key_name("garbled"), b"not json")
        with pytest.raises(LedgerUnavailable, match="not JSON"):
            await claim(ledger, "garbled")
    finally:
        await js.delete_key_value(bucket)
        await nc.close()


async def test_bucket_keys_are_the_idempotency_key_base64url_encoded(
    nats_server: EmbeddedNats,
) -> None:
    """Any idempotency key (up to 255 characters of anything) is a valid bucket key; the
    tier is the bucket's name (`JOB_LEDGER_<tier>`), not part of the key."""
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    name = f"LEDGER_TEST_{uuid.uuid4().hex[:8]}"
    kv = await js.create_key_value(api.KeyValueConfig(bucket=name, history=1))
    try:
        ledger = JetStreamLedger(kv, tier="A", node_id="n", claimant="a", timeout=5)
        odd = "k/1 with spaces, *, > and ünïcode" + "x" * 200
        assert await claim(ledger, "k/1") is Claim.CLAIMED
        assert await claim(ledger, odd) is Claim.CLAIMED
        assert sorted(await kv.keys()) == sorted(["ay8x", key_name(odd)])  # "ay8x": "k/1"
        assert (ledger_bucket("A"), ledger_bucket("C")) == ("JOB_LEDGER_A", "JOB_LEDGER_C")
        assert ledger.bucket == "JOB_LEDGER_A"
    finally:
        await js.delete_key_value(name)
        await nc.close()
