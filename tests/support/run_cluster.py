"""`make run-cluster`: the manager on embedded defaults plus a real control plane and the
example desired state, to watch the sync do its job.

Starts the test control plane (etcd, kube-apiserver, controllers, kwok with one fake
node; `make control-plane` builds it), applies the repo's namespaces, ServiceAccount and
RBAC, and runs `workload-manager serve` with the manager's own ServiceAccount token,
syncing `examples/desired-state/` into the `workloads` namespace every 30 s. Prints the
admin kubeconfig for kubectl. Ctrl-C stops everything. kwok fakes pods' status: no
container ever runs, this is not a container runtime.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from standins.control_plane import ControlPlane

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"


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
    try:
        for name in ("namespace.yaml", "workloads-namespace.yaml", "serviceaccount.yaml",
                     "rbac.yaml", "uptime-configmap.yaml"):  # fmt: skip
            plane.kubectl("apply", "-f", str(K8S / name))
        token = plane.token_for("workload-manager", "workload-manager", hours=24)
        kubeconfig = plane.write_kubeconfig(
            workdir / "manager.kubeconfig", token=token, namespace="workloads"
        )
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "DESIRED_STATE_DIR": str(ROOT / "examples" / "desired-state"),
            "MANAGED_NAMESPACE": "workloads",
            "SYNC_INTERVAL_SECONDS": os.environ.get("SYNC_INTERVAL_SECONDS", "30"),
            "CLUSTER_REFRESH_SECONDS": os.environ.get("CLUSTER_REFRESH_SECONDS", "5"),
        }
        print(  # noqa: T201
            f"\ncontrol plane up at {plane.url}; as its admin:\n"
            f"  kubectl --kubeconfig {plane.admin_kubeconfig} get deploy,pods -n workloads\n"
            "the manager syncs examples/desired-state/ with its own ServiceAccount token;\n"
            "status page: http://127.0.0.1:8080/  (Ctrl-C stops everything)\n",
            flush=True,
        )
        manager = subprocess.Popen([sys.executable, "-m", "app", "serve"], env=env, cwd=ROOT)
        try:
            return manager.wait()
        except KeyboardInterrupt:
            manager.send_signal(signal.SIGTERM)
            manager.wait()
            return 0
    finally:
        plane.stop()


if __name__ == "__main__":
    raise SystemExit(main())
