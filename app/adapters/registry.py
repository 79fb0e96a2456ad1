"""PostgreSQL through asyncpg: capability registry, job ledger and schema migrations.

The pool starts empty (`min_size=0`), so the manager starts while PostgreSQL is down
and connects when it returns; a connection broken by a server restart is replaced by
the pool on the next acquire. Every statement has a timeout. JSONB columns come and go
as Python objects.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from app.adapters.coalesce import Coalescer, distinct_runs
from app.domain.ledger import RELEASED, Claim, without_nul
from app.domain.migrations import (
    Applied,
    ContractHeldBack,
    Kind,
    LiveNode,
    Migration,
    MigrationError,
    held_back_by,
    plan,
)
from app.domain.requirements import NodeProfile, Requirements

# Where a node's row records the manager release that registered it: a key of the
# `hardware` JSONB rather than a column of its own, so that the release that began to record
# it added no migration (the release before it refuses any migration it does not know: its
# nodes' next pod start would have failed in the migrate init container). A later release
# may move it into a column with an expand migration.
MANAGER_VERSION_KEY = "manager_version"

# pg_advisory_xact_lock key for migrations: any constant shared by every migrator.
MIGRATION_LOCK_KEY = 0x574D_4D49_4752  # "WMMIGR"

# A migration may build an index on a large table, or wait for another node's migrator.
MIGRATION_TIMEOUT = 600.0

# InternalClientError: asyncpg's protocol state gone wrong on one connection ("cannot
# switch to state 12; another operation is in progress", MagicStack/asyncpg#784 and #1069,
# seen here once under CPU load): like an outage, the operation is tried again later.
RegistryUnavailable = (
    OSError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError,
    TimeoutError,
)  # fmt: skip

log = logging.getLogger(__name__)


class NodeHeldElsewhere(Exception):
    """The node's row is held by another manager instance that is live."""

    def __init__(
        self, node_id: str, holder: str | None, status: str | None, age: float | None
    ) -> None:
        seen = f", last heartbeat {age:.0f} s ago" if age is not None else ""
        super().__init__(
            f"node {node_id} is held by another live instance ({holder or 'unknown'}, "
            f"{status or 'unknown'}{seen}): this instance does not register it"
        )
        self.node_id = node_id
        self.holder = holder


_ASYNCPG_STATEMENT_CACHE = 100  # asyncpg's own default


def statement_cache_size(*, transaction_pooler: bool) -> int:
    """asyncpg's cache of named prepared statements per connection: its default, or none
    through a transaction pooler. PgBouncer in transaction mode (1.18 keeps no prepared
    statements of its own: `max_prepared_statements` came in 1.21) hands each transaction
    to whichever server connection is free, where a statement prepared on another one does
    not exist, or one of the same name prepared by another client does. Without the cache
    asyncpg sends each statement unnamed, parsed and executed in one exchange."""
    return 0 if transaction_pooler else _ASYNCPG_STATEMENT_CACHE


async def server_version(
    url: str, *, connect_timeout: float, transaction_pooler: bool = False
) -> str:
    """Connect, ask the server's version and disconnect; raises on failure or timeout."""
    conn = await asyncpg.connect(
        url,
        timeout=connect_timeout,
        statement_cache_size=statement_cache_size(transaction_pooler=transaction_pooler),
    )
    try:
        version: str = await conn.fetchval("SHOW server_version", timeout=connect_timeout)
        return version
    finally:
        await conn.close(timeout=connect_timeout)


