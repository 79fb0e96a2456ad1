"""The interval a backend asks a node's loop to keep, from a header of its answers.

The backend may answer a report (`X-Report-Interval-Seconds`, on a 2xx) and the desired
state (`X-Sync-Interval-Seconds`, on a 200 or a 304) with the interval it wants until its
next answer, a positive number of seconds. The node keeps it within its own bounds (the
settings' `*_INTERVAL_MIN_SECONDS` and `*_INTERVAL_MAX_SECONDS`) and applies it at once;
an answer without the header (or with a value that is not a positive number) puts the
loop back on its configured interval. A call that gets no answer changes nothing.
docs/backend-api.md, "The backend steers".
"""

from __future__ import annotations

import math
import re

REPORT_INTERVAL_HEADER = "X-Report-Interval-Seconds"
SYNC_INTERVAL_HEADER = "X-Sync-Interval-Seconds"

# digits, an optional fraction: "60", "12.5"; nothing signed, no exponent, no unit
_NUMBER = re.compile(r"[0-9]{1,9}(\.[0-9]{1,6})?")


def parse_interval(value: str | None) -> float | None:
    """Seconds from an interval header; None when absent or not a positive number."""
    if value is None:
        return None
    text = value.strip()
    if _NUMBER.fullmatch(text) is None:
        return None
    seconds = float(text)
    return seconds if seconds > 0 and math.isfinite(seconds) else None


def clamp_interval(asked: float, *, low: float, high: float) -> float:
    """`asked` kept within [low, high] (the node's bounds win over the backend's word)."""
    return min(max(asked, low), high)
