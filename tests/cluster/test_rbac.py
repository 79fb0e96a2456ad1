"""k8s/rbac.yaml on a real API server, exercised with the manager's own token: what the
manager does is allowed, nothing else is. The sync tests beside this one run every write
the sync makes with the same token."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from app.adapters.kube import KubeDeployments, KubeError, load_configuration
from standins.control_plane import MANAGER_ACCOUNT, ControlPlane
from standins.sync_world import manifest
from tests.conftest import K8S

CRDS_SCRIPT = K8S.parent / "tools" / "control-plane" / "crds.sh"

OWN = "workload-manager"  # the manager's namespace and Deployment


def can_i(plane: ControlPlane, verb: str, resource: str, namespace: str) -> bool:
    ns, account = MANAGER_ACCOUNT
    found = plane.kubectl(
        "auth", "can-i", verb, resource, "-n", namespace,
        f"--as=system:serviceaccount:{ns}:{account}", check=False,
    )  # fmt: skip
    return found.stdout.strip() == "yes"


@pytest.mark.parametrize(
    ("verb", "resource", "namespace", "allowed"),
    [
        ("list", "deployments.apps", "workloads", True),
        ("create", "deployments.apps", "workloads", True),
        ("patch", "deployments.apps", "workloads", True),
        ("delete", "deployments.apps", "workloads", True),
        ("update", "deployments.apps", "workloads", False),
        ("watch", "deployments.apps", "workloads", False),
        ("deletecollection", "deployments.apps", "workloads", False),
        ("list", "deployments.apps", "default", False),
        ("get", "secrets", "workloads", False),
        ("get", f"deployments.apps/{OWN}", OWN, True),
        ("patch", f"deployments.apps/{OWN}", OWN, True),
        ("patch", "deployments.apps/someone-else", OWN, False),
        ("list", "pods", OWN, False),
        ("list", "pods", "workloads", True),  # crash loops
        ("get", "configmaps/workload-manager-uptime", OWN, True),  # uptime kept
        ("patch", "configmaps/workload-manager-uptime", OWN, True),
        ("get", "configmaps/workload-manager-desired-state", OWN, True),  # last good state
        ("patch", "configmaps/workload-manager-desired-state", OWN, True),
        ("patch", "configmaps/another-config", OWN, False),
        ("get", "configmaps/other", OWN, False),
        ("create", "configmaps", OWN, False),
        ("get", "pods", "workloads", False),
        ("watch", "pods", "workloads", False),
        ("get", "pods/log", "workloads", False),
        ("create", "pods/exec", "workloads", False),
        ("get", "clusterroles.rbac.authorization.k8s.io", "", False),
    ],
)
def test_the_manager_may_do_what_it_does_and_nothing_else(
    control_plane: ControlPlane, verb: str, resource: str, namespace: str, allowed: bool
) -> None:
    args = (verb, resource, namespace or "default")
    assert can_i(control_plane, *args) is allowed


async def test_its_token_reaches_its_own_deployment_and_no_other_namespace(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    own = manifest(OWN, "0.1.0")
    own["metadata"]["namespace"] = OWN
    control_plane.kubectl("-n", OWN, "delete", "deployment", OWN, "--ignore-not-found")
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(own))
    token = control_plane.token_for(*MANAGER_ACCOUNT)
    config_path = control_plane.write_kubeconfig(tmp_path / "kc", token=token, namespace=OWN)
    configuration, _source = await load_configuration(config_path)
    mine = KubeDeployments(configuration, namespace=OWN, timeout=10)
    elsewhere = KubeDeployments(configuration, namespace="default", timeout=10)
    try:
        assert (await mine.get(OWN) or {})["metadata"]["name"] == OWN
        patched = await mine.patch(OWN, {"metadata": {"annotations": {"rbac-test": "yes"}}})
        assert patched["metadata"]["annotations"]["rbac-test"] == "yes"
        assert (await mine.server_version()).startswith("v1.")
        with pytest.raises(KubeError, match="403"):
            await elsewhere.list_managed("app.kubernetes.io/managed-by=workload-manager")
    finally:
        await mine.aclose()
        await elsewhere.aclose()
        control_plane.kubectl("-n", OWN, "delete", "deployment", OWN)


@pytest.mark.parametrize("folder", [K8S, K8S / "overlays" / "worker"], ids=["base", "worker"])
def test_the_manifests_are_accepted_by_the_api_server(
    control_plane: ControlPlane, folder: Path
) -> None:
    # against a namespace without a Deployment of that name (a selector is immutable)
    control_plane.kubectl("-n", OWN, "delete", "deployment", OWN, "--ignore-not-found")
    result = control_plane.kubectl("apply", "--dry-run=server", "-k", str(folder), check=False)
    assert result.returncode == 0, result.stderr


def test_the_monitoring_manifests_are_accepted_with_the_upstream_crds(
    control_plane: ControlPlane,
) -> None:
    """k8s/monitoring/ against prometheus-operator's own CRDs (pinned in
    tools/control-plane/versions.env): a field the schema does not know fails here."""
    crds = (
        subprocess.run([str(CRDS_SCRIPT)], capture_output=True, text=True, check=True, timeout=300)
        .stdout.strip()
        .splitlines()[-1]
    )
    control_plane.kubectl("apply", "--server-side", "--field-manager=test-admin", "-f", crds)
    control_plane.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s",
        "crd/servicemonitors.monitoring.coreos.com", "crd/prometheusrules.monitoring.coreos.com",
    )  # fmt: skip
    folder = str(K8S / "monitoring")
    result = control_plane.kubectl("apply", "--dry-run=server", "-k", folder, check=False)
    assert result.returncode == 0, result.stderr
    assert "servicemonitor.monitoring.coreos.com/workload-manager" in result.stdout
    assert "prometheusrule.monitoring.coreos.com/" in result.stdout