async def _init_connection(conn: asyncpg.Connection) -> None:
    for kind in ("json", "jsonb"):
        await conn.set_type_codec(kind, encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _keep_session(conn: asyncpg.Connection) -> None:
    return None


_UPSERT = """
INSERT INTO worker_capabilities AS w (node_id, tier, region, trust_zone, hardware, capabilities,
                                      status, last_heartbeat, heartbeat_interval_seconds,
                                      instance_id, created_at, updated_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, now(), $8, $9, now(), now())
ON CONFLICT (node_id) DO UPDATE SET
  tier = EXCLUDED.tier, region = EXCLUDED.region, trust_zone = EXCLUDED.trust_zone,
  hardware = EXCLUDED.hardware, capabilities = EXCLUDED.capabilities,
  status = EXCLUDED.status, last_heartbeat = now(),
  heartbeat_interval_seconds = EXCLUDED.heartbeat_interval_seconds,
  instance_id = EXCLUDED.instance_id, updated_at = now()
WHERE w.instance_id IS NULL OR w.instance_id = EXCLUDED.instance_id
   OR worker_liveness(w.status, w.last_heartbeat, w.heartbeat_interval_seconds)
      IN ('draining', 'offline')
RETURNING last_heartbeat
"""

_HOLDER = """
SELECT instance_id, status, EXTRACT(EPOCH FROM now() - last_heartbeat)::float8 AS age
FROM worker_capabilities WHERE node_id = $1
"""

_HEARTBEAT = """
UPDATE worker_capabilities
SET last_heartbeat = now(), updated_at = now(), status = $2
WHERE node_id = $1 AND instance_id = $3
RETURNING last_heartbeat
"""

_NODES = """
SELECT node_id, tier, region, trust_zone, hardware, capabilities, status, liveness,
       last_heartbeat, heartbeat_age_seconds::float8 AS heartbeat_age_seconds,
       heartbeat_interval_seconds, created_at, updated_at
FROM worker_liveness_now
WHERE ($1::text IS NULL OR tier = $1)
  AND ($2::text IS NULL OR liveness = $2)
  AND ($3::text IS NULL OR capabilities @> jsonb_build_array($3::text))
ORDER BY node_id
LIMIT $4
"""

# The nodes a contract migration waits for: every one not offline (it heartbeats, or has
# missed fewer than three heartbeats: it may come back), with the release it registered with.
_LIVE_NODES = """
SELECT node_id, hardware ->> 'manager_version' AS version,
       worker_liveness(status, last_heartbeat, heartbeat_interval_seconds) AS liveness
FROM worker_capabilities
WHERE worker_liveness(status, last_heartbeat, heartbeat_interval_seconds) <> 'offline'
ORDER BY node_id
"""

_ELIGIBLE = """
SELECT node_id, tier, region, trust_zone, hardware, capabilities
FROM eligible_workers($1, $2, $3, $4, $5, $6, $7, coalesce($8, now()))
"""


class AsyncpgRegistry:
    def __init__(
        self,
        url: str,
        *,
        timeout: float,
        max_connections: int = 4,
        instance: str | None = None,
        manager_version: str | None = None,
        transaction_pooler: bool = False,
    ) -> None:
        # this manager process, as the node's row records who holds it
        self.instance = instance or uuid.uuid4().hex
        # the release it runs, recorded with the node's row (what a contract migration
        # waits for); None records none
        self.manager_version = manager_version
        self._url = url
        self._timeout = timeout
        self._max = max_connections
        # the URL reaches PostgreSQL through PgBouncer in transaction mode: every statement
        # below is one transaction of its own (or, for `migrate`, one explicit transaction
        # with a transaction-scoped lock), so only the statement cache has to go
        self.transaction_pooler = transaction_pooler
        self._pool: asyncpg.Pool | None = None

    async def open(self) -> None:
        self._pool = await asyncpg.create_pool(
            self._url,
            min_size=0,
            max_size=self._max,
            timeout=self._timeout,
            command_timeout=self._timeout,
            init=_init_connection,
            # The default reset sends four statements each time a connection goes back to
            # the pool; the manager keeps no session state (no LISTEN, no session advisory
            # locks, no SET, no temporary tables, no cursors held across transactions), so
            # that round trip per statement buys nothing, and nothing breaks when a
            # transaction pooler gives each transaction another server connection.
            reset=_keep_session,
            statement_cache_size=statement_cache_size(transaction_pooler=self.transaction_pooler),
        )

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("registry is not open")
        return self._pool

    async def upsert(self, node: NodeProfile, *, status: str, interval_seconds: int) -> None:
        """Register or rewrite the node's row as held by this instance; NodeHeldElsewhere
        when another instance that is neither leaving nor quiet holds it."""
        hardware = node.hardware
        if self.manager_version is not None:
            hardware = {**hardware, MANAGER_VERSION_KEY: self.manager_version}
        written = await self.pool.fetchval(
            _UPSERT,
            node.node_id,
            node.tier.value,
            node.region,
            node.trust_zone,
            hardware,
            node.capabilities,
            status,
            interval_seconds,
            self.instance,
            timeout=self._timeout,
        )
        if written is None:
            holder = await self.pool.fetchrow(_HOLDER, node.node_id, timeout=self._timeout)
            raise NodeHeldElsewhere(
                node.node_id,
                holder["instance_id"] if holder else None,
                holder["status"] if holder else None,
                holder["age"] if holder else None,
            )

    async def heartbeat(self, node_id: str, *, status: str) -> bool:
        """Move last_heartbeat; False when this instance does not hold the node's row (it
        has none yet, or another instance took it over): it must register first."""
        moved = await self.pool.fetchval(
            _HEARTBEAT, node_id, status, self.instance, timeout=self._timeout
        )
        return moved is not None

    async def nodes(
        self,
        *,
        tier: str | None = None,
        liveness: str | None = None,
        capability: str | None = None,
        limit: int = 1000,
    ) -> list[dict[str, Any]]:
        rows = await self.pool.fetch(
            _NODES, tier, liveness, capability, limit, timeout=self._timeout
        )
        return [dict(r) for r in rows]

    async def eligible(self, requirements: Requirements, *, at: Any = None) -> list[NodeProfile]:
        hw = requirements.hardware
        rows = await self.pool.fetch(
            _ELIGIBLE,
            [t.value for t in requirements.tier] if requirements.tier is not None else None,
            requirements.region,
            requirements.trust_zone,
            requirements.capabilities or None,
            hw.gpu,
            hw.min_memory_gb,
            hw.min_cpu_count,
            at,
            timeout=self._timeout,
        )
        return [NodeProfile(**dict(r)) for r in rows]

    async def migrate(self, migrations: Sequence[Migration]) -> list[Migration]:
        """Apply pending migrations in one transaction under an advisory lock.

        Concurrent migrators (an init container per node) queue on the lock; the ones
        after the first find nothing left to do. A contract migration is applied only when
        no live node runs a release below the one it requires (`held_back_by`, read in the
        same transaction, under the lock); otherwise the migrations before it are
        committed, and ContractHeldBack names the nodes (nothing from it on is applied).
        A node of an older release that registers afterwards finds a contract ahead of it
        and its own `migrate` stops it before it starts (`plan`).
        """
        applied: list[Migration] = []
        refused: MigrationError | None = None
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(
                "SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK_KEY, timeout=MIGRATION_TIMEOUT
            )
            await conn.execute(
                """CREATE TABLE IF NOT EXISTS schema_migrations (
                     version INTEGER PRIMARY KEY,
                     name TEXT NOT NULL,
                     checksum TEXT NOT NULL,
                     applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"""
            )
            # each migration's kind, so that an older release can tell a schema ahead of
            # it by expand migrations only (app/domain/migrations.py)
            await conn.execute("ALTER TABLE schema_migrations ADD COLUMN IF NOT EXISTS kind TEXT")
            rows = await conn.fetch("SELECT version, name, checksum, kind FROM schema_migrations")
            decided = plan(
                migrations,
                [Applied(r["version"], r["name"], r["checksum"], r["kind"]) for r in rows],
            )
            if decided.ahead:
                names = ", ".join(f"{a.version:04d}_{a.name}" for a in decided.ahead)
                log.warning("%s (%s): this release's code finds all it uses", decided.note, names)
            for migration in decided.todo:
                if migration.kind is Kind.CONTRACT:
                    try:
                        holders = held_back_by(migration, await _live_nodes(conn))
                    except MigrationError as exc:
                        refused = exc
                        break
                    if holders:
                        refused = ContractHeldBack(migration, holders, list(applied))
                        break
                await conn.execute(migration.sql, timeout=MIGRATION_TIMEOUT)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name, checksum, kind) "
                    "VALUES ($1, $2, $3, $4)",
                    migration.version,
                    migration.name,
                    migration.checksum,
                    migration.kind.value if migration.kind is not None else None,
                )
                applied.append(migration)
        if refused is not None:
            raise refused
        return applied

    async def applied_versions(self) -> list[int]:
        """The migrations the database has applied (none: it was never migrated)."""
        try:
            rows = await self.pool.fetch(
                "SELECT version FROM schema_migrations ORDER BY version", timeout=self._timeout
            )
        except asyncpg.UndefinedTableError:
            return []
        return [r["version"] for r in rows]


