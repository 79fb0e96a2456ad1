"""The fault suite's rig: the real manager process syncing from the local backend into the
real control plane (behind the fault proxy), reporting every half second, with one
Deployment it does not manage beside the ones it does.

Every case follows one shape: converge, inject a fault and change what is desired, check
that nothing was lost or touched while the fault lasts, lift the fault *without touching
the manager*, and check that it converges on its own. The process must survive all of
it: the rig fails a case whose manager died or logged an error or a traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from standins.backend import LocalBackend
from standins.servers import ThreadedServer
from standins.sync_world import NAMESPACE, desire, manifest, sync_env
from tests.support.process import ManagerProcess
from tests.support.real_cluster import RealCluster


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/faults/" in item.nodeid.replace("\\", "/"):
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.faults)


@dataclass
class Rig:
    cluster: RealCluster
    local: LocalBackend
    backend_url: str
    workdir: Path
    process: ManagerProcess
    theirs_generation: int  # of the Deployment the manager must never touch

    def image(self, name: str) -> str | None:
        obj = self.cluster.get_deployment(NAMESPACE, name)
        if obj is None:
            return None
        image: str = obj["spec"]["template"]["spec"]["containers"][0]["image"]
        return image

    def names(self) -> set[str]:
        return {d["metadata"]["name"] for d in self.cluster.list_deployments(NAMESPACE)}

    def reported(self, name: str, version: str) -> bool:
        return (name, version) in [(n, b["version"]) for n, b in self.local.versions]

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(f"{self.process.url}/v1/status", timeout=5).json()
        return body

    def component(self, name: str) -> str:
        return str(self.status()["components"][name]["state"])

    def loop(self, name: str) -> str:
        return str(self.status()["loops"][name]["state"])

    def ping(self, name: str, status: str = "healthy") -> None:
        from app.domain.tokens import ping_token

        token = ping_token("sync-ping-secret", name)
        response = httpx.post(
            f"{self.process.url}/v1/workloads/{name}/health",
            json={"status": status},
            headers={"authorization": f"Bearer {token}"},
            timeout=5,
        )
        response.raise_for_status()

    def last_report_names(self) -> set[str]:
        reports = self.local.reports
        return {w["name"] for w in reports[-1]["workloads"]} if reports else set()

    def untouched(self) -> None:
        """What must hold at every moment: the foreign Deployment is as it was, and no
        managed Deployment was deleted."""
        theirs = self.cluster.get_deployment(NAMESPACE, "theirs")
        assert theirs is not None
        # its spec is as it was (status changes as its pods come and go), and the manager
        # never applied a field of it
        assert theirs["metadata"]["generation"] == self.theirs_generation
        managers = {f["manager"] for f in theirs["metadata"].get("managedFields", [])}
        assert "workload-manager" not in managers, managers
        assert {"api", "worker", "theirs"} <= self.names()

    def converged(self, api_version: str) -> None:
        """The manager, on its own, brings the cluster and the backend to the desired state."""
        self.local.wait_for(
            lambda: self.image("api") == f"registry.example/api:{api_version}", timeout=30
        )
        self.local.wait_for(lambda: self.reported("api", api_version), timeout=30)
        self.local.wait_for(lambda: self.component("sync") == "ok", timeout=30)
        self.untouched()


ENV = {
    "SYNC_INTERVAL_SECONDS": "1",
    "REPORT_INTERVAL_SECONDS": "0.5",
    "BACKEND_TIMEOUT_SECONDS": "1",
    "KUBE_TIMEOUT_SECONDS": "1",
    "CLUSTER_REFRESH_SECONDS": "1",
    "SHUTDOWN_GRACE_SECONDS": "10",
}


def start_manager(
    rig_dir: Path, backend_url: str, cluster: RealCluster, **extra: str
) -> ManagerProcess:
    rig_dir.mkdir(exist_ok=True)
    env = sync_env(backend_url, cluster.write_kubeconfig(rig_dir / "kc", NAMESPACE)) | ENV
    return ManagerProcess(env=env | extra, workdir=rig_dir).start()


@contextmanager
def running_rig(
    cluster: RealCluster,
    backend: tuple[LocalBackend, ThreadedServer],
    tmp_path: Path,
    **extra: str,
) -> Iterator[Rig]:
    """A manager (with `extra` settings) that has synced `api` and `worker` beside a
    Deployment it does not manage and sent a report; on exit: alive, stopped, and no
    traceback or ERROR in its log."""
    local, server = backend
    theirs = manifest("theirs", "1")
    theirs["metadata"]["namespace"] = NAMESPACE
    created = cluster.add_deployment(theirs)
    desire(local, ("api", "1.0.0"), ("worker", "1.0.0"))
    process = start_manager(tmp_path, server.url, cluster, **extra)
    rig = Rig(cluster, local, server.url, tmp_path, process, created["metadata"]["generation"])
    try:
        local.wait_for(lambda: rig.reported("api", "1.0.0") and rig.reported("worker", "1.0.0"))
        local.wait_for(lambda: bool(local.reports))
        yield rig
        assert rig.process.running, f"the manager died:\n{rig.process.log()}"
    finally:
        rig.process.stop()
    log = rig.process.log()
    assert "Traceback" not in log and " ERROR " not in log, log


@pytest.fixture
def rig(
    cluster: RealCluster, backend: tuple[LocalBackend, ThreadedServer], tmp_path: Path
) -> Iterator[Rig]:
    with running_rig(cluster, backend, tmp_path) as started:
        yield started
