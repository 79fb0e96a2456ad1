"""Group commit: calls made together become one batch, each caller gets its own answer."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from app.adapters.coalesce import Coalescer, distinct_runs


class Store:
    def __init__(self, fail: bool = False) -> None:
        self.batches: list[list[int]] = []
        self.fail = fail
        self.gate = asyncio.Event()
        self.gate.set()

    async def run(self, items: Sequence[int]) -> list[int]:
        self.batches.append(list(items))
        await self.gate.wait()
        if self.fail:
            raise ConnectionError("store down")
        return [item * 10 for item in items]


async def test_calls_made_in_one_turn_are_one_batch_with_answers_in_order() -> None:
    store = Store()
    group = Coalescer(store.run)
    answers = await asyncio.gather(*(group.submit(i) for i in range(5)))
    assert answers == [0, 10, 20, 30, 40]
    assert store.batches == [[0, 1, 2, 3, 4]]


async def test_calls_arriving_during_a_batch_form_the_next_one_up_to_the_limit() -> None:
    store = Store()
    store.gate.clear()
    group = Coalescer(store.run, limit=2)
    first = asyncio.ensure_future(group.submit(1))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    later = [asyncio.ensure_future(group.submit(i)) for i in (2, 3, 4)]
    await asyncio.sleep(0)
    store.gate.set()
    assert await first == 10
    assert [await f for f in later] == [20, 30, 40]
    assert store.batches == [[1], [2, 3], [4]]


async def test_a_failed_batch_fails_each_call_with_its_error() -> None:
    group = Coalescer(Store(fail=True).run)
    results = await asyncio.gather(*(group.submit(i) for i in range(3)), return_exceptions=True)
    assert [type(r) for r in results] == [ConnectionError] * 3


async def test_a_cancelled_caller_leaves_the_others_answered() -> None:
    store = Store()
    group = Coalescer(store.run)
    gone = asyncio.ensure_future(group.submit(1))
    kept = asyncio.ensure_future(group.submit(2))
    gone.cancel()
    assert await kept == 20
    assert store.batches == [[2]]


@pytest.mark.parametrize(
    ("calls", "runs"),
    [
        ([], []),
        ([("a", 1)], [[("a", 1)]]),
        ([("a", 1), ("b", 1), ("c", 1)], [[("a", 1), ("b", 1), ("c", 1)]]),
        # a key again starts a new statement
        ([("a", 1), ("b", 1), ("a", 1)], [[("a", 1), ("b", 1)], [("a", 1)]]),
        # so does another lease
        ([("a", 1), ("b", 2), ("c", 2)], [[("a", 1)], [("b", 2), ("c", 2)]]),
    ],
)
def testdistinct_runs(calls: list[tuple[str, int]], runs: list[list[tuple[str, int]]]) -> None:
    assert distinct_runs(calls, name=lambda c: c[0], same=lambda c: c[1]) == runs
