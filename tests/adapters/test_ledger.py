"""The idempotency ledger's contract, run over every ledger the worker can use: PostgreSQL
(`AsyncpgLedger`), straight and through a real PgBouncer in transaction mode, and a
JetStream key-value bucket (`JetStreamLedger`), each against a real server. One holder per
key (the same node id included), leases that expire, only the claimant renews or finishes,
finished keys answer later deliveries."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import nats
import pytest
from nats.js import api

from app.adapters.embedded import EmbeddedNats, EmbeddedPostgres
from app.adapters.kv_ledger import JetStreamLedger, LedgerUnavailable, key_name
from app.adapters.kv_ledger import bucket as ledger_bucket
from app.adapters.registry import AsyncpgLedger
from app.domain.ledger import Claim, job_fingerprint
from app.services import migrating
from app.services.working import Ledger
from standins.databases import MIGRATIONS, fresh_database
from tests.support.database_routes import DatabaseRoute, assert_route_taken


class Store:
    """One shared store: its ledgers (one per claimant and node id) and what it holds."""

    def __init__(
        self,
        make: Callable[[str, str], Ledger],
        read: Callable[[str], Awaitable[dict[str, Any]]],
        unscope: Callable[[str], Awaitable[None]],
    ) -> None:
        self._make, self.read, self.unscope = make, read, unscope

    def __call__(self, claimant: str, node_id: str = "node-1") -> Ledger:
        return self._make(claimant, node_id)


# the stored fields every ledger has, by name
FIELDS = ("status", "attempts", "result", "error", "fingerprint")


@pytest.fixture(params=["postgres", "postgres-pgbouncer", "jetstream"])
async def make_ledger(
    request: pytest.FixtureRequest,
    postgres_server: EmbeddedPostgres,
    nats_server: EmbeddedNats,
) -> AsyncIterator[Store]:
    if request.param.startswith("postgres"):
        route = DatabaseRoute()
        if request.param == "postgres-pgbouncer":
            route = DatabaseRoute(request.getfixturevalue("pgbouncer"))
        async with fresh_database(postgres_server.url) as url:
            registry = route.registry(url, max_connections=8)
            await registry.open()
            await migrating.migrate(registry, MIGRATIONS)

            async def row(key: str) -> dict[str, Any]:
                found = await registry.pool.fetchrow(
                    "SELECT * FROM job_ledger WHERE idempotency_key = $1", key
                )
                assert found is not None, key
                return {name: found.get(name) for name in FIELDS}

            async def forget_fingerprint(key: str) -> None:
                await registry.pool.execute(
                    "UPDATE job_ledger SET fingerprint = NULL WHERE idempotency_key = $1", key
                )

            yield Store(
                lambda claimant, node_id: AsyncpgLedger(
                    registry, node_id=node_id, claimant=claimant
                ),
                row,
                forget_fingerprint,
            )
            await registry.close()
        return
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    bucket = f"LEDGER_TEST_{uuid.uuid4().hex[:8]}"
    kv = await js.create_key_value(api.KeyValueConfig(bucket=bucket, history=1, ttl=3600))

    async def record(key: str) -> dict[str, Any]:
        raw = json.loads((await kv.get(key_name(key))).value or b"")
        return {name: raw.get(name) for name in FIELDS}

    async def as_written_before_fingerprints(key: str) -> None:
        raw = json.loads((await kv.get(key_name(key))).value or b"")
        raw.pop("fingerprint", None)
        await kv.put(key_name(key), json.dumps(raw).encode())

    yield Store(
        lambda claimant, node_id: JetStreamLedger(
            kv, tier="A", node_id=node_id, claimant=claimant, timeout=5
        ),
        record,
        as_written_before_fingerprints,
    )
    await js.delete_key_value(bucket)
    await nc.close()


JOB = "00000000-0000-4000-8000-000000000001"
NOOP = job_fingerprint("noop", {})
ELSEWHERE = job_fingerprint("http", {"url": "http://127.0.0.1:9/"})


async def answer(
    ledger: Ledger, key: str, lease: float = 30.0, fingerprint: str = NOOP
) -> tuple[Claim, float]:
    """The claim of `key` by a noop job and its number (or lease seconds left)."""
    return await ledger.claim(
        key=key, job_id=JOB, job_type="noop", fingerprint=fingerprint, lease_seconds=lease
    )


async def claim(ledger: Ledger, key: str, lease: float = 30.0, fingerprint: str = NOOP) -> Claim:
    return (await answer(ledger, key, lease, fingerprint))[0]


@pytest.mark.parametrize("node_ids", [("node-1", "node-1"), ("node-1", "node-2")])
async def test_concurrent_claims_of_one_key_have_one_winner(
    make_ledger: Store, node_ids: tuple[str, str]
) -> None:
    ledgers = [make_ledger(f"process-{i}", node) for i, node in enumerate(node_ids)]
    for round_ in range(20):
        key = f"race-{round_}"
        results = await asyncio.gather(*(claim(each, key) for each in ledgers))
        assert sorted(results) == sorted([Claim.CLAIMED, Claim.HELD]), (key, results)


async def test_claims_and_completions_made_together_each_get_their_own_answer(
    make_ledger: Store,
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
    make_ledger: Store,
) -> None:
    first, second = make_ledger("first"), make_ledger("second")
    assert await answer(first, "k") == (Claim.CLAIMED, 1.0)
    held, left = await answer(second, "k")
    assert held is Claim.HELD and 20 < left <= 30


async def test_only_the_claimant_finishes_renews_or_releases(make_ledger: Store) -> None:
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
    make_ledger: Store,
) -> None:
    old, new = make_ledger("old"), make_ledger("new")
    assert await claim(old, "k", lease=0.0) is Claim.CLAIMED
    taken, number = await answer(new, "k")
    assert (taken, number) == (Claim.CLAIMED, 2.0), "the second claim of the key"
    assert not await old.complete(key="k", result=None), "a lost lease cannot finish the job"
    assert await new.fail(key="k", error="boom", dead=False)
    assert await claim(old, "k") is Claim.CLAIMED, "a retrying key is claimed again"


async def test_a_released_key_is_claimed_at_once(make_ledger: Store) -> None:
    first, second = make_ledger("first"), make_ledger("second")
    assert await claim(first, "k") is Claim.CLAIMED
    assert await first.release(key="k")
    assert await claim(second, "k") is Claim.CLAIMED
    dead = make_ledger("third")
    assert await second.fail(key="k", error="bad", dead=True)
    assert await claim(dead, "k") is Claim.DEAD


async def test_a_key_used_by_another_job_is_a_conflict_whatever_its_status(
    make_ledger: Store,
) -> None:
    """The ledger answers for a key and the job it was used for (type and payload): a job
    of another type or payload under a used key is neither run nor acknowledged as done."""
    holder, other = make_ledger("holder"), make_ledger("other")
    assert await claim(holder, "running") is Claim.CLAIMED
    assert await claim(holder, "lease-out", lease=0.0) is Claim.CLAIMED
    for status in ("completed", "retrying", "dead"):
        assert await claim(holder, status) is Claim.CLAIMED
    assert await holder.complete(key="completed", result={"ok": True})
    assert await holder.fail(key="retrying", error="boom", dead=False)
    assert await holder.fail(key="dead", error="bad", dead=True)
    keys = ["running", "lease-out", "completed", "retrying", "dead"]
    assert (await make_ledger.read("completed"))["fingerprint"] == NOOP
    conflicts = await asyncio.gather(
        *(other.claim(key=k, job_id=JOB, job_type="http", fingerprint=ELSEWHERE, lease_seconds=30)
          for k in [*keys, "fresh"])
    )  # fmt: skip
    assert conflicts == [(Claim.CONFLICT, 0.0)] * 5 + [(Claim.CLAIMED, 1.0)]
    assert await claim(holder, "running", fingerprint=ELSEWHERE) is Claim.CONFLICT, "holder too"
    # nothing was taken over: the job the key was used for gets the answers it had
    same = await asyncio.gather(*(claim(other, key) for key in keys))
    assert same == [Claim.HELD, Claim.CLAIMED, Claim.COMPLETED, Claim.CLAIMED, Claim.DEAD]
    assert (await make_ledger.read("lease-out"))["attempts"] == 2


async def test_a_record_written_before_fingerprints_matches_any_job(make_ledger: Store) -> None:
    """Records stored before keys were scoped (no fingerprint) answer any job as before;
    a claim that takes one over scopes it to its job from then on."""
    ledger = make_ledger("one")
    for key in ("done", "failed"):
        assert await claim(ledger, key) is Claim.CLAIMED
    assert await ledger.complete(key="done", result=None)
    assert await ledger.fail(key="failed", error="boom", dead=False)
    for key in ("done", "failed"):
        await make_ledger.unscope(key)
        assert (await make_ledger.read(key))["fingerprint"] is None
    assert await claim(ledger, "done", fingerprint=ELSEWHERE) is Claim.COMPLETED
    assert await claim(ledger, "failed", fingerprint=ELSEWHERE) is Claim.CLAIMED
    assert (await make_ledger.read("failed"))["fingerprint"] == ELSEWHERE
    assert await ledger.release(key="failed")
    assert await claim(ledger, "failed") is Claim.CONFLICT


async def test_a_release_gives_its_attempt_back(make_ledger: Store) -> None:
    """A job handed back on shutdown never ran to an outcome: it does not spend the retry
    budget (the claim number), however often it is handed back; a failure does."""
    first, second = make_ledger("first"), make_ledger("second")
    for _shutdown in range(3):
        assert await answer(first, "k") == (Claim.CLAIMED, 1.0)
        assert await first.release(key="k")
        assert (await make_ledger.read("k"))["attempts"] == 0
    assert await answer(second, "k") == (Claim.CLAIMED, 1.0)
    assert await second.fail(key="k", error="boom", dead=False)
    assert await answer(first, "k") == (Claim.CLAIMED, 2.0), "a failure spends an attempt"
    assert await first.release(key="k")
    assert (await make_ledger.read("k"))["attempts"] == 1


async def test_nul_is_stored_as_the_replacement_character(make_ledger: Store) -> None:
    """PostgreSQL stores no NUL in text or JSONB: in a result (strings and object keys) and
    in an error text it becomes U+FFFD, in every ledger alike. A batch of completions with
    one such result completes every job of it."""
    ledger = make_ledger("one")
    keys = [f"k-{i}" for i in range(8)]
    assert await asyncio.gather(*(claim(ledger, key) for key in keys)) == [Claim.CLAIMED] * 8
    results: list[Any] = [{"n": i} for i in range(8)]
    results[3] = {"out\x00put": ["a\x00b", {"\x00": 1}], "n": 3}
    done = await asyncio.gather(
        *(
            ledger.complete(key=key, result=result)
            for key, result in zip(keys, results, strict=True)
        )
    )
    assert done == [True] * 8
    stored = [await make_ledger.read(key) for key in keys]
    assert [s["status"] for s in stored] == ["completed"] * 8
    assert stored[3]["result"] == {"out\ufffdput": ["a\ufffdb", {"\ufffd": 1}], "n": 3}
    assert stored[4]["result"] == {"n": 4}
    assert await claim(ledger, "failing") is Claim.CLAIMED
    assert await ledger.fail(key="failing", error="bad byte \x00 in output", dead=True)
    assert (await make_ledger.read("failing"))["error"] == "bad byte \ufffd in output"


async def test_any_idempotency_key_is_stored(make_ledger: Store) -> None:
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


@pytest.fixture
async def postgres_ledger(
    postgres_server: EmbeddedPostgres, route: DatabaseRoute
) -> AsyncIterator[AsyncpgLedger]:
    async with fresh_database(postgres_server.url) as url:
        registry = route.registry(url, max_connections=8)
        await registry.open()
        await migrating.migrate(registry, MIGRATIONS)
        yield AsyncpgLedger(registry, node_id="node-1", claimant="one")
        await registry.close()


async def test_a_row_postgres_refuses_fails_only_its_own_call_in_a_group_commit(
    postgres_ledger: AsyncpgLedger,
) -> None:
    """A batch statement that fails on one row's data (a NUL in a key, JSON PostgreSQL does
    not take) is tried again row by row: that caller gets the error, the others their
    answers, as with a statement each."""
    ledger = postgres_ledger
    keys = [f"k-{i}" for i in range(6)]
    claims = await asyncio.gather(
        *(claim(ledger, key) for key in [*keys[:3], "nul\x00key", *keys[3:]]),
        return_exceptions=True,
    )
    assert isinstance(claims[3], asyncpg.DataError), claims[3]
    assert claims[:3] + claims[4:] == [Claim.CLAIMED] * 6
    results: list[Any] = [{"n": i} for i in range(6)]
    results[2] = {"n": float("nan")}  # JSON has no NaN: PostgreSQL refuses the text
    done = await asyncio.gather(
        *(ledger.complete(key=k, result=r) for k, r in zip(keys, results, strict=True)),
        return_exceptions=True,
    )
    assert isinstance(done[2], asyncpg.DataError), done[2]
    assert done[:2] + done[3:] == [True] * 5
    assert await ledger.complete(key="k-2", result={"n": 2}), "the refused one is still held"


async def test_migration_0005_adds_a_nullable_fingerprint_column(
    postgres_ledger: AsyncpgLedger,
) -> None:
    """Rows from before it keep NULL (matches any job); no default, so adding it rewrites
    nothing on a large table."""
    pool = postgres_ledger._registry.pool
    column = await pool.fetchrow(
        """SELECT data_type, is_nullable, column_default FROM information_schema.columns
           WHERE table_name = 'job_ledger' AND column_name = 'fingerprint'"""
    )
    assert column is not None and dict(column) == {
        "data_type": "text", "is_nullable": "YES", "column_default": None,
    }  # fmt: skip


async def test_the_postgres_ledger_takes_its_route(
    postgres_server: EmbeddedPostgres, route: DatabaseRoute
) -> None:
    """Guard: the PostgreSQL ledger through PgBouncer really goes through it (its console
    sees this test's pool, clients and backends; one connection's transactions land on
    different backends), and straight it does not."""
    async with fresh_database(postgres_server.url) as database:
        registry = route.registry(database, max_connections=8)
        await registry.open()
        try:
            await migrating.migrate(registry, MIGRATIONS)
            ledger = AsyncpgLedger(registry, node_id="node-1", claimant="one")
            assert await claim(ledger, "guard") is Claim.CLAIMED
            await assert_route_taken(route, registry, route.url(database))
            assert await ledger.complete(key="guard", result={"ok": True}) is True
            assert await claim(ledger, "guard") is Claim.COMPLETED
        finally:
            await registry.close()
