"""The soak's world: real PostgreSQL and nats-server, the local backend, a real Kubernetes
control plane (kube-apiserver and deployment controller, kwok nodes: bench/cluster.py), and
the manager as a child process wired to all of them, with its own ServiceAccount token.

Everything lives in one temporary directory on free loopback ports, so a soak can run next
to the test suite or another soak. The manager's Kubernetes requests are counted by the API
server (`kube_requests()`, since the world started). `started()` stops it all in reverse
order on any exit, an exception or Ctrl-C included: a soak that dies must not leave servers
behind.
"""

from __future__ import annotations

import base64
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from app.adapters.embedded import EmbeddedNats, EmbeddedPostgres
from app.domain.manifests import MANAGED_SELECTOR, VERSION_ANNOTATION
from bench.checks import say
from bench.cluster import ApiserverRequests, Requests, Snapshot, start, write_manager_kubeconfig
from bench.servers import HOST, ServerProcess, ServerSpec, free_port
from standins.backend import LocalBackend
from standins.control_plane import ControlPlane
from standins.sync_world import manifest

NODE = "soak-node"
TIER = "A"
NAMESPACE = "workloads"
FIRST_VERSION = "1.0.0"
PING_TOKEN_SECRET = "soak-ping-token-secret"  # only ever sent to 127.0.0.1


def _say(message: str) -> None:
    say("soak", message)


@dataclass(frozen=True)
class ManagerConfig:
    """The manager's loops as the soak runs them; the rest are the manager's defaults."""

    sync_interval: float
    report_interval: float


@dataclass
class World:
    workdir: Path
    pg: EmbeddedPostgres
    nats: EmbeddedNats
    backend: LocalBackend
    plane: ControlPlane
    requests: ApiserverRequests
    requests_at_start: Snapshot  # before the manager started
    manager: ServerProcess
    backend_port: int
    # name -> version the backend desires now; the version bumper changes it, pingers read it
    desired: dict[str, str] = field(default_factory=dict)

    @property
    def manager_url(self) -> str:
        return f"http://{HOST}:{self.manager.port}"

    def desire(self, versions: Mapping[str, str]) -> None:
        """Serve these versions (and their manifests) as the backend's desired state."""
        for name, version in versions.items():
            if self.desired.get(name) != version:
                self.backend.set_manifest(name, version, manifest(name, version))
        self.desired.update(versions)
        self.backend.set_desired([{"name": n, "version": v} for n, v in self.desired.items()])

    def peers(self) -> dict[int, str]:
        """The manager's outbound servers by port, to name its sockets."""
        return {
            self.pg.port: "postgres",
            self.nats.port: "nats",
            self.backend_port: "backend",
            self.plane.api_port: "kube API",
        }

    def deployed_versions(self) -> dict[str, str]:
        """Managed Deployments in the cluster, by name, with the version they carry (one
        LIST as the admin, left out of `kube_requests`)."""
        listed = self.requests.list_deployments(NAMESPACE, MANAGED_SELECTOR)
        return {
            d["metadata"]["name"]: (d["metadata"].get("annotations") or {}).get(
                VERSION_ANNOTATION, ""
            )
            for d in listed
        }

    def kube_requests(self) -> Requests:
        """The Deployment requests since the world started (before the manager did), as
        the API server counts them: the manager's, plus any other client's with a counted
        verb (bench/cluster.py)."""
        return ApiserverRequests.between(self.requests_at_start, self.requests.settled_snapshot())


def _seed(key: Ed25519PrivateKey) -> str:
    raw = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    return base64.b64encode(raw).decode()


def manager_env(
    *, workdir: Path, pg: str, nats: str, backend: str, key: str, kubeconfig: Path,
    config: ManagerConfig,
) -> dict[str, str]:  # fmt: skip
    """Only what is set here reaches the manager: not the shell's environment, not a `.env`
    (the manager runs in the temporary directory), so a developer's settings cannot change
    what the soak measures."""
    env = {"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8", "HOME": str(workdir)}
    return env | {
        "HOST": HOST,
        "DATA_DIR": str(workdir / "data"),
        "EMBEDDED_SERVICES": "false",
        "LOG_LEVEL": "INFO",
        "LOG_FORMAT": "text",  # the log scan reads the text format's level column
        "DATABASE_URL": pg,
        "NATS_URL": nats,
        "NODE_ID": NODE,
        "NODE_TIER": TIER,
        "NODE_SYSTEM_ENDPOINT": backend,
        "NODE_PRIVATE_KEY": key,
        "KUBECONFIG": str(kubeconfig),
        "MANAGED_NAMESPACE": NAMESPACE,
        "PING_TOKEN_SECRET": PING_TOKEN_SECRET,
        "SYNC_INTERVAL_SECONDS": str(config.sync_interval),
        "REPORT_INTERVAL_SECONDS": str(config.report_interval),
        "REPORT_ENABLED": "true",
        "SYNC_ENABLED": "true",
        "WORKER_ENABLED": "true",
        # every simulated workload pings from this one address (pods each have their own)
        "HTTP_MAX_CONNECTIONS_PER_CLIENT": "1000",
        "MAX_DESIRED_WORKLOADS": "500",  # the soak's own bound on its workloads
    }


@contextmanager
def started(workloads: int, config: ManagerConfig) -> Iterator[World]:
    """Every server up, the desired state served, the manager ready; all stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        (workdir / "data").mkdir()
        _say(f"starting PostgreSQL and nats-server under {workdir}")
        pg = EmbeddedPostgres(workdir / "postgres")
        stack.callback(pg.stop)
        pg.start()
        nats = EmbeddedNats(workdir / "nats")
        stack.callback(nats.stop)
        nats.start()

        key = Ed25519PrivateKey.generate()
        backend = LocalBackend(NODE, key.public_key())
        server = stack.enter_context(backend.serve())
        _say("starting the control plane (etcd, kube-apiserver, controllers, kwok)")
        plane = start(workdir / "control-plane")
        stack.callback(plane.stop)
        requests = ApiserverRequests(plane)
        stack.callback(requests.close)
        kubeconfig = write_manager_kubeconfig(plane, workdir / "kubeconfig", NAMESPACE)

        env = manager_env(
            workdir=workdir, pg=pg.url, nats=nats.url, backend=server.url, key=_seed(key),
            kubeconfig=kubeconfig, config=config,
        )  # fmt: skip
        port = free_port()
        spec = ServerSpec(
            label="manager",
            argv=(sys.executable, "-m", "app", "serve"),
            env={**env, "PORT": str(port)},
            cwd=workdir,
            ready_path="/readyz",
        )
        manager = ServerProcess(spec, port=port, cpus=None, log=workdir / "manager.log")
        at_start = requests.settled_snapshot()
        world = World(workdir, pg, nats, backend, plane, requests, at_start, manager, server.port)
        world.desire({f"soak-{i:03d}": FIRST_VERSION for i in range(workloads)})
        stack.callback(manager.stop)  # first to go: registered last
        _say(f"starting the manager on port {port}")
        manager.start()
        _say(f"manager ready (pid {manager.pid})")
        yield world
