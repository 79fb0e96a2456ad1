"""Self-update against the Kubernetes emulator's rollout simulator and a local version file."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.services.runtime import Runtime, build_runtime
from app.services.syncing import SyncBusy
from app.services.updating import FAILED_VERSIONS, PREVIOUS_IMAGE, SelfUpdateBusy, SelfUpdater
from app.services.wiring import open_self_updater, open_syncer
from tests.conftest import SettingsFactory
from tests.support.kube_emulator import KubeEmulator
from tests.support.servers import ThreadedServer, serve

REPO = "ghcr.io/node-system/workload-manager"
OWN_NS = "workload-manager"


class VersionFileServer:
    """Serves /version with a settable status, body and delay (for garbage and timeouts)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.status = 200
        self.body = b"0.1.0"
        self.delay = 0.0
        self.app = Starlette(routes=[Route("/version", self._version)])

    def set(self, *, status: int = 200, body: bytes = b"", delay: float = 0.0) -> None:
        with self.lock:
            self.status, self.body, self.delay = status, body, delay

    async def _version(self, request: Request) -> Response:
        with self.lock:
            status, body, delay = self.status, self.body, self.delay
        if delay:
            await asyncio.sleep(delay)
        etag = f'"{hash(body)}"'
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304)
        return Response(body, status_code=status, headers={"ETag": etag})


@pytest.fixture(scope="module")
def version_file() -> Iterator[tuple[VersionFileServer, ThreadedServer]]:
    files = VersionFileServer()
    with serve(files.app) as server:
        yield files, server


@pytest.fixture(scope="module")
def cluster() -> Iterator[KubeEmulator]:
    with KubeEmulator.serve(rollout_delay=0.1, progress_deadline=0.6) as emu:
        yield emu


def own_deployment(image: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "workload-manager", "namespace": OWN_NS},
        "spec": {
            "selector": {"matchLabels": {"app": "wm"}},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": {"labels": {"app": "wm"}}, "spec": {"containers": [
                {"name": "manager", "image": image},
                {"name": "sidecar", "image": "busybox:1.36"}]}},
        },
    }  # fmt: skip


def image_of(cluster: KubeEmulator) -> str:
    own = cluster.get_deployment(OWN_NS, "workload-manager")
    assert own is not None
    image: str = own["spec"]["template"]["spec"]["containers"][0]["image"]
    return image


@pytest.fixture
async def runtime(
    cluster: KubeEmulator,
    version_file: tuple[VersionFileServer, ThreadedServer],
    make_settings: SettingsFactory,
    tmp_path: Path,
) -> AsyncIterator[Runtime]:
    files, server = version_file
    cluster.reset()
    files.set(body=b"0.1.0")
    cluster.add_deployment(own_deployment(f"{REPO}:0.1.0"))
    settings = make_settings(
        self_update_url=f"{server.url}/version",
        pod_namespace=OWN_NS,
        kubeconfig=cluster.write_kubeconfig(tmp_path / "kc", OWN_NS),
        self_image_repository=REPO,
        self_update_deadline_seconds=2.0,
        self_update_poll_seconds=0.05,
        self_update_timeout_seconds=0.5,
        desired_state_dir=tmp_path,  # sync on, for the lock test
        managed_namespace="workloads",
    )
    rt = build_runtime(settings)
    async with AsyncExitStack() as stack:
        assert await open_self_updater(rt, stack) is not None, rt.components["self_update"].reason
        await open_syncer(rt, stack)
        yield rt


def updater(rt: Runtime) -> SelfUpdater:
    assert rt.updater is not None
    return rt.updater


async def test_a_newer_version_is_applied_and_becomes_available(
    runtime: Runtime, cluster: KubeEmulator, version_file: tuple[VersionFileServer, Any]
) -> None:
    version_file[0].set(body=b'{"version": "0.2.0"}')
    await updater(runtime).run_scheduled()
    assert image_of(cluster) == f"{REPO}:0.2.0"
    own = cluster.get_deployment(OWN_NS, "workload-manager")
    assert own is not None
    annotations = own["metadata"]["annotations"]
    assert annotations[PREVIOUS_IMAGE] == f"{REPO}:0.1.0"
    assert annotations["workload-manager.io/update-target"] == "0.2.0"
    # only the manager container changed
    assert own["spec"]["template"]["spec"]["containers"][1]["image"] == "busybox:1.36"
    assert runtime.metrics.self_updates.labels("available")._value.get() == 1


