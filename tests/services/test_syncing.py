"""The syncer over real HTTP: the local backend (signatures checked) and the real API server
and deployment controller, behind the fault proxy, with the manager's own token."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from typing import Any

import pytest

from app.domain.manifests import (
    MANAGED_BY_LABEL,
    VERSION_ANNOTATION,
    WORKLOAD_LABEL,
)
from app.domain.tokens import ping_token
from app.services.runtime import Runtime, build_runtime, open_sync_only
from app.services.syncing import Syncer
from standins.sync_world import NAMESPACE, manifest, owned_state
from tests.services.conftest import World
from tests.support.polling import eventually


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
        bounded = await open_sync_only(build_runtime(settings), stack)
        assert bounded is not None
        outcome = await bounded.sync()
    assert outcome.aborted is not None and not outcome.ok
    assert "4 workloads, more than MAX_DESIRED_WORKLOADS (3)" in outcome.aborted
    assert "nothing changed" in outcome.aborted
    assert "MAX_DESIRED_WORKLOADS" in (bounded.outcome_of(outcome).error or "")
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


async def _bounded_syncer(
    world: World, stack: AsyncExitStack, **update: Any
) -> tuple[Syncer, Runtime]:
    runtime = build_runtime(world.runtime.settings.model_copy(update=update))
    syncer = await open_sync_only(runtime, stack)
    assert syncer is not None
    return syncer, runtime


def _manifest_requests(world: World) -> list[str]:
    return [r.path for r in world.backend.requests if r.route == "manifest"]


def _written_as_recorded(world: World, applied: set[str]) -> None:
    """What a sync ended early recorded as applied is on the cluster, whole; besides it,
    at most the one write in flight when it ended (SYNC_CONCURRENCY 1) may have landed
    (a write is one request: the API server applies it whole or not at all)."""
    deployed = world.deployments()
    assert applied <= set(deployed)
    assert len(set(deployed) - applied) <= 1, sorted(deployed)
    for name in deployed:
        assert deployed[name]["metadata"]["annotations"][VERSION_ANNOTATION] == "1.0.0"


async def _manifest_asked(world: World) -> bool:
    return bool(_manifest_requests(world))


async def test_once_a_manifest_fetch_misses_the_backend_deadline_the_rest_are_skipped(
    world: World,
) -> None:
    """A backend that trickles one manifest trickles the others: after the first fetch
    has run out its BACKEND_DEADLINE_SECONDS, the sync asks for no more, and names the
    workload it waited on in every skipped one."""
    names = [f"w{i}" for i in range(6)]
    world.desire(*((n, "1.0.0") for n in names))
    # one byte every 0.2 s: a manifest of hundreds of bytes takes a minute; each gap is
    # far below the per-read timeout (BACKEND_TIMEOUT_SECONDS, 1 s here)
    world.backend.fail("manifest", "trickle", times=None, interval=0.2)
    world.forget_requests()
    async with AsyncExitStack() as stack:
        syncer, _ = await _bounded_syncer(
            world, stack, backend_deadline_seconds=1.0, sync_concurrency=1
        )
        outcome = await syncer.sync()
        assert outcome.aborted is None, outcome.as_dict()
        (first, *rest) = outcome.results
        assert first.outcome == "failed"
        assert "BACKEND_DEADLINE_SECONDS" in (first.error or ""), first
        assert [(r.outcome, r.error) for r in rest] == [
            ("failed", f"skipped: the backend missed its deadline on {first.name}")
        ] * len(rest)
        await eventually(lambda: _manifest_asked(world), within=10.0)
        assert len(_manifest_requests(world)) == 1, _manifest_requests(world)
        assert world.kube_writes() == []
        # the next sync asks again (a skip is not remembered), and the lock is free
        world.backend.clear_failures()
        again = await syncer.sync()
        assert again.ok, again.as_dict()
        assert set(world.deployments()) == set(names)


async def test_a_sync_past_its_deadline_is_aborted_with_what_it_did_recorded(
    world: World,
) -> None:
    """Each manifest answer is slow but within BACKEND_DEADLINE_SECONDS; together they
    would hold the cluster lock for far longer than SYNC_DEADLINE_SECONDS. The sync ends
    at its deadline: aborted, saying so; what it applied is applied and recorded; the
    rest is recorded as not done and asked for no more; the next sync runs."""
    names = [f"w{i:02d}" for i in range(20)]
    world.desire(*((n, "1.0.0") for n in names))
    # every manifest answered after 0.5 s: 20 one after the other take 10 s or more
    world.backend.fail("manifest", "timeout", times=None, delay=0.5)
    world.forget_requests()
    async with AsyncExitStack() as stack:
        syncer, _runtime = await _bounded_syncer(
            world,
            stack,
            backend_timeout_seconds=5.0,
            backend_deadline_seconds=10.0,
            sync_deadline_seconds=2.0,
            sync_concurrency=1,
        )
        outcome = await syncer.sync()
        assert outcome.aborted is not None, outcome.as_dict()
        assert "deadline of 2 s (SYNC_DEADLINE_SECONDS) passed" in outcome.aborted
        assert not outcome.ok
        assert [r.name for r in outcome.results] == names, "every workload is recorded"
        applied = {r.name for r in outcome.results if r.outcome == "applied"}
        undone = [r for r in outcome.results if r.outcome != "applied"]
        assert undone, "all 20 slow fetches fitted in the sync deadline"
        for result in undone:
            assert result.outcome == "failed"
            assert "SYNC_DEADLINE_SECONDS" in (result.error or ""), result
        _written_as_recorded(world, applied)
        assert len(_manifest_requests(world)) < len(names)
        assert "SYNC_DEADLINE_SECONDS" in (syncer.outcome_of(outcome).error or "")
        # the lock is free (a sync under it raises SyncBusy): the next syncs, with a quick
        # backend now, finish the rest, each within the same short deadline
        world.backend.clear_failures()
        for _ in range(10):
            again = await syncer.sync()
            if again.ok:
                break
        assert again.ok, again.as_dict()
        assert set(world.deployments()) == set(names)
        assert sorted({n for n, _ in world.backend.versions}) == names


async def test_a_cancelled_sync_is_recorded_as_aborted_with_every_workload(
    world: World,
) -> None:
    """A sync cancelled mid-way (shutdown) says so, keeps what it applied, names every
    workload it did not reach, and lets the next sync run."""
    names = [f"w{i}" for i in range(6)]
    world.desire(*((n, "1.0.0") for n in names))
    world.backend.fail("manifest", "timeout", times=None, delay=0.5)
    world.forget_requests()
    async with AsyncExitStack() as stack:
        syncer, _ = await _bounded_syncer(
            world, stack, backend_timeout_seconds=5.0, sync_concurrency=1
        )
        running = asyncio.create_task(syncer.sync())

        async def first_done() -> bool:
            # w0 applied and reported: the sync is now waiting on w1's manifest (0.5 s)
            return any(n == "w0" for n, _ in world.backend.versions)

        await eventually(first_done, within=20.0)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        outcome = syncer.last
        assert outcome is not None and outcome.aborted is not None
        assert outcome.aborted.startswith("cancelled before it finished"), outcome.aborted
        assert [r.name for r in outcome.results] == names
        by_name = {r.name: r for r in outcome.results}
        assert by_name["w0"].outcome == "applied"
        undone = [r for r in outcome.results if r.outcome != "applied"]
        assert undone and all(
            r.outcome == "failed" and (r.error or "").startswith("not done: cancelled")
            for r in undone
        ), undone
        applied = {r.name for r in outcome.results if r.outcome == "applied"}
        _written_as_recorded(world, applied)
        world.backend.clear_failures()
        again = await syncer.sync()
        assert again.ok, again.as_dict()
        assert set(world.deployments()) == set(names)


async def test_a_version_not_yet_reported_is_dropped_with_its_workload(world: World) -> None:
    """A version the backend could not be told stays owed (and shown) while the workload
    is desired; once the backend no longer desires the workload, nothing is owed for it."""
    world.desire(("api", "1.0.0"), ("worker", "1.0.0"))
    world.backend.fail("version", "500", times=None)

    async def owed() -> object:
        return (await world.syncer.run_scheduled()).detail["versions_not_reported"]

    assert await owed() == {"api": "1.0.0", "worker": "1.0.0"}
    world.desire(("worker", "1.0.0"))  # api is no longer wanted: deleted by the next sync
    assert await owed() == {"worker": "1.0.0"}
    world.backend.clear_failures()
    world.forget_requests()
    assert await owed() == {}
    assert [(n, b["version"]) for n, b in world.backend.versions] == [("worker", "1.0.0")]
