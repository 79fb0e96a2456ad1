"""The sync planner, table-driven: every branch of the decision and every guard."""

from __future__ import annotations

import pytest

from app.domain.desired import DesiredState, DesiredWorkload
from app.domain.planning import (
    OWN_DEPLOYMENT,
    Action,
    ActionKind,
    LiveDeployment,
    SyncPolicy,
    deletion_budget,
    plan_sync,
)

C, U, D, N, H, G = (
    ActionKind.CREATE,
    ActionKind.UPDATE,
    ActionKind.DELETE,
    ActionKind.NOOP,
    ActionKind.HOLD,
    ActionKind.DELETING,
)
SINCE = "2026-12-05T12:00:00Z"


def desired(*pairs: tuple[str, str], allow_empty: bool = False) -> DesiredState:
    return DesiredState(
        revision="r1",
        allow_empty=allow_empty,
        workloads=tuple(DesiredWorkload(name=n, version=v) for n, v in pairs),
    )


def live(
    name: str,
    version: str | None,
    *,
    managed: bool = True,
    drift: str | None = None,
    deleting: bool = False,
) -> LiveDeployment:
    return LiveDeployment(
        name=name, version=version, resource_version=f"rv-{name}", managed=managed, drift=drift,
        deleting_since=SINCE if deleting else None,
        finalizers=("example.com/keep",) if deleting else (),
    )  # fmt: skip


def kinds(actions: list[Action]) -> list[tuple[str, ActionKind]]:
    return [(a.name, a.kind) for a in actions]


POLICY = SyncPolicy(max_deletes=5, max_delete_percent=100)


@pytest.mark.parametrize(
    ("want", "have", "expected"),
    [
        # nothing anywhere
        (desired(), [], []),
        # missing -> create
        (desired(("api", "1.0")), [], [("api", C)]),
        # same version, no drift -> noop
        (desired(("api", "1.0")), [live("api", "1.0")], [("api", N)]),
        # version differs -> update
        (desired(("api", "1.1")), [live("api", "1.0")], [("api", U)]),
        # live has no version annotation (hand-made with our labels) -> update
        (desired(("api", "1.0")), [live("api", None)], [("api", U)]),
        # same version but drifted -> update
        (desired(("api", "1.0")), [live("api", "1.0", drift="spec.replicas")], [("api", U)]),
        # same name exists but is not managed -> hold, never touched
        (desired(("api", "1.0")), [live("api", "1.0", managed=False)], [("api", H)]),
        # managed and no longer desired -> delete
        (desired(("api", "1.0")), [live("api", "1.0"), live("old", "3")], [("api", N), ("old", D)]),
        # unmanaged and not desired -> ignored entirely
        (desired(("api", "1.0")), [live("api", "1.0"), live("theirs", "1", managed=False)],
         [("api", N)]),
        # deleted already, kept by a finalizer -> deleting: no second DELETE
        (desired(("api", "1.0")), [live("api", "1.0"), live("old", "3", deleting=True)],
         [("api", N), ("old", G)]),
        # desired again while it is being deleted -> hold until it is gone
        (desired(("api", "1.1")), [live("api", "1.0", deleting=True)], [("api", H)]),
        # a mix, sorted by name
        (desired(("b", "2"), ("a", "1"), ("c", "3")),
         [live("a", "1"), live("b", "1"), live("z", "9")],
         [("a", N), ("b", U), ("c", C), ("z", D)]),
    ],
)  # fmt: skip
def test_plan(
    want: DesiredState, have: list[LiveDeployment], expected: list[tuple[str, ActionKind]]
) -> None:
    assert kinds(plan_sync(want, have, POLICY)) == expected


def test_update_carries_versions_reason_and_resource_version() -> None:
    (action,) = plan_sync(desired(("api", "1.1")), [live("api", "1.0")], POLICY)
    assert action == Action(U, "api", "1.1", "1.0", "version 1.0 -> 1.1", "rv-api")
    (drifted,) = plan_sync(
        desired(("api", "1.0")), [live("api", "1.0", drift="spec.x was changed")], POLICY
    )
    assert drifted.reason == "drift: spec.x was changed"
    assert drifted.resource_version == "rv-api"


def test_delete_is_conditional_on_the_planned_resource_version() -> None:
    actions = plan_sync(desired(("a", "1")), [live("a", "1"), live("old", "1")], POLICY)
    assert actions[1] == Action(D, "old", None, "1", "no longer desired", "rv-old")


