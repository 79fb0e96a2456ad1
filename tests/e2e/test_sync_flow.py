"""The whole process syncing a real cluster: the manager, the local backend, the API server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from standins.backend import LocalBackend
from standins.servers import ThreadedServer
from standins.sync_world import NAMESPACE, WRITES, desire, manifest, sync_env
from tests.support.process import manager
from tests.support.real_cluster import RealCluster

pytestmark = pytest.mark.e2e


def images(cluster: RealCluster) -> dict[str, str]:
    return {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]["image"]
        for d in cluster.list_deployments(NAMESPACE)
    }


def test_a_version_bump_is_rolled_out_and_reported(
    cluster: RealCluster, backend: tuple[LocalBackend, ThreadedServer], tmp_path: Path
) -> None:
    local, server = backend
    theirs = manifest("theirs", "1")
    theirs["metadata"]["namespace"] = NAMESPACE
    cluster.add_deployment(theirs)
    desire(local, ("api", "1.0.0"), ("worker", "1.0.0"))
    env = sync_env(server.url, cluster.write_kubeconfig(tmp_path / "kc", NAMESPACE))
    env |= {"SYNC_INTERVAL_SECONDS": "1", "REPORT_INTERVAL_SECONDS": "1"}
    with manager(env=env, workdir=tmp_path) as m:
        local.wait_for(lambda: len(local.versions) >= 2, timeout=20)
        assert images(cluster)["api"] == "registry.example/api:1.0.0"
        desire(local, ("api", "1.1.0"), ("worker", "1.0.0"))
        local.wait_for(lambda: ("api", "1.1.0") in [(n, b["version"]) for n, b in local.versions],
                       timeout=20)  # fmt: skip
        assert images(cluster)["api"] == "registry.example/api:1.1.0"
        # the report carries the cluster's view of each workload
        local.wait_for(
            lambda: any(
                {w["name"]: w.get("deployed_version") for w in r["workloads"]}.get("api") == "1.1.0"
                for r in local.reports
            ),
            timeout=20,
        )
        status = httpx.get(f"{m.url}/v1/status").json()
        assert status["components"]["sync"]["state"] == "ok"
        assert status["sync"]["last"]["ok"] is True
        # a backend outage: syncs fail, nothing changes in the cluster
        local.fail("workloads", "500", times=None)
        cluster.clear_requests()
        failures = len(local.requests)
        local.wait_for(lambda: len(local.requests) >= failures + 2, timeout=20)
        assert [r for r in cluster.requests if r.method in WRITES] == []
        assert httpx.get(f"{m.url}/healthz").status_code == 200
        local.clear_failures()
    assert "theirs" in images(cluster), "an unmanaged Deployment survives"
    assert local.rejected == []


def test_sync_endpoint_runs_a_sync_and_plans_a_dry_run(
    cluster: RealCluster, backend: tuple[LocalBackend, ThreadedServer], tmp_path: Path
) -> None:
    local, server = backend
    desire(local, ("api", "1.0.0"))
    env = sync_env(server.url, cluster.write_kubeconfig(tmp_path / "kc", NAMESPACE))
    env |= {"SYNC_INTERVAL_SECONDS": "3600", "API_TOKEN": "op-token"}
    with manager(env=env, workdir=tmp_path) as m:
        auth = {"authorization": "Bearer op-token"}
        assert httpx.post(f"{m.url}/v1/sync").status_code == 401
        plan = httpx.post(f"{m.url}/v1/sync?dry_run=true", headers=auth, timeout=30).json()
        assert [(r["name"], r["outcome"]) for r in plan["results"]] == [("api", "planned")]
        assert plan["dry_run"] is True
        result = httpx.post(f"{m.url}/v1/sync", headers=auth, timeout=30).json()
        assert result["ok"] is True
        assert result["counts"] == {"create": 1}
    assert set(images(cluster)) == {"api"}


def run_cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app", *args],
        env={"PATH": os.environ.get("PATH", ""), "HOME": str(cwd), **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_sync_once_dry_run_prints_the_plan_and_changes_nothing(
    cluster: RealCluster, backend: tuple[LocalBackend, ThreadedServer], tmp_path: Path
) -> None:
    local, server = backend
    desire(local, ("api", "1.0.0"), ("worker", "2.0.0"))
    env = sync_env(server.url, cluster.write_kubeconfig(tmp_path / "kc", NAMESPACE))
    dry = run_cli(["sync", "--once", "--dry-run"], env, tmp_path)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert lines[0].startswith("Sync plan (dry run: nothing was changed)")
    assert lines[1].split() == ["WORKLOAD", "ACTION", "FROM", "TO", "OUTCOME", "REASON"]
    assert lines[2].split() == ["api", "create", "-", "1.0.0", "planned", "missing"]
    assert lines[3].split() == ["worker", "create", "-", "2.0.0", "planned", "missing"]
    assert cluster.list_deployments(NAMESPACE) == []
    assert [r for r in cluster.requests if r.method in WRITES] == []
    real = run_cli(["sync", "--once"], env, tmp_path)
    assert real.returncode == 0, real.stderr
    assert "create=2" in real.stdout
    assert set(images(cluster)) == {"api", "worker"}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_lists_what_the_manager_created(
    cluster: RealCluster, backend: tuple[LocalBackend, ThreadedServer], tmp_path: Path
) -> None:
    local, server = backend
    desire(local, ("api", "1.0.0"), ("worker", "2.0.0"))
    env = sync_env(server.url, cluster.write_kubeconfig(tmp_path / "kc", NAMESPACE))
    assert run_cli(["sync", "--once"], env, tmp_path).returncode == 0
    direct = cluster.write_direct_kubeconfig(tmp_path / "direct", NAMESPACE)
    listed = subprocess.run(
        ["kubectl", f"--kubeconfig={direct}", "get", "deploy", "-n", NAMESPACE,
         "-l", "app.kubernetes.io/managed-by=workload-manager", "-o", "json"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    items = json.loads(listed.stdout)["items"]
    assert sorted(i["metadata"]["name"] for i in items) == ["api", "worker"]
    assert {i["metadata"]["annotations"]["workload-manager.io/version"] for i in items} == {
        "1.0.0",
        "2.0.0",
    }
