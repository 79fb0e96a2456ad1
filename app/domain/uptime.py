"""Uptime management's rule: when a workload that stays bad is restarted.

A workload that has been `unhealthy`, or `stale` (it pinged, then went silent), for
longer than `after_seconds` gets a rollout restart of its Deployment. Restarts of one
workload back off exponentially (`backoff_seconds` after the first, doubling up to
`backoff_max_seconds`), and two budgets bound them over any hour: per workload and per
node. A workload that never pinged is `unknown`, never `stale`: it is not restarted for
silence (a workload opts in by pinging once). Only Deployments the manager manages are
restarted. Times are monotonic seconds.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

RESTARTABLE = frozenset({"unhealthy", "stale"})
HOUR = 3600.0


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    after_seconds: float
    backoff_seconds: float
    backoff_max_seconds: float
    per_workload_per_hour: int
    per_node_per_hour: int

    def backoff(self, restarts_in_hour: int) -> float:
        """The wait after the last restart, given the restarts of the last hour (>= 1)."""
        doubled: float = self.backoff_seconds * 2.0 ** (restarts_in_hour - 1)
        return min(self.backoff_max_seconds, doubled)


@dataclass(frozen=True, slots=True)
class RestartDecision:
    restart: bool
    reason: str
    budget_spent: bool = False  # held back by a budget (alerted once per budget and hour)


def decide_restart(
    status: str,
    *,
    managed: bool,
    bad_since: float | None,
    now: float,
    workload_restarts: Sequence[float],
    node_restarts: Sequence[float],
    policy: RestartPolicy,
) -> RestartDecision:
    """Whether to restart a workload now, and why (or why not), for `/v1/status`."""
    if status not in RESTARTABLE or bad_since is None:
        return RestartDecision(False, "")
    bad_for = now - bad_since
    if not managed:
        return RestartDecision(False, f"{status} for {bad_for:.0f} s; not a managed Deployment")
    if bad_for < policy.after_seconds:
        return RestartDecision(
            False, f"{status} for {bad_for:.0f} s; restarted after {policy.after_seconds:.0f} s"
        )
    recent = sorted(t for t in workload_restarts if now - t < HOUR)
    if len(recent) >= policy.per_workload_per_hour:
        return RestartDecision(
            False,
            f"{status} for {bad_for:.0f} s; restart budget spent: {len(recent)} restarts of this "
            "workload in the last hour",
            budget_spent=True,
        )
    if recent:
        wait = policy.backoff(len(recent))
        since = now - recent[-1]
        if since < wait:
            return RestartDecision(
                False,
                f"{status} for {bad_for:.0f} s; restarted {since:.0f} s ago, next restart in "
                f"{wait - since:.0f} s (backoff)",
            )
    node_recent = [t for t in node_restarts if now - t < HOUR]
    if len(node_recent) >= policy.per_node_per_hour:
        return RestartDecision(
            False,
            f"{status} for {bad_for:.0f} s; the node's restart budget is spent: "
            f"{len(node_recent)} restarts in the last hour",
            budget_spent=True,
        )
    return RestartDecision(
        True, f"{status} for {bad_for:.0f} s (longer than {policy.after_seconds:.0f} s)"
    )


# --- uptime: the share of time healthy ---------------------------------------------------

SAVE_EVERY_SECONDS = 300.0  # how often the record is saved: a crash loses at most this

DAY = 24 * HOUR
WEEK = 7 * DAY
HEALTHY = frozenset({"healthy", "degraded"})  # up and answering, if not at its best
UNOBSERVED = frozenset({"unknown"})  # never pinged and no cluster view: no data
_SLOT_MAX = int(HOUR)  # seconds observed in one clock hour, at most
_MAX_HOURS = int(WEEK // HOUR) + 2  # a week, and the hours it starts and ends in
MAX_RESTARTS_KEPT = 240  # per workload: a day at 10 an hour (the node budget's default)


@dataclass(frozen=True, slots=True)
class HourShare:
    hour: int  # the clock hour: wall seconds // 3600
    observed: float  # seconds
    healthy: float
    restarts: int = 0  # rollout restarts by uptime management in the hour


@dataclass(frozen=True, slots=True)
class UptimeHistory:
    day: float | None  # share healthy over the last 24 h; None without data
    day_observed: float  # the seconds that share covers
    week: float | None
    week_observed: float
    hours: tuple[HourShare, ...]  # the last 24 clock hours, oldest first


class UptimeRecord:
    """Per workload and clock hour: seconds observed and seconds healthy, for a week.

    Time counts only while the manager looks (a gap longer than `max_step` between two
    looks counts as not observed), so the manager's own downtime is never blamed on a
    workload. Shares are to the hour: the window's first hour counts whole.
    """

    def __init__(
        self,
        hours: dict[str, dict[int, list[float]]] | None = None,
        restarts: dict[str, list[float]] | None = None,
    ) -> None:
        self.hours: dict[str, dict[int, list[float]]] = hours or {}
        # rollout restarts by uptime management, wall seconds, the last 24 h: the budgets
        # survive a restart of the manager, and the status strip shows them
        self.restarts: dict[str, list[float]] = restarts or {}

    def restarted(self, name: str, *, at: float) -> None:
        kept = self.restarts.setdefault(name, [])
        kept.append(float(int(at)))
        del kept[:-MAX_RESTARTS_KEPT]

    def restarts_since(self, since: float) -> dict[str, list[float]]:
        """Each workload's restarts at or after `since` (wall seconds), oldest first."""
        found = {n: [t for t in ts if t >= since] for n, ts in self.restarts.items()}
        return {n: ts for n, ts in found.items() if ts}

    def observe(self, statuses: dict[str, str], *, start: float, end: float) -> None:
        """Count [start, end) (wall seconds) for each workload in its status then."""
        for name, status in statuses.items():
            if status in UNOBSERVED:
                continue
            healthy = status in HEALTHY
            at = start
            while at < end:
                hour = int(at // HOUR)
                step = min(end, (hour + 1) * HOUR) - at
                slot = self.hours.setdefault(name, {}).setdefault(hour, [0.0, 0.0])
                slot[0] += step
                if healthy:
                    slot[1] += step
                at += step

    def share(self, name: str, *, now: float, window: float) -> float | None:
        """Healthy seconds / observed seconds over the last `window`; None without data."""
        first = int((now - window) // HOUR)
        observed = healthy = 0.0
        for hour, (seen, up) in self.hours.get(name, {}).items():
            if hour >= first:
                observed += seen
                healthy += up
        return None if observed <= 0 else round(healthy / observed, 6)

    def observed(self, name: str, *, now: float, window: float) -> float:
        """Seconds observed over the last `window` (to the hour, as `share` counts)."""
        first = int((now - window) // HOUR)
        return sum(seen for hour, (seen, _) in self.hours.get(name, {}).items() if hour >= first)

    def history(self, name: str, *, now: float) -> UptimeHistory:
        """What a person needs at a glance: both shares with the time they cover, and the
        last 24 clock hours one by one (oldest first, the current hour last)."""
        by = self.hours.get(name, {})
        current = int(now // HOUR)
        restarts: dict[int, int] = {}
        for at in self.restarts.get(name, ()):
            restarts[int(at // HOUR)] = restarts.get(int(at // HOUR), 0) + 1
        return UptimeHistory(
            day=self.share(name, now=now, window=DAY),
            day_observed=self.observed(name, now=now, window=DAY),
            week=self.share(name, now=now, window=WEEK),
            week_observed=self.observed(name, now=now, window=WEEK),
            hours=tuple(
                HourShare(
                    h,
                    by[h][0] if h in by else 0.0,
                    by[h][1] if h in by else 0.0,
                    restarts=restarts.get(h, 0),
                )
                for h in range(current - 23, current + 1)
            ),
        )

    def prune(self, *, now: float) -> None:
        """Forget hours older than a week, restarts older than a day, and workloads with
        nothing left."""
        self.restarts = self.restarts_since(now - DAY)
        oldest = int((now - WEEK) // HOUR)
        for name in list(self.hours):
            kept = {h: v for h, v in self.hours[name].items() if h >= oldest}
            if kept:
                self.hours[name] = kept
            else:
                del self.hours[name]

    def to_json(self) -> dict[str, Any]:
        """The compact form (version 2): from one first clock hour, each workload's hours
        as base64 of 3 bytes an hour, observed and healthy whole seconds in 12 bits each.
        A week of one workload is about 680 characters, so every workload the settings
        allow fits one ConfigMap (1 MiB in all) with room to spare; version 1 spent about
        30 characters an hour."""
        used = [h for by in self.hours.values() for h in by]
        first = min(used, default=0)
        packed: dict[str, str] = {}
        for name, by in sorted(self.hours.items()):
            if not by:
                continue
            out = bytearray()
            for hour in range(first, max(by) + 1):
                seen, up = by.get(hour, (0.0, 0.0))
                observed = min(_SLOT_MAX, round(seen))
                healthy = min(observed, round(up))
                out += bytes((observed >> 4, (observed & 0xF) << 4 | healthy >> 8, healthy & 0xFF))
            packed[name] = base64.b64encode(bytes(out)).decode("ascii")
        restarts = {name: [int(t) for t in ts] for name, ts in sorted(self.restarts.items()) if ts}
        return {"version": 2, "first_hour": first, "hours": packed, "restarts": restarts}

    @classmethod
    def from_json(cls, data: Any) -> UptimeRecord:
        """What `to_json` wrote, or the version 1 record an earlier manager wrote; raises
        ValueError naming what is wrong in anything else."""
        if isinstance(data, dict) and data.get("version") == 1:
            return cls._from_version_1(data)
        if not isinstance(data, dict) or data.get("version") != 2:
            raise ValueError("not an uptime record (version 2 or 1)")
        first, raw = data.get("first_hour"), data.get("hours")
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise ValueError("first_hour: not a clock hour")
        if not isinstance(raw, dict):
            raise ValueError("hours: not a mapping")
        hours: dict[str, dict[int, list[float]]] = {}
        for name, text in raw.items():
            try:
                blob = base64.b64decode(text, validate=True) if isinstance(text, str) else b"-"
            except ValueError:
                blob = b"-"
            if len(blob) % 3 or len(blob) > 3 * _MAX_HOURS:
                raise ValueError(f"hours.{name}: not base64 of 3 bytes an hour, a week at most")
            slots: dict[int, list[float]] = {}
            for i in range(0, len(blob), 3):
                a, b, c = blob[i : i + 3]
                observed, healthy = a << 4 | b >> 4, (b & 0xF) << 8 | c
                if observed > _SLOT_MAX or healthy > observed:
                    raise ValueError(f"hours.{name}: hour {first + i // 3} is not an hour")
                if observed:
                    slots[first + i // 3] = [float(observed), float(healthy)]
            if slots:
                hours[str(name)] = slots
        return cls(hours, _restarts_from(data.get("restarts", {})))

    @classmethod
    def _from_version_1(cls, data: dict[str, Any]) -> UptimeRecord:
        hours: dict[str, dict[int, list[float]]] = {}
        raw = data.get("hours")
        if not isinstance(raw, dict):
            raise ValueError("hours: not a mapping")
        for name, by in raw.items():
            if not isinstance(by, dict):
                raise ValueError(f"hours.{name}: not a mapping")
            slots: dict[int, list[float]] = {}
            for hour, pair in by.items():
                if (
                    not isinstance(pair, list)
                    or len(pair) != 2
                    or not all(isinstance(v, int | float) and v >= 0 for v in pair)
                    or pair[1] > pair[0]
                ):
                    raise ValueError(f"hours.{name}.{hour}: not [observed, healthy] seconds")
                slots[int(hour)] = [float(pair[0]), float(pair[1])]
            hours[str(name)] = slots
        return cls(hours)


def _restarts_from(raw: Any) -> dict[str, list[float]]:
    if not isinstance(raw, dict):
        raise ValueError("restarts: not a mapping")
    restarts: dict[str, list[float]] = {}
    for name, times in raw.items():
        if (
            not isinstance(times, list)
            or len(times) > MAX_RESTARTS_KEPT
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in times)
        ):
            raise ValueError(f"restarts.{name}: not a list of wall seconds")
        if times:
            restarts[str(name)] = sorted(float(t) for t in times)
    return restarts
