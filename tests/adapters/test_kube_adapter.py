"""The Kubernetes adapter through the real kubernetes-asyncio client against a real API
server (behind the fault proxy), with the manager's own ServiceAccount token."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.adapters.kube import (
    ClusterUnavailable,
    KubeConflict,
    KubeDeployments,
    KubeError,
    load_configuration,
)
from tests.support.real_cluster import RealCluster

NS = "workloads"  # where the manager's Role lets it manage Deployments


def deployment(
    name: str, *, labels: dict[str, str] | None = None, image: str = "r/x:1"
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS, "labels": labels or {}},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": name, "image": image}]},
            },
        },
    }


@pytest.fixture
def served(cluster: RealCluster) -> Iterator[RealCluster]:
    yield cluster


def scale(served: RealCluster, name: str, replicas: int) -> None:
    """An edit by someone else (another field manager)."""
    served.plane.kubectl("-n", NS, "scale", f"deployment/{name}", f"--replicas={replicas}")


@pytest.fixture
async def kube(served: RealCluster, tmp_path: Path) -> AsyncIterator[KubeDeployments]:
    configuration, _ = await load_configuration(served.write_kubeconfig(tmp_path / "kc", NS))
    client = KubeDeployments(configuration, namespace=NS, timeout=1.0, max_wait=0.05)
    yield client
    await client.aclose()


async def test_list_uses_the_label_selector(served: RealCluster, kube: KubeDeployments) -> None:
    served.add_deployment(deployment("ours", labels={"m": "wm"}))
    served.add_deployment(deployment("theirs", labels={"m": "other"}))
    names = [d["metadata"]["name"] for d in await kube.list_managed("m=wm")]
    assert names == ["ours"]
    assert served.requests[-1].query["labelSelector"] == "m=wm"


async def test_get_missing_is_none(kube: KubeDeployments) -> None:
    assert await kube.get("nope") is None


async def test_apply_creates_then_updates_with_server_side_apply(
    served: RealCluster, kube: KubeDeployments
) -> None:
    created = await kube.apply(deployment("api"))
    assert created["metadata"]["generation"] == 1
    scale(served, "api", 4)
    updated = await kube.apply(deployment("api", image="r/x:2"))
    assert updated["spec"]["template"]["spec"]["containers"][0]["image"] == "r/x:2"
    assert updated["spec"]["replicas"] == 4, "a field set by someone else survives the apply"
    last = served.requests[-1]
    assert (last.method, last.content_type) == ("PATCH", "application/apply-patch+yaml")
    assert last.query["fieldManager"] == "workload-manager"
    assert last.query["force"].lower() == "true"


async def test_conditional_apply_conflicts_on_a_stale_resource_version(
    served: RealCluster, kube: KubeDeployments
) -> None:
    created = await kube.apply(deployment("api"))
    stale = created["metadata"]["resourceVersion"]
    scale(served, "api", 2)
    manifest = deployment("api", image="r/x:2")
    manifest["metadata"]["resourceVersion"] = stale
    with pytest.raises(KubeConflict):
        await kube.apply(manifest)


async def test_delete_with_a_stale_precondition_conflicts(
    served: RealCluster, kube: KubeDeployments
) -> None:
    created = await kube.apply(deployment("api"))
    scale(served, "api", 2)
    with pytest.raises(KubeConflict):
        await kube.delete("api", resource_version=created["metadata"]["resourceVersion"])
    # with the current resourceVersion it goes; "current" may be stale again by the time
    # it arrives (the deployment controller writes status), so read it again then
    for _ in range(10):
        current = await kube.get("api")
        assert current is not None
        try:
            await kube.delete("api", resource_version=current["metadata"]["resourceVersion"])
        except KubeConflict:
            continue
        break
    assert await kube.get("api") is None


async def test_5xx_is_retried(served: RealCluster, kube: KubeDeployments) -> None:
    served.fail_next("GET", "/deployments", status=503, times=2)
    assert await kube.list_managed("a=b") == []
    assert [r.status for r in served.requests] == [503, 503, 200]


async def test_persistent_5xx_is_a_kube_error(served: RealCluster, kube: KubeDeployments) -> None:
    served.fail_next("GET", "/deployments", status=500, times=10)
    with pytest.raises(KubeError, match="HTTP 500"):
        await kube.list_managed("a=b")
    assert len(served.requests) == 3


async def test_timeouts_are_bounded(served: RealCluster, kube: KubeDeployments) -> None:
    served.delay_next("GET", "/deployments", seconds=30, times=10)
    with pytest.raises(KubeError, match="timed out"):
        await kube.list_managed("a=b")  # each try gives up after its 1 s timeout


async def test_no_kubeconfig_means_cluster_unavailable(tmp_path: Path) -> None:
    with pytest.raises(ClusterUnavailable, match="no kubeconfig"):
        await load_configuration(tmp_path / "absent")
    (tmp_path / "bad").write_text("{not: [valid")
    with pytest.raises(ClusterUnavailable, match="not usable"):
        await load_configuration(tmp_path / "bad")


async def paged(served: RealCluster, tmp_path: Path, page_size: int) -> KubeDeployments:
    configuration, _ = await load_configuration(served.write_kubeconfig(tmp_path / "kp", NS))
    return KubeDeployments(
        configuration, namespace=NS, timeout=5.0, max_wait=0.05, page_size=page_size
    )


async def test_list_managed_reads_every_page(served: RealCluster, tmp_path: Path) -> None:
    for i in range(5):
        served.add_deployment(deployment(f"paged-{i}", labels={"m": "wm"}))
    served.clear_requests()
    kube = await paged(served, tmp_path, page_size=2)
    try:
        names = sorted(d["metadata"]["name"] for d in await kube.list_managed("m=wm"))
    finally:
        await kube.aclose()
    assert names == [f"paged-{i}" for i in range(5)]
    lists = [r for r in served.requests if r.method == "GET" and r.path.endswith("/deployments")]
    assert [r.query.get("limit") for r in lists] == ["2", "2", "2"]
    assert "continue" not in lists[0].query
    assert all(r.query.get("continue") for r in lists[1:])
    assert all(r.query["labelSelector"] == "m=wm" for r in lists)


def pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"paged": "yes"}},
        "spec": {"containers": [{"name": "c", "image": "r/x:1"}]},
    }


async def test_list_pods_reads_every_page(served: RealCluster, tmp_path: Path) -> None:
    names = [f"paged-pod-{i}" for i in range(5)]
    served.plane.apply(*(pod(n) for n in names))
    kube = await paged(served, tmp_path, page_size=2)
    try:
        served.clear_requests()
        listed = {p["metadata"]["name"] for p in await kube.list_pods()}
        lists = [r for r in served.requests if r.path.endswith("/pods")]
    finally:
        await kube.aclose()
        served.plane.kubectl("-n", NS, "delete", "pods", "-l", "paged=yes", "--wait=false")
    assert set(names) <= listed
    assert len(lists) >= 3 and {r.query.get("limit") for r in lists} == {"2"}
    assert all(r.query.get("continue") for r in lists[1:])


async def test_a_listing_of_more_pages_than_the_bound_is_refused(
    served: RealCluster, tmp_path: Path
) -> None:
    for i in range(3):
        served.add_deployment(deployment(f"many-{i}", labels={"m": "wm"}))
    configuration, _ = await load_configuration(served.write_kubeconfig(tmp_path / "kb", NS))
    kube = KubeDeployments(configuration, namespace=NS, timeout=5.0, page_size=1, max_pages=2)
    try:
        with pytest.raises(KubeError, match="more than 2 pages of 1"):
            await kube.list_managed("m=wm")
    finally:
        await kube.aclose()
