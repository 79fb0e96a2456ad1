"""Tests of the Kubernetes API emulator, driven through kubernetes_asyncio and the real kubectl.

They pin the behaviours the workload manager's tests rely on: selectors, resourceVersion
conflicts, generation, defaults, the four patch types and the rollout simulator.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import pytest
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from tests.support.kube_emulator import KubeEmulator

NS = "apps"
SMP = "application/strategic-merge-patch+json"


@pytest.fixture(scope="module")
def served() -> Iterator[KubeEmulator]:
    with KubeEmulator.serve(rollout_delay=0.1, progress_deadline=0.3) as emulator:
        yield emulator


@pytest.fixture
def emu(served: KubeEmulator) -> KubeEmulator:
    served.reset()
    return served


@asynccontextmanager
async def apps_api(emu: KubeEmulator) -> AsyncIterator[client.AppsV1Api]:
    async with client.ApiClient(client.Configuration(host=emu.url)) as api:
        yield client.AppsV1Api(api)


def deployment(
    name: str,
    labels: dict[str, str] | None = None,
    *,
    image: str = "repo/app:1.0",
    replicas: int | None = None,
    env: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "app", "image": image}
    if env is not None:
        container["env"] = env
    spec: dict[str, Any] = {
        "selector": {"matchLabels": {"app": name}},
        "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [container]}},
    }
    if replicas is not None:
        spec["replicas"] = replicas
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": spec,
    }


async def create(apps: client.AppsV1Api, ns: str, body: dict[str, Any]) -> client.V1Deployment:
    # The generated client serialises plain dicts; its stubs only admit model objects.
    call: Any = apps.create_namespaced_deployment
    return cast(client.V1Deployment, await call(ns, body))


async def patch_as(
    apps: client.AppsV1Api, content_type: str, name: str, body: Any, **options: Any
) -> client.V1Deployment:
    # `_content_type` is accepted at runtime but missing from the stubs.
    call: Any = apps.patch_namespaced_deployment
    return cast(
        client.V1Deployment, await call(name, NS, body, _content_type=content_type, **options)
    )


def status_of(exc: ApiException) -> dict[str, Any]:
    assert exc.body is not None
    body: dict[str, Any] = json.loads(exc.body)
    assert body["kind"] == "Status"
    assert body["apiVersion"] == "v1"
    assert body["status"] == "Failure"
    assert body["code"] == exc.status
    return body


async def wait_for(read: Callable[[], Any], check: Callable[[Any], bool]) -> Any:
    """Poll `read` until `check` passes or 3 s elapse; returns the last value read."""
    deadline = time.monotonic() + 3.0
    while True:
        value = await read()
        if check(value) or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.02)


def condition(dep: client.V1Deployment, kind: str) -> client.V1DeploymentCondition:
    found = [c for c in dep.status.conditions or [] if c.type == kind]
    assert found, f"no {kind} condition in {dep.status}"
    return found[0]


# -- discovery and reads -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_discovery_describes_deployments(emu: KubeEmulator) -> None:
    async with client.ApiClient(client.Configuration(host=emu.url)) as api:
        version = await client.VersionApi(api).get_code()
        groups = await client.ApisApi(api).get_api_versions()
        resources = await client.AppsV1Api(api).get_api_resources()
    assert version.major == "1"
    assert [g.name for g in groups.groups] == ["apps"]
    deployments = next(r for r in resources.resources if r.name == "deployments")
    assert deployments.kind == "Deployment"
    assert deployments.namespaced is True
    assert {"create", "get", "list", "patch", "update", "delete"} <= set(deployments.verbs)


@pytest.mark.asyncio
async def test_create_applies_server_defaults_and_metadata(emu: KubeEmulator) -> None:
    async with apps_api(emu) as apps:
        created = await create(apps, NS, deployment("api"))
        fetched = await apps.read_namespaced_deployment("api", NS)
    meta, spec = fetched.metadata, fetched.spec
    assert meta.uid == created.metadata.uid and meta.uid
    assert meta.creation_timestamp is not None
    assert meta.generation == 1
    assert meta.resource_version.isdigit()
    assert spec.replicas == 1
    assert spec.strategy.type == "RollingUpdate"
    assert spec.strategy.rolling_update.max_surge == "25%"
    assert spec.strategy.rolling_update.max_unavailable == "25%"
    assert (spec.revision_history_limit, spec.progress_deadline_seconds) == (10, 600)
    pod = spec.template.spec
    assert (pod.restart_policy, pod.dns_policy, pod.scheduler_name) == (
        "Always",
        "ClusterFirst",
        "default-scheduler",
    )
    assert pod.termination_grace_period_seconds == 30
    container = pod.containers[0]
    assert container.image_pull_policy == "IfNotPresent"
    assert container.termination_message_path == "/dev/termination-log"
    assert container.termination_message_policy == "File"
    assert emu.get_deployment(NS, "api") is not None
    latest = emu.add_deployment(deployment("latest", image="repo/app"), namespace=NS)
    assert latest["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] == "Always"


LABELLED = {
    "web": {"tier": "front", "env": "prod"},
    "api": {"tier": "back", "env": "prod"},
    "job": {"tier": "back"},
}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("tier=front", ["web"]),
        ("tier==back", ["api", "job"]),
        ("env!=prod", ["job"]),
        ("tier in (front, back),env", ["api", "web"]),
        ("tier notin (front)", ["api", "job"]),
        ("env", ["api", "web"]),
        ("!env", ["job"]),
        ("tier=back,!env", ["job"]),
        ("", ["api", "job", "web"]),
    ],
)
async def test_list_honours_label_selectors(
    emu: KubeEmulator, selector: str, expected: list[str]
) -> None:
    async with apps_api(emu) as apps:
        for name, labels in LABELLED.items():
            await create(apps, NS, deployment(name, labels))
        await create(apps, "other", deployment("web", {"tier": "front"}))
        listed = await apps.list_namespaced_deployment(NS, label_selector=selector)
    assert [d.metadata.name for d in listed.items] == expected
    assert listed.metadata.resource_version == emu.resource_version


@pytest.mark.asyncio
async def test_list_field_selector_all_namespaces_and_paging(emu: KubeEmulator) -> None:
    async with apps_api(emu) as apps:
        for ns in ("a", "b"):
            for name in ("one", "two"):
                await create(apps, ns, deployment(name))
        by_name = await apps.list_deployment_for_all_namespaces(field_selector="metadata.name=two")
        page = await apps.list_deployment_for_all_namespaces(limit=3)
        rest = await apps.list_deployment_for_all_namespaces(
            limit=3, _continue=page.metadata._continue
        )
        with pytest.raises(ApiException) as bad:
            await apps.list_namespaced_deployment("a", label_selector="tier in front")
    assert [(d.metadata.namespace, d.metadata.name) for d in by_name.items] == [
        ("a", "two"),
        ("b", "two"),
    ]
    assert [d.metadata.name for d in page.items + rest.items] == ["one", "two", "one", "two"]
    assert not rest.metadata._continue
    assert bad.value.status == 400


# -- write semantics -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_stale_resource_version_conflicts(emu: KubeEmulator) -> None:
    async with apps_api(emu) as apps:
        stale = await create(apps, NS, deployment("api"))
        emu.edit_deployment(NS, "api", lambda d: d["spec"].update(replicas=4))
        stale.spec.replicas = 2
        with pytest.raises(ApiException) as on_put:
            await apps.replace_namespaced_deployment("api", NS, stale)
        patch = {"metadata": {"resourceVersion": stale.metadata.resource_version}}
        with pytest.raises(ApiException) as on_patch:
            await apps.patch_namespaced_deployment("api", NS, patch)
        current = await apps.read_namespaced_deployment("api", NS)
        current.spec.replicas = 2
        replaced = await apps.replace_namespaced_deployment("api", NS, current)
    for failure in (on_put.value, on_patch.value):
        assert failure.status == 409
        assert status_of(failure)["reason"] == "Conflict"
    assert replaced.spec.replicas == 2
    assert int(replaced.metadata.resource_version) > int(current.metadata.resource_version)


@pytest.mark.asyncio
async def test_duplicate_create_is_already_exists(emu: KubeEmulator) -> None:
    async with apps_api(emu) as apps:
        await create(apps, NS, deployment("api"))
        with pytest.raises(ApiException) as exc:
            await create(apps, NS, deployment("api"))
    assert exc.value.status == 409
    body = status_of(exc.value)
    assert body["reason"] == "AlreadyExists"
    assert body["details"] == {"name": "api", "group": "apps", "kind": "deployments"}


@pytest.mark.asyncio
async def test_missing_deployment_is_not_found(emu: KubeEmulator) -> None:
    async with apps_api(emu) as apps:
        calls = [
            apps.read_namespaced_deployment("ghost", NS),
            apps.patch_namespaced_deployment("ghost", NS, {"spec": {"replicas": 2}}),
            apps.delete_namespaced_deployment("ghost", NS),
        ]
        for call in calls:
            with pytest.raises(ApiException) as exc:
                await call
            assert exc.value.status == 404
            assert status_of(exc.value)["message"] == 'deployments.apps "ghost" not found'


@pytest.mark.asyncio
async def test_invalid_bodies_are_rejected(emu: KubeEmulator) -> None:
    nameless = deployment("x")
    del nameless["metadata"]["name"]
    mismatched = deployment("x")
    mismatched["spec"]["selector"] = {"matchLabels": {"app": "other"}}
    async with apps_api(emu) as apps:
        for body, code in [
            (nameless, 422),
            (mismatched, 422),
            ({**deployment("x"), "kind": "StatefulSet"}, 400),
        ]:
            with pytest.raises(ApiException) as exc:
                await create(apps, NS, body)
            assert exc.value.status == code
            assert status_of(exc.value)["reason"] == ("Invalid" if code == 422 else "BadRequest")
    assert emu.list_deployments(NS) == []


@pytest.mark.asyncio
async def test_generation_bumps_on_spec_changes_only(emu: KubeEmulator) -> None:
    async with apps_api(emu) as apps:
        created = await create(apps, NS, deployment("api"))
        relabelled = await apps.patch_namespaced_deployment(
            "api", NS, {"metadata": {"labels": {"team": "x"}}}
        )
        rescaled = await apps.patch_namespaced_deployment("api", NS, {"spec": {"replicas": 3}})
        unchanged = await apps.replace_namespaced_deployment("api", NS, rescaled)
    assert created.metadata.generation == 1
    assert relabelled.metadata.generation == 1
    assert int(relabelled.metadata.resource_version) > int(created.metadata.resource_version)
    assert rescaled.metadata.generation == 2
    assert unchanged.metadata.generation == 2
    assert unchanged.metadata.resource_version == rescaled.metadata.resource_version
    edited = emu.edit_deployment(NS, "api", lambda d: d["metadata"].update(annotations={"a": "1"}))
    assert edited["metadata"]["generation"] == 2
    assert edited["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "1"


# -- patch types -----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_strategic_merge_patch_merges_lists_by_key(emu: KubeEmulator) -> None:
    original = deployment(
        "api", env=[{"name": "A", "value": "a"}, {"name": "B", "value": "b"}, {"name": "D"}]
    )
    containers = original["spec"]["template"]["spec"]["containers"]
    containers.append({"name": "sidecar", "image": "repo/proxy:1"})
    emu.add_deployment(original, namespace=NS)
    emu.edit_deployment(NS, "api", lambda d: d["spec"].update(replicas=5))  # e.g. an HPA
    patch = {
        "metadata": {"labels": {"release": "2"}},
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "app",
                            "image": "repo/app:2.0",
                            "env": [
                                {"name": "B", "value": "new"},
                                {"name": "C", "value": "c"},
                                {"name": "D", "$patch": "delete"},
                            ],
                        }
                    ]
                }
            }
        },
    }
    async with apps_api(emu) as apps:
        patched = await patch_as(apps, SMP, "api", patch)
    pod = patched.spec.template.spec
    assert [c.name for c in pod.containers] == ["app", "sidecar"]
    assert pod.containers[0].image == "repo/app:2.0"
    assert [(e.name, e.value) for e in pod.containers[0].env] == [
        ("A", "a"),
        ("B", "new"),
        ("C", "c"),
    ]
    assert pod.containers[1].image == "repo/proxy:1"
    assert patched.spec.replicas == 5
    assert patched.metadata.labels == {"release": "2"}
    assert patched.metadata.generation == 3
    assert emu.requests[-1].content_type == SMP


@pytest.mark.asyncio
async def test_merge_patch_replaces_lists_and_deletes_with_null(emu: KubeEmulator) -> None:
    original = deployment("api", {"keep": "1", "drop": "1"}, env=[{"name": "A", "value": "a"}])
    emu.add_deployment(original, namespace=NS)
    new_containers = [{"name": "other", "image": "repo/other:1"}]
    patch = {
        "metadata": {"labels": {"drop": None}},
        "spec": {"template": {"spec": {"containers": new_containers}}},
    }
    async with apps_api(emu) as apps:
        patched = await patch_as(apps, "application/merge-patch+json", "api", patch)
    assert patched.metadata.labels == {"keep": "1"}
    assert [c.name for c in patched.spec.template.spec.containers] == ["other"]
    assert not patched.spec.template.spec.containers[0].env
    # Defaults are re-applied to what the merge patch brought in.
    assert patched.spec.template.spec.containers[0].image_pull_policy == "IfNotPresent"


@pytest.mark.asyncio
async def test_json_patch_and_failed_test_operation(emu: KubeEmulator) -> None:
    emu.add_deployment(deployment("api", replicas=2), namespace=NS)
    async with apps_api(emu) as apps:
        patched = await apps.patch_namespaced_deployment(
            "api",
            NS,
            [
                {"op": "test", "path": "/spec/replicas", "value": 2},
                {"op": "replace", "path": "/spec/replicas", "value": 6},
            ],
        )
        with pytest.raises(ApiException) as exc:
            await apps.patch_namespaced_deployment(
                "api", NS, [{"op": "test", "path": "/spec/replicas", "value": 2}]
            )
    assert patched.spec.replicas == 6
    assert exc.value.status == 422
    assert emu.requests[0].content_type == "application/json-patch+json"


@pytest.mark.asyncio
async def test_server_side_apply_creates_and_prunes_own_fields(emu: KubeEmulator) -> None:
    apply = "application/apply-patch+yaml"
    first = deployment("api", env=[{"name": "A", "value": "a"}, {"name": "B", "value": "b"}])
    second = deployment("api", env=[{"name": "A", "value": "a2"}])
    async with apps_api(emu) as apps:
        with pytest.raises(ApiException) as missing_manager:
            await patch_as(apps, apply, "api", first)
        await patch_as(apps, apply, "api", first, field_manager="mgr")
        emu.edit_deployment(NS, "api", lambda d: d["spec"].update(replicas=3))
        applied = await patch_as(apps, apply, "api", second, field_manager="mgr")
    assert missing_manager.value.status == 422
    assert [r.status for r in emu.requests] == [422, 201, 200]
    env = applied.spec.template.spec.containers[0].env
    assert [(e.name, e.value) for e in env] == [("A", "a2")]
    assert applied.spec.replicas == 3  # not in either apply, owned by someone else


# -- subresources --------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_status_and_scale_subresources(emu: KubeEmulator) -> None:
    emu.rollout_delay = 60
    emu.add_deployment(deployment("api"), namespace=NS)
    async with apps_api(emu) as apps:
        status = await apps.patch_namespaced_deployment_status(
            "api", NS, {"status": {"readyReplicas": 1}, "spec": {"replicas": 9}}
        )
        scaled = await apps.patch_namespaced_deployment_scale("api", NS, {"spec": {"replicas": 4}})
        after = await apps.read_namespaced_deployment("api", NS)
    assert status.status.ready_replicas == 1
    assert status.spec.replicas == 1  # spec is ignored on the status subresource
    assert scaled.spec.replicas == 4
    assert (after.spec.replicas, after.metadata.generation) == (4, 2)


# -- rollout simulator -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_rollout_becomes_ready_after_the_delay(emu: KubeEmulator) -> None:
    async with apps_api(emu) as apps:
        # The write's response is computed at elapsed ~0, so it is the pre-delay state.
        early = await create(apps, NS, deployment("api", replicas=2))
        ready = await wait_for(
            lambda: apps.read_namespaced_deployment("api", NS),
            lambda d: d.status.ready_replicas == 2,
        )
    assert early.status.observed_generation == 1
    assert early.status.updated_replicas == 2
    assert not early.status.ready_replicas  # omitted while zero
    assert condition(early, "Progressing").reason == "ReplicaSetUpdated"
    assert condition(early, "Available").status == "False"
    assert ready.status.observed_generation == 1
    assert (ready.status.replicas, ready.status.available_replicas) == (2, 2)
    assert (condition(ready, "Available").status, condition(ready, "Available").reason) == (
        "True",
        "MinimumReplicasAvailable",
    )
    assert condition(ready, "Progressing").reason == "NewReplicaSetAvailable"


@pytest.mark.asyncio
async def test_bad_image_rollout_exceeds_progress_deadline(emu: KubeEmulator) -> None:
    emu.mark_bad_image("repo/app:2.0")
    async with apps_api(emu) as apps:
        await create(apps, NS, deployment("api", replicas=2))
        await wait_for(
            lambda: apps.read_namespaced_deployment("api", NS),
            lambda d: d.status.ready_replicas == 2,
        )
        image = {
            "spec": {
                "template": {"spec": {"containers": [{"name": "app", "image": "repo/app:2.0"}]}}
            }
        }
        stuck = await apps.patch_namespaced_deployment("api", NS, image)
        failed = await wait_for(
            lambda: apps.read_namespaced_deployment("api", NS),
            lambda d: condition(d, "Progressing").status == "False",
        )
    assert stuck.status.observed_generation == 2
    assert condition(stuck, "Progressing").reason == "ReplicaSetUpdated"
    assert failed.status.ready_replicas == 2  # the old ReplicaSet keeps serving
    assert failed.status.updated_replicas == 2
    assert condition(failed, "Progressing").reason == "ProgressDeadlineExceeded"


@pytest.mark.asyncio
async def test_watch_streams_the_rollout(emu: KubeEmulator) -> None:
    emu.rollout_delay = 0.4  # margin for the watch to start before the rollout completes
    async with apps_api(emu) as apps:
        await create(apps, NS, deployment("api"))
        seen: list[tuple[str, int | None]] = []
        async with watch.Watch() as stream:
            async for event in stream.stream(
                apps.list_namespaced_deployment, NS, timeout_seconds=2
            ):
                seen.append((event["type"], event["object"].status.ready_replicas))
                if event["object"].status.ready_replicas == 1:
                    break
    assert seen[0] == ("ADDED", None)
    assert seen[-1] == ("MODIFIED", 1)


# -- delete ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_delete_returns_success_status(emu: KubeEmulator) -> None:
    async with apps_api(emu) as apps:
        created = await create(apps, NS, deployment("api"))
        result = await apps.delete_namespaced_deployment("api", NS)
        remaining = await apps.list_namespaced_deployment(NS)
    assert result.status == "Success"
    assert result.details.uid == created.metadata.uid
    assert remaining.items == []
    assert emu.get_deployment(NS, "api") is None
    assert emu.delete_deployment(NS, "api") is False


# -- test-facing controls ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_fault_injection_delays_and_recording(emu: KubeEmulator) -> None:
    emu.add_deployment(deployment("api"), namespace=NS)
    emu.fail_next("PATCH", "/deployments/api", status=500)
    emu.delay_next("GET", "/deployments/api", seconds=5)
    async with apps_api(emu) as apps:
        with pytest.raises(ApiException) as failed:
            await apps.patch_namespaced_deployment("api", NS, {"spec": {"replicas": 2}})
        patched = await apps.patch_namespaced_deployment("api", NS, {"spec": {"replicas": 2}})
        with pytest.raises(TimeoutError):
            await apps.read_namespaced_deployment("api", NS, _request_timeout=0.2)
    assert failed.value.status == 500
    assert status_of(failed.value)["reason"] == "InternalError"
    assert patched.spec.replicas == 2
    patches = [r for r in emu.requests if r.method == "PATCH"]
    assert [r.status for r in patches] == [500, 200]
    assert patches[1].body == {"spec": {"replicas": 2}}
    assert patches[1].path == f"/apis/apps/v1/namespaces/{NS}/deployments/api"
    emu.clear_requests()
    assert emu.requests == []
    # The GET still held by delay_next is cut short by reset() and never recorded afterwards.
    emu.reset()
    await asyncio.sleep(0.1)
    assert emu.requests == []


@pytest.mark.asyncio
async def test_kubeconfig_drives_kubernetes_asyncio(emu: KubeEmulator, tmp_path: Path) -> None:
    path = emu.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(path), client_configuration=configuration)
    emu.add_deployment(deployment("api"), namespace=NS)
    async with client.ApiClient(configuration) as api:
        listed = await client.AppsV1Api(api).list_namespaced_deployment(NS)
        namespaces = await client.CoreV1Api(api).list_namespace()
    assert configuration.host == emu.url
    assert [d.metadata.name for d in listed.items] == ["api"]
    assert [n.metadata.name for n in namespaces.items] == [NS]


@pytest.mark.asyncio
async def test_namespaces_and_strict_namespace_mode() -> None:
    with KubeEmulator.serve(strict_namespaces=True) as strict:
        async with client.ApiClient(client.Configuration(host=strict.url)) as api:
            core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
            with pytest.raises(ApiException) as missing:
                await create(apps, NS, deployment("api"))
            await core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NS)))
            await create(apps, NS, deployment("api"))
            namespace = await core.read_namespace(NS)
    assert missing.value.status == 404
    assert status_of(missing.value)["message"] == f'namespaces "{NS}" not found'
    assert namespace.status.phase == "Active"
    assert namespace.metadata.labels == {"kubernetes.io/metadata.name": NS}
    assert [d["metadata"]["name"] for d in strict.list_deployments(NS)] == ["api"]


def test_real_kubectl_lists_by_label(emu: KubeEmulator, tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed on this machine")
    emu.add_deployment(deployment("api", {"team": "core"}), namespace=NS)
    emu.add_deployment(deployment("web", {"team": "edge"}), namespace=NS)
    emu.add_deployment(deployment("elsewhere", {"team": "core"}), namespace="other")
    result = subprocess.run(
        [
            *(kubectl, f"--server={emu.url}", f"--cache-dir={tmp_path / 'cache'}"),
            *("get", "deploy", "-n", NS, "-l", "team=core", "-o", "json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    assert [(i["metadata"]["namespace"], i["metadata"]["name"]) for i in listed["items"]] == [
        (NS, "api")
    ]
    assert listed["items"][0]["spec"]["replicas"] == 1
    lists = [r for r in emu.requests if r.path == f"/apis/apps/v1/namespaces/{NS}/deployments"]
    assert lists and lists[0].query["labelSelector"] == "team=core"