async def _live_nodes(conn: asyncpg.Connection | PoolConnectionProxy) -> list[LiveNode]:
    """The registry's live nodes with their releases; none before its table exists."""
    if await conn.fetchval("SELECT to_regclass('worker_capabilities')") is None:
        return []
    rows = await conn.fetch(_LIVE_NODES, timeout=MIGRATION_TIMEOUT)
    return [LiveNode(r["node_id"], r["version"], r["liveness"]) for r in rows]


# The claim of a batch of distinct keys, one statement (group commit): a new key is
# inserted; a key `retrying`, or `running` with a lease that ran out, is taken over, unless
# its fingerprint is another job's (NULL, from before fingerprints, matches any). `before`
# is the statement's snapshot, taken before the insert: for a key not claimed, the row that
# stopped it.
_CLAIM_MANY = """
WITH input AS (
  SELECT * FROM unnest($1::varchar[], $2::uuid[], $3::varchar[], $4::text[])
    AS t(key, job_id, job_type, fingerprint)
), claimed AS (
  INSERT INTO job_ledger AS l (idempotency_key, job_id, job_type, fingerprint, node_id,
                               claimant, status, attempts, lease_until)
  SELECT key, job_id, job_type, fingerprint, $5, $6, 'running', 1,
         now() + make_interval(secs => $7)
  FROM input
  ON CONFLICT (idempotency_key) DO UPDATE SET
    job_id = EXCLUDED.job_id, job_type = EXCLUDED.job_type, fingerprint = EXCLUDED.fingerprint,
    node_id = EXCLUDED.node_id, claimant = EXCLUDED.claimant, status = 'running',
    attempts = l.attempts + 1, lease_until = EXCLUDED.lease_until, updated_at = now(),
    error = NULL
  WHERE (l.fingerprint IS NULL OR l.fingerprint = EXCLUDED.fingerprint)
    AND (l.status = 'retrying'
         OR (l.status = 'running' AND (l.lease_until IS NULL OR l.lease_until < now())))
  RETURNING l.idempotency_key, l.attempts
)
SELECT i.key, c.attempts, before.status,
       coalesce(before.fingerprint <> i.fingerprint, false) AS conflict,
       greatest(EXTRACT(EPOCH FROM before.lease_until - now()), 0)::float8 AS left
FROM input i
LEFT JOIN claimed c ON c.idempotency_key = i.key
LEFT JOIN job_ledger before ON before.idempotency_key = i.key
"""

