"""The idempotency ledger's rules (app/domain/ledger.py), as a table."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.domain.ledger import (
    Claim,
    LedgerRecord,
    decide_claim,
    decide_finish,
    decide_renew,
)

NOW = 1_000_000.0
RUNNING = LedgerRecord("running", "job-1", "noop", "node-a", "holder", 1, NOW + 10)


def claim(current: LedgerRecord | None, claimant: str = "me") -> tuple[Claim, float, int | None]:
    decision = decide_claim(
        current, now=NOW, job_id="job-1", job_type="noop", node_id="node-b",
        claimant=claimant, lease_seconds=30,
    )  # fmt: skip
    attempts = decision.write.attempts if decision.write else None
    return decision.claim, decision.number, attempts


@pytest.mark.parametrize(
    ("current", "expected"),
    [
        (None, (Claim.CLAIMED, 1.0, 1)),
        (RUNNING, (Claim.HELD, 10.0, None)),
        (replace(RUNNING, lease_until=NOW), (Claim.CLAIMED, 2.0, 2)),  # ran out just now
        (replace(RUNNING, lease_until=NOW - 5, attempts=3), (Claim.CLAIMED, 4.0, 4)),
        (replace(RUNNING, lease_until=None), (Claim.CLAIMED, 2.0, 2)),
        (replace(RUNNING, status="retrying", lease_until=None), (Claim.CLAIMED, 2.0, 2)),
        (replace(RUNNING, status="completed", lease_until=None), (Claim.COMPLETED, 0.0, None)),
        (replace(RUNNING, status="dead", lease_until=None), (Claim.DEAD, 0.0, None)),
    ],
    ids=["new", "held", "lease-just-out", "lease-out", "no-lease", "retrying", "completed", "dead"],
)
def test_claims(current: LedgerRecord | None, expected: tuple[Claim, float, int | None]) -> None:
    assert claim(current) == expected


def test_the_same_process_cannot_claim_its_own_live_key_twice() -> None:
    assert claim(RUNNING, claimant="holder")[0] is Claim.HELD


def test_a_claim_takes_the_record_over_and_clears_the_old_error() -> None:
    failed = replace(RUNNING, status="retrying", lease_until=None, error="boom")
    decision = decide_claim(
        failed, now=NOW, job_id="job-1", job_type="noop", node_id="node-b", claimant="me",
        lease_seconds=30,
    )  # fmt: skip
    assert decision.write is not None
    assert (decision.write.claimant, decision.write.node_id) == ("me", "node-b")
    assert (decision.write.status, decision.write.error) == ("running", None)
    assert decision.write.lease_until == NOW + 30


@pytest.mark.parametrize(
    ("current", "claimant", "renewed"),
    [
        (RUNNING, "holder", True),
        (replace(RUNNING, lease_until=NOW - 100), "holder", True),  # late, not taken over
        (RUNNING, "someone-else", False),
        (replace(RUNNING, status="completed"), "holder", False),
        (None, "holder", False),
    ],
)
def test_renewals(current: LedgerRecord | None, claimant: str, renewed: bool) -> None:
    after = decide_renew(current, now=NOW, claimant=claimant, lease_seconds=30)
    assert (after is not None) is renewed
    if after is not None:
        assert after.lease_until == NOW + 30


@pytest.mark.parametrize("status", ["completed", "retrying", "dead"])
def test_only_the_holder_finishes(status: str) -> None:
    done = decide_finish(RUNNING, claimant="holder", status=status, result={"n": 1}, error="e")
    assert done is not None and (done.status, done.lease_until) == (status, None)
    assert decide_finish(RUNNING, claimant="other", status=status) is None
    assert decide_finish(done, claimant="holder", status=status) is None, "finished once"


def test_finishing_as_running_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="cannot finish"):
        decide_finish(RUNNING, claimant="holder", status="running")


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"{", "not JSON"),
        (b"[]", "not an object"),
        (b'{"status": "running"}', "wrong fields"),
        (RUNNING.encode().replace(b'"running"', b'"paused"'), "unknown status 'paused'"),
    ],
)
def test_garbled_records_are_refused(data: bytes, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        LedgerRecord.decode(data)


def test_records_survive_a_round_trip() -> None:
    record = replace(RUNNING, result={"rows": [1, 2]}, error=None)
    assert LedgerRecord.decode(record.encode()) == record
