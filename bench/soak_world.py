"""The soak's world: real PostgreSQL and nats-server, the local backend, the Kubernetes API
emulator, and the manager as a child process wired to all of them.

Everything lives in one temporary directory on free loopback ports, so a soak can run next
to the test suite or another soak. `started()` stops it all in reverse order on any exit,
an exception or Ctrl-C included: a soak that dies must not leave servers behind.
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
from bench.servers import HOST, ServerProcess, ServerSpec, free_port
from tests.support.backend import LocalBackend
from tests.support.kube_emulator import KubeEmulator
from tests.support.sync_world import manifest

NODE = "soak-node"
TIER = "A"
NAMESPACE = "workloads"
FIRST_VERSION = "1.0.0"
PING_TOKEN_SECRET = "soak-ping-token-secret"  # only ever sent to 127.0.0.1
# Rollouts become ready after ROLLOUT_DELAY; nothing in the soak should ever hit the deadline.
ROLLOUT_DELAY = 0.2
PROGRESS_DEADLINE = 60.0


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
    emulator: KubeEmulator
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
        emulator_port = int(self.emulator.url.rsplit(":", 1)[1])
        return {
            self.pg.port: "postgres",
            self.nats.port: "nats",
            self.backend_port: "backend",
            emulator_port: "kube API",
        }

    def deployed_versions(self) -> dict[str, str]:
        """Managed Deployments in the emulator, by name, with the version they carry."""
        listed = self.emulator.list_deployments(NAMESPACE, label_selector=MANAGED_SELECTOR)
        return {
            d["metadata"]["name"]: (d["metadata"].get("annotations") or {}).get(
                VERSION_ANNOTATION, ""
            )
            for d in listed
        }


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
        emulator = KubeEmulator(rollout_delay=ROLLOUT_DELAY, progress_deadline=PROGRESS_DEADLINE)
        stack.callback(emulator.stop)
        emulator.start()
        kubeconfig = emulator.write_kubeconfig(workdir / "kubeconfig", NAMESPACE)

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
        world = World(workdir, pg, nats, backend, emulator, manager, server.port)
        world.desire({f"soak-{i:03d}": FIRST_VERSION for i in range(workloads)})
        stack.callback(manager.stop)  # first to go: registered last
        _say(f"starting the manager on port {port}")
        manager.start()
        _say(f"manager ready (pid {manager.pid})")
        yield world
