"""The idempotency ledger in a JetStream key-value bucket, for nodes without PostgreSQL.

Same contract as the PostgreSQL ledger (adapters/registry.py `AsyncpgLedger`; the rules
are app/domain/ledger.py): at most one claimant per key, leases that expire, only the
claimant renews or finishes. Atomicity comes from the bucket's compare-and-set: a claim
of a new key is a `create` (fails if the key exists), every other transition an `update`
conditioned on the revision that was read. Losing that race means someone else wrote
first: the record is read again and decided again (bounded).

Records expire `ttl` after their last write (the bucket's max age): that is how long a
finished key is remembered, the duplicate window of the ledger. Lease times are this
machine's wall clock, so the nodes sharing a bucket need synchronised clocks (NTP), as
leases on PostgreSQL need none (they use the server's `now()`).

Each tier has a bucket of its own, `JOB_LEDGER_<tier>` (its stream `KV_JOB_LEDGER_<tier>`),
so that a tier's NATS permissions name that bucket's subjects and no other
(k8s/nats/auth.conf.example): a shared bucket would be one stream, whose stream info lists
every tier's keys and which a `Nats-Rollup: all` header on any key of it would empty (no
permission can see a header). The buckets allow no rollups either: the ledger never
purges, it writes and lets records expire. A key is the idempotency key base64url-encoded
(a bucket key allows only `[-/_=.a-zA-Z0-9]`, an idempotency key anything up to 255
characters).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Callable
from typing import Any

import nats.errors
import nats.js.errors

from app.domain.ledger import (
    COMPLETED,
    DEAD,
    RETRYING,
    Claim,
    LedgerRecord,
    decide_claim,
    decide_finish,
    decide_release,
    decide_renew,
    without_nul,
)

log = logging.getLogger(__name__)

BUCKET_PREFIX = "JOB_LEDGER"
RACES = 5  # re-reads after losing a compare-and-set before a transition gives up


class LedgerUnavailable(Exception):
    """The bucket could not be read or written (timeout, no JetStream, a garbled record)."""


class JetStreamLedger:
    def __init__(
        self,
        kv: Any = None,
        *,
        tier: str,
        node_id: str,
        claimant: str,
        timeout: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._kv = kv
        self.tier = tier
        self.node_id = node_id
        self.claimant = claimant
        self._timeout = timeout
        self._clock = clock

    @property
    def bucket(self) -> str:
        return bucket(self.tier)

    def bind(self, kv: Any) -> None:
        """The tier's bucket, once the bus is connected (the worker's preparation does this)."""
        self._kv = kv

    async def claim(
        self, *, key: str, job_id: str, job_type: str, fingerprint: str, lease_seconds: float
    ) -> tuple[Claim, float]:
        """The claim, with the number of this claim (1 for the first) for CLAIMED and the
        seconds left on the holder's lease for HELD; CONFLICT when the key was used for a
        job of another fingerprint (app/domain/ledger.py `job_fingerprint`)."""
        name = key_name(key)
        for _race in range(RACES):
            current, revision = await self._read(name)
            decision = decide_claim(
                current, now=self._clock(), job_id=job_id, job_type=job_type,
                fingerprint=fingerprint, node_id=self.node_id, claimant=self.claimant,
                lease_seconds=lease_seconds,
            )  # fmt: skip
            if decision.write is None:
                return decision.claim, decision.number
            if await self._write(name, decision.write, revision):
                return decision.claim, decision.number
        # every read was overtaken by another writer: someone else is busy with this key
        return Claim.HELD, 0.0

    async def renew(self, *, key: str, lease_seconds: float) -> bool:
        return await self._transition(
            key,
            lambda current: decide_renew(
                current, now=self._clock(), claimant=self.claimant, lease_seconds=lease_seconds
            ),
        )

    async def complete(self, *, key: str, result: Any) -> bool:
        """Store the result, NUL in its strings and keys as U+FFFD (as PostgreSQL must)."""
        return await self._finish(key, COMPLETED, result=without_nul(result))

    async def fail(self, *, key: str, error: str, dead: bool) -> bool:
        return await self._finish(key, DEAD if dead else RETRYING, error=without_nul(error))

    async def release(self, *, key: str) -> bool:
        """Give a claimed job back (shutdown) with its attempt: the next delivery may run it
        at once, as the same claim number."""
        return await self._transition(
            key, lambda current: decide_release(current, claimant=self.claimant)
        )

    async def _finish(
        self, key: str, status: str, *, result: Any = None, error: str | None = None
    ) -> bool:
        return await self._transition(
            key,
            lambda current: decide_finish(
                current, claimant=self.claimant, status=status, result=result, error=error
            ),
        )

    async def _transition(
        self, key: str, decide: Callable[[LedgerRecord | None], LedgerRecord | None]
    ) -> bool:
        name = key_name(key)
        for _race in range(RACES):
            current, revision = await self._read(name)
            after = decide(current)
            if after is None:
                return False  # not (or no longer) this claimant's
            if await self._write(name, after, revision):
                return True
        return False

    async def _read(self, name: str) -> tuple[LedgerRecord | None, int]:
        """The record and its revision; (None, 0) for a key never written or expired."""
        if self._kv is None:
            raise LedgerUnavailable(f"the {self.bucket} bucket is not open yet")
        try:
            async with asyncio.timeout(self._timeout):
                entry = await self._kv.get(name)
        except nats.js.errors.KeyNotFoundError:
            return None, 0
        except (nats.errors.Error, TimeoutError, OSError) as exc:
            raise LedgerUnavailable(f"reading the ledger: {exc or type(exc).__name__}") from exc
        try:
            return LedgerRecord.decode(entry.value or b""), int(entry.revision)
        except ValueError as exc:
            raise LedgerUnavailable(f"{self.bucket} key {name}: {exc}") from None

    async def _write(self, name: str, record: LedgerRecord, revision: int) -> bool:
        """Store `record` if the key is still at `revision` (0: absent); False when someone
        else wrote in between."""
        try:
            async with asyncio.timeout(self._timeout):
                if revision == 0:
                    await self._kv.create(name, record.encode())
                else:
                    await self._kv.update(name, record.encode(), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return False
        except (nats.errors.Error, TimeoutError, OSError) as exc:
            raise LedgerUnavailable(f"writing the ledger: {exc or type(exc).__name__}") from exc
        return True


def bucket(tier: str) -> str:
    """The ledger bucket of `tier`."""
    return f"{BUCKET_PREFIX}_{tier}"


def key_name(key: str) -> str:
    """The bucket key of idempotency key `key`."""
    return base64.urlsafe_b64encode(key.encode()).decode()
