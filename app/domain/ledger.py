"""The idempotency ledger's rules, apart from where the ledger lives.

One record per idempotency key. A claim is won by at most one manager process (its
`claimant`, unique per process) and lasts until its lease runs out; only the claimant may
renew it or finish it. A finished key answers every later delivery: `completed` is
acknowledged without running, `dead` is terminated, `retrying` may be claimed again.

A key answers for the job it was first used for: the record keeps that job's fingerprint
(`job_fingerprint`, its type and payload), and a claim with another fingerprint is a
CONFLICT whatever the record's status, so a different job reusing a key is neither run nor
acknowledged as done. Records stored before fingerprints existed have none and match any
job; the next claim that takes one over stores its own.

`attempts` is the claim number, the worker's retry budget: a failure spends one, a release
(a job handed back on shutdown, never run to an outcome) gives its own back.

PostgreSQL stores no NUL (U+0000) in text or JSONB, and a statement carrying one fails (with
group commit, every call batched with it). So the ledgers store results and error texts
through `without_nul`, NUL becoming U+FFFD in every string and object key, the same in both.

PostgreSQL applies these rules in single SQL statements (adapters/registry.py); the
JetStream key-value ledger (adapters/kv_ledger.py) reads a record, decides here, and writes
the decision back conditioned on the revision it read, so a concurrent writer makes the
write fail instead of both winning. Everything here is pure.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any, overload


class Claim(StrEnum):
    CLAIMED = "claimed"  # this process runs it now
    COMPLETED = "completed"  # done before: acknowledge without running
    DEAD = "dead"  # dead-lettered before: terminate
    HELD = "held"  # another process holds a live lease: try again later
    CONFLICT = "conflict"  # the key was used for another job (type or payload)


def job_fingerprint(job_type: str, payload: Mapping[str, Any]) -> str:
    """What a key is scoped to: "sha256:" and the hex digest of the canonical JSON of
    {"type", "payload"} (sorted keys, no spaces, UTF-8 unescaped), the same whatever the
    payload's key order or the job id. A lone surrogate (JSON may escape one, UTF-8 has
    none) is hashed as its code point, not refused."""
    canonical = json.dumps(
        {"type": job_type, "payload": payload},
        sort_keys=True, separators=(",", ":"), ensure_ascii=False,
    )  # fmt: skip
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


REPLACEMENT_CHARACTER = "\ufffd"


@overload
def without_nul(value: str) -> str: ...


@overload
def without_nul(value: Any) -> Any: ...


def without_nul(value: Any) -> Any:
    """`value` (a JSON value or a text) with every NUL in a string or an object key replaced
    by U+FFFD; the value itself, uncopied, when it has none."""
    if isinstance(value, str):
        return value.replace("\x00", REPLACEMENT_CHARACTER) if "\x00" in value else value
    if isinstance(value, dict):
        items = [(without_nul(k), without_nul(v)) for k, v in value.items()]
        if all(k is k0 and v is v0 for (k, v), (k0, v0) in zip(items, value.items(), strict=True)):
            return value
        return dict(items)
    if isinstance(value, list | tuple):
        inner = [without_nul(v) for v in value]
        return value if all(a is b for a, b in zip(inner, value, strict=True)) else inner
    return value


RUNNING, COMPLETED, RETRYING, DEAD = "running", "completed", "retrying", "dead"
FINISHED = (COMPLETED, RETRYING, DEAD)


@dataclass(frozen=True, slots=True)
class LedgerRecord:
    status: str  # running | completed | retrying | dead
    job_id: str
    job_type: str
    node_id: str
    claimant: str
    attempts: int
    lease_until: float | None  # seconds since the epoch; None once finished
    error: str | None = None
    result: Any = None
    fingerprint: str | None = None  # None: stored before fingerprints, matches any job

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":"), default=str).encode()

    @classmethod
    def decode(cls, data: bytes) -> LedgerRecord:
        """A stored record; a value that is not one raises ValueError (naming the field)."""
        try:
            raw = json.loads(data)
        except ValueError as exc:
            raise ValueError(f"ledger record is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("ledger record is not an object")
        try:
            record = cls(**raw)
        except TypeError as exc:
            raise ValueError(f"ledger record has the wrong fields: {exc}") from None
        if record.status not in (RUNNING, *FINISHED):
            raise ValueError(f"ledger record has an unknown status {record.status!r}")
        return record


@dataclass(frozen=True, slots=True)
class ClaimDecision:
    claim: Claim
    number: float  # CLAIMED: the number of this claim (1 for the first); HELD: lease seconds left
    write: LedgerRecord | None  # what to store (only for CLAIMED)


def decide_claim(
    current: LedgerRecord | None,
    *,
    now: float,
    job_id: str,
    job_type: str,
    fingerprint: str,
    node_id: str,
    claimant: str,
    lease_seconds: float,
) -> ClaimDecision:
    """What a claim of a key whose record is `current` (None: never seen) comes to."""
    if current is None:
        fresh = LedgerRecord(
            RUNNING, job_id, job_type, node_id, claimant, 1, now + lease_seconds,
            fingerprint=fingerprint,
        )  # fmt: skip
        return ClaimDecision(Claim.CLAIMED, 1.0, fresh)
    if current.fingerprint is not None and current.fingerprint != fingerprint:
        return ClaimDecision(Claim.CONFLICT, 0.0, None)
    if current.status == COMPLETED:
        return ClaimDecision(Claim.COMPLETED, 0.0, None)
    if current.status == DEAD:
        return ClaimDecision(Claim.DEAD, 0.0, None)
    live = current.status == RUNNING and (
        current.lease_until is not None and current.lease_until > now
    )
    if live:
        assert current.lease_until is not None
        return ClaimDecision(Claim.HELD, max(current.lease_until - now, 0.0), None)
    # retrying, or running with a lease that ran out (its holder crashed or hung)
    attempts = current.attempts + 1
    taken = replace(
        current, status=RUNNING, job_id=job_id, job_type=job_type, node_id=node_id,
        claimant=claimant, attempts=attempts, lease_until=now + lease_seconds, error=None,
        fingerprint=fingerprint,
    )  # fmt: skip
    return ClaimDecision(Claim.CLAIMED, float(attempts), taken)


def decide_renew(
    current: LedgerRecord | None, *, now: float, claimant: str, lease_seconds: float
) -> LedgerRecord | None:
    """The renewed record, or None when the claim is no longer this claimant's."""
    if not _holds(current, claimant):
        return None
    assert current is not None
    return replace(current, lease_until=now + lease_seconds)


