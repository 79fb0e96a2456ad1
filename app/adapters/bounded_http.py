"""What the HTTP clients of untrusted servers (the backend, the Matrix homeserver) share:
an answer read to a bound, each attempt's timeout cut to what is left of the call's
deadline, and the wait before the next attempt when the server said how long
(`Retry-After`, honoured as a floor by app.domain.retrying, with jitter chosen here)."""

from __future__ import annotations

import random
from collections.abc import Callable

import httpx

from app.domain.retrying import GiveUp, wait_as_asked

# no attempt is given less than this (httpx needs a positive timeout)
_SHORTEST_ATTEMPT = 0.001


class TooLarge(Exception):
    """An answer past the bound: `declared` is its Content-Length when that said so
    (the body was left unread), else None (reading stopped at the bound)."""

    def __init__(self, bound: int, declared: int | None) -> None:
        super().__init__(f"answer larger than {bound} bytes")
        self.bound = bound
        self.declared = declared


async def read_bounded(
    response: httpx.Response, bound: int, *, received: Callable[[int], None] | None = None
) -> bytes:
    """The whole body, or TooLarge: a declared Content-Length past `bound` is refused
    before a byte is read, and reading stops once the bytes (decoded: a compressed
    answer is bounded by what it expands to) pass it. `received` is told the bytes
    read so far after each chunk."""
    declared = response.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > bound:
        raise TooLarge(bound, int(declared))
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if received is not None:
            received(size)
        if size > bound:
            raise TooLarge(bound, None)
        chunks.append(chunk)
    return b"".join(chunks)


def attempt_timeout(timeout: float, left: float) -> httpx.Timeout:
    """One attempt's timeout: the client's own, or what is left of the deadline if less."""
    return httpx.Timeout(max(_SHORTEST_ATTEMPT, min(timeout, left)))


def decide_wait(asked: float, *, left: float, longest: float) -> float | GiveUp:
    """Wait at least `asked` seconds (plus up to a second of jitter, less when `longest`
    or the `left` seconds of the deadline are near), or give up with the reason."""
    decision = wait_as_asked(
        asked,
        left=left,
        longest=longest,
        jitter=min(1.0, longest),
        spread=random.random(),  # jitter, not a secret
    )
    return decision if isinstance(decision, GiveUp) else decision.seconds
