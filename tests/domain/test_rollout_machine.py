"""The update state machine: every step from a record and a situation, the record's annotation,
a whole update across a restart, and a property test over random runs."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.domain.health import PingStatus
from app.domain.rollout import (
    Judge,
    Lease,
    Observed,
    PingSeen,
    RolloutSpec,
    UpdateTerms,
    UpdateWindow,
)
from app.domain.rollout_machine import (
    MAX_FAILED,
    MAX_RECORD_CHARS,
    Action,
    Outcome,
    Report,
    Situation,
    Step,
    UpdateRecord,
    UpdateState,
    dump_record,
    load_record,
    next_step,
)

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)  # a Sunday
OLD, NEW, NEWER = "1.4.2", "1.5.0", "1.5.1"
TERMS = UpdateTerms(min_healthy_seconds=60, deadline_seconds=600, unhealthy_seconds=45)
CLOSED = UpdateWindow(days=("mon",), start="02:00", end="05:00")
SHUT = replace(TERMS, window=CLOSED)
S = UpdateState


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def world(desired: str = NEW, running: str | None = OLD, **fields: Any) -> Situation:
    return Situation(
        name="api", node_id="node-1", desired=desired, running=running,
        terms=fields.pop("terms", TERMS), stale_after=30, **fields,
    )  # fmt: skip


def rec(state: UpdateState, **fields: Any) -> UpdateRecord:
    fields.setdefault("last_good_version", OLD)
    return UpdateRecord(target=fields.pop("target", NEW), state=state, since=T0, **fields)


def judging(version: str = NEW, **fields: Any) -> UpdateRecord:
    fields.setdefault("judge", Judge.PINGS)
    return rec(S.JUDGING, attempted_version=version, applied_at=T0, **fields)


def reverted(**fields: Any) -> UpdateRecord:
    return replace(judging(failed_versions=(NEW,), **fields), state=S.ROLLED_BACK)


def healthy_pings(version: str, start: float = 10, end: float = 100) -> Observed:
    seen = [PingSeen(at(t), PingStatus.HEALTHY, version) for t in range(int(start), int(end), 10)]
    return Observed(complete_since=at(5), pings=seen)


FAILING = Observed(complete_since=at(5), crash_loop="container app in CrashLoopBackOff")
LEASE = Lease(until=at(700), renewed_at=at(590), reason="draining a batch")


@pytest.mark.parametrize(
    ("record", "situation", "now", "action", "version", "state", "reason"),
    [
        # first sight: what runs is the last good version
        (None, world(running=NEW), 0, Action.NONE, None, S.CURRENT, ""),
        (None, world(), 0, Action.APPLY, NEW, S.APPLYING, "1.4.2 -> 1.5.0"),
        (None, world(running=None), 0, Action.APPLY, NEW, S.APPLYING, "nothing -> 1.5.0"),
        # the gates, in order
        (rec(S.CURRENT, target=OLD), world(rollout=RolloutSpec(percent=0, halt=True)), 0,
         Action.NONE, None, S.HALTED, "the rollout is halted"),
        (rec(S.CURRENT, target=OLD), world(rollout=RolloutSpec(percent=0)), 0,
         Action.NONE, None, S.WAITING_WAVE, " ≥ 0 %"),
        (rec(S.WAITING_WAVE), world(rollout=RolloutSpec(percent=100), terms=SHUT), 0,
         Action.NONE, None, S.OUTSIDE_WINDOW, "outside the update window mon 02:00-05:00 UTC"),
        (rec(S.OUTSIDE_WINDOW), world(lease=LEASE), 600, Action.NONE, None, S.DEFERRED,
         "the workload asks to wait: draining a batch (100 s; 3600 s of the cap)"),
        (rec(S.DEFERRED, deferred_since=at(0)), world(lease=LEASE), 600, Action.NONE, None,
         S.DEFERRED, "(100 s; 3000 s of the cap)"),
        (rec(S.DEFERRED, deferred_since=at(-3000)), world(lease=LEASE), 600, Action.APPLY, NEW,
         S.APPLYING, "1.4.2 -> 1.5.0; deferral cap reached (3600 s)"),
        (rec(S.DEFERRED, deferred_since=at(0)), world(lease=LEASE), 621, Action.APPLY, NEW,
         S.APPLYING, "1.4.2 -> 1.5.0; the deferring workload went stale: its lease is void"),
        (rec(S.DEFERRED, deferred_since=at(0)), world(lease=LEASE), 700, Action.APPLY, NEW,
         S.APPLYING, "1.4.2 -> 1.5.0"),
        (rec(S.WAITING_WAVE), world(running=NEW), 0, Action.NONE, None, S.CURRENT, "running 1.5.0"),
        # applying until the Deployment runs it, then judging
        (replace(judging(), state=S.APPLYING), world(), 5, Action.APPLY, NEW, S.APPLYING, ""),
        (replace(judging(), state=S.APPLYING), world(rollout=RolloutSpec(halt=True)), 5,
         Action.NONE, None, S.HALTED, ""),  # not in place: decided again
        (replace(judging(), state=S.APPLYING), world(running=NEW), 5, Action.NONE, None, S.JUDGING,
         "1.5.0 applied; judging"),
        (judging(), world(running=NEW), 50, Action.NONE, None, S.JUDGING, "rolling out"),
        (judging(), world(running=NEW, seen=Observed(complete_since=at(5))), 50, Action.NONE, None,
         S.JUDGING, "waiting for a ping from 1.5.0"),
        (judging(), world(running=NEW, seen=healthy_pings(NEW)), 100, Action.NONE, None, S.HEALTHY,
         "healthy pings from 1.5.0 for 80 s"),
        (judging(), world(running=NEW, seen=FAILING), 50, Action.REVERT, OLD, S.ROLLED_BACK,
         "1.5.0 failed: crash loop: container app in CrashLoopBackOff"),
        (judging(), world(running=NEW, seen=healthy_pings(OLD)), 600, Action.REVERT, OLD,
         S.ROLLED_BACK, "1.5.0 failed: the new version never pinged within 600 s (pings report"),
        # a revert is never halted, waved, windowed nor deferred
        (judging(), world(running=NEW, seen=FAILING, rollout=RolloutSpec(percent=0, halt=True),
                          lease=LEASE, terms=SHUT), 600,
         Action.REVERT, OLD, S.ROLLED_BACK, "1.5.0 failed"),
        (judging(last_good_version=None), world(running=NEW, seen=FAILING), 50, Action.HOLD, None,
         S.HELD_FAILED, "no version judged healthy on this node to go back to: held"),
        (judging(), world(running=NEW, seen=FAILING, terms=replace(TERMS, revert=False)), 50,
         Action.HOLD, None, S.HELD_FAILED, "revert is off: held"),
        # the revert: again until in place, then judged
        (reverted(), world(running=NEW), 50, Action.REVERT, OLD, S.ROLLED_BACK, ""),
        (reverted(), world(running=OLD, seen=healthy_pings(OLD)), 100, Action.NONE, None,
         S.ROLLED_BACK, ""),
        (reverted(), world(running=OLD, seen=FAILING), 50, Action.HOLD, None, S.HELD_FAILED,
         "CrashLoopBackOff (after the revert from 1.5.0): both held"),
        # a failed version is not applied again until the desired version changes
        (rec(S.ROLLED_BACK, failed_versions=(NEW,)), world(), 900, Action.NONE, None,
         S.ROLLED_BACK, ""),
        (rec(S.HELD_FAILED, failed_versions=(NEW, OLD)), world(), 900, Action.NONE, None,
         S.HELD_FAILED, ""),
        (rec(S.ROLLED_BACK, failed_versions=(NEW,)), world(NEWER), 900, Action.APPLY, NEWER,
         S.APPLYING, "1.4.2 -> 1.5.1"),
        (rec(S.HELD_FAILED, failed_versions=(NEW, OLD), last_good_version=None), world(NEWER), 900,
         Action.APPLY, NEWER, S.APPLYING, "1.4.2 -> 1.5.1"),
        (rec(S.ROLLED_BACK, failed_versions=(NEW,), target=NEWER), world(NEW), 900, Action.APPLY,
         NEW, S.APPLYING, "1.4.2 -> 1.5.0"),  # a change back to it: a retry
        (rec(S.HELD_FAILED, failed_versions=(NEW, OLD), last_good_version=None), world(OLD), 900,
         Action.NONE, None, S.CURRENT, "running 1.4.2"),
        # the backend's retry token: a new one tries the desired version again, once
        (rec(S.ROLLED_BACK, failed_versions=(NEW,)), world(retry="r1"), 900, Action.APPLY, NEW,
         S.APPLYING, "1.4.2 -> 1.5.0"),
        (rec(S.ROLLED_BACK, failed_versions=(NEW,), retry="r1"), world(retry="r1"), 900,
         Action.NONE, None, S.ROLLED_BACK, ""),
        (rec(S.HELD_FAILED, failed_versions=(NEW, OLD)), world(running=NEW, retry="r2"), 900,
         Action.NONE, None, S.CURRENT, "running 1.5.0"),
        (judging(), world(running=NEW, retry="r3"), 50, Action.NONE, None, S.JUDGING,
         "rolling out"),  # a judgement in flight goes on
        # a judgement goes on when the desired version changes, and ends when another runs
        (judging(), world(NEWER, running=NEW, seen=healthy_pings(NEW)), 100, Action.NONE, None,
         S.HEALTHY, "healthy pings from 1.5.0"),
        (replace(judging(), target=NEWER, state=S.HEALTHY, applied_at=None),
         world(NEWER, running=NEW), 100, Action.APPLY, NEWER, S.APPLYING, "1.5.0 -> 1.5.1"),
        (judging(), world(running="1.3.0"), 50, Action.APPLY, NEW, S.APPLYING, "1.3.0 -> 1.5.0"),
        (judging(), world(running="1.3.0", rollout=RolloutSpec(percent=0)), 50, Action.NONE, None,
         S.WAITING_WAVE, "place"),
        (replace(judging(), state=S.APPLYING), world(NEWER), 5, Action.APPLY, NEWER, S.APPLYING,
         "1.4.2 -> 1.5.1"),
        # judge off: healthy once applied
        (judging(judge=Judge.OFF), world(running=NEW), 0, Action.NONE, None, S.HEALTHY,
         "judge off"),
    ],
)  # fmt: skip
def test_next_step(
    record: UpdateRecord | None,
    situation: Situation,
    now: float,
    action: Action,
    version: str | None,
    state: UpdateState,
    reason: str,
) -> None:
    step = next_step(record, situation, at(now))
    assert (step.action, step.version, step.record.state) == (action, version, state)
    assert reason in step.record.reason
    assert step.record.target == situation.desired
    entered = record is None or record.state is not state
    assert (step.alert is not None) == (action in (Action.REVERT, Action.HOLD) and entered)


def test_the_outcomes_reported() -> None:
    applied = next_step(
        replace(judging(), state=S.APPLYING, reason="1.4.2 -> 1.5.0"), world(running=NEW), at(5)
    )
    assert applied.report == Report(Outcome.APPLIED, NEW, NEW, "1.4.2 -> 1.5.0")
    assert applied.record.applied_at == T0  # the deadlines count from the apply
    healthy = next_step(judging(), world(running=NEW, seen=healthy_pings(NEW)), at(100))
    assert healthy.report == Report(Outcome.HEALTHY, NEW, NEW, "healthy pings from 1.5.0 for 80 s")
    assert healthy.record.last_good_version == NEW
    assert not healthy.record.in_flight
    failed = next_step(judging(), world(running=NEW, seen=FAILING), at(50))
    why = "1.5.0 failed: crash loop: container app in CrashLoopBackOff"
    assert failed.report == Report(Outcome.ROLLED_BACK, OLD, NEW, why)
    assert failed.alert == f"api: {why}; reverted to 1.4.2"
    assert failed.record.failed_versions == (NEW,)
    assert failed.record.applied_at == at(50)  # the revert is judged from now
    again = next_step(failed.record, world(running=NEW), at(55))  # the revert not in place yet
    assert (again.action, again.report) == (Action.REVERT, failed.report)
    back = next_step(failed.record, world(running=OLD, seen=healthy_pings(OLD, 60, 130)), at(130))
    assert (back.report, back.record.reason, back.record.in_flight) == (None, why, False)
    held = next_step(failed.record, world(running=OLD, seen=FAILING), at(60))
    assert held.report is None
    assert held.record.failed_versions == (NEW, OLD)
    assert held.record.last_good_version is None
    assert held.alert is not None and held.alert.endswith("both held")


def test_the_deferral_is_counted_from_the_first_one_for_the_target() -> None:
    first = next_step(rec(S.CURRENT, target=OLD), world(lease=LEASE), at(600))
    assert (first.record.state, first.record.deferred_since) == (S.DEFERRED, at(600))
    later = next_step(first.record, world(lease=LEASE), at(610))
    assert later.record.deferred_since == at(600)
    moved = next_step(later.record, world(NEWER, lease=LEASE), at(620))
    assert moved.record.deferred_since == at(620)  # a new target counts again


def test_the_record_is_written_only_when_more_than_its_reason_changed() -> None:
    assert next_step(None, world(running=NEW), at(0)).persist
    progress = next_step(judging(), world(running=NEW), at(50))
    assert not progress.persist and progress.record.reason != ""
    assert next_step(judging(), world(running=NEW, seen=FAILING), at(50)).persist
    waiting = rec(S.WAITING_WAVE, reason="place 37.2 ≥ 20 %")
    assert not next_step(waiting, world(rollout=RolloutSpec(percent=0)), at(9)).persist
    assert next_step(waiting, world(rollout=RolloutSpec(percent=0), running=NEW), at(9)).persist


# --- the record on the Kubernetes object

FULL = UpdateRecord(
    target=NEW,
    state=S.ROLLED_BACK,
    since=at(50),
    reason="1.5.0 failed: the new version never pinged within 600 s",
    failed_versions=("1.4.9", NEW),
    last_good_version=OLD,
    attempted_version=NEW,
    judge=Judge.PINGS,
    applied_at=at(50),
    deferred_since=at(-100),
    retry="r7",
)


@pytest.mark.parametrize(
    "record",
    [FULL, UpdateRecord(NEW, S.CURRENT, T0), rec(S.HELD_FAILED, reason="ü")],
    ids=["full", "bare", "unicode"],
)
def test_a_record_reads_back_as_written(record: UpdateRecord) -> None:
    assert load_record(dump_record(record)) == (record, None)


def test_the_annotation_is_compact_json() -> None:
    assert json.loads(dump_record(UpdateRecord(NEW, S.CURRENT, T0))) == {
        "v": 1,
        "target": "1.5.0",
        "state": "current",
        "since": "2026-11-29T12:00:00Z",
    }


def test_the_annotation_is_bounded() -> None:
    versions = tuple(f"{i:02}" + "9" * 126 for i in range(12))
    big = replace(
        FULL,
        reason="r" * 5000,
        failed_versions=versions,
        attempted_version=versions[0],
        last_good_version=versions[1],
        target=versions[2],
        retry="t" * 64,
    )
    text = dump_record(big)
    assert len(text) <= MAX_RECORD_CHARS
    record, problem = load_record(text)
    assert problem is None and record is not None
    assert record.failed_versions == versions[-MAX_FAILED:]
    assert record.reason == "r" * 256


GOOD = json.loads(dump_record(FULL))


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (None, None),
        ("", None),
        ("x" * (MAX_RECORD_CHARS + 1), "longer than 4096 characters"),
        ("not json", "does not read (record: Invalid JSON"),
        ("[1]", "does not read (record:"),
        (json.dumps(GOOD | {"v": 2}), "does not read (v:"),
        (json.dumps(GOOD | {"state": "sleeping"}), "does not read (state:"),
        (json.dumps(GOOD | {"since": "yesterday"}), "does not read (since:"),
        (json.dumps(GOOD | {"since": "2026-11-29T12:00:00"}), "does not read (since:"),
        (json.dumps(GOOD | {"target": "1 5"}), "does not read (target:"),
        (json.dumps(GOOD | {"failed": ["1"] * 9}), "does not read (failed:"),
        (json.dumps(GOOD | {"judge": "maybe"}), "does not read (judge:"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "target"}), "does not read (target:"),
        (json.dumps(GOOD | {"state": "judging", "attempted": None}), "judging without its"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "last_good"}), "rolled-back without"),
    ],
)  # fmt: skip
def test_a_record_that_does_not_read_is_none_with_the_reason(
    text: str | None, problem: str | None
) -> None:
    record, why = load_record(text)
    assert record is None
    if problem is None:
        assert why is None
    else:
        assert why is not None and problem in why and why.endswith("ignored")


def test_unknown_fields_of_a_later_manager_are_ignored() -> None:
    assert load_record(json.dumps(GOOD | {"later": [1, 2]})) == (FULL, None)


# --- whole updates, the record read back from its annotation at every step (a restart)


def run(script: list[tuple[float, Situation]], record: UpdateRecord | None = None) -> list[Step]:
    steps = []
    for now, situation in script:
        if record is not None:
            record, problem = load_record(dump_record(record))
            assert problem is None
        step = next_step(record, situation, at(now))
        steps.append(step)
        record = step.record
    return steps


def test_a_healthy_update_across_restarts() -> None:
    pinging = world(running=NEW, seen=healthy_pings(NEW, 20, 90))
    steps = run(
        [
            (0, world()),
            (5, world(running=NEW)),
            (30, world(running=NEW)),
            (90, pinging),
            (95, pinging),
        ],
        rec(S.CURRENT, target=OLD, judge=None),
    )
    assert [s.action for s in steps] == [Action.APPLY, *[Action.NONE] * 4]
    assert [s.record.state for s in steps] == [S.APPLYING, *[S.JUDGING] * 2, *[S.HEALTHY] * 2]
    assert [s.report.outcome for s in steps if s.report] == [Outcome.APPLIED, Outcome.HEALTHY]
    assert steps[0].record.judge is Judge.ROLLOUT  # never pinged before: judged by its rollout
    assert steps[-1].record.last_good_version == NEW


def test_a_version_that_keeps_pinging_the_old_one_is_reverted_once() -> None:
    before = Observed(pings=[PingSeen(at(-5), PingStatus.HEALTHY, OLD)])
    old = world(running=NEW, seen=healthy_pings(OLD, 10, 600))
    steps = run(
        [
            (0, world(seen=before)),
            (5, world(running=NEW)),
            (300, old),
            (600, old),
            (610, world(running=OLD, seen=healthy_pings(OLD, 610, 700))),
            (700, world(running=OLD, seen=healthy_pings(OLD, 610, 700))),
            (900, world(running=OLD)),
        ]
    )
    assert steps[0].record.judge is Judge.PINGS  # it pinged its version: judged by its pings
    assert [s.action for s in steps].count(Action.REVERT) == 1
    assert [s.record.state for s in steps][-3:] == [S.ROLLED_BACK] * 3
    assert not steps[-1].record.in_flight
    assert steps[3].report == Report(
        Outcome.ROLLED_BACK, OLD, NEW,
        "1.5.0 failed: the new version never pinged within 600 s (pings report 1.4.2)",
    )  # fmt: skip


# --- random runs


VERSIONS = ("1.0.0", "1.1.0", "1.2.0")
events = st.lists(
    st.tuples(
        st.sampled_from(VERSIONS),  # desired
        st.integers(1, 400),  # seconds since the last step
        st.sampled_from([None, None, None, RolloutSpec(percent=0), RolloutSpec(halt=True)]),
        st.sampled_from([None, None, None, CLOSED]),  # the window
        st.sampled_from(["healthy"] * 4 + ["unhealthy", "silent", "crash", "deadline", "rolling"]),
        st.booleans(),  # the apply or revert fails (the Deployment stays as it was)
        st.booleans(),  # a deferral lease
    ),
    max_size=40,
)


def observed(kind: str, running: str | None, now: datetime) -> Observed:
    if kind == "rolling":
        return Observed()
    status = PingStatus.UNHEALTHY if kind == "unhealthy" else PingStatus.HEALTHY
    ago = () if kind == "silent" else (0, 70)
    pings = [PingSeen(now - timedelta(seconds=s), status, running) for s in ago]
    return Observed(
        complete_since=now - timedelta(seconds=120),
        crash_loop="crash" if kind == "crash" else None,
        deadline_exceeded=kind == "deadline",
        pings=pings,
    )


@settings(max_examples=300)
@given(events)
def test_random_runs_keep_the_rules(script: list[tuple[Any, ...]]) -> None:
    record: UpdateRecord | None = None
    running: str | None = "1.0.0"
    now = T0
    changes = 0  # actions since the desired version last changed
    for desired, wait, rollout, window, kind, fails, lease in script:
        now += timedelta(seconds=wait)
        before = record
        if before is not None and before.target != desired:
            changes = 0
        held = Lease(now + timedelta(seconds=60), now, "busy") if lease else None
        situation = world(
            desired,
            running,
            rollout=rollout,
            terms=replace(TERMS, window=window),
            seen=observed(kind, running, now),
            lease=held,
        )
        step = next_step(before, situation, now)
        record = step.record
        assert load_record(dump_record(record)) == (record, None)
        assert record.target == desired
        if step.action is Action.APPLY:
            assert step.version == desired
            assert not (before and before.target == desired and desired in before.failed_versions)
            assert rollout is None and window is None  # gated: never halted, waved, windowed
        if step.action is Action.REVERT:
            assert before is not None and step.version == before.last_good_version
            assert step.report is not None and step.report.version == step.version
        if step.action is Action.HOLD or (
            step.action is Action.REVERT and before and before.state is not S.ROLLED_BACK
        ):
            assert step.alert
        if before is not None and before.state is S.HELD_FAILED and before.target == desired:
            assert step.action is Action.NONE
        if step.action is Action.HOLD:
            assert record.state is S.HELD_FAILED
        if step.action in (Action.APPLY, Action.REVERT):
            changes += not fails
            assert changes <= 3  # no loop: apply, revert, and one more after a judgement
            if not fails:
                running = step.version
