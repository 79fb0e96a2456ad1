"""`make run-node`: a real single-node cluster with the manager installed on it from its
image, to watch it do its whole job.

Starts the node of the tests (tests/support/node.py: the control plane, kubelet,
kube-proxy, containerd and the CNI bridge in a network namespace of its own), side-loads
the images `make image` built, installs the manager from the rendered `k8s/` file as
`lfgnode start` does (docs/install.md), and has the local backend want
`examples/desired-state/`; prints the kubectl commands to look. Ctrl-C (or SIGTERM)
removes everything: processes, mounts, cgroups and files.
"""

from __future__ import annotations

import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from tests.support.node import Node
from tests.support.node_world import OWN_NS, WORKLOADS, installed, ready, until

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "desired-state"


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
            kubectl = " ".join(shlex.quote(part) for part in (
                "nsenter", f"--net=/proc/{node.holder.pid}/ns/net", "kubectl",
                f"--kubeconfig={node.plane.admin_kubeconfig}",
            ))  # fmt: skip
            _say(
                "\nthe node is up; the manager syncs examples/desired-state/ from the local "
                "backend. Look with:\n"
                f"  {kubectl} get nodes -o wide\n"
                f"  {kubectl} -n {OWN_NS} get pods\n"
                f"  {kubectl} -n {OWN_NS} logs deploy/workload-manager -f\n"
                f"  {kubectl} -n {WORKLOADS} get deploy,pods\n"
                "Ctrl-C removes everything.\n"
            )
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        _say("removing the node...")
        node.stop()


if __name__ == "__main__":
    sys.exit(main())
