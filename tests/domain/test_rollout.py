"""Safe rollout's rules: placement, waves, windows, the policy's defaults, deferral, the judge."""

from __future__ import annotations

import hashlib
import math
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.domain.health import PingStatus
from app.domain.rollout import (
    Apply,
    Deferral,
    Failed,
    Halted,
    Healthy,
    Judge,
    Judging,
    Lease,
    Observed,
    PingSeen,
    RolloutSpec,
    Trail,
    UpdateSpec,
    UpdateTerms,
    UpdateWindow,
    Verdict,
    WaitingWave,
    defer_lease,
    deferral,
    judge,
    judge_mode,
    place,
    resolve_terms,
    seed_for,
    wave,
    window_open,
)

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


# --- placement


@pytest.mark.parametrize(
    ("seed", "node_id", "first_bytes", "expected"),
    [
        ("api/1.4.3", "node-3f2a9c0d11e4b7a8", "2a4ecc8f21ed7e27", 16.52648782200482),
        ("api/1.4.3", "node-0000000000000000", "50842640cc39e5fb", 31.45164402196552),
        ("api/1.4.4", "node-3f2a9c0d11e4b7a8", "65c436906805b710", 39.75252249292882),
        ("ünï/1", "node-a", "8345587f52f2053d", 51.27768812989828),
    ],
    ids=["release", "other-node", "next-release", "utf-8"],
)
def test_place_is_the_documented_function_of_sha256(
    seed: str, node_id: str, first_bytes: str, expected: float
) -> None:
    # the vectors were computed with `printf 'seed\nnode' | sha256sum`; the formula is the
    # one the backend uses, in plain IEEE doubles
    digest = hashlib.sha256(f"{seed}\n{node_id}".encode()).digest()
    assert digest[:8].hex() == first_bytes
    n = int(first_bytes, 16) >> 11
    assert float(n) * 100.0 / 2.0**53 == expected
    assert place(seed, node_id) == expected


IDS = [f"node-{i:016x}" for i in range(10_000)]


def test_place_is_in_range_and_uniform_enough_over_ten_thousand_nodes() -> None:
    places = [place("api/1.4.3", node) for node in IDS]
    assert all(0 <= p < 100 for p in places)
    sigma = math.sqrt(10_000 * 0.2 * 0.8)  # 40
    assert abs(sum(p < 20 for p in places) - 2_000) <= 3 * sigma
    for decile in range(10):  # every tenth of the range holds its share
        count = sum(decile * 10 <= p < decile * 10 + 10 for p in places)
        assert abs(count - 1_000) <= 3 * math.sqrt(10_000 * 0.1 * 0.9)


def test_applying_nodes_only_grow_with_the_percent() -> None:
    places = [place("api/1.4.3", node) for node in IDS]
    before: set[int] = set()
    for percent in (0, 0.5, 1, 5, 20, 20.5, 50, 99, 99.99, 100):
        now = {
            i
            for i, p in enumerate(places)
            if isinstance(wave(p, RolloutSpec(percent=percent)), Apply)
        }
        assert before <= now, percent
        before = now
    assert len(before) == 10_000


def test_early_nodes_differ_per_release() -> None:
    early = [
        {n for n in IDS if place(seed_for("api", version, None), n) < 20}
        for version in ("1.4.3", "1.4.4")
    ]
    assert 0 < len(early[0] & early[1]) < 0.3 * len(early[0])  # independent: some 20 %


@pytest.mark.parametrize(
    ("rollout", "expected"),
    [
        (None, "api/1.4.3"),
        (RolloutSpec(percent=20), "api/1.4.3"),
        (RolloutSpec(percent=20, seed="wave-7"), "wave-7"),
    ],
    ids=["no-rollout", "default", "given"],
)
def test_seed(rollout: RolloutSpec | None, expected: str) -> None:
    assert seed_for("api", "1.4.3", rollout) == expected


