"""Safe rollout, the update state machine of one workload (the rules of its parts are in
`rollout`). `next_step` decides from the record kept on the node and what the node sees
now; it is pure, so a manager restarted mid-update decides as the one before it would.

States: `current` (runs the desired version), `waiting-wave`, `halted`, `outside-window`,
`deferred` (a new desired version held back, by the first of these that holds it, in
this order), `applying` (until the Deployment runs it; if it does not, decided again),
`judging`, `healthy`, `rolled-back`, `held-failed`.

- The first sight of a workload (no record) takes what runs as its last good version.
- A judged-healthy version becomes the last good one (reported `healthy`; `applied` was
  reported once the Deployment ran it).
- A failed version is remembered (`failed_versions`, the 8 latest) and not applied again
  until the desired version changes (a change back to it is a retry), or the backend's
  `update.retry` token changes (`Situation.retry`: the desired version is tried again). It is
  reverted at once to the last good version (`rolled-back`, reported `rolled_back` with
  the reason, alerted), never waved, windowed nor deferred, and the revert is judged the
  same way (with the same judge). If it fails too, both are held (`held-failed`, alerted)
  until the desired version changes, instead of looping. With no last good version, or
  `revert: false`, the failed version is held as it runs.
- A judgement in progress finishes before a new desired version is taken; a Deployment
  changed to another version outside the update ends it unjudged. A halt stops new
  applications only: judgements and reverts go on.

The record is one annotation (`RECORD_ANNOTATION`), compact JSON of at most
`MAX_RECORD_CHARS`: `{"v": 1, "target", "state", "since", "reason", "failed",
"last_good", "attempted", "judge", "applied_at", "deferred_since", "retry"}` (times RFC
3339 UTC in whole seconds, absent values left out, the reason cut to 256 characters). A record that
does not read is no record, with the reason why (`load_record`). A step says whether its
record changed in more than its reason (`Step.persist`): a judgement's progress is shown,
not written at every step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from app.domain.desired import Version
from app.domain.rollout import (
    Apply,
    Halted,
    Healthy,
    Judge,
    Judging,
    Lease,
    Observed,
    RolloutSpec,
    UpdateTerms,
    deferral,
    judge,
    judge_mode,
    place,
    seed_for,
    wave,
    window_open,
)
from app.domain.updates import stamp

RECORD_ANNOTATION = "workload-manager.io/update-record"
MAX_RECORD_CHARS = 4096
MAX_FAILED = 8
MAX_REASON = 256


class UpdateState(StrEnum):
    CURRENT = "current"
    WAITING_WAVE = "waiting-wave"
    HALTED = "halted"
    OUTSIDE_WINDOW = "outside-window"
    DEFERRED = "deferred"
    APPLYING = "applying"
    JUDGING = "judging"
    HEALTHY = "healthy"
    ROLLED_BACK = "rolled-back"
    HELD_FAILED = "held-failed"


class Outcome(StrEnum):
    APPLIED = "applied"
    HEALTHY = "healthy"
    ROLLED_BACK = "rolled_back"


class Action(StrEnum):
    NONE = "none"
    APPLY = "apply"  # put `Step.version` in place
    REVERT = "revert"  # put the last good `Step.version` back
    HOLD = "hold"  # change nothing, and alert: the update failed with nowhere to go back to


@dataclass(frozen=True, slots=True)
class UpdateRecord:
    """What is kept on the node about a workload's update."""

    target: str  # the desired version
    state: UpdateState
    since: datetime  # when the state was entered
    reason: str = ""
    failed_versions: tuple[str, ...] = ()  # oldest first
    last_good_version: str | None = None
    attempted_version: str | None = None  # the last version applied (not a revert)
    judge: Judge | None = None  # the judge of the attempt, `auto` settled
    applied_at: datetime | None = None  # set while the attempt (or its revert) is in flight
    deferred_since: datetime | None = None  # the target's first deferral
    retry: str | None = None  # the backend's retry token last taken

    @property
    def in_flight(self) -> bool:
        """Applying, or judging an attempt or a revert: uptime restarts leave it alone."""
        return self.applied_at is not None


@dataclass(frozen=True, slots=True)
class Situation:
    """What the node knows of a workload now, besides its record."""

    name: str
    node_id: str
    desired: str
    running: str | None  # the version the Deployment's spec is at; None without one
    terms: UpdateTerms
    stale_after: float  # PING_STALE_SECONDS
    rollout: RolloutSpec | None = None
    seen: Observed = field(default_factory=Observed)
    lease: Lease | None = None  # the workload's deferral, as its last ping left it
    retry: str | None = None  # the desired state's `update.retry`


