"""The manager installed on the real node (tests/support/node.py) as a user's node gets it:
the images built here and side-loaded into containerd, the rendered `k8s/` install file
applied as `lfgnode start` applies it (docs/install.md), the node's Secret and settings,
and the servers it talks to (the local backend, the version file, Matrix and Sentry
stand-ins, PostgreSQL and nats-server) on this machine's loopback, each forwarded to a
port of the node's address."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.adapters.embedded import EmbeddedNats, EmbeddedPostgres
from standins.backend import LocalBackend
from standins.control_plane import ROOT
from standins.sentry_receiver import SentryReceiver
from standins.servers import serve
from standins.sync_world import KEY, NODE, key_seed
from tests.support.matrix_receiver import ROOM, TOKEN, MatrixReceiver
from tests.support.node import NODE_IP, Node
from tests.support.version_file import REPO, VersionFileServer

IMAGE_BUILD = ROOT / "tools" / "image" / "build.sh"
OWN_NS = "workload-manager"
WORKLOADS = "workloads"
PINGER = "localhost/pinger:1"
API_TOKEN = "node-api-token"
GOOD, NEVER_READY = "0.2.0", "0.3.0"
# the node's ports for the loopback servers (its own namespace: no other run shares them)
PORTS = {"backend": 18080, "versions": 18081, "matrix": 18082, "sentry": 18083,
         "postgres": 15432, "nats": 14222}  # fmt: skip
# short intervals, so that each step of the tests is seconds, not minutes
SETTINGS = {
    "LOG_LEVEL": "INFO", "SCHEDULER_JITTER_FRACTION": "0",
    "SYNC_INTERVAL_SECONDS": "3", "REPORT_INTERVAL_SECONDS": "2",
    "HEARTBEAT_INTERVAL_SECONDS": "5",
    "PING_STALE_SECONDS": "6", "UPTIME_RESTART_AFTER_SECONDS": "10",
    "UPTIME_RESTART_BACKOFF_SECONDS": "10",
    "SELF_UPDATE_INTERVAL_SECONDS": "3", "SELF_UPDATE_POLL_SECONDS": "1",
    "SELF_UPDATE_DEADLINE_SECONDS": "45", "SELF_UPDATE_ALLOW_PRERELEASE": "false",
    "SELF_UPDATE_MIN_HEALTHY_SECONDS": "0",
    "NATS_STREAM_REPLICAS": "1", "NATS_AUTO_INIT_STREAMS": "true", "NODE_TIER": "C",
    "ALERT_WINDOW_SECONDS": "60", "CLUSTER_REFRESH_SECONDS": "2",
    # a workload update's judgement: a version pinging unhealthy for 8 s is reverted
    "WORKLOAD_UPDATE_UNHEALTHY_SECONDS": "8", "UPDATE_JUDGE_INTERVAL_SECONDS": "1",
    # the first runs spread as in production, over seconds (30 s by default)
    "STARTUP_SPREAD_SECONDS": "3",
    # the backend and the version file are this machine's, reached through the node's own
    # namespace: plain http with no one on the path (production refuses it otherwise)
    "ALLOW_PLAIN_HTTP": "NODE_SYSTEM_ENDPOINT,SELF_UPDATE_URL",
}  # fmt: skip


def build_image(*args: str, env: dict[str, str] | None = None) -> Path:
    """tools/image/build.sh (cached); the archive it names on its last line."""
    done = subprocess.run(
        [str(IMAGE_BUILD), *args], capture_output=True, text=True,
        env={**os.environ, **(env or {})}, timeout=3600,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"tools/image/build.sh {' '.join(args)}:\n{done.stderr[-4000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def images() -> list[Path]:
    """Every image the node tests side-load: the pause and pinger images, the manager at its
    own version, 0.2.0 (the same code, another version) and 0.3.0, which never serves."""
    helpers = build_image("--helpers")
    current = build_image("--never-ready", NEVER_READY)
    good = build_image("--version", GOOD)
    return [
        helpers / "pause-3.10.oci.tar", helpers / "pinger-1.oci.tar", current, good,
        current.parent / f"workload-manager-{NEVER_READY}.oci.tar",
    ]  # fmt: skip


def render_install(out: Path) -> Path:
    """The one file `lfgnode start` applies: `kubectl kustomize k8s/` (docs/install.md)."""
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(ROOT / "k8s")], capture_output=True, text=True, check=True
    ).stdout
    out.write_text(rendered)
    return out


@dataclass
class NodeWorld:
    node: Node
    backend: LocalBackend
    versions: VersionFileServer
    matrix: MatrixReceiver
    install: Path

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        assert self.node.plane is not None
        return self.node.plane.kubectl(*args, input=input, check=check).stdout

    def get(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        assert self.node.plane is not None
        return self.node.plane.get(kind, name, namespace)

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        listed = json.loads(self.kubectl("-n", namespace, "get", "pods", "-l", selector, "-o",
                                         "json"))  # fmt: skip
        items: list[dict[str, Any]] = listed["items"]
        return items

    def manager_pods(self) -> list[dict[str, Any]]:
        return self.pods(OWN_NS, "app.kubernetes.io/name=workload-manager")

    def apply_install(self) -> None:
        """What K3S's deploy controller does with a file in its auto-deploy folder at every
        start, and `lfgnode start` once: a client-side (three-way) apply."""
        self.kubectl("apply", "-f", str(self.install))

    def exec_manager(self, code: str) -> str:
        """Python in the running manager container (its own interpreter and user)."""
        ready = [p for p in self.manager_pods() if _ready(p)]
        assert ready, "no ready manager pod"
        return self.kubectl("-n", OWN_NS, "exec", ready[0]["metadata"]["name"], "-c", "manager",
                            "--", "python", "-c", code)  # fmt: skip

    def status(self) -> dict[str, Any]:
        """GET /v1/status from inside the manager's pod, with the API token."""
        out = self.exec_manager(
            "import urllib.request as u;"
            "r=u.Request('http://127.0.0.1:8080/v1/status',"
            f"headers={{'Authorization':'Bearer {API_TOKEN}'}});"
            "print(u.urlopen(r,timeout=5).read().decode())"
        )
        found: dict[str, Any] = json.loads(out)
        return found

    def latest_report(self) -> dict[str, Any] | None:
        reports = self.backend.reports
        return reports[-1] if reports else None

    def workload(self, name: str) -> dict[str, Any] | None:
        report = self.latest_report()
        for item in (report or {}).get("workloads", []):
            if item["name"] == name:
                found: dict[str, Any] = item
                return found
        return None