@pytest.mark.parametrize(
    ("where", "rollout", "expected"),
    [
        (99.99, None, Apply("no rollout")),
        (37.24, RolloutSpec(percent=20), WaitingWave("place 37.2 ≥ 20 %")),
        (20.0, RolloutSpec(percent=20), WaitingWave("place 20 ≥ 20 %")),
        (19.99, RolloutSpec(percent=20), Apply("place 19.9 < 20 %")),
        (0.0, RolloutSpec(percent=0), WaitingWave("place 0 ≥ 0 %")),
        (99.99, RolloutSpec(percent=100), Apply("place 99.9 < 100 %")),
        (2.5, RolloutSpec(percent=12.5), Apply("place 2.5 < 12.5 %")),
        (1.0, RolloutSpec(percent=100, halt=True), Halted("the rollout is halted")),
        (50.0, RolloutSpec(percent=20, halt=True), Halted("the rollout is halted")),
    ],
    ids=["none", "above", "equal", "below", "zero", "hundred", "fraction", "halt", "halt-above"],
)
def test_wave(
    where: float, rollout: RolloutSpec | None, expected: Apply | WaitingWave | Halted
) -> None:
    assert wave(where, rollout) == expected


# --- the window

WEEKEND_NIGHTS = UpdateWindow(days=("sat", "sun"), start="02:00", end="05:00", tz="Europe/Kyiv")
FRIDAY_NIGHT = UpdateWindow(days=("fri",), start="22:00", end="03:00", tz="Europe/Kyiv")


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


@pytest.mark.parametrize(
    ("window", "now", "open_"),
    [
        (None, utc("2026-11-25T12:00"), True),
        # Kyiv is UTC+2 in winter: 02:00-05:00 there is 00:00-03:00 UTC
        (WEEKEND_NIGHTS, utc("2026-11-28T00:00"), True),  # Sat 02:00: start inclusive
        (WEEKEND_NIGHTS, utc("2026-11-28T02:59"), True),
        (WEEKEND_NIGHTS, utc("2026-11-28T03:00"), False),  # end exclusive
        (WEEKEND_NIGHTS, utc("2026-11-27T23:59"), False),  # Sat 01:59
        (WEEKEND_NIGHTS, utc("2026-11-29T01:00"), True),  # Sunday
        (WEEKEND_NIGHTS, utc("2026-11-30T01:00"), False),  # Monday
        # UTC+3 in summer: the same UTC instant is 03:00 there (inside), then outside
        (WEEKEND_NIGHTS, utc("2026-06-27T02:30"), False),  # Sat 05:30
        (WEEKEND_NIGHTS, utc("2026-06-27T01:30"), True),  # Sat 04:30
        # the nights the clocks change (29 March, 25 October 2026): wall time counts
        (WEEKEND_NIGHTS, utc("2026-03-29T00:30"), True),  # 02:30 EET
        (WEEKEND_NIGHTS, utc("2026-03-29T01:30"), True),  # 04:30 EEST (03:00-04:00 skipped)
        (WEEKEND_NIGHTS, utc("2026-03-29T02:00"), False),  # 05:00 EEST
        (WEEKEND_NIGHTS, utc("2026-10-25T00:30"), True),  # 03:30 EEST
        (WEEKEND_NIGHTS, utc("2026-10-25T01:30"), True),  # 03:30 EET, the second time
        (WEEKEND_NIGHTS, utc("2026-10-25T03:00"), False),  # 05:00 EET
        # crossing midnight: the window's day is the day it starts
        (FRIDAY_NIGHT, utc("2026-11-27T20:00"), True),  # Fri 22:00
        (FRIDAY_NIGHT, utc("2026-11-27T23:30"), True),  # Sat 01:30, opened Friday
        (FRIDAY_NIGHT, utc("2026-11-28T01:00"), False),  # Sat 03:00
        (FRIDAY_NIGHT, utc("2026-11-28T20:00"), False),  # Sat 22:00
        (FRIDAY_NIGHT, utc("2026-11-26T23:30"), False),  # Fri 01:30, opened Thursday
        (FRIDAY_NIGHT, utc("2026-11-27T12:00"), False),  # Fri noon
    ],
)
def test_window_open(window: UpdateWindow | None, now: datetime, open_: bool) -> None:
    assert window_open(window, now) is open_


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("02:00-05:00", UpdateWindow(start="02:00", end="05:00")),
        (" 23:00-01:30 ", UpdateWindow(start="23:00", end="01:30", tz="UTC")),
        (
            '{"days": ["sat"], "start": "02:00", "end": "05:00", "tz": "Europe/Kyiv"}',
            UpdateWindow(days=("sat",), start="02:00", end="05:00", tz="Europe/Kyiv"),
        ),
    ],
    ids=["daily", "spaces", "json"],
)
def test_a_window_setting_takes_either_form(text: str, expected: UpdateWindow) -> None:
    assert UpdateWindow.from_setting(text) == expected


