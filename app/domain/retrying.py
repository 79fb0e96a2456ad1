"""When to try a call again after the other side said when.

HTTP servers say it with `Retry-After` (RFC 9110 10.2.3: delay-seconds or an HTTP-date),
on a 429 or a 503; a Matrix homeserver with `retry_after_ms` in its 429 error body. Such a
wait is honoured as a floor, never shortened: either the call waits at least that long
(plus some jitter, so that many nodes told the same do not come back at the same moment),
or it gives up now with the reason, when the wait is longer than the longest wait allowed
or would not leave time for the attempt before the call's deadline.

A wait too long for the call puts off the loop that made it instead (`held_for`): at
most `RETRY_AFTER_MAX_SECONDS` (the setting; `RETRY_AFTER_CEILING` is its highest value),
plus a small positive jitter, so that a fleet told the same date does not come back in
the same second.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

# longer than any HTTP-date form (29 characters for IMF-fixdate) or sane delay-seconds
MAX_RETRY_AFTER_CHARS = 64
# the highest RETRY_AFTER_MAX_SECONDS may be: a Retry-After never puts a loop off longer
RETRY_AFTER_CEILING = 3600.0
# the jitter added to a loop's wait: up to this fraction of it, and at least up to
# RETRY_AFTER_JITTER_LEAST seconds (15,000 nodes told `Retry-After: 30` come back over 3 s)
RETRY_AFTER_JITTER_FRACTION = 0.1
RETRY_AFTER_JITTER_LEAST = 1.0


@dataclass(frozen=True)
class Wait:
    """Wait this many seconds, then try again."""

    seconds: float


@dataclass(frozen=True)
class GiveUp:
    """Do not try again in this call: why."""

    reason: str


def parse_retry_after(value: str | None, now: datetime) -> float | None:
    """Seconds to wait from a `Retry-After` value; None when absent or malformed (the
    caller's own backoff applies then). A date already past means 0."""
    if value is None:
        return None
    text = value.strip()
    if not text or len(text) > MAX_RETRY_AFTER_CHARS or not text.isascii():
        return None
    if text.isdigit():
        return float(int(text))
    if text[0] in "+-" or text[0].isdigit():
        return None  # a signed or fractional number is neither form
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # the asctime form carries no zone: HTTP dates are GMT
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - now).total_seconds())


def parse_retry_after_ms(value: object) -> float | None:
    """Seconds from Matrix's `retry_after_ms` (an integer of milliseconds); None when
    absent or not a non-negative integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value / 1000


def wait_as_asked(
    asked: float, *, left: float, longest: float, jitter: float, spread: float
) -> Wait | GiveUp:
    """Wait `asked` seconds plus up to `jitter` (`spread`, in [0, 1), says how much of it),
    the jitter cut so that the wait passes neither `longest` nor the `left` seconds of
    the deadline; or give up when `asked` itself is too long."""
    if asked >= left:
        return GiveUp(
            f"Retry-After {_seconds(asked)} s is past the {_seconds(left)} s left of the deadline"
        )
    if asked > longest:
        return GiveUp(
            f"Retry-After {_seconds(asked)} s is longer than the longest wait "
            f"({_seconds(longest)} s)"
        )
    room = max(0.0, min(jitter, longest - asked, left - asked))
    return Wait(asked + room * min(max(spread, 0.0), 1.0))


def jitter_room(wait: float) -> float:
    """How much jitter goes on top of a loop's wait of `wait` seconds (at most)."""
    return max(RETRY_AFTER_JITTER_LEAST, wait * RETRY_AFTER_JITTER_FRACTION)


def held_for(asked: float, *, longest: float, spread: float) -> float:
    """How long a loop waits after a Retry-After of `asked` seconds: never less than asked
    unless that is past `longest` (then `longest`), plus jitter (`spread` in [0, 1] says
    how much of `jitter_room`): always at least the wait, never more than wait + room."""
    wait = min(max(asked, 0.0), longest)
    return wait + jitter_room(wait) * min(max(spread, 0.0), 1.0)


def _seconds(value: float) -> str:
    """1.96 -> "2", 0.43 -> "0.4", 120.0 -> "120": readable in a reason."""
    text = f"{value:.1f}"
    return text.removesuffix(".0")
