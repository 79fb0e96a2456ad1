"""k8s/workloads-namespace.yaml on a real API server: Pod Security Admission refuses any
pod that breaks the baseline profile, whoever writes it and however, and admits a
compliant one, warning about what the restricted profile would refuse."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from app.domain.pod_security import STANDARD_VERSION
from standins.control_plane import ControlPlane
from tests.conftest import K8S

NAMESPACE_FILE = K8S / "workloads-namespace.yaml"
BASELINE = f'violates PodSecurity "baseline:{STANDARD_VERSION}"'
RESTRICTED_WARNING = f'would violate PodSecurity "restricted:{STANDARD_VERSION}"'


@pytest.fixture(scope="module")
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    """A namespace of its own, made from the managed namespace's file (only renamed)."""
    doc = yaml.safe_load(NAMESPACE_FILE.read_text())
    doc["metadata"]["name"] = name = f"psa-{uuid.uuid4().hex[:8]}"
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(doc))
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false")


def pod(name: str, spec: dict[str, Any] | None = None, **container: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "c", "image": "r/x:1", **container}], **(spec or {})},
    }


def create(plane: ControlPlane, namespace: str, obj: dict[str, Any]) -> tuple[bool, str]:
    """Create as the cluster admin, straight to the API server: (created, stderr)."""
    done = plane.kubectl("-n", namespace, "create", "-f", "-", input=json.dumps(obj), check=False)
    return done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("obj", "says"),
    [
        (pod("caps", securityContext={"capabilities": {"add": ["SYS_ADMIN"]}}),
         'non-default capabilities (container "c" must not include "SYS_ADMIN"'),
        (pod("dac", securityContext={"capabilities": {"add": ["DAC_READ_SEARCH"]}}),
         '"DAC_READ_SEARCH"'),
        (pod("privileged", securityContext={"privileged": True}), "privileged"),
        (pod("hostnet", {"hostNetwork": True}), "host namespaces (hostNetwork=true)"),
        (pod("hostpath", {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}),
         'hostPath volumes (volume "root")'),
        (pod("hostport", ports=[{"containerPort": 80, "hostPort": 80}]), "hostPort"),
        (pod("seccomp", {"securityContext": {"seccompProfile": {"type": "Unconfined"}}}),
         'seccompProfile (pod must not set securityContext.seccompProfile.type to "Unconfined")'),
        (pod("apparmor", {"securityContext": {"appArmorProfile": {"type": "Unconfined"}}}),
         "forbidden AppArmor profile"),
        (pod("sysctl", {"securityContext": {"sysctls": [{"name": "kernel.msgmax",
                                                          "value": "65536"}]}}),
         'forbidden sysctls (kernel.msgmax)'),
        (pod("selinux", securityContext={"seLinuxOptions": {"user": "system_u"}}),
         "seLinuxOptions"),
    ],
    ids=lambda v: v["metadata"]["name"] if isinstance(v, dict) else None,
)  # fmt: skip
def test_a_pod_breaking_the_baseline_is_refused_even_written_directly(
    control_plane: ControlPlane, namespace: str, obj: dict[str, Any], says: str
) -> None:
    created, stderr = create(control_plane, namespace, obj)
    assert not created
    assert "Error from server (Forbidden)" in stderr, stderr
    assert BASELINE in stderr and says in stderr, stderr
    assert control_plane.get("pod", obj["metadata"]["name"], namespace) is None


def test_a_compliant_pod_is_admitted_with_a_warning_about_restricted(
    control_plane: ControlPlane, namespace: str
) -> None:
    created, stderr = create(control_plane, namespace, pod("plain"))
    assert created, stderr
    assert RESTRICTED_WARNING in stderr, stderr
    hardened = pod(
        "hardened",
        {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}},
        securityContext={"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    )
    created, stderr = create(control_plane, namespace, hardened)
    assert created, stderr
    assert "PodSecurity" not in stderr, stderr


def test_the_managed_namespace_carries_the_labels_of_its_file(control_plane: ControlPlane) -> None:
    """The session's `workloads` namespace was applied from the same file."""
    found = json.loads(control_plane.kubectl("get", "namespace", "workloads", "-o", "json").stdout)
    wanted = yaml.safe_load(NAMESPACE_FILE.read_text())["metadata"]["labels"]
    assert wanted.items() <= found["metadata"]["labels"].items()


def test_the_managers_table_and_the_admission_agree(
    control_plane: ControlPlane, namespace: str
) -> None:
    """Every case of the manager's baseline table, as a pod, through the real API server
    (server-side dry run, one request for all). What the manager lets through is
    admitted; what it holds is refused (by Pod Security Admission, or earlier as invalid).
    Two kinds of case are not told apart by name: a value of the wrong type, which the
    server cannot decode (its answer names no pod), and the seccomp annotation of the
    standard before v1.19, which the manager still refuses and the server ignores."""
    from app.domain.pod_security import SECCOMP_POD_ANNOTATION
    from tests.domain.test_pod_security import BASELINE_CASES

    pods, held, unnamed = [], set(), set()
    for i, case in enumerate(BASELINE_CASES):
        template, violations = case.values
        if template["spec"].get("ephemeralContainers"):
            continue  # the API server refuses these on create, whatever they hold
        name = f"case-{i}"
        pods.append({"apiVersion": "v1", "kind": "Pod",
                     "metadata": {**template["metadata"], "name": name},
                     "spec": template["spec"]})  # fmt: skip
        if violations:
            held.add(name)
        text = json.dumps(template)
        if violations and ('"privileged": "true"' in text or SECCOMP_POD_ANNOTATION in text):
            unnamed.add(name)
    body = json.dumps({"apiVersion": "v1", "kind": "List", "items": pods})
    done = control_plane.kubectl(
        "-n", namespace, "create", "--dry-run=server", "--validate=false", "-f", "-",
        input=body, check=False,
    )  # fmt: skip
    refused = {
        p["metadata"]["name"]
        for p in pods
        if f'"{p["metadata"]["name"]}" is forbidden' in done.stderr
        or f'"{p["metadata"]["name"]}" is invalid' in done.stderr
    }
    admitted = {p["metadata"]["name"] for p in pods} - refused
    assert admitted & held == unnamed, done.stderr
    assert refused - held == set(), done.stderr
