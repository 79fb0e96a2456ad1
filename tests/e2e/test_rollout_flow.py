"""The whole process rolling out a bad version: the manager (`app serve`), the local backend,
the real control plane, and a workload that pings it over HTTP but never with the new
version. The manager is killed (SIGKILL) while it judges the update; the next process
reads the judgement from the Deployment and reverts exactly once."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.domain.manifests import VERSION_ANNOTATION
from app.domain.tokens import ping_token
from standins.backend import LocalBackend
from standins.servers import ThreadedServer
from standins.sync_world import NAMESPACE, manifest, sync_env
from tests.support.process import ManagerProcess
from tests.support.real_cluster import RealCluster

pytestmark = pytest.mark.e2e

FAST = {"min_healthy_seconds": 2, "deadline_seconds": 10}


class Pinger:
    """The workload: pings the manager it is pointed at, over HTTP, as version `version`."""

    def __init__(self, name: str, secret: str) -> None:
        self.url: str | None = None
        self.version = "1.0.0"
        self.answers: list[dict[str, str]] = []
        self._name, self._token = name, ping_token(secret, name)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Pinger:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self._stop.wait(0.3):
                if self.url is None:
                    continue
                try:
                    answer = client.post(
                        f"{self.url}/v1/workloads/{self._name}/health",
                        json={"status": "healthy", "version": self.version},
                        headers={"authorization": f"Bearer {self._token}"},
                    )
                except httpx.TransportError:
                    continue  # the manager is being restarted
                self.answers.append(dict(answer.headers))


def rolled_back(local: LocalBackend) -> list[dict[str, Any]]:
    return [b for n, b in local.versions if n == "api" and b.get("outcome") == "rolled_back"]


def test_a_manager_killed_mid_judgement_reverts_once_after_its_restart(
    cluster: RealCluster, backend: tuple[LocalBackend, ThreadedServer], tmp_path: Path
) -> None:
    local, server = backend
    env = sync_env(server.url, cluster.write_kubeconfig(tmp_path / "kc", NAMESPACE))
    env |= {
        "SYNC_INTERVAL_SECONDS": "2",
        "UPDATE_JUDGE_INTERVAL_SECONDS": "0.5",
        "REPORT_INTERVAL_SECONDS": "3600",
    }
    local.set_manifest("api", "1.0.0", manifest("api", "1.0.0"))
    local.set_manifest("api", "1.1.0", manifest("api", "1.1.0"))
    local.set_desired([{"name": "api", "version": "1.0.0", "update": FAST}])
    with Pinger("api", env["PING_TOKEN_SECRET"]) as pinger:
        first = ManagerProcess(env=env, workdir=tmp_path).start()
        try:
            pinger.url = first.url
            local.wait_for(lambda: [b["version"] for _, b in local.versions] == ["1.0.0"], 20)
            local.wait_for(lambda: len(pinger.answers) >= 2, 10)
            local.set_desired([{"name": "api", "version": "1.1.0", "update": FAST}])
            local.wait_for(lambda: ("1.1.0", "applied") in _outcomes(local), 20)
            first.send(signal.SIGKILL)  # judging: no chance to finish anything
            first.wait(timeout=10)
        finally:
            first.stop()
        assert rolled_back(local) == []
        second = ManagerProcess(env=env, workdir=tmp_path).start()
        try:
            pinger.url = second.url
            local.wait_for(lambda: len(rolled_back(local)) == 1, 60)
            (put,) = rolled_back(local)
            assert (put["version"], put["attempted_version"]) == ("1.0.0", "1.1.0")
            assert "never pinged" in put["reason"]
            live = cluster.get_deployment(NAMESPACE, "api") or {}
            assert live["metadata"]["annotations"][VERSION_ANNOTATION] == "1.0.0"
            image = live["spec"]["template"]["spec"]["containers"][0]["image"]
            assert image == "registry.example/api:1.0.0"
            status = httpx.get(f"{second.url}/v1/status").json()
            (api,) = [w for w in status["workloads"] if w["name"] == "api"]
            assert api["update"]["state"] == "rolled-back"
            assert api["update"]["failed_versions"] == ["1.1.0"]
            # later syncs leave the failed version be: still one revert, one alert
            local.wait_for(lambda: _gets(local) >= 3, 20)
            assert len(rolled_back(local)) == 1
            alerts = httpx.get(f"{second.url}/v1/status").json()["alerts"]
            assert [a["key"] for a in alerts] == ["rollout:api:1.1.0:rolled-back"]
        finally:
            second.stop()
    assert local.rejected == []


def _gets(local: LocalBackend) -> int:
    return sum(1 for r in local.requests if r.method == "GET" and r.path.endswith("/workloads"))


def _outcomes(local: LocalBackend) -> list[tuple[str, str]]:
    return [(b["version"], b.get("outcome", "")) for n, b in local.versions if n == "api"]
