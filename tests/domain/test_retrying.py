"""When to try a call again after the other side said when, table-driven."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from app.domain.retrying import (
    MAX_RETRY_AFTER_CHARS,
    GiveUp,
    Wait,
    parse_retry_after,
    parse_retry_after_ms,
    wait_as_asked,
)

NOW = datetime(2026, 12, 2, 5, 30, 0, tzinfo=UTC)
LONGEST = "the longest wait"
LEFT = "left of the deadline"


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        ("", None),
        ("   ", None),
        ("0", 0.0),
        ("7", 7.0),
        (" 7 ", 7.0),
        ("120", 120.0),
        ("99999999999999999999", 99999999999999999999.0),  # given up on by the caller
        # RFC 9110 5.6.7: IMF-fixdate, and the obsolete RFC 850 and asctime forms
        ("Wed, 02 Dec 2026 05:30:09 GMT", 9.0),
        ("Wednesday, 02-Dec-26 05:30:09 GMT", 9.0),
        ("Wed Dec  2 05:30:09 2026", 9.0),
        # a date already past: retry at once
        ("Wed, 02 Dec 2026 05:00:00 GMT", 0.0),
        # malformed: the caller's own backoff applies
        ("-5", None),
        ("1.5", None),
        ("5s", None),
        ("soon", None),
        ("Wed, 32 Dec 2026 05:30:09 GMT", None),
        ("٣", None),  # a digit, but not an ASCII one (RFC 9110 delay-seconds = 1*DIGIT)
        ("1" * (MAX_RETRY_AFTER_CHARS + 1), None),
    ],
)
def test_parse_retry_after(value: str | None, seconds: float | None) -> None:
    assert parse_retry_after(value, NOW) == seconds


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        (0, 0.0),
        (1500, 1.5),
        (-1, None),
        (1.5, None),  # the spec's field is an integer
        (True, None),
        ("1500", None),
        (10**20, 10**17),
    ],
)
def test_parse_retry_after_ms(value: object, seconds: float | None) -> None:
    assert parse_retry_after_ms(value) == seconds


@pytest.mark.parametrize(
    ("asked", "left", "longest", "jitter", "spread", "expected"),
    [
        # waits what was asked, never less, plus part of the jitter
        (2.0, 10.0, 5.0, 1.0, 0.0, Wait(2.0)),
        (2.0, 10.0, 5.0, 1.0, 0.5, Wait(2.5)),
        (0.0, 10.0, 5.0, 1.0, 0.25, Wait(0.25)),
        # the jitter never pushes the wait past the longest wait or the deadline
        (4.5, 10.0, 5.0, 1.0, 0.999, Wait(4.5 + 0.5 * 0.999)),
        (2.0, 2.4, 5.0, 1.0, 0.5, Wait(2.2)),
        (5.0, 10.0, 5.0, 1.0, 0.9, Wait(5.0)),
        # too far away: given up on now, not waited out
        (5.5, 10.0, 5.0, 1.0, 0.0, GiveUp(f"Retry-After 5.5 s is longer than {LONGEST} (5 s)")),
        (120.0, 1.96, 300.0, 1.0, 0.0, GiveUp(f"Retry-After 120 s is past the 2 s {LEFT}")),
        # asked for exactly what is left: no time would remain for the attempt itself
        (3.0, 3.0, 5.0, 1.0, 0.0, GiveUp(f"Retry-After 3 s is past the 3 s {LEFT}")),
        (1.0, 0.0, 5.0, 1.0, 0.0, GiveUp(f"Retry-After 1 s is past the 0 s {LEFT}")),
    ],
)
def test_wait_as_asked(
    asked: float, left: float, longest: float, jitter: float, spread: float, expected: Wait | GiveUp
) -> None:
    decision = wait_as_asked(asked, left=left, longest=longest, jitter=jitter, spread=spread)
    if isinstance(expected, Wait):
        assert isinstance(decision, Wait)
        assert decision.seconds == pytest.approx(expected.seconds)
    else:
        assert decision == expected
