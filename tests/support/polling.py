"""Waiting in tests for something another process or task does, with a bound."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def eventually(
    check: Callable[[], Awaitable[bool]], *, within: float = 10.0, step: float = 0.05
) -> None:
    """Return once `check()` is true; fail the test after `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(step)
    raise AssertionError(f"condition not met within {within} s")


def eventually_sync(check: Callable[[], bool], *, within: float = 10.0, step: float = 0.02) -> None:
    """`eventually` for synchronous tests: a server thread records what it did."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(step)
    raise AssertionError(f"condition not met within {within} s")
