"""Group commit: calls that arrive while a statement is on its way are sent together.

Each caller awaits its own answer, as with a statement of its own; the store sees one
statement per batch instead of one per call. A batch starts at once when nothing is in
flight (no added latency when idle) and otherwise holds everything that arrived while
the previous one ran, up to `limit`. A failed batch fails each of its calls with the
same error; an item the batch function cannot take with the others (the same key twice)
is its business: it may answer it in a later batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
In = TypeVar("In")
Out = TypeVar("Out")


class Coalescer(Generic[In, Out]):
    def __init__(
        self, run: Callable[[Sequence[In]], Awaitable[Sequence[Out]]], *, limit: int = 64
    ) -> None:
        self._run = run
        self._limit = limit
        self._waiting: list[tuple[In, asyncio.Future[Out]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.batches = 0  # statements sent, for tests and benchmarks

    async def submit(self, item: In) -> Out:
        future: asyncio.Future[Out] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="group-commit")
        return await future

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # the calls made in this same turn of the loop join in
        while self._waiting:
            batch = self._waiting[: self._limit]
            del self._waiting[: self._limit]
            live = [(item, f) for item, f in batch if not f.cancelled()]
            if not live:
                continue
            self.batches += 1
            try:
                answers = await self._run([item for item, _ in live])
            except asyncio.CancelledError:
                for _, future in [*live, *self._waiting]:
                    if not future.done():
                        future.cancel()
                self._waiting.clear()
                raise
            except Exception as exc:  # each caller sees the error its own call would have
                for _, future in live:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), answer in zip(live, answers, strict=True):
                if not future.done():
                    future.set_result(answer)


def distinct_runs(
    calls: Sequence[T], *, name: Callable[[T], str], same: Callable[[T], object] = lambda _: None
) -> list[list[T]]:
    """`calls` in order, cut where a name repeats or `same` changes: a key twice in one
    statement is an error in PostgreSQL (ON CONFLICT cannot affect a row twice), and a
    statement takes one lease."""
    runs: list[list[T]] = []
    names: set[str] = set()
    for call in calls:
        if not runs or name(call) in names or same(call) != same(runs[-1][0]):
            runs.append([])
            names = set()
        runs[-1].append(call)
        names.add(name(call))
    return runs