@dataclass(frozen=True, slots=True)
class Report:
    """An outcome for the version PUT: `version` runs now; `attempted_version` was tried."""

    outcome: Outcome
    version: str
    attempted_version: str
    reason: str


@dataclass(frozen=True, slots=True)
class Step:
    action: Action
    record: UpdateRecord  # to keep (shown always; written when `persist`)
    version: str | None = None  # APPLY, REVERT: the version to put in place
    report: Report | None = None
    alert: str | None = None
    persist: bool = False  # the record changed in more than its reason


def next_step(record: UpdateRecord | None, situation: Situation, now: datetime) -> Step:
    """What to do about one workload now, and the record to keep."""
    step = _decide(record, situation, now)
    kept = record is not None and replace(record, reason="") == replace(step.record, reason="")
    return replace(step, persist=not kept)


def _enter(record: UpdateRecord, state: UpdateState, now: datetime, reason: str) -> UpdateRecord:
    since = record.since if record.state is state else now
    return replace(record, state=state, since=since, reason=reason)


def _decide(record: UpdateRecord | None, s: Situation, now: datetime) -> Step:
    desired = s.desired
    if record is None:
        record = UpdateRecord(
            desired, UpdateState.CURRENT, now, last_good_version=s.running, retry=s.retry
        )
    elif record.target != desired:  # a new desired version; to a failed one: a retry
        failed = tuple(v for v in record.failed_versions if v != desired)
        record = replace(record, target=desired, failed_versions=failed, deferred_since=None)
    if s.retry is not None and s.retry != record.retry:  # the backend asks for a retry
        failed = tuple(v for v in record.failed_versions if v != desired)
        record = replace(record, failed_versions=failed, retry=s.retry)
    attempted = record.attempted_version
    if record.state is UpdateState.APPLYING and attempted is not None:
        if s.running == attempted:
            judging = _enter(record, UpdateState.JUDGING, now, f"{attempted} applied; judging")
            report = Report(Outcome.APPLIED, attempted, attempted, record.reason)
            return Step(Action.NONE, judging, report=report)
        record = replace(record, applied_at=None)  # not in place: decided again
    elif record.in_flight:
        reverting = record.state is UpdateState.ROLLED_BACK
        judged = record.last_good_version if reverting else attempted
        if judged is not None and s.running == judged:
            return _judged(record, judged, s, now)
        if reverting and judged and attempted and s.running == attempted:
            why = record.reason  # the revert is not in place yet: again
            report = Report(Outcome.ROLLED_BACK, judged, attempted, why)
            return Step(Action.REVERT, record, version=judged, report=report)
        outside = f"the Deployment runs {s.running}, not {judged}: changed outside the update"
        record = replace(_enter(record, UpdateState.CURRENT, now, outside), applied_at=None)
    return _at_rest(record, s, now)


def _at_rest(record: UpdateRecord, s: Situation, now: datetime) -> Step:
    desired = s.desired
    if desired in record.failed_versions:
        if record.state in (UpdateState.ROLLED_BACK, UpdateState.HELD_FAILED):
            return Step(Action.NONE, record)
        why = f"{desired} failed on this node: not applied again until the desired version changes"
        return Step(Action.NONE, _enter(record, UpdateState.HELD_FAILED, now, why))
    if s.running == desired:
        if record.state in (UpdateState.CURRENT, UpdateState.HEALTHY):
            return Step(Action.NONE, record)
        return Step(Action.NONE, _enter(record, UpdateState.CURRENT, now, f"running {desired}"))
    gate = wave(place(seed_for(s.name, desired, s.rollout), s.node_id), s.rollout)
    if not isinstance(gate, Apply):
        state = UpdateState.HALTED if isinstance(gate, Halted) else UpdateState.WAITING_WAVE
        return Step(Action.NONE, _enter(record, state, now, gate.reason))
    if not window_open(s.terms.window, now):
        why = f"outside the update window {s.terms.window}"
        return Step(Action.NONE, _enter(record, UpdateState.OUTSIDE_WINDOW, now, why))
    since = record.deferred_since
    held = deferral(
        s.lease,
        now=now,
        stale_after=s.stale_after,
        deferred_since=since,
        max_defer=s.terms.max_defer_seconds,
    )
    if held.defer:
        deferred = _enter(record, UpdateState.DEFERRED, now, held.reason)
        return Step(Action.NONE, replace(deferred, deferred_since=since or now))
    why = f"{s.running or 'nothing'} -> {desired}" + (f"; {held.reason}" if held.reason else "")
    applying = replace(
        record,
        state=UpdateState.APPLYING,
        since=now,
        reason=why,
        attempted_version=desired,
        judge=judge_mode(s.terms.judge, s.seen.last_ping),
        applied_at=now,
        deferred_since=None,
    )
    return Step(Action.APPLY, applying, version=desired)


