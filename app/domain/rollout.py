"""Safe rollout, the rules: a workload's update policy, its wave, its window, its deferral
and the judgement of an applied version. Pure; `rollout_machine` strings them together.

**Policy.** A desired workload may carry `"update": {"judge", "min_healthy_seconds",
"deadline_seconds", "revert", "window", "max_defer_seconds"}` and `"rollout": {"percent",
"halt", "seed"}`. Every `update` field left out takes the node's default (`resolve_terms`
over an `UpdateTerms` of settings); a field out of bounds is a `DesiredStateError` naming it.

**Placement.** A node's place for a rollout is `place(seed, node_id)` in [0, 100): the
SHA-256 of the UTF-8 bytes of `seed + "\\n" + node_id`; of its first 8 bytes read as a
big-endian unsigned integer the top 53 bits `n` (`>> 11`); place = `n * 100 / 2**53`.
`n` is exact in an IEEE double, so `double(n) * 100.0 / 2**53` gives the same value
everywhere (the backend can compute every node's place). The seed defaults to
`name/version`: the early nodes differ per release. A node applies while `place <
percent` and not `halt` (`wave`); a node that applies at a percent applies at every
higher one. A halt stops new applications only; a revert is never waved.

**Window.** `days` (of `mon`..`sun`), `start` and `end` (`HH:MM`, wall time in `tz`, an
IANA zone; UTC by default). A window whose end is not after its start crosses midnight,
and its day is the day it starts. Wall time is compared, so a window is shorter or
longer on the nights clocks change (a skipped hour never comes). It gates the start of
an update only: never a judgement or a revert.

**Deferral.** A ping may ask to wait `defer_update_seconds` (capped by the step,
`defer_step_seconds`) for `defer_reason`: a lease until the ping's time plus that, which
each ping replaces (a ping asking nothing ends it), void once the workload is stale
(no ping for `stale_after` seconds). One target version is deferred at most
`max_defer_seconds` from its first deferral; then the update applies ("deferral cap
reached").

**Judgement** of version V applied at T (`judge`), in order: judge `off` is healthy at
once. Failed on the rollout's progress deadline, on a crash loop, on pings from V
unhealthy for `unhealthy_seconds` (pings judge), when the rollout is not complete, or V
has not pinged (pings judge), `deadline_seconds` after T ("the new version never
pinged"), or when it is not healthy `deadline_seconds + min_healthy_seconds` after T.
Healthy when the rollout is complete and, for the `rollout` judge, was so for
`min_healthy_seconds`; for the `pings` judge, when the latest run of V's pings is
healthy or degraded, two at least, its first and last `min_healthy_seconds` apart.
Pings of other versions (old pods) and without a version say nothing about V. No data
is never healthy. `auto` is settled when the update is applied (`judge_mode`): `pings`
when the workload's latest ping reported a version (it echoes `WORKLOAD_VERSION`; that
ping came from the version being left, so a revert to it is judged by pings too),
`rollout` otherwise.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, time, timedelta
from enum import StrEnum
from typing import Annotated, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.domain.health import PingStatus

Day = Literal["mon", "tue", "wed", "thu", "fri", "sat", "sun"]
DAYS: tuple[Day, ...] = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
HHMM = Annotated[str, Field(pattern=r"^([01][0-9]|2[0-3]):[0-5][0-9]$")]
MAX_DEFER_REASON = 256
_BACKEND = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)


class Judge(StrEnum):
    AUTO = "auto"
    PINGS = "pings"
    ROLLOUT = "rollout"
    OFF = "off"


class UpdateWindow(BaseModel):
    """When an update may start (the module docstring has the rules)."""

    model_config = _BACKEND

    days: Annotated[tuple[Day, ...], Field(min_length=1, max_length=7)] = DAYS
    start: HHMM
    end: HHMM
    tz: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_+/-]+$")] = "UTC"

    @field_validator("days")
    @classmethod
    def _distinct(cls, value: tuple[Day, ...]) -> tuple[Day, ...]:
        if len(set(value)) != len(value):
            raise ValueError("a day is listed twice")
        return value

    @field_validator("tz")
    @classmethod
    def _zone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError("not a time zone (an IANA key, such as Europe/Kyiv)") from None
        return value

    @model_validator(mode="after")
    def _not_empty(self) -> UpdateWindow:
        if self.start == self.end:
            raise ValueError("start and end are the same: an empty window")
        return self

    @property
    def times(self) -> tuple[time, time]:
        return time.fromisoformat(self.start), time.fromisoformat(self.end)

    def __str__(self) -> str:
        days = "every day" if set(self.days) == set(DAYS) else ",".join(self.days)
        return f"{days} {self.start}-{self.end} {self.tz}"

    @classmethod
    def from_setting(cls, text: str) -> UpdateWindow:
        """A window given as `HH:MM-HH:MM` (UTC, every day: SELF_UPDATE_WINDOW's form) or
        as the JSON object above; pydantic's ValidationError (a ValueError) otherwise."""
        text = text.strip()
        if text.startswith("{"):
            return cls.model_validate_json(text)
        start, _, end = text.partition("-")
        return cls(start=start, end=end)


def in_window(now: datetime, window: tuple[time, time] | None) -> bool:
    """Whether the time of day of `now` is in [start, end), which crosses midnight when
    the end is not after the start; None is always."""
    if window is None:
        return True
    start, end = window
    moment = now.time().replace(tzinfo=None)
    if start <= end:
        return start <= moment < end
    return moment >= start or moment < end  # the window spans midnight


def window_open(window: UpdateWindow | None, now: datetime) -> bool:
    """Whether an update may start at `now` (aware); no window is always open."""
    if window is None:
        return True
    local = now.astimezone(ZoneInfo(window.tz))
    start, end = window.times
    if not in_window(local, (start, end)):  # the time of day, midnight crossing included
        return False
    opened = local.date()
    if start > end and local.time() < start:  # past midnight: the window opened yesterday
        opened -= timedelta(days=1)
    return DAYS[opened.weekday()] in window.days


class UpdateSpec(BaseModel):
    """A desired workload's `update`; None is the node's default."""

    model_config = _BACKEND

    judge: Judge | None = None
    min_healthy_seconds: Annotated[float, Field(ge=2, le=3_600)] | None = None
    deadline_seconds: Annotated[float, Field(ge=10, le=86_400)] | None = None
    revert: bool | None = None
    window: UpdateWindow | None = None
    max_defer_seconds: Annotated[float, Field(ge=0, le=7 * 86_400)] | None = None
    # the backend's retry: a token that, once it differs from the one the node last took,
    # makes the node forget that the desired version failed here and try it again
    retry: Annotated[str, Field(min_length=1, max_length=64)] | None = None


class RolloutSpec(BaseModel):
    """A desired workload's `rollout`: apply on nodes placed below `percent`, none on `halt`."""

    model_config = _BACKEND

    percent: Annotated[float, Field(ge=0, le=100)] = 100.0
    halt: bool = False
    seed: Annotated[str, Field(min_length=1, max_length=128)] | None = None


@dataclass(frozen=True, slots=True)
class UpdateTerms:
    """An update's terms, all resolved: the node's defaults (from settings), or those with a
    workload's `update` over them (`resolve_terms`)."""

    judge: Judge = Judge.AUTO
    min_healthy_seconds: float = 60.0
    deadline_seconds: float = 600.0
    unhealthy_seconds: float = 60.0  # WORKLOAD_UPDATE_UNHEALTHY_SECONDS; node-wide
    revert: bool = True
    window: UpdateWindow | None = None
    max_defer_seconds: float = 3_600.0  # UPDATE_DEFER_MAX_SECONDS
    defer_step_seconds: float = 600.0  # one ping's defer_update_seconds, at most; node-wide


def resolve_terms(spec: UpdateSpec | None, defaults: UpdateTerms) -> UpdateTerms:
    if spec is None:
        return defaults
    given = spec.model_dump(exclude_none=True, exclude={"window", "retry"})
    window = spec.window if spec.window is not None else defaults.window
    return replace(defaults, **given, window=window)


# --- placement and waves


def seed_for(name: str, version: str, rollout: RolloutSpec | None) -> str:
    return rollout.seed if rollout is not None and rollout.seed else f"{name}/{version}"


def place(seed: str, node_id: str) -> float:
    """The node's place in [0, 100) for `seed` (the module docstring gives the bytes)."""
    digest = hashlib.sha256(f"{seed}\n{node_id}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") >> 11) * 100 / 2**53


