"""The deployment sync against a real kube-apiserver and deployment controller, with the
manager's own ServiceAccount token bound by k8s/rbac.yaml."""

from __future__ import annotations

import json
from typing import Any

from app.domain.manifests import MANAGED_BY_LABEL
from standins.sync_world import NAMESPACE, manifest
from tests.cluster.conftest import ClusterWorld
from tests.support.polling import eventually


def image_of(deployment: dict[str, Any] | None) -> str:
    assert deployment is not None
    image: str = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    return image


def apply_managers(deployment: dict[str, Any] | None) -> set[str]:
    assert deployment is not None
    return {
        entry["manager"]
        for entry in deployment["metadata"].get("managedFields", [])
        if entry.get("operation") == "Apply"
    }


async def test_create_update_and_delete_with_server_side_apply(world: ClusterWorld) -> None:
    world.desire(("api", "1.0.0"), ("worker", "1.0.0"))
    created = await world.syncer.sync()
    assert created.ok, created.as_dict()
    api = world.deployment("api")
    assert apply_managers(api) == {"workload-manager"}
    assert api is not None and api["metadata"]["labels"][MANAGED_BY_LABEL] == "workload-manager"
    world.desire(("api", "1.1.0"))
    changed = await world.syncer.sync()
    assert {(r.name, r.action, r.outcome) for r in changed.results} == {
        ("api", "update", "applied"),
        ("worker", "delete", "applied"),
    }
    assert image_of(world.deployment("api")) == "registry.example/api:1.1.0"
    await eventually(lambda: _gone(world, "worker"))
    assert sorted((n, b["version"]) for n, b in world.backend.versions) == [
        ("api", "1.0.0"), ("api", "1.1.0"), ("worker", "1.0.0"),
    ]  # fmt: skip


async def _gone(world: ClusterWorld, name: str) -> bool:
    return world.deployment(name) is None


async def test_steady_state_writes_nothing(world: ClusterWorld) -> None:
    world.desire(("api", "1.0.0"))
    await world.syncer.sync()
    before = world.versions()
    again = await world.syncer.sync()
    assert [(r.name, r.outcome) for r in again.results] == [("api", "unchanged")]
    assert world.versions() == before


async def test_a_scale_by_another_manager_survives_and_an_edit_is_repaired(
    world: ClusterWorld,
) -> None:
    world.desire(("api", "1.0.0"))
    await world.syncer.sync()
    world.cluster.kubectl("-n", NAMESPACE, "scale", "deployment/api", "--replicas=3")
    scaled = await world.syncer.sync()
    assert [(r.name, r.outcome) for r in scaled.results] == [("api", "unchanged")]
    assert (world.deployment("api") or {})["spec"]["replicas"] == 3
    world.cluster.kubectl("-n", NAMESPACE, "set", "image", "deployment/api", "api=evil/api:6")
    repaired = await world.syncer.sync()
    (result,) = repaired.results
    assert (result.action, result.outcome) == ("update", "applied"), result
    assert "image was changed" in result.reason
    assert image_of(world.deployment("api")) == "registry.example/api:1.0.0"
    assert (world.deployment("api") or {})["spec"]["replicas"] == 3


async def test_non_canonical_quantities_are_applied_once(world: ClusterWorld) -> None:
    written = manifest("api", "1.0.0")
    written["spec"]["template"]["spec"]["containers"][0]["resources"] = {
        "requests": {"cpu": "1000m", "memory": "1024Mi"},
        "limits": {"cpu": "2000m", "memory": "2048Mi"},
    }
    world.desire(("api", "1.0.0"), api=written)
    await world.syncer.sync()
    live = world.deployment("api") or {}
    resources = live["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"] == {"cpu": "1", "memory": "1Gi"}, "the server canonicalised"
    before = world.versions()
    again = await world.syncer.sync()
    assert [(r.name, r.outcome) for r in again.results] == [("api", "unchanged")]
    assert world.versions() == before


async def test_an_unmanaged_deployment_of_the_same_name_is_held(world: ClusterWorld) -> None:
    theirs = manifest("api", "0.1")
    theirs["metadata"]["namespace"] = NAMESPACE
    world.cluster.kubectl("apply", "-f", "-", input=json.dumps(theirs))
    before = world.versions()
    world.desire(("api", "1.0.0"))
    outcome = await world.syncer.sync()
    (result,) = outcome.results
    assert result.outcome == "held" and "not managed" in result.reason
    assert world.versions() == before
    assert image_of(world.deployment("api")) == "registry.example/api:0.1"


async def test_rollout_state_comes_from_the_deployment_controller(world: ClusterWorld) -> None:
    stuck = manifest("stuck", "1")
    stuck["spec"]["progressDeadlineSeconds"] = 2
    # no node has this label: its pods stay Pending and the rollout misses its deadline
    stuck["spec"]["template"]["spec"]["nodeSelector"] = {"example.invalid/nowhere": "true"}
    world.desire(("api", "1.0.0"), ("stuck", "1"), stuck=stuck)
    await world.syncer.sync()
    book = world.runtime.book

    async def settled() -> bool:
        await world.syncer.refresh_view()
        views = {v.name: v.rollout for v in book.views()}
        return views == {"api": "ready", "stuck": "failed"}

    await eventually(settled, within=60, step=0.5)
    statuses = {v.name: v.status for v in book.views()}
    assert statuses["stuck"] == "failed"


async def test_a_manifests_finalizers_are_not_applied_and_one_set_later_is_waited_for(
    world: ClusterWorld,
) -> None:
    """The backend's finalizers are dropped; one another controller sets keeps the deleted
    Deployment: the next syncs report it as being deleted and send no second DELETE."""
    finalized = manifest("api", "1.0.0")
    finalized["metadata"]["finalizers"] = ["example.com/keep"]
    world.desire(("api", "1.0.0"), ("old", "1.0.0"), api=finalized)
    assert (await world.syncer.sync()).ok
    api = world.deployment("api")
    assert api is not None and "finalizers" not in api["metadata"]
    finalizers(world, "old", ["example.com/keep"])
    try:
        world.desire(("api", "1.0.0"))
        deleted = await world.syncer.sync()
        done = {(r.name, r.action, r.outcome) for r in deleted.results}
        assert ("old", "delete", "applied") in done
        kept = world.deployment("old")
        assert kept is not None and kept["metadata"].get("deletionTimestamp")
        for _ in range(2):
            again = await world.syncer.sync()
            (old,) = [r for r in again.results if r.name == "old"]
            assert (old.action, old.outcome) == ("deleting", "unchanged"), old
            assert "kept by finalizers example.com/keep" in old.reason
    finally:  # else the namespace's clean-up would wait for it forever
        finalizers(world, "old", None)
    await eventually(lambda: _gone(world, "old"))


def finalizers(world: ClusterWorld, name: str, finalizers: list[str] | None) -> None:
    world.cluster.kubectl(
        "-n", NAMESPACE, "patch", "deployment", name, "--type=merge",
        "-p", json.dumps({"metadata": {"finalizers": finalizers}}),
    )  # fmt: skip


async def test_pods_carrying_the_managers_name_are_held_in_its_namespace(
    world: ClusterWorld,
) -> None:
    impostor = manifest("api", "1.0.0")
    impostor["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] = (
        "workload-manager"
    )
    world.desire(("api", "1.0.0"), api=impostor)
    result = await world.syncer.sync()
    (api,) = result.results
    assert (api.action, api.outcome) == ("hold", "held"), api
    assert "app.kubernetes.io/name=workload-manager are the manager's own" in api.reason
    assert world.deployment("api") is None