@pytest.mark.parametrize(
    ("allow_empty", "expected"),
    [(False, [("a", H), ("b", H)]), (True, [("a", D), ("b", D)])],
)
def test_empty_desired_list_deletes_only_when_allowed(
    allow_empty: bool, expected: list[tuple[str, ActionKind]]
) -> None:
    actions = plan_sync(desired(allow_empty=allow_empty), [live("a", "1"), live("b", "1")], POLICY)
    assert kinds(actions) == expected
    if not allow_empty:
        assert all("allow_empty" in a.reason for a in actions)


@pytest.mark.parametrize(
    ("max_deletes", "percent", "orphans", "kept", "deleted"),
    [
        (5, 100, 3, 0, 3),   # within both caps
        (2, 100, 5, 0, 2),   # count cap
        (10, 50, 4, 4, 4),   # 50 % of 8 managed = 4
        (10, 10, 3, 7, 1),   # 10 % of 10 = 1
        (10, 1, 3, 0, 1),    # a percent of a small number still allows one
        (0, 100, 3, 0, 0),   # deletions switched off
    ],
)  # fmt: skip
def test_deletion_budget_caps_and_holds_the_rest(
    max_deletes: int, percent: float, orphans: int, kept: int, deleted: int
) -> None:
    keep = [(f"k{i}", "1") for i in range(kept)]
    have = [live(n, v) for n, v in keep] + [live(f"o{i}", "1") for i in range(orphans)]
    policy = SyncPolicy(max_deletes=max_deletes, max_delete_percent=percent)
    actions = plan_sync(desired(*keep, allow_empty=True), have, policy)
    assert sum(a.kind is D for a in actions) == deleted
    held = [a for a in actions if a.kind is H]
    assert len(held) == orphans - deleted
    assert all("deletion budget" in a.reason for a in held)
    # deterministic: the first orphans by name go first
    assert [a.name for a in actions if a.kind is D] == [f"o{i}" for i in range(deleted)]


@pytest.mark.parametrize(
    ("max_deletes", "percent", "managed", "budget"),
    [(5, 50, 0, 1), (5, 50, 2, 1), (5, 50, 4, 2), (5, 50, 100, 5), (0, 50, 100, 0),
     (3, 100, 2, 2), (5, 0, 10, 1)],
)  # fmt: skip
def test_deletion_budget(max_deletes: int, percent: float, managed: int, budget: int) -> None:
    policy = SyncPolicy(max_deletes=max_deletes, max_delete_percent=percent)
    assert deletion_budget(policy, managed) == budget


def test_protected_names_are_never_touched() -> None:
    policy = SyncPolicy(protected=frozenset({"workload-manager"}))
    as_desired = plan_sync(desired(("workload-manager", "9")), [], policy)
    assert kinds(as_desired) == [("workload-manager", H)]
    assert as_desired[0].reason == OWN_DEPLOYMENT
    as_orphan = plan_sync(desired(("api", "1")), [live("api", "1"), live("workload-manager", "1")],
                          policy)  # fmt: skip
    assert kinds(as_orphan) == [("api", N), ("workload-manager", H)]


def test_every_desired_and_every_managed_deployment_gets_exactly_one_action() -> None:
    want = desired(*[(f"w{i}", "2") for i in range(0, 40, 2)])
    have = [live(f"w{i}", "1" if i % 4 else "2", drift="x" if i % 6 == 0 else None)
            for i in range(0, 40, 3)]  # fmt: skip
    actions = plan_sync(want, have, SyncPolicy(max_deletes=3))
    names = [a.name for a in actions]
    assert len(names) == len(set(names))
    assert set(names) == {w.name for w in want.workloads} | {d.name for d in have}


def test_a_deployment_being_deleted_takes_no_share_of_the_deletion_budget() -> None:
    """With one deletion a sync, three Deployments kept by finalizers do not stand in the
    way of the next orphan; each is reported as being deleted, with its finalizers."""
    have = [live(f"stuck{i}", "1", deleting=True) for i in range(3)] + [live("orphan", "1")]
    actions = plan_sync(desired(allow_empty=True), have, SyncPolicy(max_deletes=1))
    assert kinds(actions) == [("orphan", D), ("stuck0", G), ("stuck1", G), ("stuck2", G)]
    reason = actions[1].reason
    assert reason == f"being deleted since {SINCE}, kept by finalizers example.com/keep"