@dataclass(frozen=True, slots=True)
class Apply:
    reason: str


@dataclass(frozen=True, slots=True)
class WaitingWave:
    reason: str


@dataclass(frozen=True, slots=True)
class Halted:
    reason: str


def _num(value: float) -> str:
    return f"{value:g}"


def wave(where: float, rollout: RolloutSpec | None) -> Apply | WaitingWave | Halted:
    """Whether a node at place `where` may apply a new version now."""
    if rollout is None:
        return Apply("no rollout")
    if rollout.halt:
        return Halted("the rollout is halted")
    shown = _num(math.floor(where * 10) / 10)  # rounded down: never "100", never below
    if where < rollout.percent:
        return Apply(f"place {shown} < {_num(rollout.percent)} %")
    return WaitingWave(f"place {shown} ≥ {_num(rollout.percent)} %")


# --- deferral


@dataclass(frozen=True, slots=True)
class Lease:
    """A workload's request to wait: until `until`, from its ping at `renewed_at`."""

    until: datetime
    renewed_at: datetime
    reason: str | None = None


def defer_lease(
    *, at: datetime, seconds: float | None, reason: str | None, step_max: float
) -> Lease | None:
    """The lease a ping received at `at` leaves: it replaces the one before (none when the
    ping asks for nothing); `seconds` is capped at `step_max`."""
    if seconds is None or not seconds > 0:
        return None
    wait = min(seconds, step_max)
    return Lease(at + timedelta(seconds=wait), at, reason[:MAX_DEFER_REASON] if reason else None)