@pytest.mark.parametrize("text", ["2:00-5:00", "02:00", "24:00-01:00", "05:00-05:00", "{"])
def test_a_window_setting_that_is_not_one_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        UpdateWindow.from_setting(text)


def test_a_window_says_what_it_is() -> None:
    assert str(WEEKEND_NIGHTS) == "sat,sun 02:00-05:00 Europe/Kyiv"
    assert str(UpdateWindow(start="02:00", end="05:00")) == "every day 02:00-05:00 UTC"


# --- the policy's defaults

DEFAULTS = UpdateTerms(
    judge=Judge.AUTO,
    min_healthy_seconds=60,
    deadline_seconds=600,
    unhealthy_seconds=45,
    revert=True,
    window=WEEKEND_NIGHTS,
    max_defer_seconds=3600,
    defer_step_seconds=300,
)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (None, DEFAULTS),
        (UpdateSpec(), DEFAULTS),
        (
            UpdateSpec(judge=Judge.ROLLOUT, min_healthy_seconds=2, revert=False),
            UpdateTerms(Judge.ROLLOUT, 2, 600, 45, False, WEEKEND_NIGHTS, 3600, 300),
        ),
        (
            UpdateSpec(deadline_seconds=900, window=FRIDAY_NIGHT, max_defer_seconds=0),
            UpdateTerms(Judge.AUTO, 60, 900, 45, True, FRIDAY_NIGHT, 0, 300),
        ),
    ],
    ids=["absent", "empty", "some", "others"],
)
def test_the_workload_s_update_over_the_node_s_defaults(
    spec: UpdateSpec | None, expected: UpdateTerms
) -> None:
    assert resolve_terms(spec, DEFAULTS) == expected


# --- deferral


@pytest.mark.parametrize(
    ("seconds", "reason", "expected"),
    [
        (None, "x", None),
        (0, "x", None),
        (-5, None, None),
        (math.nan, None, None),
        (120, "draining", Lease(at(120), T0, "draining")),
        (10_000, None, Lease(at(300), T0, None)),  # capped per step
        (1, "r" * 300, Lease(at(1), T0, "r" * 256)),
    ],
    ids=["absent", "zero", "negative", "nan", "asked", "capped", "long-reason"],
)
def test_the_lease_a_ping_leaves(
    seconds: float | None, reason: str | None, expected: Lease
) -> None:
    assert defer_lease(at=T0, seconds=seconds, reason=reason, step_max=300) == expected


LEASE = Lease(until=at(300), renewed_at=at(0), reason="draining")
WAIT = "the workload asks to wait"
STALE = "the deferring workload went stale: its lease is void"


@pytest.mark.parametrize(
    ("lease", "now", "since", "expected"),
    [
        (None, at(10), None, Deferral(False)),
        (LEASE, at(300), None, Deferral(False)),  # expired
        (LEASE, at(31), None, Deferral(False, STALE)),
        (LEASE, at(20), None, Deferral(True, f"{WAIT}: draining (280 s; 3600 s of the cap)")),
        (Lease(at(300), at(0)), at(20), at(-100),
         Deferral(True, f"{WAIT} (280 s; 3480 s of the cap)")),
        (LEASE, at(20), at(-3580), Deferral(False, "deferral cap reached (3600 s)")),
    ],
    ids=["none", "expired", "stale", "holds", "holds-since", "cap"],
)  # fmt: skip
def test_deferral(
    lease: Lease | None, now: datetime, since: datetime | None, expected: Deferral
) -> None:
    assert (
        deferral(lease, now=now, stale_after=30, deferred_since=since, max_defer=3600) == expected
    )


# --- the judge

