"""The Pod Security Standard as the manager applies it to every manifest."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from app.domain.manifests import Injection, ManifestPolicy, ManifestRejected, prepare_manifest
from app.domain.pod_security import (
    APPARMOR_ANNOTATION,
    BASELINE_CAPABILITIES,
    CONTROLS,
    HOST_NAMESPACES,
    RESTRICTED_VOLUMES,
    SAFE_SYSCTLS,
    SECCOMP_POD_ANNOTATION,
    SELINUX_TYPES,
    Exceptions,
    Level,
    check_pod_template,
)

INJECT = Injection(manager_url="http://manager:8080", ping_token=None)
APPARMOR, SECCOMP_POD = APPARMOR_ANNOTATION, SECCOMP_POD_ANNOTATION
T = "spec.template"
C0 = f"{T}.spec.containers[0]"


def deployment(pod: dict[str, Any], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    spec = {"containers": [{"name": "api", "image": "r/api:1"}], **pod}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "api"},
        "spec": {
            "selector": {"matchLabels": {"app": "api"}},
            "template": {
                "metadata": {"labels": {"app": "api"}, "annotations": annotations or {}},
                "spec": spec,
            },
        },
    }


def container(**fields: Any) -> dict[str, Any]:
    return {"containers": [{"name": "api", "image": "r/api:1", **fields}]}


@pytest.mark.parametrize(
    ("raw", "field", "control"),
    [
        (deployment(container(securityContext={"capabilities": {"add": ["CHOWN", "SYS_ADMIN"]}})),
         f"{C0}.securityContext.capabilities.add[1]", "baseline: Capabilities"),
        (deployment(container(securityContext={"capabilities": {"add": ["DAC_READ_SEARCH"]}})),
         f"{C0}.securityContext.capabilities.add[0]", "baseline: Capabilities"),
        (deployment(container(securityContext={"procMount": "Unmasked"})),
         f"{C0}.securityContext.procMount", "baseline: /proc Mount Type"),
        (deployment({"securityContext": {"seccompProfile": {"type": "Unconfined"}}}),
         f"{T}.spec.securityContext.seccompProfile.type", "baseline: Seccomp"),
        (deployment({"securityContext": {"appArmorProfile": {"type": "Unconfined"}}}),
         f"{T}.spec.securityContext.appArmorProfile.type", "baseline: AppArmor"),
        (deployment({"securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}}),
         f"{T}.spec.securityContext.sysctls[0].name", "baseline: Sysctls"),
        (deployment(container(securityContext={"seLinuxOptions": {"user": "system_u"}})),
         f"{C0}.securityContext.seLinuxOptions.user", "baseline: SELinux"),
        (deployment(container(securityContext={"seLinuxOptions": {"type": "spc_t"}})),
         f"{C0}.securityContext.seLinuxOptions.type", "baseline: SELinux"),
    ],
)  # fmt: skip
def test_what_took_the_node_is_held_naming_the_field_and_the_control(
    raw: dict[str, Any], field: str, control: str
) -> None:
    with pytest.raises(ManifestRejected) as caught:
        prepare_manifest(
            raw, name="api", version="1", namespace="workloads", policy=ManifestPolicy(),
            injection=INJECT,
        )  # fmt: skip
    assert field in str(caught.value)
    assert control in str(caught.value)


# -- the table of controls, case by case, as the standard lists them ----------------------

P = f"{T}.spec"
CONTAINER_PATHS = {
    "containers": f"{P}.containers[0]",
    "initContainers": f"{P}.initContainers[0]",
    "ephemeralContainers": f"{P}.ephemeralContainers[0]",
}
RESTRICTED_POD = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def template(
    spec: dict[str, Any] | None = None,
    *,
    annotations: dict[str, Any] | None = None,
    restricted: bool = False,
) -> dict[str, Any]:
    """A pod template with one container `api`; `restricted` makes it meet that profile."""
    main: dict[str, Any] = {"name": "api", "image": "r/api:1"}
    pod: dict[str, Any] = {"containers": [main]}
    if restricted:
        main["securityContext"] = copy.deepcopy(RESTRICTED_CONTAINER)
        pod["securityContext"] = copy.deepcopy(RESTRICTED_POD)
    for key, value in (spec or {}).items():
        if isinstance(value, dict) and isinstance(pod.get(key), dict):
            pod[key] = {**pod[key], **value}
        else:
            pod[key] = value
    return {"metadata": {"labels": {"app": "api"}, "annotations": annotations or {}}, "spec": pod}


def with_container(
    kind: str, *, restricted: bool = False, security: dict[str, Any] | None = None, **fields: Any
) -> dict[str, Any]:
    """A template whose container in `kind` (the only one in `containers`, else one beside
    `api`) has these fields and securityContext entries."""
    built = template(restricted=restricted)
    base = copy.deepcopy(RESTRICTED_CONTAINER) if restricted else {}
    body: dict[str, Any] = {"name": "c", "image": "r/c:1", **fields}
    if kind == "initContainers":
        body["restartPolicy"] = "Always"  # a sidecar: the kind that may have probes and hooks
    if base or security is not None:
        body["securityContext"] = {**base, **(security or {})}
    if kind == "containers":
        built["spec"]["containers"] = [body]
    else:
        built["spec"][kind] = [body]
    return built


Expected = set[tuple[str, str]]


def found(pod: dict[str, Any], level: Level = Level.BASELINE, **exceptions: bool) -> Expected:
    violations = check_pod_template(pod, level=level, exceptions=Exceptions(**exceptions))
    return {(v.path, v.control) for v in violations}


def each_container(control: str, subpath: str | None, **fields: Any) -> list[Any]:
    """One case per container list: the same fields, refused (subpath) or allowed (None)."""
    return [
        pytest.param(
            with_container(kind, **fields),
            set() if subpath is None else {(f"{prefix}.{subpath}", control)},
            id=f"{control}-{kind}-{subpath or 'allowed'}-{fields}",
        )
        for kind, prefix in CONTAINER_PATHS.items()
    ]


def pod_level(spec: dict[str, Any], expected: Expected, **kw: Any) -> Any:
    return pytest.param(template(spec, **kw), expected, id=f"pod-{spec}-{sorted(expected)}")


HP = "baseline: HostProcess"
HN = "baseline: Host Namespaces"
PRIV = "baseline: Privileged Containers"
CAPS = "baseline: Capabilities"
HOSTPATH = "baseline: HostPath Volumes"
PORTS = "baseline: Host Ports"
PROBES = "baseline: Host Probes / Lifecycle Hooks"
AA = "baseline: AppArmor"
SEL = "baseline: SELinux"
PROC = "baseline: /proc Mount Type"
SECCOMP = "baseline: Seccomp"
SYSCTLS = "baseline: Sysctls"

BASELINE_CASES = [
    # the default (minimally specified) pod
    pytest.param(template(), set(), id="minimal"),
    # HostProcess
    pod_level({"securityContext": {"windowsOptions": {"hostProcess": True}}},
              {(f"{P}.securityContext.windowsOptions.hostProcess", HP)}),
    pod_level({"securityContext": {"windowsOptions": {"hostProcess": False}}}, set()),
    *each_container(HP, "securityContext.windowsOptions.hostProcess",
                    security={"windowsOptions": {"hostProcess": True}}),
    *each_container(HP, None, security={"windowsOptions": {"hostProcess": False}}),
    # Host Namespaces
    *[pod_level({key: True}, {(f"{P}.{key}", HN)}) for key in HOST_NAMESPACES],
    *[pod_level({key: False}, set()) for key in HOST_NAMESPACES],
    # Privileged Containers
    *each_container(PRIV, "securityContext.privileged", security={"privileged": True}),
    *each_container(PRIV, "securityContext.privileged", security={"privileged": "true"}),
    *each_container(PRIV, None, security={"privileged": False}),
    # Capabilities
    *each_container(CAPS, "securityContext.capabilities.add[0]",
                    security={"capabilities": {"add": ["SYS_ADMIN"]}}),
    *each_container(CAPS, "securityContext.capabilities.add[0]",
                    security={"capabilities": {"add": ["NET_RAW"]}}),
    *each_container(CAPS, "securityContext.capabilities.add[1]",
                    security={"capabilities": {"add": ["CHOWN", "CAP_SYS_ADMIN"]}}),
    *each_container(CAPS, None, security={"capabilities": {"add": sorted(BASELINE_CAPABILITIES)}}),
    *each_container(CAPS, None, security={"capabilities": {"drop": ["ALL"], "add": []}}),
    # HostPath Volumes
    pod_level({"volumes": [{"name": "e", "emptyDir": {}},
                           {"name": "r", "hostPath": {"path": "/"}}]},
              {(f"{P}.volumes[1].hostPath", HOSTPATH)}),
    pod_level({"volumes": [{"name": "e", "emptyDir": {}}, {"name": "n", "hostPath": None}]}, set()),
    # Host Ports
    *each_container(PORTS, "ports[1].hostPort",
                    ports=[{"containerPort": 80}, {"containerPort": 81, "hostPort": 81}]),
    *each_container(PORTS, None, ports=[{"containerPort": 80, "hostPort": 0}]),
    # Host Probes / Lifecycle Hooks
    *[case
      for probe in ("livenessProbe", "readinessProbe", "startupProbe")
      for action in ("httpGet", "tcpSocket")
      for case in each_container(PROBES, f"{probe}.{action}.host",
                                 **{probe: {action: {"port": 80, "host": "169.254.169.254"}}})],
    *[case
      for hook in ("postStart", "preStop")
      for action in ("httpGet", "tcpSocket")
      for case in each_container(PROBES, f"lifecycle.{hook}.{action}.host",
                                 lifecycle={hook: {action: {"port": 80, "host": "10.0.0.1"}}})],
    *each_container(PROBES, None, livenessProbe={"httpGet": {"port": 80, "host": ""}},
                    lifecycle={"preStop": {"exec": {"command": ["true"]}}}),
    # AppArmor
    pod_level({}, {(f"{T}.metadata.annotations[{APPARMOR}api]", AA)},
              annotations={f"{APPARMOR}api": "unconfined"}),
    *[pod_level({}, set(), annotations={f"{APPARMOR}api": value})
      for value in ("runtime/default", "localhost/mine", "")],
    pod_level({"securityContext": {"appArmorProfile": {"type": "Unconfined"}}},
              {(f"{P}.securityContext.appArmorProfile.type", AA)}),
    pod_level({"securityContext": {"appArmorProfile": {}}},
              {(f"{P}.securityContext.appArmorProfile.type", AA)}),
    *[pod_level({"securityContext": {"appArmorProfile": profile}}, set())
      for profile in ({"type": "RuntimeDefault"}, {"type": "Localhost", "localhostProfile": "p"})],
    *each_container(AA, "securityContext.appArmorProfile.type",
                    security={"appArmorProfile": {"type": "Unconfined"}}),
    *each_container(AA, None, security={"appArmorProfile": {"type": "RuntimeDefault"}}),
    # SELinux
    *[pod_level({"securityContext": {"seLinuxOptions": {key: "x"}}},
                {(f"{P}.securityContext.seLinuxOptions.{key}", SEL)})
      for key in ("type", "user", "role")],
    *[pod_level({"securityContext": {"seLinuxOptions": {"type": kind, "level": "s0:c1"}}}, set())
      for kind in sorted(SELINUX_TYPES)],
    *each_container(SEL, "securityContext.seLinuxOptions.type",
                    security={"seLinuxOptions": {"type": "spc_t"}}),
    *each_container(SEL, "securityContext.seLinuxOptions.user",
                    security={"seLinuxOptions": {"user": "system_u"}}),
    *each_container(SEL, "securityContext.seLinuxOptions.role",
                    security={"seLinuxOptions": {"role": "sysadm_r"}}),
    *each_container(SEL, None, security={"seLinuxOptions": {"type": "container_t", "user": ""}}),
    # /proc Mount Type
    *each_container(PROC, "securityContext.procMount", security={"procMount": "Unmasked"}),
    *each_container(PROC, None, security={"procMount": "Default"}),
    # (v1.35+: any value in a user namespace)
    pytest.param(template({"hostUsers": False, "containers": [
        {"name": "api", "image": "x", "securityContext": {"procMount": "Unmasked"}}]}),
        set(), id="procMount-in-a-user-namespace"),
    # Seccomp
    pod_level({"securityContext": {"seccompProfile": {"type": "Unconfined"}}},
              {(f"{P}.securityContext.seccompProfile.type", SECCOMP)}),
    *[pod_level({"securityContext": {"seccompProfile": profile}}, set())
      for profile in ({"type": "RuntimeDefault"},
                      {"type": "Localhost", "localhostProfile": "p.json"})],
    *each_container(SECCOMP, "securityContext.seccompProfile.type",
                    security={"seccompProfile": {"type": "Unconfined"}}),
    *each_container(SECCOMP, None, security={"seccompProfile": {"type": "Localhost",
                                                                 "localhostProfile": "p.json"}}),
    pod_level({}, {(f"{T}.metadata.annotations[{SECCOMP_POD}]", SECCOMP)},
              annotations={SECCOMP_POD: "unconfined"}),
    pod_level({}, set(), annotations={SECCOMP_POD: "runtime/default"}),
    # Sysctls
    pod_level({"securityContext": {"sysctls": [{"name": "net.ipv4.tcp_syncookies", "value": "1"},
                                               {"name": "kernel.msgmax", "value": "1"}]}},
              {(f"{P}.securityContext.sysctls[1].name", SYSCTLS)}),
    pod_level({"securityContext": {"sysctls": [{"name": n, "value": "1"}
                                               for n in sorted(SAFE_SYSCTLS)]}}, set()),
]  # fmt: skip


@pytest.mark.parametrize(("pod", "expected"), BASELINE_CASES)
def test_baseline_control_by_control(pod: dict[str, Any], expected: Expected) -> None:
    assert found(pod) == expected
    # the restricted profile refuses everything the baseline does
    assert expected <= found(pod, Level.RESTRICTED)


VOLUMES = "restricted: Volume Types"
ESCALATION = "restricted: Privilege Escalation"
NON_ROOT = "restricted: Running as Non-root"
NON_ROOT_USER = "restricted: Running as Non-root user"
R_SECCOMP = "restricted: Seccomp"
R_CAPS = "restricted: Capabilities"
R_PROC = "restricted: /proc Mount Type"


def restricted_pod(spec: dict[str, Any], expected: Expected) -> Any:
    return pytest.param(
        template(spec, restricted=True), expected, id=f"pod-{spec}-{sorted(expected)}"
    )


RESTRICTED_CASES = [
    pytest.param(template(restricted=True), set(), id="restricted-minimal"),
    # Volume Types
    *[restricted_pod({"volumes": [{"name": "v", kind: {}}]}, set())
      for kind in sorted(RESTRICTED_VOLUMES)],
    *[restricted_pod({"volumes": [{"name": "v", kind: {}}]}, {(f"{P}.volumes[0].{kind}", VOLUMES)})
      for kind in ("nfs", "gitRepo", "iscsi", "rbd", "flexVolume", "cephfs", "awsElasticBlockStore",
                   "somethingNew")],
    restricted_pod({"volumes": [{"name": "v", "hostPath": {"path": "/"}}]},
                   {(f"{P}.volumes[0].hostPath", HOSTPATH)}),
    # Privilege Escalation
    *each_container(ESCALATION, "securityContext.allowPrivilegeEscalation", restricted=True,
                    security={"allowPrivilegeEscalation": True}),
    *each_container(ESCALATION, "securityContext.allowPrivilegeEscalation", restricted=True,
                    security={"allowPrivilegeEscalation": None}),
    # Running as Non-root
    restricted_pod({"securityContext": {"runAsNonRoot": False}},
                   {(f"{P}.securityContext.runAsNonRoot", NON_ROOT),
                    (f"{P}.containers[0].securityContext.runAsNonRoot", NON_ROOT)}),
    restricted_pod({"securityContext": {"runAsNonRoot": None}},
                   {(f"{P}.containers[0].securityContext.runAsNonRoot", NON_ROOT)}),
    *each_container(NON_ROOT, "securityContext.runAsNonRoot", restricted=True,
                    security={"runAsNonRoot": False}),
    *each_container(NON_ROOT, None, restricted=True, security={"runAsNonRoot": True}),
    # (set on every container instead of the pod)
    pytest.param(
        template({"securityContext": {"runAsNonRoot": None}, "containers": [
            {"name": "api", "image": "x",
             "securityContext": {**RESTRICTED_CONTAINER, "runAsNonRoot": True}}]}, restricted=True),
        set(), id="runAsNonRoot-on-every-container"),
    # Running as Non-root user
    restricted_pod({"securityContext": {"runAsUser": 0}},
                   {(f"{P}.securityContext.runAsUser", NON_ROOT_USER)}),
    restricted_pod({"securityContext": {"runAsUser": 1000}}, set()),
    *each_container(NON_ROOT_USER, "securityContext.runAsUser", restricted=True,
                    security={"runAsUser": 0}),
    *each_container(NON_ROOT_USER, None, restricted=True, security={"runAsUser": 65532}),
    # (v1.35+: any user in a user namespace)
    restricted_pod({"hostUsers": False, "securityContext": {"runAsUser": 0, "runAsNonRoot": False}},
                   set()),
    # Seccomp: set at the pod or on every container
    restricted_pod({"securityContext": {"seccompProfile": None}},
                   {(f"{P}.containers[0].securityContext.seccompProfile.type", R_SECCOMP)}),
    *each_container(R_SECCOMP, None, restricted=True,
                    security={"seccompProfile": {"type": "RuntimeDefault"}}),
    pytest.param(
        template({"securityContext": {"seccompProfile": None}, "containers": [
            {"name": "api", "image": "x", "securityContext": {
                **RESTRICTED_CONTAINER,
                "seccompProfile": {"type": "Localhost", "localhostProfile": "p.json"}}}]},
            restricted=True),
        set(), id="seccomp-on-every-container"),
    # Capabilities: drop ALL, add only NET_BIND_SERVICE
    *each_container(R_CAPS, "securityContext.capabilities.drop", restricted=True,
                    security={"capabilities": {"drop": ["NET_RAW"]}}),
    *each_container(R_CAPS, "securityContext.capabilities.add[0]", restricted=True,
                    security={"capabilities": {"drop": ["ALL"], "add": ["CHOWN"]}}),
    *each_container(R_CAPS, None, restricted=True,
                    security={"capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}),
    # /proc Mount Type: also in a user namespace
    pytest.param(
        template({"hostUsers": False, "containers": [{"name": "api", "image": "x",
            "securityContext": {**RESTRICTED_CONTAINER, "procMount": "Unmasked"}}]},
            restricted=True),
        {(f"{P}.containers[0].securityContext.procMount", R_PROC)}, id="procMount-restricted"),
    # a Windows pod is exempt from the Linux-only restricted controls
    pytest.param(
        template({"os": {"name": "windows"}, "securityContext": {"seccompProfile": None},
                  "containers": [{"name": "api", "image": "x",
                                  "securityContext": {"runAsNonRoot": True}}]}),
        set(), id="windows"),
]  # fmt: skip


@pytest.mark.parametrize(("pod", "expected"), RESTRICTED_CASES)
def test_restricted_control_by_control(pod: dict[str, Any], expected: Expected) -> None:
    assert found(pod, Level.RESTRICTED) == expected


def test_a_plain_pod_meets_baseline_but_not_restricted() -> None:
    assert found(template()) == set()
    assert found(template(), Level.RESTRICTED) == {
        (f"{P}.containers[0].securityContext.allowPrivilegeEscalation", ESCALATION),
        (f"{P}.containers[0].securityContext.runAsNonRoot", NON_ROOT),
        (f"{P}.containers[0].securityContext.seccompProfile.type", R_SECCOMP),
        (f"{P}.containers[0].securityContext.capabilities.drop", R_CAPS),
    }


def test_every_control_of_the_table_has_a_refusing_case() -> None:
    cases = [*BASELINE_CASES, *RESTRICTED_CASES]
    refused = {control for case in cases for _path, control in case.values[1]}
    assert refused == {control.label for control in CONTROLS}


@pytest.mark.parametrize(
    ("exception", "pod", "lifted"),
    [
        ("privileged", with_container("containers", security={"privileged": True}), PRIV),
        ("host_namespaces", template({"hostNetwork": True, "hostPID": True}), HN),
        ("host_path", template({"volumes": [{"name": "r", "hostPath": {"path": "/"}}]}), HOSTPATH),
        ("host_ports", with_container("containers", ports=[{"containerPort": 1, "hostPort": 1}]),
         PORTS),
    ],
)  # fmt: skip
def test_an_operator_exception_lifts_its_own_control_only(
    exception: str, pod: dict[str, Any], lifted: str
) -> None:
    assert {control for _, control in found(pod)} == {lifted}
    assert found(pod, Level.BASELINE, **{exception: True}) == set()
    others = dict.fromkeys(("privileged", "host_namespaces", "host_path", "host_ports"), True)
    del others[exception]
    assert {control for _, control in found(pod, Level.BASELINE, **others)} == {lifted}
    # privileged does not lift capabilities: each is its own control
    with_caps = with_container(
        "containers", security={"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}}
    )
    assert {control for _, control in found(with_caps, privileged=True)} == {CAPS}


def test_an_exception_for_host_paths_holds_under_restricted_too() -> None:
    pod = template({"volumes": [{"name": "r", "hostPath": {"path": "/d"}}]}, restricted=True)
    assert found(pod, Level.RESTRICTED) == {(f"{P}.volumes[0].hostPath", HOSTPATH)}
    assert found(pod, Level.RESTRICTED, host_path=True) == set()


@pytest.mark.parametrize(
    ("spec", "path"),
    [
        ({"securityContext": "privileged"}, f"{P}.securityContext"),
        ({"securityContext": {"sysctls": {"name": "kernel.msgmax"}}},
         f"{P}.securityContext.sysctls"),
        ({"volumes": ["hostPath"]}, f"{P}.volumes[0]"),
        ({"containers": [{"name": "api", "securityContext": ["privileged"]}]},
         f"{P}.containers[0].securityContext"),
        ({"containers": [{"name": "api",
                          "securityContext": {"capabilities": {"add": "SYS_ADMIN"}}}]},
         f"{P}.containers[0].securityContext.capabilities.add"),
        ({"ephemeralContainers": "debug"}, f"{P}.ephemeralContainers"),
        ({"containers": [{"name": "api", "livenessProbe": {"httpGet": "x"}}]},
         f"{P}.containers[0].livenessProbe.httpGet"),
    ],
)  # fmt: skip
def test_a_field_of_the_wrong_type_is_refused_not_skipped(spec: dict[str, Any], path: str) -> None:
    violations = check_pod_template(template(spec), level=Level.BASELINE)
    assert [(v.path, v.control) for v in violations] == [(path, "manifest: Field Types")]


def test_a_violation_reads_as_field_detail_and_control() -> None:
    pod = with_container("containers", security={"capabilities": {"add": ["SYS_ADMIN"]}})
    (violation,) = check_pod_template(pod, level=Level.BASELINE)
    assert str(violation) == (
        f"{P}.containers[0].securityContext.capabilities.add[0]: capability 'SYS_ADMIN' is not "
        "in the baseline set (baseline: Capabilities)"
    )


def test_the_restricted_policy_reaches_prepare_manifest() -> None:
    plain = deployment({})
    restricted = ManifestPolicy(level=Level.RESTRICTED)
    with pytest.raises(ManifestRejected, match="restricted: Privilege Escalation"):
        prepare_manifest(
            plain, name="api", version="1", namespace="workloads", policy=restricted,
            injection=INJECT,
        )  # fmt: skip
    meets = deployment(template(restricted=True)["spec"])
    prepared = prepare_manifest(
        meets, name="api", version="1", namespace="workloads", policy=restricted, injection=INJECT
    )
    assert prepared["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