@dataclass(frozen=True, slots=True)
class Deferral:
    defer: bool
    reason: str = ""  # why deferred, or why not when a lease was there


def deferral(
    lease: Lease | None,
    *,
    now: datetime,
    stale_after: float,
    deferred_since: datetime | None,
    max_defer: float,
) -> Deferral:
    """Whether a lease holds an update back now. `deferred_since`: the target version's
    first deferral (None: not deferred yet)."""
    if lease is None or now >= lease.until:
        return Deferral(False)
    if (now - lease.renewed_at).total_seconds() > stale_after:
        return Deferral(False, "the deferring workload went stale: its lease is void")
    waited = (now - deferred_since).total_seconds() if deferred_since else 0.0
    if waited >= max_defer:
        return Deferral(False, f"deferral cap reached ({_num(max_defer)} s)")
    why = f": {lease.reason}" if lease.reason else ""
    left = (lease.until - now).total_seconds()
    return Deferral(
        True,
        f"the workload asks to wait{why} ({left:.0f} s; {max_defer - waited:.0f} s of the cap)",
    )


# --- the judgement


@dataclass(frozen=True, slots=True)
class PingSeen:
    at: datetime
    status: PingStatus
    version: str | None = None


@dataclass(frozen=True, slots=True)
class Observed:
    """What the node sees of a workload now."""

    complete_since: datetime | None = None  # its rollout complete at the applied generation
    deadline_exceeded: bool = False  # ProgressDeadlineExceeded
    crash_loop: str | None = None  # why, when a pod crash-loops
    pings: Sequence[PingSeen] = ()  # its recent pings, any order

    @property
    def last_ping(self) -> PingSeen | None:
        return max(self.pings, key=lambda p: p.at, default=None)


def judge_mode(mode: Judge, last_ping: PingSeen | None) -> Judge:
    """`auto` settled when an update is applied: pings when the latest ping reported a version."""
    if mode is not Judge.AUTO:
        return mode
    return Judge.PINGS if last_ping is not None and last_ping.version else Judge.ROLLOUT


@dataclass(frozen=True, slots=True)
class Judging:
    reason: str


@dataclass(frozen=True, slots=True)
class Healthy:
    reason: str


@dataclass(frozen=True, slots=True)
class Failed:
    reason: str


Verdict = Judging | Healthy | Failed


