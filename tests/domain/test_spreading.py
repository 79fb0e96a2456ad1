"""The spreading rules, table by table, with the draws chosen: full-jitter reconnect waits,
the lame duck wait, the start-up spread, and the settings that give them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from app.domain.spreading import ReconnectPolicy, StartupSpread, full_jitter
from app.settings import Settings


def draws(*values: float) -> Iterator[float]:
    return iter(values)


@pytest.mark.parametrize(
    ("attempt", "base", "cap", "draw", "wait"),
    [
        (0, 1.0, 30.0, 0.5, 0.5),  # the first window is the base
        (0, 1.0, 30.0, 0.0, 0.0),  # full jitter: as early as at once
        (1, 1.0, 30.0, 0.5, 1.0),
        (3, 1.0, 30.0, 0.99, 7.92),
        (4, 1.0, 30.0, 1.0, 16.0),
        (5, 1.0, 30.0, 1.0, 30.0),  # 32 capped
        (5, 1.0, 30.0, 0.1, 3.0),  # a capped window is still drawn from whole
        (1_000, 1.0, 30.0, 0.5, 15.0),  # no overflow, however long it stays away
        (-1, 1.0, 30.0, 0.5, 0.5),  # nonsense counts as the first
        (2, 0.25, 0.5, 0.5, 0.25),
    ],
)
def test_full_jitter(attempt: int, base: float, cap: float, draw: float, wait: float) -> None:
    assert full_jitter(attempt, base=base, cap=cap, draw=lambda: draw) == pytest.approx(wait)


def test_a_policy_draws_once_per_wait() -> None:
    values = draws(0.5, 0.5, 0.25, 0.5)
    policy = ReconnectPolicy(base=2.0, cap=10.0, lame_duck_spread=8.0, draw=lambda: next(values))
    assert [policy.wait(0), policy.wait(1), policy.wait(3)] == [1.0, 2.0, 2.5]
    assert policy.lame_duck_wait() == 4.0


@pytest.mark.parametrize(
    ("seconds", "first_after", "draw", "after"),
    [
        (0.0, 5.0, 0.9, 5.0),  # no spread: the loop's own first delay
        (30.0, 5.0, 0.0, 5.0),
        (30.0, 5.0, 0.5, 20.0),
        (30.0, 0.1, 0.999, 30.07),
        (30.0, 60.0, 0.5, 75.0),
    ],
)
def test_startup_spread(seconds: float, first_after: float, draw: float, after: float) -> None:
    spread = StartupSpread(seconds, draw=lambda: draw)
    assert spread.after(first_after) == pytest.approx(after)
    assert spread.offset() == pytest.approx(after - first_after)


@pytest.mark.parametrize(
    ("env", "spread"),
    [
        ({}, 0.0),
        ({"app_env": "production"}, 30.0),
        ({"app_env": "production", "startup_spread_seconds": 0}, 0.0),
        ({"startup_spread_seconds": 12}, 12.0),
    ],
)
def test_the_start_up_spread_is_on_in_production(env: dict[str, object], spread: float) -> None:
    assert Settings(_env_file=None, **env).startup_spread == spread  # type: ignore[arg-type]


def test_a_reconnect_cap_below_its_base_is_refused() -> None:
    with pytest.raises(ValidationError, match="NATS_RECONNECT_MAX_SECONDS"):
        Settings(_env_file=None, nats_reconnect_base_seconds=5, nats_reconnect_max_seconds=2)


def test_the_pull_wait_is_bounded() -> None:
    assert Settings(_env_file=None).worker_pull_wait_seconds == 30.0
    for wrong in (0.5, 301):
        with pytest.raises(ValidationError):
            Settings(_env_file=None, worker_pull_wait_seconds=wrong)