# Completion for a batch of distinct keys this claimant holds (group commit).
_COMPLETE_MANY = """
UPDATE job_ledger l
SET status = 'completed', result = t.result, error = NULL, lease_until = NULL,
    updated_at = now(), completed_at = now()
FROM unnest($1::varchar[], $2::jsonb[]) AS t(key, result)
WHERE l.idempotency_key = t.key AND l.claimant = $3 AND l.status = 'running'
RETURNING l.idempotency_key
"""

_FAIL = """
UPDATE job_ledger
SET status = $3::varchar, result = NULL, error = $4, lease_until = NULL, updated_at = now()
WHERE idempotency_key = $1 AND claimant = $2 AND status = 'running'
RETURNING 1
"""

# A release gives its attempt back: the job never ran to an outcome (a shutdown).
_RELEASE = """
UPDATE job_ledger
SET status = 'retrying', attempts = greatest(attempts - 1, 0), result = NULL, error = $3,
    lease_until = NULL, updated_at = now()
WHERE idempotency_key = $1 AND claimant = $2 AND status = 'running'
RETURNING 1
"""

In = TypeVar("In")
Out = TypeVar("Out")


class AsyncpgLedger:
    """The idempotency ledger: each transition is one atomic statement.

    A ledger belongs to one manager process: `claimant` is unique to it, so two processes
    with the same node id (a rollout, a misconfiguration) never both hold one key, and a
    process whose lease was taken over cannot finish the job it lost.
    """

    def __init__(self, registry: AsyncpgRegistry, *, node_id: str, claimant: str) -> None:
        self._registry = registry
        self.node_id = node_id
        self.claimant = claimant
        # group commit: the claims and completions of jobs fetched together (or finishing
        # together) go to PostgreSQL as one statement each; every caller gets its own answer,
        # or its own error (a batch PostgreSQL refuses for one row's data is tried again row
        # by row, so one bad row fails only its caller)
        self._claims: Coalescer[_ClaimCall, tuple[Claim, float] | Exception] = Coalescer(
            self._claim_many
        )
        self._completions: Coalescer[tuple[str, Any], bool | Exception] = Coalescer(
            self._complete_many
        )

    @property
    def _timeout(self) -> float:
        return self._registry._timeout

    async def claim(
        self, *, key: str, job_id: str, job_type: str, fingerprint: str, lease_seconds: float
    ) -> tuple[Claim, float]:
        """The claim, with the number of this claim (1 for the first) for CLAIMED and the
        seconds left on the holder's lease for HELD; CONFLICT when the key was used for a
        job of another fingerprint (app/domain/ledger.py `job_fingerprint`)."""
        answer = await self._claims.submit(
            _ClaimCall(key, job_id, job_type, fingerprint, lease_seconds)
        )
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def _claim_many(
        self, calls: Sequence[_ClaimCall]
    ) -> list[tuple[Claim, float] | Exception]:
        answers: list[tuple[Claim, float] | Exception] = []
        for batch in distinct_runs(
            calls, name=lambda call: call.key, same=lambda call: call.lease_seconds
        ):
            answers += await _row_by_row_on_data_errors(self._claim_batch, batch)
        return answers

    async def _claim_batch(self, batch: Sequence[_ClaimCall]) -> list[tuple[Claim, float]]:
        rows = await self._registry.pool.fetch(
            _CLAIM_MANY, [c.key for c in batch], [c.job_id for c in batch],
            [c.job_type for c in batch], [c.fingerprint for c in batch], self.node_id,
            self.claimant, batch[0].lease_seconds, timeout=self._timeout,
        )  # fmt: skip
        by_key = {row["key"]: row for row in rows}
        return [_claim_answer(by_key[c.key]) for c in batch]

    async def renew(self, *, key: str, lease_seconds: float) -> bool:
        renewed = await self._registry.pool.fetchval(
            """UPDATE job_ledger SET lease_until = now() + make_interval(secs => $3),
                      updated_at = now()
               WHERE idempotency_key = $1 AND claimant = $2 AND status = 'running'
               RETURNING 1""",
            key, self.claimant, lease_seconds, timeout=self._timeout,
        )  # fmt: skip
        return renewed is not None

    async def complete(self, *, key: str, result: Any) -> bool:
        """Store the result (NUL in its strings and keys as U+FFFD, which JSONB can hold)."""
        answer = await self._completions.submit((key, without_nul(result)))
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def _complete_many(self, calls: Sequence[tuple[str, Any]]) -> list[bool | Exception]:
        done: list[bool | Exception] = []
        for batch in distinct_runs(calls, name=lambda call: call[0]):
            done += await _row_by_row_on_data_errors(self._complete_batch, batch)
        return done

    async def _complete_batch(self, batch: Sequence[tuple[str, Any]]) -> list[bool]:
        rows = await self._registry.pool.fetch(
            _COMPLETE_MANY, [key for key, _ in batch], [result for _, result in batch],
            self.claimant, timeout=self._timeout,
        )  # fmt: skip
        stored = {row["idempotency_key"] for row in rows}
        return [key in stored for key, _ in batch]

    async def fail(self, *, key: str, error: str, dead: bool) -> bool:
        """Finish as dead or retrying (the error text's NUL as U+FFFD)."""
        status = "dead" if dead else "retrying"
        done = await self._registry.pool.fetchval(
            _FAIL, key, self.claimant, status, without_nul(error), timeout=self._timeout
        )
        return done is not None

    async def release(self, *, key: str) -> bool:
        """Give a claimed job back (shutdown) with its attempt: the next delivery may run it
        at once, as the same claim number."""
        done = await self._registry.pool.fetchval(
            _RELEASE, key, self.claimant, RELEASED, timeout=self._timeout
        )
        return done is not None


