"""The sync plan: desired workloads x live Deployments -> what to do, and why.

Pure and total: every desired workload and every live managed Deployment gets exactly
one action. The guards live here too, so they are table-tested with the rest: an empty
desired list deletes nothing unless the backend allows it, deletions per sync are
capped, and nothing unmanaged or protected is ever touched.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from app.domain.desired import DesiredState, DesiredWorkload
from app.domain.manifests import MANAGED_BY, MANAGED_BY_LABEL, VERSION_ANNOTATION, find_drift

OWN_DEPLOYMENT = "the manager's own Deployment is never managed"


class ActionKind(StrEnum):
    CREATE = "create"
    UPDATE = "update"
    DELETE = "delete"
    NOOP = "noop"
    HOLD = "hold"
    DELETING = "deleting"  # deleted already, kept by its finalizers: nothing to do


@dataclass(frozen=True, slots=True)
class LiveDeployment:
    name: str
    version: str | None
    resource_version: str | None
    managed: bool
    drift: str | None
    deleting_since: str | None = None  # metadata.deletionTimestamp: deleted, not gone yet
    finalizers: tuple[str, ...] = ()

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> LiveDeployment:
        metadata = obj.get("metadata") or {}
        labels = metadata.get("labels") or {}
        annotations = metadata.get("annotations") or {}
        managed = labels.get(MANAGED_BY_LABEL) == MANAGED_BY
        return cls(
            name=str(metadata.get("name")),
            version=annotations.get(VERSION_ANNOTATION),
            resource_version=metadata.get("resourceVersion"),
            managed=managed,
            drift=find_drift(obj) if managed else None,
            deleting_since=metadata.get("deletionTimestamp"),
            finalizers=tuple(str(f) for f in metadata.get("finalizers") or ()),
        )

    @property
    def being_deleted(self) -> str:
        kept = f", kept by finalizers {', '.join(self.finalizers)}" if self.finalizers else ""
        return f"being deleted since {self.deleting_since}{kept}"


@dataclass(frozen=True, slots=True)
class Action:
    kind: ActionKind
    name: str
    version: str | None = None
    from_version: str | None = None
    reason: str = ""
    resource_version: str | None = None


@dataclass(frozen=True, slots=True)
class SyncPolicy:
    max_deletes: int = 5
    max_delete_percent: float = 50.0
    protected: frozenset[str] = frozenset()


def deletion_budget(policy: SyncPolicy, managed_count: int) -> int:
    """How many deletions one sync may make: the count cap and the percent cap, whichever
    is lower, but at least one while the count cap allows any (a percent of a small
    number would otherwise forbid deleting the last workloads)."""
    if policy.max_deletes <= 0:
        return 0
    by_percent = math.floor(managed_count * policy.max_delete_percent / 100)
    return min(policy.max_deletes, max(1, by_percent))


def _plan_desired(
    workload: DesiredWorkload, current: LiveDeployment | None, policy: SyncPolicy
) -> Action:
    name, version = workload.name, workload.version
    if name in policy.protected:
        return Action(ActionKind.HOLD, name, version, reason=OWN_DEPLOYMENT)
    if current is None:
        return Action(ActionKind.CREATE, name, version, reason="missing")
    if not current.managed:
        reason = "a Deployment with this name exists and is not managed by workload-manager"
        return Action(ActionKind.HOLD, name, version, current.version, reason=reason)
    if current.deleting_since is not None:
        reason = f"{current.being_deleted}; created again once it is gone"
        return Action(ActionKind.HOLD, name, version, current.version, reason=reason)
    if current.version != version:
        reason = f"version {current.version} -> {version}"
    elif current.drift is not None:
        reason = f"drift: {current.drift}"
    else:
        return Action(ActionKind.NOOP, name, version, current.version)
    return Action(
        ActionKind.UPDATE,
        name,
        version,
        current.version,
        reason=reason,
        resource_version=current.resource_version,
    )


def plan_sync(
    desired: DesiredState, live: Iterable[LiveDeployment], policy: SyncPolicy
) -> list[Action]:
    live_by_name = {d.name: d for d in live}
    wanted = desired.by_name()
    actions: list[Action] = []

    for workload in wanted.values():
        actions.append(_plan_desired(workload, live_by_name.get(workload.name), policy))

    orphans = sorted(
        (d for d in live_by_name.values() if d.managed and d.name not in wanted),
        key=lambda d: d.name,
    )
    # deleted already and kept by a finalizer: no second DELETE, and no share of the budget
    for orphan in [o for o in orphans if o.deleting_since is not None]:
        orphans.remove(orphan)
        actions.append(
            Action(ActionKind.DELETING, orphan.name, None, orphan.version,
                   reason=orphan.being_deleted)
        )  # fmt: skip
    managed_count = sum(1 for d in live_by_name.values() if d.managed)
    budget = deletion_budget(policy, managed_count)
    for orphan in orphans:
        hold_reason: str | None = None
        if orphan.name in policy.protected:
            hold_reason = OWN_DEPLOYMENT
        elif not wanted and not desired.allow_empty:
            hold_reason = "the desired list is empty and the backend did not set allow_empty"
        elif budget <= 0:
            hold_reason = (
                f"deletion budget used ({deletion_budget(policy, managed_count)} per sync); "
                "deleted by a later sync"
            )
        if hold_reason is not None:
            actions.append(
                Action(ActionKind.HOLD, orphan.name, None, orphan.version, reason=hold_reason)
            )
            continue
        budget -= 1
        actions.append(
            Action(
                ActionKind.DELETE,
                orphan.name,
                None,
                orphan.version,
                reason="no longer desired",
                resource_version=orphan.resource_version,
            )
        )
    return sorted(actions, key=lambda a: a.name)