def _ready(pod: dict[str, Any]) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return False
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def ready(pod: dict[str, Any]) -> bool:
    return _ready(pod)


def until(what: str, check: Callable[[], Any], timeout: float = 120.0) -> Any:
    """Poll `check` until it returns something truthy; that value (or fail naming `what`)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


@contextmanager
def installed(node: Node, workdir: Path) -> Iterator[NodeWorld]:
    for archive in images():
        node.import_image(archive)
    backend = LocalBackend(NODE, KEY.public_key())
    versions = VersionFileServer()
    versions.set(body=b"0.1.0")
    matrix = MatrixReceiver()
    with ExitStack() as stack:
        postgres = EmbeddedPostgres(workdir / "pg").start()
        stack.callback(postgres.stop)
        nats = EmbeddedNats(workdir / "nats").start()
        stack.callback(nats.stop)
        servers = {
            "backend": stack.enter_context(backend.serve()).port,
            "versions": stack.enter_context(serve(versions.app)).port,
            "matrix": stack.enter_context(serve(matrix.app)).port,
            "sentry": stack.enter_context(serve(SentryReceiver().app)).port,
            "postgres": postgres.port,
            "nats": nats.port,
        }
        at = {name: node.forward(PORTS[name], port) for name, port in servers.items()}
        install = render_install(workdir / "workload-manager.yaml")
        world = NodeWorld(node, backend, versions, matrix, install)
        world.apply_install()
        secret = {
            "NODE_ID": NODE, "NODE_PRIVATE_KEY": key_seed(),
            "NODE_SYSTEM_ENDPOINT": f"http://{at['backend']}",
            "API_TOKEN": API_TOKEN, "PING_TOKEN_SECRET": "node-ping-secret",
            "DATABASE_URL": f"postgresql://postgres@{at['postgres']}/postgres",
            "NATS_URL": f"nats://{at['nats']}",
            "SELF_UPDATE_URL": f"http://{at['versions']}/version",
            "SELF_IMAGE_REPOSITORY": REPO,
            "MATRIX_HOMESERVER": f"http://{at['matrix']}", "MATRIX_ROOM_ID": ROOM,
            "MATRIX_ACCESS_TOKEN": TOKEN,
            "SENTRY_DSN": f"http://publickey@{at['sentry']}/1",
        }  # fmt: skip
        world.kubectl("-n", OWN_NS, "create", "secret", "generic", "workload-manager",
                      *(f"--from-literal={k}={v}" for k, v in secret.items()))  # fmt: skip
        world.kubectl("-n", OWN_NS, "create", "configmap", "workload-manager",
                      *(f"--from-literal={k}={v}" for k, v in SETTINGS.items()))  # fmt: skip
        yield world


__all__ = ["NODE_IP", "NodeWorld", "installed", "ready", "until"]