def _judged(record: UpdateRecord, judged: str, s: Situation, now: datetime) -> Step:
    assert record.applied_at is not None
    verdict = judge(
        record.judge or Judge.ROLLOUT,
        judged,
        applied_at=record.applied_at,
        seen=s.seen,
        terms=s.terms,
        now=now,
    )
    reverting = record.state is UpdateState.ROLLED_BACK
    if isinstance(verdict, Judging):  # a revert keeps its reason: why it was reverted
        return Step(Action.NONE, record if reverting else replace(record, reason=verdict.reason))
    if isinstance(verdict, Healthy):
        if reverting:  # back on the last good version; the reason stays why
            return Step(Action.NONE, replace(record, applied_at=None))
        healthy = _enter(record, UpdateState.HEALTHY, now, verdict.reason)
        report = Report(Outcome.HEALTHY, judged, judged, verdict.reason)
        return Step(
            Action.NONE, replace(healthy, last_good_version=judged, applied_at=None), report=report
        )
    failed = (*(v for v in record.failed_versions if v != judged), judged)[-MAX_FAILED:]
    why = f"{judged} failed: {verdict.reason}"
    last = record.last_good_version
    if reverting:
        why = f"{why} (after the revert from {record.attempted_version}): both held"
        last = None
    elif not s.terms.revert:
        why = f"{why}; revert is off: held"
    elif last is None or last == judged:
        why = f"{why}; no version judged healthy on this node to go back to: held"
    else:
        rolled = _enter(record, UpdateState.ROLLED_BACK, now, why)
        report = Report(Outcome.ROLLED_BACK, last, judged, why)
        return Step(
            Action.REVERT,
            replace(rolled, failed_versions=failed, applied_at=now),
            version=last,
            report=report,
            alert=f"{s.name}: {why}; reverted to {last}",
        )
    held = _enter(record, UpdateState.HELD_FAILED, now, why)
    held = replace(held, failed_versions=failed, last_good_version=last, applied_at=None)
    return Step(Action.HOLD, held, alert=f"{s.name}: {why}")


# --- the record on the Kubernetes object


class _Stored(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    v: Literal[1]
    target: Version
    state: UpdateState
    since: AwareDatetime
    reason: Annotated[str, Field(max_length=1024)] = ""
    failed: Annotated[tuple[Version, ...], Field(max_length=MAX_FAILED)] = ()
    last_good: Version | None = None
    attempted: Version | None = None
    judge: Judge | None = None
    applied_at: AwareDatetime | None = None
    deferred_since: AwareDatetime | None = None
    retry: Annotated[str, Field(max_length=64)] | None = None


def dump_record(record: UpdateRecord) -> str:
    """The annotation's value: at most MAX_RECORD_CHARS for versions the desired state takes."""
    fields = {
        "v": 1,
        "target": record.target,
        "state": record.state.value,
        "since": stamp(record.since),
        "reason": record.reason[:MAX_REASON],
        "failed": list(record.failed_versions[-MAX_FAILED:]),
        "last_good": record.last_good_version,
        "attempted": record.attempted_version,
        "judge": record.judge.value if record.judge else None,
        "applied_at": stamp(record.applied_at) if record.applied_at else None,
        "deferred_since": stamp(record.deferred_since) if record.deferred_since else None,
        "retry": record.retry,
    }
    kept = {k: v for k, v in fields.items() if v or k == "v"}
    return json.dumps(kept, separators=(",", ":"), ensure_ascii=False)


def load_record(text: str | None) -> tuple[UpdateRecord | None, str | None]:
    """The record in an annotation's value, or None and why not (None when absent)."""
    if not text:
        return None, None
    if len(text) > MAX_RECORD_CHARS:
        return None, f"the update record is longer than {MAX_RECORD_CHARS} characters; ignored"
    try:
        stored = _Stored.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "record"
        return None, f"the update record does not read ({where}: {first['msg']}); ignored"
    attempt = stored.state in (UpdateState.APPLYING, UpdateState.JUDGING)
    revert = stored.state is UpdateState.ROLLED_BACK and stored.applied_at is not None
    if (attempt and not (stored.attempted and stored.applied_at)) or (
        revert and not (stored.attempted and stored.last_good)
    ):
        return None, f"the update record is {stored.state} without its versions; ignored"
    record = UpdateRecord(
        target=stored.target,
        state=stored.state,
        since=stored.since,
        reason=stored.reason,
        failed_versions=stored.failed,
        last_good_version=stored.last_good,
        attempted_version=stored.attempted,
        judge=stored.judge,
        applied_at=stored.applied_at,
        deferred_since=stored.deferred_since,
        retry=stored.retry,
    )
    return record, None