@pytest.mark.parametrize("published", [b"0.1.0", b"0.0.9", b'{"version": "0.1.0"}'])
async def test_the_same_or_an_older_version_changes_nothing(
    runtime: Runtime, cluster: KubeEmulator, version_file: tuple[VersionFileServer, Any],
    published: bytes,
) -> None:  # fmt: skip
    version_file[0].set(body=published)
    cluster.clear_requests()
    await updater(runtime).run_scheduled()
    assert image_of(cluster) == f"{REPO}:0.1.0"
    assert [r for r in cluster.requests if r.method != "GET"] == []
    last = updater(runtime).last
    assert last is not None and last["decision"] == "noop"


@pytest.mark.parametrize(
    ("status", "body", "delay", "says"),
    [
        (200, b"<html>oops</html>", 0.0, "not a version"),
        (404, b"", 0.0, "HTTP 404"),
        (500, b"", 0.0, "HTTP 500"),
        (200, b"0.9.0", 3.0, "timed out"),
    ],
)
async def test_unreadable_version_files_change_nothing_and_say_why(
    runtime: Runtime, cluster: KubeEmulator, version_file: tuple[VersionFileServer, Any],
    status: int, body: bytes, delay: float, says: str,
) -> None:  # fmt: skip
    version_file[0].set(status=status, body=body, delay=delay)
    cluster.clear_requests()
    await updater(runtime).run_scheduled()
    assert image_of(cluster) == f"{REPO}:0.1.0"
    assert [r for r in cluster.requests if r.method != "GET"] == []
    component = runtime.components["self_update"]
    assert component.state == "failing" and says in (component.last_error or "")


async def test_an_image_that_never_gets_ready_is_rolled_back_and_skipped_after(
    runtime: Runtime, cluster: KubeEmulator, version_file: tuple[VersionFileServer, Any]
) -> None:
    cluster.mark_bad_image(f"{REPO}:0.3.0")
    version_file[0].set(body=b"0.3.0")
    await updater(runtime).run_scheduled()
    assert image_of(cluster) == f"{REPO}:0.1.0"
    own = cluster.get_deployment(OWN_NS, "workload-manager")
    assert own is not None
    assert own["metadata"]["annotations"][FAILED_VERSIONS] == "0.3.0"
    assert "rolled back" in (runtime.components["self_update"].last_error or "")
    assert any("rolled back" in a.text for a in runtime.alerts.recent)
    cluster.clear_requests()
    await updater(runtime).run_scheduled()
    assert [r for r in cluster.requests if r.method != "GET"] == []
    last = updater(runtime).last
    assert last is not None and last["decision"] == "skip" and "failed before" in last["reason"]


async def test_only_the_configured_repository_is_taken(
    runtime: Runtime, cluster: KubeEmulator, version_file: tuple[VersionFileServer, Any]
) -> None:
    version_file[0].set(body=b'{"version": "9.9.9", "image": "evil.example/wm:9.9.9"}')
    cluster.clear_requests()
    await updater(runtime).run_scheduled()
    assert image_of(cluster) == f"{REPO}:0.1.0"
    assert [r for r in cluster.requests if r.method != "GET"] == []


async def test_sync_and_self_update_never_overlap(
    runtime: Runtime, cluster: KubeEmulator, version_file: tuple[VersionFileServer, Any]
) -> None:
    cluster.mark_bad_image(f"{REPO}:0.4.0")  # keeps the update watching until its deadline
    version_file[0].set(body=b"0.4.0")
    update = asyncio.create_task(updater(runtime).run_scheduled())
    await asyncio.sleep(0.3)
    assert runtime.syncer is not None
    with pytest.raises(SyncBusy):
        await runtime.syncer.sync()
    await update
    async with runtime.cluster_lock:
        decision = await updater(runtime).check()
        with pytest.raises(SelfUpdateBusy):
            await updater(runtime).update(decision)


async def test_outside_a_cluster_self_update_is_off(make_settings: SettingsFactory) -> None:
    rt = build_runtime(make_settings(self_update_url="https://example.invalid/version"))
    component = rt.components["self_update"]
    assert component.enabled is False
    assert "not running in a cluster" in component.reason
