"""Shared by the benchmarks: refuse to report numbers the world does not back, say progress."""

from __future__ import annotations

import sys


class CheckFailed(Exception):
    """The world after a phase is not what the numbers would claim: report it, not them."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def say(benchmark: str, message: str) -> None:
    """Progress on stderr, so stdout is only the report."""
    print(f"  [{benchmark}] {message}", file=sys.stderr, flush=True)