TERMS = UpdateTerms(min_healthy_seconds=60, deadline_seconds=600, unhealthy_seconds=45)
V, OLD = "1.5.0", "1.4.2"
P, R, OFF = Judge.PINGS, Judge.ROLLOUT, Judge.OFF


def pings(
    start: float, end: float, status: str = "healthy", version: str | None = V, every: float = 10
) -> list[PingSeen]:
    count = int((end - start) // every) + 1
    return [PingSeen(at(start + i * every), PingStatus(status), version) for i in range(count)]


def seen(complete: float | None = 30, **kwargs: object) -> Observed:
    return Observed(complete_since=None if complete is None else at(complete), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mode", "observed", "now", "verdict"),
    [
        (OFF, seen(None, crash_loop="x"), 0, Healthy("judge off: healthy once applied")),
        (P, seen(deadline_exceeded=True), 50, Failed("the rollout exceeded its progress deadline")),
        (R, seen(crash_loop="pod a: CrashLoopBackOff"), 50,
         Failed("crash loop: pod a: CrashLoopBackOff")),
        # the rollout judge: complete, and stays so for min_healthy_seconds
        (R, seen(None), 30, Judging("rolling out")),
        (R, seen(None), 600, Failed("the rollout did not complete within 600 s")),
        (R, seen(30), 60, Judging("the rollout complete for 30 s of 60")),
        (R, seen(30), 90, Healthy("the rollout complete for 60 s")),
        (R, seen(-100), 59, Judging("the rollout complete for 59 s of 60")),  # since the apply
        (R, seen(630), 660,
         Failed("not healthy within 660 s: the rollout complete for 30 s of 60")),
        (Judge.AUTO, seen(30), 90, Healthy("the rollout complete for 60 s")),
        (R, seen(30, pings=pings(0, 90, "unhealthy")), 90,
         Healthy("the rollout complete for 60 s")),
        # the pings judge: two pings at least, min_healthy_seconds apart, all from V
        (P, seen(), 60, Judging(f"waiting for a ping from {V}")),
        (P, seen(pings=pings(10, 10)), 70, Judging(f"healthy pings from {V} for 0 s of 60")),
        (P, seen(pings=pings(10, 60)), 70, Judging(f"healthy pings from {V} for 50 s of 60")),
        (P, seen(pings=pings(10, 70)), 70, Healthy(f"healthy pings from {V} for 60 s")),
        (P, seen(pings=pings(10, 70, "degraded")), 70, Healthy(f"healthy pings from {V} for 60 s")),
        (P, seen(None, pings=pings(10, 90)), 90, Judging("rolling out")),
        (P, seen(pings=pings(-100, -10)), 70, Judging(f"waiting for a ping from {V}")),  # before
        (P, seen(pings=pings(10, 90, version=OLD)), 90, Judging(f"waiting for a ping from {V}")),
        (P, seen(pings=pings(10, 90, version=None)), 90, Judging(f"waiting for a ping from {V}")),
        (P, seen(pings=pings(0, 600, version=OLD)), 600,
         Failed("the new version never pinged within 600 s (pings report 1.4.2)")),
        (P, seen(), 600, Failed("the new version never pinged within 600 s")),
        # the run counts from its first ping: an unhealthy one starts it again
        (P, seen(pings=[*pings(0, 50), *pings(60, 60, "unhealthy"), *pings(70, 120)]), 120,
         Judging(f"healthy pings from {V} for 50 s of 60")),
        (P, seen(pings=[*pings(0, 50), *pings(60, 100, "unhealthy")]), 100,
         Judging(f"{V} pings unhealthy")),
        (P, seen(pings=[*pings(0, 50), *pings(60, 100, "unhealthy")]), 105,
         Failed(f"unhealthy pings from {V} for 45 s")),
        (P, seen(None, pings=pings(0, 50, "unhealthy")), 50,
         Failed(f"unhealthy pings from {V} for 50 s")),
        # interleaved old pods say nothing about V
        (P, seen(pings=[*pings(10, 70), *pings(15, 75, "unhealthy", OLD)]), 75,
         Healthy(f"healthy pings from {V} for 60 s")),
        # silence after a few healthy pings: no verdict until it is late
        (P, seen(pings=pings(590, 620)), 659, Judging(f"healthy pings from {V} for 30 s of 60")),
        (P, seen(pings=pings(590, 620)), 660,
         Failed(f"not healthy within 660 s: healthy pings from {V} for 30 s of 60")),
    ],
)  # fmt: skip
def test_judge(mode: Judge, observed: Observed, now: float, verdict: Verdict) -> None:
    assert judge(mode, V, applied_at=T0, seen=observed, terms=TERMS, now=at(now)) == verdict


def test_pings_may_come_in_any_order() -> None:
    shuffled = Observed(complete_since=at(0), pings=list(reversed(pings(10, 70))))
    verdict = judge(Judge.PINGS, V, applied_at=T0, seen=shuffled, terms=TERMS, now=at(70))
    assert verdict == Healthy("healthy pings from 1.5.0 for 60 s")


@pytest.mark.parametrize(
    ("mode", "last", "expected"),
    [
        (Judge.AUTO, None, Judge.ROLLOUT),
        (Judge.AUTO, PingSeen(T0, PingStatus.HEALTHY, None), Judge.ROLLOUT),
        (Judge.AUTO, PingSeen(T0, PingStatus.UNHEALTHY, "1.4.2"), Judge.PINGS),
        (Judge.PINGS, None, Judge.PINGS),
        (Judge.ROLLOUT, PingSeen(T0, PingStatus.HEALTHY, "1.4.2"), Judge.ROLLOUT),
        (Judge.OFF, None, Judge.OFF),
    ],
    ids=["auto-silent", "auto-no-version", "auto-versioned", "pings", "rollout", "off"],
)
def test_auto_is_pings_for_a_workload_that_pings_its_version(
    mode: Judge, last: PingSeen | None, expected: Judge
) -> None:
    assert judge_mode(mode, last) is expected


# --- the trail of pings a judgement reads


def test_a_trail_keeps_each_run_as_its_first_and_last_ping() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    trail = Trail()
    pings = [
        PingSeen(t0 + timedelta(seconds=i), status, version)
        for i, (status, version) in enumerate(
            [(PingStatus.HEALTHY, "1"), (PingStatus.DEGRADED, "1"), (PingStatus.HEALTHY, "1"),
             (PingStatus.UNHEALTHY, "1"), (PingStatus.HEALTHY, "2")]
        )
    ]  # fmt: skip
    for ping in pings:
        trail.add(ping)
    assert trail.pings() == [pings[0], pings[2], pings[3], pings[4]]


def test_a_trail_is_bounded() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    trail = Trail()
    for i in range(10 * Trail.MAX_RUNS):
        trail.add(PingSeen(t0 + timedelta(seconds=i), PingStatus.HEALTHY, str(i % 2)))
    assert len(trail.pings()) == Trail.MAX_RUNS


_statuses = st.sampled_from(list(PingStatus))
_versions = st.sampled_from([None, "1.0.0", "1.1.0"])


@given(st.lists(st.tuples(st.integers(1, 20), _statuses, _versions), max_size=40),
       st.integers(0, 400), st.sampled_from([Judge.PINGS, Judge.ROLLOUT]))  # fmt: skip
def test_judging_the_trail_is_judging_every_ping(
    steps: list[tuple[int, PingStatus, str | None]], extra: int, mode: Judge
) -> None:
    """The trail's few pings give the verdict all the pings give (while within its bound)."""
    applied = datetime(2026, 1, 1, tzinfo=UTC)
    at, pings, trail = applied, [], Trail()
    for gap, status, version in steps:
        at += timedelta(seconds=gap)
        ping = PingSeen(at, status, version)
        pings.append(ping)
        trail.add(ping)
    terms = UpdateTerms(min_healthy_seconds=30, deadline_seconds=120, unhealthy_seconds=20)
    now = at + timedelta(seconds=extra)
    complete = applied + timedelta(seconds=5)

    def verdict(seen: list[PingSeen]) -> object:
        observed = Observed(complete_since=complete, pings=seen)
        return judge(mode, "1.1.0", applied_at=applied, seen=observed, terms=terms, now=now)

    assert verdict(trail.pings()) == verdict(pings)