def _trailing_run(pings: Sequence[PingSeen], bad: bool) -> Sequence[PingSeen]:
    start = len(pings)
    while start > 0 and (pings[start - 1].status is PingStatus.UNHEALTHY) == bad:
        start -= 1
    return pings[start:]


def judge(
    mode: Judge,
    version: str,
    *,
    applied_at: datetime,
    seen: Observed,
    terms: UpdateTerms,
    now: datetime,
) -> Verdict:
    """The verdict on `version`, applied at `applied_at` (the module docstring has the rules);
    `mode` is settled (`judge_mode`): auto is judged as rollout."""
    if mode is Judge.OFF:
        return Healthy("judge off: healthy once applied")
    if seen.deadline_exceeded:
        return Failed("the rollout exceeded its progress deadline")
    if seen.crash_loop:
        return Failed(f"crash loop: {seen.crash_loop}")
    elapsed = (now - applied_at).total_seconds()
    deadline, needed = terms.deadline_seconds, terms.min_healthy_seconds
    late = elapsed >= deadline + needed
    mine: Sequence[PingSeen] = ()
    if mode is Judge.PINGS:
        after = sorted((p for p in seen.pings if p.at >= applied_at), key=lambda p: p.at)
        mine = [p for p in after if p.version == version]
        if mine and mine[-1].status is PingStatus.UNHEALTHY:
            bad_for = (now - _trailing_run(mine, bad=True)[0].at).total_seconds()
            if bad_for >= terms.unhealthy_seconds:
                return Failed(f"unhealthy pings from {version} for {bad_for:.0f} s")
        if not mine and elapsed >= deadline:
            other = next((p.version for p in reversed(after) if p.version), None)
            tail = f" (pings report {other})" if other else ""
            return Failed(f"the new version never pinged within {_num(deadline)} s{tail}")
    if seen.complete_since is None:
        if elapsed >= deadline:
            return Failed(f"the rollout did not complete within {_num(deadline)} s")
        return Judging("rolling out")
    if mode is not Judge.PINGS:
        steady = (now - max(seen.complete_since, applied_at)).total_seconds()
        if steady >= needed:
            return Healthy(f"the rollout complete for {steady:.0f} s")
        progress = f"the rollout complete for {steady:.0f} s of {_num(needed)}"
    elif not mine:
        progress = f"waiting for a ping from {version}"
    elif mine[-1].status is PingStatus.UNHEALTHY:
        progress = f"{version} pings unhealthy"
    else:
        run = _trailing_run(mine, bad=False)
        span = (run[-1].at - run[0].at).total_seconds()
        if len(run) >= 2 and span >= needed:
            return Healthy(f"healthy pings from {version} for {span:.0f} s")
        progress = f"healthy pings from {version} for {span:.0f} s of {_num(needed)}"
    if late:
        return Failed(f"not healthy within {_num(deadline + needed)} s: {progress}")
    return Judging(progress)


# --- the pings a judgement reads


@dataclass(slots=True)
class _Run:
    version: str | None
    bad: bool
    first: PingSeen
    last: PingSeen
    count: int = 1


class Trail:
    """A workload's pings while its update is judged, kept short: consecutive pings of one
    version and one kind (unhealthy, or not) are one run, kept as its first and last ping
    and a count. That is all `judge` reads of them (runs of a version's pings, their first
    and last times, two pings at least), so a judgement of an hour of 5 s pings costs a
    few runs, not 720 pings. At most `MAX_RUNS` runs, the oldest dropped first."""

    MAX_RUNS = 64
    __slots__ = ("_runs",)

    def __init__(self) -> None:
        self._runs: list[_Run] = []

    def add(self, seen: PingSeen) -> None:
        bad = seen.status is PingStatus.UNHEALTHY
        runs = self._runs
        if runs and runs[-1].version == seen.version and runs[-1].bad == bad:
            runs[-1].last = seen
            runs[-1].count += 1
            return
        runs.append(_Run(seen.version, bad, seen, seen))
        if len(runs) > self.MAX_RUNS:
            del runs[0]

    def pings(self) -> list[PingSeen]:
        """The runs' first and last pings, in order: what `judge` needs of them."""
        kept: list[PingSeen] = []
        for run in self._runs:
            kept.append(run.first)
            if run.count > 1:
                kept.append(run.last)
        return kept
