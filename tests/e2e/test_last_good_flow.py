"""The whole process keeping its last good state: the manager (`app serve`) syncs from a
signing local backend into the real control plane and stores what it accepted in its
ConfigMap; the backend goes away and the manager is restarted; a Deployment deleted and
another scaled by hand are put back from the store by the new process, which deletes
nothing and says on `/v1/status` and the page that it enforces the last good state."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from app.domain.manifests import MANAGED_BY, MANAGED_BY_LABEL, VERSION_ANNOTATION
from app.services.last_good import STATE_CONFIG_MAP
from standins.backend import LocalBackend
from standins.servers import ThreadedServer
from standins.sync_world import KEY, NAMESPACE, NODE, manifest, sync_env
from tests.support.polling import eventually_sync
from tests.support.process import ManagerProcess
from tests.support.real_cluster import RealCluster

pytestmark = pytest.mark.e2e

OWN = "workload-manager"
SIGNER = Ed25519PrivateKey.generate()


def owned(name: str, version: str) -> dict[str, Any]:
    found = manifest(name, version)
    found["spec"]["replicas"] = 1  # the manifest owns the scale: a change is drift
    return found


def stored(cluster: RealCluster) -> dict[str, str]:
    found = cluster.plane.get("configmap", STATE_CONFIG_MAP, OWN) or {}
    data: dict[str, str] = found.get("data") or {}
    return data


def status(process: ManagerProcess) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(f"{process.url}/v1/status", timeout=5).json()
    return found


def test_a_restarted_manager_enforces_its_stored_state_while_the_backend_is_away(
    cluster: RealCluster, tmp_path: Path
) -> None:
    cluster.plane.kubectl(
        "-n", OWN, "patch", "configmap", STATE_CONFIG_MAP, "--type=json",
        "-p", '[{"op": "remove", "path": "/data"}]', check=False,
    )  # fmt: skip
    local = LocalBackend(NODE, KEY.public_key())
    local.signing_key = SIGNER
    for name in ("api", "web"):
        local.set_manifest(name, "1.0.0", owned(name, "1.0.0"))
    local.set_desired([{"name": "api", "version": "1.0.0"}, {"name": "web", "version": "1.0.0"}])
    server = ThreadedServer(local.app).start()
    public = SIGNER.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    env = sync_env(server.url, cluster.write_kubeconfig(tmp_path / "kc", NAMESPACE)) | {
        "SYNC_INTERVAL_SECONDS": "2",
        "REPORT_INTERVAL_SECONDS": "3600",
        "POD_NAMESPACE": OWN,
        "DESIRED_STATE_PUBLIC_KEYS": base64.b64encode(public).decode(),
    }
    try:
        first = ManagerProcess(env=env, workdir=tmp_path).start()
        try:
            local.wait_for(lambda: len(local.versions) == 2, 30)
            eventually_sync(lambda: bool(stored(cluster)), within=20)
            serial = status(first)["sync"]["desired"]["desired_serial"]
            assert isinstance(serial, int)
        finally:
            first.stop()
    finally:
        server.stop()  # the backend is gone for the rest of the test

    orphan = manifest("orphan", "0.1.0")
    orphan["metadata"]["namespace"] = NAMESPACE
    orphan["metadata"]["labels"] = {MANAGED_BY_LABEL: MANAGED_BY}
    cluster.add_deployment(orphan)
    cluster.plane.kubectl("-n", NAMESPACE, "delete", "deployment", "api", "--wait=true")
    cluster.plane.kubectl("-n", NAMESPACE, "scale", "deployment", "web", "--replicas=3")

    second = ManagerProcess(env=env, workdir=tmp_path).start()
    try:

        def repaired() -> bool:
            api = cluster.get_deployment(NAMESPACE, "api")
            web = cluster.get_deployment(NAMESPACE, "web") or {}
            return api is not None and web.get("spec", {}).get("replicas") == 1

        eventually_sync(repaired, within=30)
        api = cluster.get_deployment(NAMESPACE, "api") or {}
        assert api["metadata"]["annotations"][VERSION_ANNOTATION] == "1.0.0"
        assert cluster.get_deployment(NAMESPACE, "orphan") is not None  # never deleted
        now = status(second)
        desired = now["sync"]["desired"]
        assert desired["from"] == "last good" and desired["desired_serial"] == serial
        assert desired["text"].startswith(f"last good, serial {serial}, stored ")
        assert "backend unreachable since" in desired["text"]
        held = {r["name"]: r for r in now["sync"]["last"]["results"]}["orphan"]
        assert held["outcome"] == "held" and "not deleted" in held["reason"]
        page = httpx.get(f"{second.url}/", timeout=5).text
        assert f"desired state: last good, serial {serial}, stored " in page
        metrics = httpx.get(f"{second.url}/metrics", timeout=5).text
        assert "workload_manager_desired_state_offline 1.0" in metrics
        reason = now["components"]["sync"]["reason"]
        assert f"last good state: ConfigMap {OWN}/{STATE_CONFIG_MAP}: serial {serial}" in reason
    finally:
        second.stop()
    assert local.rejected == []
