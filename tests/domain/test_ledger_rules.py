"""The idempotency ledger's rules (app/domain/ledger.py), as a table."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import Any

import pytest

from app.domain.ledger import (
    REPLACEMENT_CHARACTER,
    Claim,
    LedgerRecord,
    decide_claim,
    decide_finish,
    decide_release,
    decide_renew,
    job_fingerprint,
    without_nul,
)

NOW = 1_000_000.0
MINE = job_fingerprint("noop", {"n": 1})
OTHER = job_fingerprint("noop", {"n": 2})
RUNNING = LedgerRecord("running", "job-1", "noop", "node-a", "holder", 1, NOW + 10)


def claim(
    current: LedgerRecord | None, claimant: str = "me", fingerprint: str = MINE
) -> tuple[Claim, float, int | None]:
    decision = decide_claim(
        current, now=NOW, job_id="job-1", job_type="noop", fingerprint=fingerprint,
        node_id="node-b", claimant=claimant, lease_seconds=30,
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


@pytest.mark.parametrize(
    "current",
    [
        RUNNING,
        replace(RUNNING, lease_until=NOW - 5),
        replace(RUNNING, status="retrying", lease_until=None),
        replace(RUNNING, status="completed", lease_until=None),
        replace(RUNNING, status="dead", lease_until=None),
    ],
    ids=["held", "lease-out", "retrying", "completed", "dead"],
)
def test_a_key_used_by_another_job_is_a_conflict_whatever_its_status(
    current: LedgerRecord,
) -> None:
    assert claim(replace(current, fingerprint=OTHER)) == (Claim.CONFLICT, 0.0, None)
    # the same job again (a redelivery, a publisher retrying) keeps the old answers
    assert claim(replace(current, fingerprint=MINE)) == claim(current)


def test_a_record_from_before_fingerprints_matches_any_job_and_is_scoped_when_taken() -> None:
    old = replace(RUNNING, status="retrying", lease_until=None, fingerprint=None)
    decision = decide_claim(
        old, now=NOW, job_id="job-2", job_type="other", fingerprint=OTHER, node_id="node-b",
        claimant="me", lease_seconds=30,
    )  # fmt: skip
    assert decision.claim is Claim.CLAIMED and decision.write is not None
    assert (decision.write.fingerprint, decision.write.job_type) == (OTHER, "other")
    fresh = decide_claim(
        None, now=NOW, job_id="job-1", job_type="noop", fingerprint=MINE, node_id="node-b",
        claimant="me", lease_seconds=30,
    )  # fmt: skip
    assert fresh.write is not None and fresh.write.fingerprint == MINE


@pytest.mark.parametrize(
    ("job_type", "payload", "canonical"),
    [
        ("noop", {}, '{"payload":{},"type":"noop"}'),
        ("memory.write", {"b": 1, "a": [1.5, None]},
         '{"payload":{"a":[1.5,null],"b":1},"type":"memory.write"}'),
        ("noop", {"text": "ключ ü"}, '{"payload":{"text":"ключ ü"},"type":"noop"}'),
        ("noop", {"z": {"y": 1, "x": 2}}, '{"payload":{"z":{"x":2,"y":1}},"type":"noop"}'),
    ],
    ids=["empty", "sorted-keys", "utf-8-not-escaped", "nested-sorted"],
)  # fmt: skip
def test_fingerprints_hash_the_canonical_json_of_type_and_payload(
    job_type: str, payload: dict[str, Any], canonical: str
) -> None:
    expected = "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
    assert job_fingerprint(job_type, payload) == expected
    assert job_fingerprint(job_type, dict(reversed(payload.items()))) == expected, "key order"


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (("noop", {"n": 1}), ("noop", {"n": 2})),
        (("noop", {"n": 1}), ("http", {"n": 1})),
        (("noop", {"n": 1}), ("noop", {"n": "1"})),
        (("noop", {}), ("noop", {"": None})),
    ],
    ids=["payload", "type", "value-type", "empty-vs-key"],
)
def test_different_jobs_have_different_fingerprints(
    one: tuple[str, dict[str, Any]], other: tuple[str, dict[str, Any]]
) -> None:
    assert job_fingerprint(*one) != job_fingerprint(*other)


def test_a_payload_with_a_lone_surrogate_still_has_a_fingerprint() -> None:
    """json.loads('"\\ud800"') is a str UTF-8 cannot encode: it is hashed, not an error."""
    lone = json.loads('{"s": "\\ud800"}')
    assert job_fingerprint("noop", lone) != job_fingerprint("noop", {"s": ""})


@pytest.mark.parametrize(
    ("attempts", "after"), [(1, 0), (3, 2), (0, 0)], ids=["first", "third", "never-below-0"]
)
def test_a_release_gives_the_attempt_back(attempts: int, after: int) -> None:
    held = replace(RUNNING, attempts=attempts, fingerprint=MINE)
    released = decide_release(held, claimant="holder")
    assert released is not None
    assert (released.status, released.attempts, released.lease_until) == ("retrying", after, None)
    assert released.fingerprint == MINE
    assert claim(released) == (Claim.CLAIMED, float(after + 1), after + 1), "the same number again"


@pytest.mark.parametrize(
    ("current", "claimant"),
    [(RUNNING, "other"), (replace(RUNNING, status="completed"), "holder"), (None, "holder")],
    ids=["not-the-holder", "finished", "absent"],
)
def test_only_the_holder_releases(current: LedgerRecord | None, claimant: str) -> None:
    assert decide_release(current, claimant=claimant) is None


R = REPLACEMENT_CHARACTER


@pytest.mark.parametrize(
    ("value", "stored"),
    [
        ("a\x00b\x00", f"a{R}b{R}"),
        ({"k\x00": ["x\x00", 1, None, True, 2.5, {"\x00": "\x00"}]},
         {f"k{R}": [f"x{R}", 1, None, True, 2.5, {R: R}]}),
        ([["\x00"]], [[R]]),
        ({"clean": ["no", 1]}, {"clean": ["no", 1]}),
        (None, None),
        (7, 7),
    ],
    ids=["text", "keys-and-nested-values", "nested-lists", "clean", "none", "number"],
)  # fmt: skip
def test_nul_becomes_the_replacement_character(value: Any, stored: Any) -> None:
    assert R == "\ufffd"
    assert without_nul(value) == stored


def test_a_value_without_nul_is_returned_as_it_is() -> None:
    """Nothing is copied for the usual result."""
    clean = {"rows": [{"a": "b"}] * 3}
    assert without_nul(clean) is clean


def test_the_same_process_cannot_claim_its_own_live_key_twice() -> None:
    assert claim(RUNNING, claimant="holder")[0] is Claim.HELD


def test_a_claim_takes_the_record_over_and_clears_the_old_error() -> None:
    failed = replace(RUNNING, status="retrying", lease_until=None, error="boom")
    decision = decide_claim(
        failed, now=NOW, job_id="job-1", job_type="noop", fingerprint=MINE, node_id="node-b",
        claimant="me", lease_seconds=30,
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
    record = replace(RUNNING, result={"rows": [1, 2]}, error=None, fingerprint=MINE)
    assert LedgerRecord.decode(record.encode()) == record


def test_a_record_written_before_fingerprints_decodes_without_one() -> None:
    raw = json.loads(RUNNING.encode())
    del raw["fingerprint"]
    old = LedgerRecord.decode(json.dumps(raw).encode())
    assert old.fingerprint is None and claim(old, fingerprint=OTHER)[0] is Claim.HELD
