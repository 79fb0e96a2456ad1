"""The syncer over real HTTP: the local backend (signatures checked) and the real API server
and deployment controller, behind the fault proxy, with the manager's own token."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from app.domain.manifests import (
    APPLIED_ANNOTATION,
    MANAGED_BY_LABEL,
    VERSION_ANNOTATION,
    WORKLOAD_LABEL,
)
from app.domain.tokens import ping_token
from app.services.syncing import SyncBusy
from tests.services.conftest import World
from tests.support.polling import eventually
from tests.support.sync_world import NAMESPACE, manifest


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
    before = {n: d["metadata"]["resourceVersion"] for n, d in world.deployments().items()}
    world.desire(("api", "1.0.0"), allow_empty=True)
    outcome = await world.syncer.sync()
    (result,) = outcome.results
    assert (result.name, result.outcome) == ("api", "held")
    assert "not managed" in result.reason
    world.desire(allow_empty=True)
    await world.syncer.sync()
    after = {n: d["metadata"]["resourceVersion"] for n, d in world.deployments().items()}
    assert after == before
    assert world.kube_writes() == []


@pytest.mark.parametrize("mode", ["500", "timeout", "garbage"])
async def test_a_failing_backend_changes_nothing(world: World, mode: str) -> None:
    world.desire(("api", "1.0.0"), ("worker", "1.0.0"))
    await world.syncer.sync()
    world.desire(("api", "2.0.0"))  # would update api and delete worker
    world.backend.fail("workloads", mode, times=None, delay=5)  # type: ignore[arg-type]
    world.forget_requests()
    outcome = await world.syncer.sync()
    assert outcome.aborted is not None and "nothing changed" in outcome.aborted
    assert world.kube_writes() == []
    assert world.runtime.components["sync"].state == "failing"
    assert set(world.deployments()) == {"api", "worker"}
    world.backend.clear_failures()


async def test_one_failing_workload_does_not_block_the_others(world: World) -> None:
    world.desire(("api", "1.0.0"), ("worker", "1.0.0"), ("web", "1.0.0"))
    world.backend.fail("manifest", "500", times=1)  # the first manifest fetched fails
    world.cluster.fail_next("PATCH", "/deployments/web", status=500, times=10)
    outcome = await world.syncer.sync()
    outcomes = sorted((r.name, r.outcome) for r in outcome.results)
    assert outcomes.count(("web", "failed")) == 1
    assert sum(o == "failed" for _, o in outcomes) == 2
    assert sum(o == "applied" for _, o in outcomes) == 1
    assert not outcome.ok
    assert world.runtime.components["sync"].state == "failing"
    world.cluster.clear_faults()
    again = await world.syncer.sync()
    assert again.ok, again.as_dict()
    assert set(world.deployments()) == {"api", "worker", "web"}


async def test_a_conflict_re_reads_and_plans_again(world: World) -> None:
    world.desire(("api", "1.0.0"))
    await world.syncer.sync()
    world.desire(("api", "1.1.0"))
    world.cluster.fail_next("PATCH", "/deployments/api", status=409, times=1)
    outcome = await world.syncer.sync()
    (result,) = outcome.results
    assert result.outcome == "applied"
    assert "after a conflict" in result.reason
    assert image_of(world.deployments()["api"]) == "registry.example/api:1.1.0"


async def test_policy_violations_are_held_with_the_reason(world: World) -> None:
    bad = manifest("api", "1.0.0")
    bad["spec"]["template"]["spec"]["hostNetwork"] = True
    world.desire(("api", "1.0.0"), ("ok", "1.0.0"), api=bad)
    outcome = await world.syncer.sync()
    by_name = {r.name: r for r in outcome.results}
    assert (by_name["api"].outcome, by_name["api"].action) == ("held", "hold")
    assert "hostNetwork" in by_name["api"].reason
    assert by_name["ok"].outcome == "applied"
    assert set(world.deployments()) == {"ok"}


async def test_orphans_are_deleted_within_the_budget(world: World) -> None:
    world.desire(*[(f"w{i}", "1") for i in range(4)])
    await world.syncer.sync()
    world.desire(("w0", "1"))
    first = await world.syncer.sync()
    assert sorted(r.name for r in first.results if r.action == "delete") == ["w1", "w2"]
    assert [r.name for r in first.results if r.outcome == "held"] == ["w3"]
    assert set(world.deployments()) == {"w0", "w3"}
    await world.syncer.sync()
    assert set(world.deployments()) == {"w0"}


async def test_an_empty_list_deletes_nothing_unless_allowed(world: World) -> None:
    world.desire(("api", "1"))
    await world.syncer.sync()
    world.desire()
    held = await world.syncer.sync()
    assert [(r.name, r.outcome) for r in held.results] == [("api", "held")]
    assert set(world.deployments()) == {"api"}
    world.desire(allow_empty=True)
    await world.syncer.sync()
    assert world.deployments() == {}


async def test_a_lost_version_report_is_sent_by_the_next_sync(world: World) -> None:
    world.desire(("api", "1.0.0"))
    world.backend.fail("version", "500", times=1)
    await world.syncer.sync()
    assert world.backend.versions == []
    await world.syncer.sync()
    assert [(n, b["version"]) for n, b in world.backend.versions] == [("api", "1.0.0")]


async def test_an_update_that_timed_out_but_landed_is_still_reported(world: World) -> None:
    world.desire(("api", "1.0.0"))
    await world.syncer.sync()
    await world.settled("api")  # so that the held apply's resourceVersion still holds
    world.desire(("api", "1.1.0"))
    # the server applies the patch after the client has given up on it (every attempt)
    world.cluster.delay_next("PATCH", "/deployments/api", seconds=60, times=3)
    first = await world.syncer.sync()
    assert [(r.name, r.outcome) for r in first.results] == [("api", "failed")]
    assert "timed out" in (first.results[0].error or first.results[0].reason)
    world.cluster.release_held()

    async def landed() -> bool:
        return image_of(world.deployments()["api"]) == "registry.example/api:1.1.0"

    await eventually(landed)
    assert ("api", "1.1.0") not in [(n, b["version"]) for n, b in world.backend.versions]
    second = await world.syncer.sync()
    assert [(r.name, r.action) for r in second.results] == [("api", "noop")]
    assert ("api", "1.1.0") in [(n, b["version"]) for n, b in world.backend.versions]
    world.forget_requests()
    await world.syncer.sync()
    assert [r.route for r in world.backend.requests] == ["workloads"], "confirmed once"


async def test_dry_run_plans_and_changes_nothing(world: World) -> None:
    world.desire(("api", "1.0.0"))
    world.forget_requests()
    outcome = await world.syncer.sync(dry_run=True)
    assert [(r.name, r.action, r.outcome) for r in outcome.results] == [
        ("api", "create", "planned")
    ]
    assert world.kube_writes() == []
    assert world.backend.versions == []
    assert world.syncer.last is None


async def test_syncs_never_overlap(world: World) -> None:
    world.desire(("api", "1.0.0"))
    world.backend.fail("workloads", "timeout", times=1, delay=0.5)
    first = asyncio.create_task(world.syncer.sync())

    async def under_way() -> bool:
        return world.runtime.cluster_lock.locked()

    await eventually(under_way)
    with pytest.raises(SyncBusy):
        await world.syncer.sync()
    await first


async def test_rollout_state_feeds_workload_status(world: World) -> None:
    broken = manifest("broken", "1", image="registry.example/broken:never-ready")
    broken["spec"]["progressDeadlineSeconds"] = 2  # kwok never makes this image's pod Ready
    world.desire(
        ("api", "1.0.0"),
        ("broken", "1"),
        ("blocked", "1"),
        broken=broken,
        blocked={**manifest("blocked", "1"), "kind": "StatefulSet"},
    )
    await world.syncer.sync()
    book = world.runtime.book
    expected = {"api": "unknown", "broken": "failed", "blocked": "missing"}

    async def rolled_out() -> bool:  # the controller's view: Ready, ProgressDeadlineExceeded
        await world.syncer.refresh_view()
        return {v.name: v.status for v in book.views()} == expected

    await eventually(rolled_out)
    api = book.view("api")
    assert api is not None
    assert (api.desired_version, api.deployed_version, api.rollout) == ("1.0.0", "1.0.0", "ready")


async def test_applied_spec_is_recorded_for_drift_checks(world: World) -> None:
    world.desire(("api", "1.0.0"))
    await world.syncer.sync()
    annotations = world.deployments()["api"]["metadata"]["annotations"]
    applied = json.loads(annotations[APPLIED_ANNOTATION])
    assert applied["template"]["spec"]["containers"][0]["image"] == "registry.example/api:1.0.0"


async def test_an_edit_between_plan_and_apply_is_a_real_conflict(world: World) -> None:
    world.desire(("api", "1.0.0"))
    await world.syncer.sync()
    await world.settled("api")  # no status write of the controller's in between
    world.desire(("api", "1.1.0"))
    # hold the apply at the server while someone edits the Deployment
    world.cluster.delay_next("PATCH", "/deployments/api", seconds=60, times=1)
    world.forget_requests()
    task = asyncio.create_task(world.syncer.sync())

    async def patch_held() -> bool:
        return world.cluster.delays_waiting == 0

    await eventually(patch_held, step=0.01)
    # one quick write by another field manager, well within the manager's client timeout
    await asyncio.to_thread(
        world.cluster.plane.kubectl, "-n", NAMESPACE, "patch", "deployment", "api",
        "--type=merge", "-p", json.dumps({"spec": {"replicas": 2}}),
    )  # fmt: skip
    world.cluster.release_held()
    outcome = await task
    patches = [r.status for r in world.cluster.requests if r.method == "PATCH"]
    # the held apply met the edit; the scale-up's status writes may conflict once more
    assert patches[0] == 409 and patches[-1] == 200 and set(patches[1:-1]) <= {409}, patches
    (result,) = outcome.results
    assert result.outcome == "applied" and "after a conflict" in result.reason
    api = world.deployments()["api"]
    assert image_of(api) == "registry.example/api:1.1.0"
    assert api["spec"]["replicas"] == 2


async def test_an_unexpected_error_fails_that_workload_and_the_sync(world: World) -> None:
    """A bug in preparing one manifest is that workload's failure, named, and never an ok
    sync; every other action of the sync is finished before `sync()` returns."""
    broken = manifest("bad", "1.0.0")
    broken["spec"]["template"]["spec"]["volumes"] = 5
    world.desire(("bad", "1.0.0"), *[(f"w{i}", "1.0.0") for i in range(6)], bad=broken)
    syncs_ok = world.runtime.metrics.syncs.labels("ok")
    ok_before = syncs_ok._value.get()
    before = asyncio.all_tasks()
    outcome = await world.syncer.sync()
    # nothing of this sync is still running (and so writing) after it returned
    assert [t for t in asyncio.all_tasks() - before if not t.done()] == []
    by_name = {r.name: r for r in outcome.results}
    assert set(by_name) == {"bad", *(f"w{i}" for i in range(6))}
    assert by_name["bad"].outcome == "failed"
    assert by_name["bad"].error is not None and "TypeError" in by_name["bad"].error
    assert all(by_name[f"w{i}"].outcome == "applied" for i in range(6))
    assert not outcome.ok
    assert world.runtime.components["sync"].state == "failing"
    assert syncs_ok._value.get() == ok_before
    assert set(world.deployments()) == {f"w{i}" for i in range(6)}


async def test_a_cancelled_sync_is_recorded_as_aborted(world: World) -> None:
    world.desire(("api", "1.0.0"))
    world.backend.fail("workloads", "timeout", times=1, delay=0.8)  # holds the sync
    task = asyncio.create_task(world.syncer.sync())

    async def under_way() -> bool:
        return world.runtime.cluster_lock.locked()

    await eventually(under_way)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    last = world.syncer.last
    assert last is not None and not last.ok
    assert last.aborted is not None and "cancelled" in last.aborted
    assert world.runtime.components["sync"].state == "failing"


async def test_conflicts_from_a_busy_controller_are_re_read_a_few_times(world: World) -> None:
    """A real deployment controller writes status (a new resourceVersion) several times
    during a rollout: two conflicts in a row still end in an applied update."""
    world.desire(("api", "1.0.0"))
    await world.syncer.sync()
    world.desire(("api", "1.1.0"))
    world.cluster.fail_next("PATCH", "/deployments/api", status=409, times=2)
    outcome = await world.syncer.sync()
    (result,) = outcome.results
    assert result.outcome == "applied", result
    assert image_of(world.deployments()["api"]) == "registry.example/api:1.1.0"


async def test_a_delete_that_meets_repeated_conflicts_is_re_read_and_done(world: World) -> None:
    world.desire(("api", "1.0.0"), ("old", "1.0.0"))
    await world.syncer.sync()
    world.desire(("api", "1.0.0"))
    world.cluster.fail_next("DELETE", "/deployments/old", status=409, times=2)
    outcome = await world.syncer.sync()
    by_name = {r.name: r for r in outcome.results}
    assert by_name["old"].outcome == "applied", by_name["old"]
    assert set(world.deployments()) == {"api"}
