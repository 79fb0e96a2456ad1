"""What the HTTP clients of untrusted servers (the backend, the Matrix homeserver) share:
an answer read to a bound, each attempt's timeout cut to what is left of the call's
deadline, and the wait before the next attempt when the server said how long
(`Retry-After`, honoured as a floor by app.domain.retrying, with jitter chosen here)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx

from app.domain.retrying import GiveUp, held_for, wait_as_asked

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


@dataclass(frozen=True)
class Held:
    """A call not made: the server's Retry-After holds it `left` more seconds (`until`)."""

    left: float
    until: datetime
    unreachable: bool  # what the answer that set it was (a 503) or was not (a 429)

    def text(self) -> str:
        shown = self.until.isoformat(timespec="seconds").replace("+00:00", "Z")
        return f"not sent: Retry-After until {shown}"


class Holds:
    """Each kind of call's time before which it is not made again, set by a Retry-After
    the call could not wait out: capped at `longest` seconds and jittered (`held_for`),
    so every caller of that kind (a loop, an operator's sync, the final report) waits
    the same, and the loop's next run, told the same wait, finds it lifted."""

    def __init__(self, *, longest: float, clock: Callable[[], float]) -> None:
        self._longest = longest
        self._clock = clock
        self._until: dict[str, tuple[float, float, bool]] = {}  # until, the wait given, 5xx

    def hold(self, kind: str, asked: float, *, unreachable: bool) -> float:
        """Hold `kind` after a Retry-After of `asked` seconds; the seconds it is held. A
        hold that ends later already (another answer of the kind, in flight at once) is
        kept: a shorter Retry-After never lifts a longer one."""
        wait = held_for(asked, longest=self._longest, spread=random.random())
        now = self._clock()
        current = self.held(kind)
        if current is not None and current.left > wait:
            return current.left
        self._until[kind] = (now + wait, wait, unreachable)
        return wait

    def held(self, kind: str) -> Held | None:
        """Whether `kind` is held now, and how long still. A wall clock stepped back (NTP)
        never makes a hold longer than the wait it was given: it is taken from now."""
        found = self._until.get(kind)
        if found is None:
            return None
        until, wait, unreachable = found
        now = self._clock()
        left = until - now
        if left > wait:  # the clock went back
            left = wait
            self._until[kind] = (now + wait, wait, unreachable)
        if left <= 0:
            del self._until[kind]
            return None
        return Held(left, datetime.fromtimestamp(now + left, UTC), unreachable)
