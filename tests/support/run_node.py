"""`make run-node`: a real single-node cluster with the manager installed on it from its
image, to watch it do its whole job.

Starts the node of the tests (tests/support/node.py: the control plane, kubelet,
kube-proxy, containerd and the CNI bridge in a network namespace of its own), side-loads
the images `make image` built, installs the manager from the rendered `k8s/` file as
`lfgnode start` does (docs/install.md), and has the local backend want
`examples/desired-state/`; prints how to open the status page and `/v1/status` from this
machine (a port on its loopback that reaches the manager's Service inside the node, and the
API token) and the kubectl commands to look. Ctrl-C (or SIGTERM) removes the node: processes,
mounts, cgroups and the servers' data; the logs are kept, and where and how large is said.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support.node import Node
from tests.support.node_world import (
    API_TOKEN,
    OWN_NS,
    WORKLOADS,
    NodeWorld,
    installed,
    ready,
    until,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "desired-state"
# the manager's port on this machine's loopback (RUN_NODE_PORT; another one if it is taken)
DEFAULT_PORT = 18088


def _interrupted(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _examples() -> dict[str, tuple[str, dict[str, Any]]]:
    wanted = yaml.safe_load((EXAMPLES / "workloads.yaml").read_text())["workloads"]
    return {
        name: (str(version),
               yaml.safe_load((EXAMPLES / "manifests" / name / f"{version}.yaml").read_text()))
        for name, version in wanted.items()
    }  # fmt: skip


def _say(text: str) -> None:
    print(text, flush=True)  # noqa: T201


def _host_port() -> int:
    wanted = int(os.environ.get("RUN_NODE_PORT", DEFAULT_PORT))
    for port in (wanted, 0):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            bound: int = probe.getsockname()[1]
            return bound
    raise RuntimeError("no free port on 127.0.0.1")


def _expose_manager(node: Node, world: NodeWorld) -> str:
    """A port on this machine's loopback that reaches the manager's Service in the node,
    checked with an authenticated GET /v1/status before it is printed."""
    service = world.kubectl("-n", OWN_NS, "get", "service", "workload-manager",
                            "-o", "jsonpath={.spec.clusterIP}:{.spec.ports[0].port}")  # fmt: skip
    address = node.expose(service, _host_port())
    headers = {"Authorization": f"Bearer {API_TOKEN}"}

    def answers() -> bool:
        try:
            return httpx.get(f"http://{address}/v1/status", headers=headers, timeout=5).is_success
        except httpx.HTTPError:
            return False

    until(f"the manager's /v1/status through {address}", answers, timeout=60)
    return address


def _size(path: Path) -> str:
    total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    return f"{total / 2**20:.1f} MiB"


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupted)
    workdir = Path(tempfile.mkdtemp(prefix="workload-manager-node-"))
    _say(f"starting the node (logs in {workdir})...")
    node = Node.start(workdir / "logs")
    try:
        _say("installing the manager from its image, as lfgnode start does...")
        with installed(node, workdir / "world") as world:
            until("the manager Ready", lambda: [p for p in world.manager_pods() if ready(p)],
                  timeout=300)  # fmt: skip
            examples = _examples()
            for name, (version, body) in examples.items():
                world.backend.set_manifest(name, version, body)
            world.backend.set_desired(
                [{"name": name, "version": version} for name, (version, _) in examples.items()]
            )
            assert node.plane is not None and node.holder is not None
            address = _expose_manager(node, world)
            kubectl = " ".join(shlex.quote(part) for part in (
                "nsenter", f"--net=/proc/{node.holder.pid}/ns/net", "kubectl",
                f"--kubeconfig={node.plane.admin_kubeconfig}",
            ))  # fmt: skip
            _say(
                "\nthe node is up; the manager syncs examples/desired-state/ from the local "
                "backend.\n"
                f"Status page: http://{address}/ (any user name; the password is the API token "
                f"{API_TOKEN})\n"
                f"  curl -H 'Authorization: Bearer {API_TOKEN}' http://{address}/v1/status\n"
                "Look with kubectl:\n"
                f"  {kubectl} get nodes -o wide\n"
                f"  {kubectl} -n {OWN_NS} get pods\n"
                f"  {kubectl} -n {OWN_NS} logs deploy/workload-manager -f\n"
                f"  {kubectl} -n {WORKLOADS} get deploy,pods\n"
                "Ctrl-C removes the node (the logs are kept, and where is said).\n"
            )
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        _say("removing the node...")
        node.stop()
        shutil.rmtree(workdir / "world", ignore_errors=True)  # the servers' data
        logs = workdir / "logs"
        _say(f"removed. The logs are kept in {logs} ({_size(logs)}): rm -rf {workdir}")


if __name__ == "__main__":
    sys.exit(main())