def decide_finish(
    current: LedgerRecord | None,
    *,
    claimant: str,
    status: str,
    result: Any = None,
    error: str | None = None,
) -> LedgerRecord | None:
    """The finished record (`status` one of completed, retrying, dead), or None when the
    claim is no longer this claimant's: a process whose lease was taken over cannot
    finish the job it lost."""
    if status not in FINISHED:
        raise ValueError(f"cannot finish a claim as {status!r}")
    if not _holds(current, claimant):
        return None
    assert current is not None
    return replace(current, status=status, result=result, error=error, lease_until=None)


RELEASED = "released on shutdown"


def decide_release(current: LedgerRecord | None, *, claimant: str) -> LedgerRecord | None:
    """The record handed back (retrying, its attempt given back, never below 0), or None
    when the claim is no longer this claimant's."""
    if not _holds(current, claimant):
        return None
    assert current is not None
    return replace(
        current, status=RETRYING, attempts=max(current.attempts - 1, 0), lease_until=None,
        result=None, error=RELEASED,
    )  # fmt: skip


def _holds(current: LedgerRecord | None, claimant: str) -> bool:
    # as in PostgreSQL: the claimant keeps a running claim until someone takes it over,
    # even past its lease
    return current is not None and current.status == RUNNING and current.claimant == claimant
