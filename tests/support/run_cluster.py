"""`make run-cluster`: the manager on embedded defaults plus a real control plane and the
example desired state, to watch the sync do its job.

Starts the test control plane (etcd, kube-apiserver, controllers, kwok with one fake
node; `make control-plane` builds it), applies the repo's namespaces, ServiceAccount and
RBAC, and runs `workload-manager serve` with the manager's own ServiceAccount token,
syncing `examples/desired-state/` into the `workloads` namespace every 30 s from the local
backend (`standins/backend.py`), which signs each desired state with the development key
(DESIRED_STATE_PUBLIC_KEYS in .env.example); the manager keeps the last good one in the
ConfigMap `workload-manager-desired-state`. Once both workloads run, a second desired
state shows a safe rollout (docs/rollout.md) on the status page: `echo` 2.2.0 waits for
its wave (this node's place is above the rollout's 50 %), and `hello` 1.1.0, an image
kwok never makes ready, misses its progress deadline and is reverted to 1.0.0. Prints the
admin kubeconfig for kubectl. Ctrl-C stops everything. kwok fakes pods' status: no container
ever runs, this is not a container runtime.
"""

from __future__ import annotations

import base64
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from app.domain.manifests import VERSION_ANNOTATION
from app.domain.rollout import place
from standins.backend import LocalBackend, development_signer
from standins.control_plane import ControlPlane

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "desired-state"
K8S = ROOT / "k8s"
NODE_ID = "run-cluster-node"
NAMESPACE = "workloads"


def wave_seed(node_id: str, percent: float) -> str:
    """A rollout seed that places `node_id` at or above `percent`: it waits for the wave."""
    return next(s for n in itertools.count() if place(s := f"echo/demo-{n}", node_id) >= percent)


def _manifest(name: str, version: str) -> dict[str, Any]:
    found: dict[str, Any] = yaml.safe_load(
        (EXAMPLES / "manifests" / name / f"{version}.yaml").read_text()
    )
    return found


def first_act(backend: LocalBackend) -> None:
    """The example desired state, served signed."""
    wanted = yaml.safe_load((EXAMPLES / "workloads.yaml").read_text())["workloads"]
    for name, version in wanted.items():
        backend.set_manifest(name, str(version), _manifest(name, str(version)))
    backend.set_desired([{"name": n, "version": str(v)} for n, v in wanted.items()])


def second_act(backend: LocalBackend) -> None:
    """The desired state that shows a wave and a revert, with the manifests it names."""
    backend.set_manifest("echo", "2.2.0", _manifest("echo", "2.1.0"))
    hello = _manifest("hello", "1.0.0")
    container = hello["spec"]["template"]["spec"]["containers"][0]
    container["image"] = "localhost/pinger:1.1.0-never-ready"  # kwok never makes it ready
    hello["spec"]["progressDeadlineSeconds"] = 20
    backend.set_manifest("hello", "1.1.0", hello)
    backend.set_desired([
        {"name": "echo", "version": "2.2.0",
         "rollout": {"percent": 50, "seed": wave_seed(NODE_ID, 50)}},
        {"name": "hello", "version": "1.1.0",
         "update": {"judge": "rollout", "min_healthy_seconds": 10, "deadline_seconds": 120}},
    ])  # fmt: skip


def stage_when_running(plane: ControlPlane, backend: LocalBackend, stop: threading.Event) -> None:
    """Write the second act once both example workloads run their first versions."""
    while not stop.wait(1.0):
        versions = {
            name: ((plane.get("deployment", name, NAMESPACE) or {}).get("metadata") or {})
            .get("annotations", {})
            .get(VERSION_ANNOTATION)
            for name in ("echo", "hello")
        }
        if versions == {"echo": "2.1.0", "hello": "1.0.0"}:
            time.sleep(15)  # let the page show them running first
            second_act(backend)
            print(  # noqa: T201
                "\nsecond act: echo 2.2.0 waits for its wave, hello 1.1.0 never becomes "
                "ready and is reverted; watch the status page's rollout column\n",
                flush=True,
            )
            return


def _interrupted(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM ends the run as Ctrl-C does: everything stops


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupted)
    data = ROOT / ".data"
    workdir = data / "control-plane"
    if workdir.exists():
        subprocess.run(["rm", "-rf", str(workdir)], check=True)
    print("starting the control plane (etcd, kube-apiserver, controllers, kwok)...", flush=True)  # noqa: T201
    plane = ControlPlane.start(workdir)
    stack = ExitStack()
    try:
        for name in ("namespace.yaml", "workloads-namespace.yaml", "serviceaccount.yaml",
                     "rbac.yaml", "uptime-configmap.yaml",
                     "desired-state-configmap.yaml"):  # fmt: skip
            plane.kubectl("apply", "-f", str(K8S / name))
        token = plane.token_for("workload-manager", "workload-manager", hours=24)
        kubeconfig = plane.write_kubeconfig(
            workdir / "manager.kubeconfig", token=token, namespace="workloads"
        )
        node_key = Ed25519PrivateKey.generate()
        backend = LocalBackend(NODE_ID, node_key.public_key())
        backend.signing_key = development_signer()
        first_act(backend)
        server = stack.enter_context(backend.serve())
        seed = node_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        signer = development_signer().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "NODE_SYSTEM_ENDPOINT": server.url,
            "NODE_PRIVATE_KEY": base64.b64encode(seed).decode(),
            "DESIRED_STATE_PUBLIC_KEYS": base64.b64encode(signer).decode(),
            "POD_NAMESPACE": "workload-manager",
            "NODE_ID": NODE_ID,
            "MANAGED_NAMESPACE": "workloads",
            "SYNC_INTERVAL_SECONDS": os.environ.get("SYNC_INTERVAL_SECONDS", "30"),
            "CLUSTER_REFRESH_SECONDS": os.environ.get("CLUSTER_REFRESH_SECONDS", "5"),
        }
        print(  # noqa: T201
            f"\ncontrol plane up at {plane.url}; as its admin:\n"
            f"  kubectl --kubeconfig {plane.admin_kubeconfig} get deploy,pods -n workloads\n"
            f"the manager syncs examples/desired-state/, served signed by the local backend at "
            f"{server.url},\nwith its own ServiceAccount token;\n"
            "status page: http://127.0.0.1:8080/  (Ctrl-C stops everything)\n",
            flush=True,
        )
        manager = subprocess.Popen([sys.executable, "-m", "app", "serve"], env=env, cwd=ROOT)
        stop = threading.Event()
        act = threading.Thread(target=stage_when_running, args=(plane, backend, stop), daemon=True)
        act.start()
        try:
            return manager.wait()
        except KeyboardInterrupt:
            manager.send_signal(signal.SIGTERM)
            manager.wait()
            return 0
        finally:
            stop.set()
    finally:
        stack.close()
        plane.stop()


if __name__ == "__main__":
    raise SystemExit(main())