async def _row_by_row_on_data_errors(
    run: Callable[[Sequence[In]], Awaitable[Sequence[Out]]], batch: Sequence[In]
) -> list[Out | Exception]:
    """`run(batch)`; when PostgreSQL refuses the statement for its data (a DataError: NUL
    in a varchar, JSON it does not take), each call again on its own, so that the error is
    the offending call's alone. The failed statement changed nothing, so nothing runs twice."""
    try:
        return list(await run(batch))
    except asyncpg.DataError as exc:
        if len(batch) == 1:
            return [exc]
    answers: list[Out | Exception] = []
    for call in batch:
        try:
            answers += await run([call])
        except asyncpg.DataError as exc:
            answers.append(exc)
    return answers


class _ClaimCall(NamedTuple):
    key: str
    job_id: str
    job_type: str
    fingerprint: str
    lease_seconds: float


def _claim_answer(row: asyncpg.Record) -> tuple[Claim, float]:
    """A key's answer from `_CLAIM_MANY`: claimed, or what the row that stopped it says."""
    if row["attempts"] is not None:
        return Claim.CLAIMED, float(row["attempts"])
    if row["status"] is None:  # inserted by another claim meanwhile: look again later
        return Claim.HELD, 0.0
    if row["conflict"]:
        return Claim.CONFLICT, 0.0
    if row["status"] == "completed":
        return Claim.COMPLETED, 0.0
    if row["status"] == "dead":
        return Claim.DEAD, 0.0
    return Claim.HELD, float(row["left"] or 0.0)
