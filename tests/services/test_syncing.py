"""The syncer over real HTTP: the local backend (signatures checked) and the real API server
and deployment controller, behind the fault proxy, with the manager's own token."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import pytest

from app.domain.manifests import (
    MANAGED_BY_LABEL,
    VERSION_ANNOTATION,
    WORKLOAD_LABEL,
)
from app.domain.tokens import ping_token
from app.services.runtime import build_runtime, open_sync_only
from tests.services.conftest import World
from tests.support.sync_world import NAMESPACE, manifest, owned_state


def env_of(deployment: dict[str, Any], container: int = 0) -> dict[str, str]:
    spec = deployment["spec"]["template"]["spec"]["containers"][container]
    return {e["name"]: e.get("value", "") for e in spec.get("env", [])}


def image_of(deployment: dict[str, Any]) -> str:
    image: str = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    return image


async def test_first_sync_creates_everything_and_reports_versions(world: World) -> None:
    world.desire(("api", "1.0.0"), ("worker", "2.3.0"))
    outcome = await world.syncer.sync()
    assert outcome.ok, outcome.as_dict()
    assert {(r.name, r.action, r.outcome) for r in outcome.results} == {
        ("api", "create", "applied"),
        ("worker", "create", "applied"),
    }
    deployed = world.deployments()
    api = deployed["api"]
    assert api["metadata"]["labels"][MANAGED_BY_LABEL] == "workload-manager"
    assert api["metadata"]["labels"][WORKLOAD_LABEL] == "api"
    assert api["metadata"]["annotations"][VERSION_ANNOTATION] == "1.0.0"
    env = env_of(api)
    assert env["WORKLOAD_MANAGER_URL"] == world.runtime.settings.manager_url
    assert env["WORKLOAD_MANAGER_PING_TOKEN"] == ping_token("sync-ping-secret", "api")
    assert sorted((n, b["version"]) for n, b in world.backend.versions) == [
        ("api", "1.0.0"),
        ("worker", "2.3.0"),
    ]
    assert world.backend.rejected == []


async def test_steady_state_costs_one_backend_request_and_one_list(world: World) -> None:
    world.desire(("api", "1.0.0"), ("worker", "2.3.0"))
    await world.syncer.sync()
    world.forget_requests()
    outcome = await world.syncer.sync()
    assert {r.outcome for r in outcome.results} == {"unchanged"}
    assert [(r.method, r.status) for r in world.backend.requests] == [("GET", 304)]
    assert [(r.method, r.path) for r in world.cluster.requests] == [
        ("GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments")
    ]


async def test_a_version_bump_is_rolled_out_and_reported(world: World) -> None:
    world.desire(("api", "1.0.0"), ("worker", "2.3.0"))
    await world.syncer.sync()
    # someone scaled the workload; the manifest does not set replicas
    world.cluster.edit_deployment(NAMESPACE, "api", lambda d: d["spec"].update(replicas=3))
    world.desire(("api", "1.1.0"), ("worker", "2.3.0"))
    world.forget_requests()
    outcome = await world.syncer.sync()
    by_name = {r.name: r for r in outcome.results}
    assert (by_name["api"].action, by_name["api"].outcome) == ("update", "applied")
    assert by_name["api"].from_version == "1.0.0"
    assert by_name["worker"].outcome == "unchanged"
    api = world.deployments()["api"]
    assert image_of(api) == "registry.example/api:1.1.0"
    assert api["spec"]["replicas"] == 3, "a replica count set by someone else survives"
    assert [(n, b["version"]) for n, b in world.backend.versions] == [("api", "1.1.0")]
    # only the changed workload's manifest was fetched
    fetched = [r.path for r in world.backend.requests if "manifest" in r.path]
    assert fetched == ["/v1/nodes/node-sync/workloads/api/manifest"]


async def test_fields_dropped_from_the_manifest_are_removed(world: World) -> None:
    world.desire(("api", "1.0.0"), api=manifest("api", "1.0.0", env={"OLD_FLAG": "1"}))
    await world.syncer.sync()
    assert "OLD_FLAG" in env_of(world.deployments()["api"])
    world.desire(("api", "1.1.0"))
    await world.syncer.sync()
    assert "OLD_FLAG" not in env_of(world.deployments()["api"])


async def test_drift_made_by_hand_is_repaired(world: World) -> None:
    world.desire(("api", "1.0.0"))
    await world.syncer.sync()

    def tamper(d: dict[str, Any]) -> None:
        d["spec"]["template"]["spec"]["containers"][0]["image"] = "evil/api:6.6.6"

    world.cluster.edit_deployment(NAMESPACE, "api", tamper)
    outcome = await world.syncer.sync()
    (result,) = outcome.results
    assert (result.action, result.outcome) == ("update", "applied")
    assert "containers[api].image was changed" in result.reason
    assert image_of(world.deployments()["api"]) == "registry.example/api:1.0.0"
    assert (await world.syncer.sync()).results[0].outcome == "unchanged"


async def test_unmanaged_deployments_survive_every_sync(world: World) -> None:
    theirs = manifest("theirs", "1")
    theirs["metadata"]["namespace"] = NAMESPACE
    world.cluster.add_deployment(theirs)
    clash = manifest("api", "0.1")
    clash["metadata"]["namespace"] = NAMESPACE
    world.cluster.add_deployment(clash)
    before = {n: owned_state(d) for n, d in world.deployments().items()}
    world.desire(("api", "1.0.0"), allow_empty=True)
    outcome = await world.syncer.sync()
    (result,) = outcome.results
    assert (result.name, result.outcome) == ("api", "held")
    assert "not managed" in result.reason
    world.desire(allow_empty=True)
    await world.syncer.sync()
    after = {n: owned_state(d) for n, d in world.deployments().items()}
    assert after == before
    assert world.kube_writes() == []


@pytest.mark.parametrize("served", [True, False], ids=["reported_version", "without-it"])
async def test_a_restarted_manager_puts_only_what_the_backend_does_not_know(
    world: World, served: bool
) -> None:
    """After a restart the manager knows nothing of its earlier PUTs. With the desired
    state's `reported_version` it PUTs nothing in steady state; a backend without the
    field gets today's one PUT per workload; a version the backend has wrong is put
    right."""
    world.desire(("api", "1.0.0"), ("worker", "1.0.0"))
    await world.syncer.sync()
    world.backend.serve_reported = served
    world.forget_requests()
    async with AsyncExitStack() as stack:
        restarted = await open_sync_only(build_runtime(world.runtime.settings), stack)
        assert restarted is not None
        outcome = await restarted.sync()
        assert {(r.name, r.outcome) for r in outcome.results} == {
            ("api", "unchanged"), ("worker", "unchanged"),
        }  # fmt: skip
        puts = sorted(n for n, _ in world.backend.versions)
        assert puts == ([] if served else ["api", "worker"])
        if served:
            # the backend lost its record of api: told again, once
            world.backend.record_version("api", "0.9.0")
            world.desire(("api", "1.0.0"), ("worker", "1.0.0"))  # a new revision to read
            world.forget_requests()
            await restarted.sync()
            await restarted.sync()
            assert [(n, b["version"]) for n, b in world.backend.versions] == [("api", "1.0.0")]


async def test_a_desired_state_over_the_workload_bound_is_refused_whole(world: World) -> None:
    """More workloads than MAX_DESIRED_WORKLOADS: a failed sync that says why, and nothing
    on the cluster changes (no creates, and above all no deletes)."""
    world.desire(("api", "1.0.0"))
    assert (await world.syncer.sync()).ok
    settings = world.runtime.settings.model_copy(update={"max_desired_workloads": 3})
    world.desire(*((f"w{i}", "1.0.0") for i in range(4)))
    world.forget_requests()
    async with AsyncExitStack() as stack:
        bounded = await open_sync_only(runtime := build_runtime(settings), stack)
        assert bounded is not None
        outcome = await bounded.sync()
    assert outcome.aborted is not None and not outcome.ok
    assert "4 workloads, more than MAX_DESIRED_WORKLOADS (3)" in outcome.aborted
    assert "nothing changed" in outcome.aborted
    assert "MAX_DESIRED_WORKLOADS" in (runtime.components["sync"].last_error or "")
    assert world.kube_writes() == []
    assert set(world.deployments()) == {"api"}
    assert not [r for r in world.backend.requests if "manifest" in r.path]


async def test_a_manifest_that_could_take_the_node_is_held_and_never_written(
    world: World,
) -> None:
    root = manifest("api", "1.0.0")
    container = root["spec"]["template"]["spec"]["containers"][0]
    container["securityContext"] = {"capabilities": {"add": ["SYS_ADMIN"]}}
    world.desire(("api", "1.0.0"), ("worker", "1.0.0"), api=root)
    outcome = await world.syncer.sync()
    by_name = {r.name: r for r in outcome.results}
    assert (by_name["api"].action, by_name["api"].outcome) == ("hold", "held")
    assert "containers[0].securityContext.capabilities.add[0]" in by_name["api"].reason
    assert "(baseline: Capabilities)" in by_name["api"].reason
    assert by_name["worker"].outcome == "applied"
    assert set(world.deployments()) == {"worker"}
    assert not [w for w in world.kube_writes() if w.endswith("/deployments/api")]


async def test_an_oversized_manifest_is_held_and_kept_only_as_its_reason(world: World) -> None:
    big = manifest("api", "1.0.0", env={"PADDING": "x" * 70_000})
    world.desire(("api", "1.0.0"), api=big)
    first = await world.syncer.sync()
    again = await world.syncer.sync()
    for outcome in (first, again):
        (result,) = outcome.results
        assert result.outcome == "held"
        assert "more than MANIFEST_MAX_BYTES (65536) (manager: Size)" in result.reason
    assert world.deployments() == {}
    fetched = [r.path for r in world.backend.requests if "manifest" in r.path]
    assert fetched == ["/v1/nodes/node-sync/workloads/api/manifest"]
