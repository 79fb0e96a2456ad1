"""The one rule from a job's outcome to its JetStream answer and event, as a table."""

from __future__ import annotations

import pytest

from app.domain.job_flow import (
    DEAD_LETTERS,
    Code,
    Delays,
    Outcome,
    Plan,
    Verb,
    plan,
    transient_delay,
    unsent,
)
from app.domain.jobs import EventKind

DELAYS = Delays(not_here=2.0, held=10.0, transient_cap=60.0)

CASES: list[tuple[Outcome, dict[str, float], Plan]] = [
    (Outcome.INVALID, {}, Plan(Verb.TERM, event=EventKind.REJECTED, code=Code.INVALID, final=True)),
    (
        Outcome.KEY_CONFLICT,
        {},
        Plan(Verb.TERM, event=EventKind.REJECTED, code=Code.KEY_CONFLICT, final=True),
    ),
    (Outcome.EXPIRED, {}, Plan(Verb.TERM, event=EventKind.EXPIRED, code=Code.EXPIRED, final=True)),
    (Outcome.HANDED_ON, {}, Plan(Verb.NAK, delay=2.0)),
    (
        Outcome.UNROUTABLE,
        {},
        Plan(Verb.TERM, event=EventKind.DEAD, code=Code.UNROUTABLE, final=True),
    ),
    (
        Outcome.DELIVERIES_SPENT,
        {},
        Plan(Verb.TERM, event=EventKind.DEAD, code=Code.DELIVERIES_SPENT, final=True),
    ),
    # held: the held delay, or until the holder's lease would have run out
    (Outcome.HELD, {}, Plan(Verb.NAK, delay=10.0)),
    (Outcome.HELD, {"held_for": 42.0}, Plan(Verb.NAK, delay=42.5)),
    # an outage: the held delay doubling with deliveries, capped, spread by the worker
    (Outcome.LEDGER_UNAVAILABLE, {}, Plan(Verb.NAK, delay=10.0, transient=True)),
    (
        Outcome.DUPLICATE,
        {},
        Plan(Verb.ACK, event=EventKind.COMPLETED, code=Code.COMPLETED, final=True),
    ),
    (Outcome.DUPLICATE_DEAD, {}, Plan(Verb.TERM, event=EventKind.DEAD, final=True)),
    (Outcome.STUCK, {}, Plan(Verb.TERM, event=EventKind.DEAD, code=Code.STUCK, final=True)),
    (
        Outcome.COMPLETED,
        {},
        Plan(Verb.ACK, event=EventKind.COMPLETED, code=Code.COMPLETED, final=True),
    ),
    # a retry's event is informational: the NAK goes with the backoff step either way
    (
        Outcome.RETRYING,
        {"retry_in": 30.0},
        Plan(Verb.NAK, delay=30.0, event=EventKind.FAILED, code=Code.RETRYING),
    ),
    (
        Outcome.PERMANENT,
        {},
        Plan(Verb.TERM, event=EventKind.DEAD, code=Code.PERMANENT, final=True),
    ),
    (
        Outcome.ATTEMPTS_SPENT,
        {},
        Plan(Verb.TERM, event=EventKind.DEAD, code=Code.ATTEMPTS_SPENT, final=True),
    ),
    # the holder of the claim answers the job; no event, no ack from here
    (Outcome.LOST_CLAIM, {}, Plan(Verb.NAK, delay=10.0)),
    (Outcome.HANDED_BACK, {}, Plan(Verb.NAK, delay=0.0)),
]


@pytest.mark.parametrize(("outcome", "extra", "expected"), CASES, ids=lambda c: str(c))
def test_each_outcome_has_one_answer_and_event(
    outcome: Outcome, extra: dict[str, float], expected: Plan
) -> None:
    assert plan(outcome, delays=DELAYS, delivered=1, **extra) == expected


def test_the_table_covers_every_outcome() -> None:
    assert {case[0] for case in CASES} == set(Outcome)


def test_final_answers_carry_their_event_and_only_retries_nak_with_one() -> None:
    for outcome in Outcome:
        step = plan(outcome, delays=DELAYS, delivered=1)
        if step.verb is not Verb.NAK:
            assert step.event is not None and step.final, outcome
        elif step.event is not None:
            assert outcome is Outcome.RETRYING and not step.final


def test_dead_letters_are_exactly_the_outcomes_with_a_dead_event() -> None:
    assert {
        o for o in Outcome if plan(o, delays=DELAYS, delivered=1).event is EventKind.DEAD
    } == DEAD_LETTERS


@pytest.mark.parametrize(
    ("delivered", "delay"),
    [(0, 10.0), (1, 10.0), (2, 20.0), (3, 40.0), (4, 60.0), (50, 60.0), (10_000, 60.0)],
)
def test_transient_delays_double_with_deliveries_up_to_the_cap(
    delivered: int, delay: float
) -> None:
    assert transient_delay(delivered, DELAYS) == delay


def test_a_held_delay_above_the_cap_is_kept() -> None:
    slow = Delays(not_here=2.0, held=120.0, transient_cap=60.0)
    assert transient_delay(5, slow) == 120.0


@pytest.mark.parametrize("outcome", sorted(o for o in Outcome if plan(
    o, delays=DELAYS, delivered=1).final))  # fmt: skip
def test_a_final_answer_whose_event_was_not_stored_hands_the_job_back(outcome: Outcome) -> None:
    assert plan(outcome, delays=DELAYS, delivered=3).final
    assert unsent(delays=DELAYS, delivered=3) == Plan(Verb.NAK, delay=40.0, transient=True)
