"""The Kubernetes Pod Security Standards (baseline and restricted) as one table of checks.

Each control of https://kubernetes.io/docs/concepts/security/pod-security-standards/ (as of
Kubernetes v1.37) is one row of `CONTROLS`, with the fields it restricts and the values it
allows, covering what its reference implementation (k8s.io/pod-security-admission,
`policy/check_*.go`) covers: the pod's own securityContext and that of every container in
`containers`, `initContainers` and `ephemeralContainers`. Whatever a control does not list
as allowed is a `Violation` naming the field's path and the control, so a value of an
unexpected type is refused, never read as harmless. The restricted profile is the baseline
plus its own rows; every field is reported once, by the first control that refuses it.

Pure: the caller passes a pod template (a Deployment's `spec.template`) and gets the list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

STANDARD_VERSION = "v1.37"


class Level(StrEnum):
    BASELINE = "baseline"
    RESTRICTED = "restricted"


@dataclass(frozen=True, slots=True)
class Violation:
    path: str  # e.g. spec.template.spec.containers[0].securityContext.capabilities.add[1]
    control: str  # e.g. "baseline: Capabilities"
    detail: str

    def __str__(self) -> str:
        return f"{self.path}: {self.detail} ({self.control})"


@dataclass(frozen=True, slots=True)
class Exceptions:
    """Controls the operator switched off on purpose (ALLOW_PRIVILEGED, ALLOW_HOST_*)."""

    privileged: bool = False
    host_namespaces: bool = False
    host_path: bool = False
    host_ports: bool = False


# -- the values the standard allows -------------------------------------------------------

BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
})  # fmt: skip
RESTRICTED_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem",
    "net.ipv4.tcp_slow_start_after_idle", "net.ipv4.tcp_notsent_lowat",
})  # fmt: skip
SELINUX_TYPES = frozenset(
    {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
)
PROFILE_TYPES = frozenset({"RuntimeDefault", "Localhost"})  # seccomp and AppArmor
RESTRICTED_VOLUMES = frozenset({
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "image",
    "persistentVolumeClaim", "projected", "secret",
})  # fmt: skip
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
SECCOMP_POD_ANNOTATION = "seccomp.security.alpha.kubernetes.io/pod"
SECCOMP_CONTAINER_ANNOTATION = "container.seccomp.security.alpha.kubernetes.io/"
CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")
PROBES = ("livenessProbe", "readinessProbe", "startupProbe")
LIFECYCLE_HANDLERS = ("postStart", "preStop")
HOST_NAMESPACES = ("hostNetwork", "hostPID", "hostIPC")


# -- a pod template, read leniently (the shape check has refused wrong types) -------------


@dataclass(frozen=True, slots=True)
class _Container:
    path: str  # spec.template.spec.containers[0]
    name: str
    body: Mapping[str, Any]

    @property
    def security(self) -> Mapping[str, Any]:
        return _obj(self.body.get("securityContext"))


@dataclass(frozen=True, slots=True)
class _Pod:
    path: str  # spec.template
    annotations: Mapping[str, Any]
    spec: Mapping[str, Any]
    containers: tuple[_Container, ...]
    exceptions: Exceptions

    @property
    def spec_path(self) -> str:
        return f"{self.path}.spec"

    @property
    def security(self) -> Mapping[str, Any]:
        return _obj(self.spec.get("securityContext"))

    @property
    def in_user_namespace(self) -> bool:
        """`hostUsers: false`: the standard relaxes some controls for such pods (v1.35+)."""
        return self.spec.get("hostUsers") is False

    @property
    def windows(self) -> bool:
        return _obj(self.spec.get("os")).get("name") == "windows"

    def security_contexts(self) -> Iterator[tuple[str, Mapping[str, Any]]]:
        """The pod's securityContext, then every container's, with their paths."""
        yield f"{self.spec_path}.securityContext", self.security
        for c in self.containers:
            yield f"{c.path}.securityContext", c.security


def _obj(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _one_of(value: Any, allowed: frozenset[str]) -> bool:
    return isinstance(value, str) and value in allowed


def _unset_or_false(value: Any) -> bool:
    return value is None or value is False


def _unset_or_empty(value: Any) -> bool:
    return value is None or value == ""


Found = Iterator[tuple[str, str]]  # (field path, what is wrong)


# -- baseline -----------------------------------------------------------------------------


def _host_process(pod: _Pod) -> Found:
    for where, security in pod.security_contexts():
        value = _obj(security.get("windowsOptions")).get("hostProcess")
        if not _unset_or_false(value):
            yield f"{where}.windowsOptions.hostProcess", "a Windows HostProcess container"


def _host_namespaces(pod: _Pod) -> Found:
    if pod.exceptions.host_namespaces:
        return
    for key in HOST_NAMESPACES:
        if not _unset_or_false(pod.spec.get(key)):
            yield f"{pod.spec_path}.{key}", f"{key} shares a namespace of the node"


def _privileged(pod: _Pod) -> Found:
    if pod.exceptions.privileged:
        return
    for c in pod.containers:
        if not _unset_or_false(c.security.get("privileged")):
            yield f"{c.path}.securityContext.privileged", f"privileged container {c.name!r}"


def _capabilities_baseline(pod: _Pod) -> Found:
    for c in pod.containers:
        added = _items(_obj(c.security.get("capabilities")).get("add"))
        for i, capability in enumerate(added):
            if not _one_of(capability, BASELINE_CAPABILITIES):
                yield (
                    f"{c.path}.securityContext.capabilities.add[{i}]",
                    f"capability {capability!r} is not in the baseline set",
                )


def _host_path_volumes(pod: _Pod) -> Found:
    if pod.exceptions.host_path:
        return
    for i, volume in enumerate(_items(pod.spec.get("volumes"))):
        if _obj(volume).get("hostPath") is not None:
            name = _obj(volume).get("name")
            yield f"{pod.spec_path}.volumes[{i}].hostPath", f"hostPath volume {name!r}"


def _host_ports(pod: _Pod) -> Found:
    if pod.exceptions.host_ports:
        return
    for c in pod.containers:
        for i, port in enumerate(_items(c.body.get("ports"))):
            value = _obj(port).get("hostPort")
            if not (value is None or (type(value) is int and value == 0)):
                yield f"{c.path}.ports[{i}].hostPort", f"hostPort {value} in container {c.name!r}"


def _host_probes(pod: _Pod) -> Found:
    for c in pod.containers:
        handlers = [(f"{c.path}.{probe}", c.body.get(probe)) for probe in PROBES]
        lifecycle = _obj(c.body.get("lifecycle"))
        handlers += [(f"{c.path}.lifecycle.{h}", lifecycle.get(h)) for h in LIFECYCLE_HANDLERS]
        for where, handler in handlers:
            for action in ("httpGet", "tcpSocket"):
                host = _obj(_obj(handler).get(action)).get("host")
                if not _unset_or_empty(host):
                    yield f"{where}.{action}.host", f"host {host!r}: only the pod itself"


def _apparmor(pod: _Pod) -> Found:
    for key, value in pod.annotations.items():
        if not str(key).startswith(APPARMOR_ANNOTATION):
            continue
        if not (value in ("", "runtime/default") or str(value).startswith("localhost/")):
            where = f"{pod.path}.metadata.annotations[{key}]"
            yield where, f"AppArmor profile {value!r}"
    for where, security in pod.security_contexts():
        profile = security.get("appArmorProfile")
        if profile is not None and not _one_of(_obj(profile).get("type"), PROFILE_TYPES):
            kind = _obj(profile).get("type")
            yield f"{where}.appArmorProfile.type", f"AppArmor profile type {kind!r}"


def _selinux(pod: _Pod) -> Found:
    for where, security in pod.security_contexts():
        options = _obj(security.get("seLinuxOptions"))
        kind = options.get("type")
        if kind is not None and not _one_of(kind, SELINUX_TYPES):
            yield f"{where}.seLinuxOptions.type", f"SELinux type {kind!r}"
        for key in ("user", "role"):
            if not _unset_or_empty(options.get(key)):
                yield f"{where}.seLinuxOptions.{key}", f"SELinux {key} may not be set"


def _unmasked_proc(pod: _Pod) -> Found:
    for c in pod.containers:
        value = c.security.get("procMount")
        if not (value is None or value == "Default"):
            yield f"{c.path}.securityContext.procMount", f"/proc mount {value!r}"


def _proc_mount_baseline(pod: _Pod) -> Found:
    if not pod.in_user_namespace:
        yield from _unmasked_proc(pod)


def _seccomp_baseline(pod: _Pod) -> Found:
    for where, security in pod.security_contexts():
        profile = security.get("seccompProfile")
        if profile is not None and not _one_of(_obj(profile).get("type"), PROFILE_TYPES):
            kind = _obj(profile).get("type")
            yield f"{where}.seccompProfile.type", f"seccomp profile type {kind!r}"
    # the annotations the standard restricted before v1.19; older nodes still read them
    keys = [
        SECCOMP_POD_ANNOTATION,
        *(SECCOMP_CONTAINER_ANNOTATION + c.name for c in pod.containers),
    ]
    for key in keys:
        if key not in pod.annotations:
            continue
        value = pod.annotations[key]
        if not (
            value in ("runtime/default", "docker/default") or str(value).startswith("localhost/")
        ):
            yield f"{pod.path}.metadata.annotations[{key}]", f"seccomp profile {value!r}"


def _sysctls(pod: _Pod) -> Found:
    for i, sysctl in enumerate(_items(pod.security.get("sysctls"))):
        name = _obj(sysctl).get("name")
        if not _one_of(name, SAFE_SYSCTLS):
            yield (
                f"{pod.spec_path}.securityContext.sysctls[{i}].name",
                f"sysctl {name!r} is not in the safe set",
            )


# -- restricted (beyond what the baseline rows already refuse) ----------------------------


def _volume_types(pod: _Pod) -> Found:
    for i, volume in enumerate(_items(pod.spec.get("volumes"))):
        for key, source in _obj(volume).items():
            if key == "name" or source is None or key in RESTRICTED_VOLUMES:
                continue
            if key == "hostPath":
                continue  # the baseline's HostPath Volumes row (or its exception)
            name = _obj(volume).get("name")
            yield f"{pod.spec_path}.volumes[{i}].{key}", f"{key} volume {name!r}"


def _privilege_escalation(pod: _Pod) -> Found:
    if pod.windows:
        return
    for c in pod.containers:
        if c.security.get("allowPrivilegeEscalation") is not False:
            yield f"{c.path}.securityContext.allowPrivilegeEscalation", "must be false"


def _run_as_non_root(pod: _Pod) -> Found:
    if pod.in_user_namespace:
        return
    at_pod = pod.security.get("runAsNonRoot")
    if at_pod is not None and at_pod is not True:
        yield f"{pod.spec_path}.securityContext.runAsNonRoot", "must be true"
    for c in pod.containers:
        value = c.security.get("runAsNonRoot")
        if value is None and at_pod is not True:
            yield (
                f"{c.path}.securityContext.runAsNonRoot",
                f"container {c.name!r} must run as non-root (here or for the pod)",
            )
        elif value is not None and value is not True:
            yield f"{c.path}.securityContext.runAsNonRoot", "must be true"


def _run_as_user(pod: _Pod) -> Found:
    if pod.in_user_namespace:
        return
    for where, security in pod.security_contexts():
        value = security.get("runAsUser")
        if not (value is None or (type(value) is int and value != 0)):
            yield f"{where}.runAsUser", f"runAsUser {value!r} (root)"


def _seccomp_restricted(pod: _Pod) -> Found:
    if pod.windows:
        return
    at_pod = _obj(pod.security.get("seccompProfile")).get("type")
    if _one_of(at_pod, PROFILE_TYPES):
        return
    for c in pod.containers:
        if c.security.get("seccompProfile") is None:
            yield (
                f"{c.path}.securityContext.seccompProfile.type",
                f"container {c.name!r} needs RuntimeDefault or Localhost (here or for the pod)",
            )


def _capabilities_restricted(pod: _Pod) -> Found:
    if pod.windows:
        return
    for c in pod.containers:
        capabilities = _obj(c.security.get("capabilities"))
        if "ALL" not in _items(capabilities.get("drop")):
            yield f"{c.path}.securityContext.capabilities.drop", 'must include "ALL"'
        for i, capability in enumerate(_items(capabilities.get("add"))):
            allowed = _one_of(capability, RESTRICTED_CAPABILITIES)
            if not allowed and _one_of(capability, BASELINE_CAPABILITIES):
                yield (
                    f"{c.path}.securityContext.capabilities.add[{i}]",
                    f"capability {capability!r}: only NET_BIND_SERVICE may be added",
                )


def _proc_mount_restricted(pod: _Pod) -> Found:
    if pod.in_user_namespace:  # the baseline row let it pass; the restricted one does not
        yield from _unmasked_proc(pod)


# -- the table ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Control:
    level: Level
    name: str  # as the standard names it
    check: Callable[[_Pod], Found]

    @property
    def label(self) -> str:
        return f"{self.level.value}: {self.name}"


CONTROLS: tuple[Control, ...] = (
    Control(Level.BASELINE, "HostProcess", _host_process),
    Control(Level.BASELINE, "Host Namespaces", _host_namespaces),
    Control(Level.BASELINE, "Privileged Containers", _privileged),
    Control(Level.BASELINE, "Capabilities", _capabilities_baseline),
    Control(Level.BASELINE, "HostPath Volumes", _host_path_volumes),
    Control(Level.BASELINE, "Host Ports", _host_ports),
    Control(Level.BASELINE, "Host Probes / Lifecycle Hooks", _host_probes),
    Control(Level.BASELINE, "AppArmor", _apparmor),
    Control(Level.BASELINE, "SELinux", _selinux),
    Control(Level.BASELINE, "/proc Mount Type", _proc_mount_baseline),
    Control(Level.BASELINE, "Seccomp", _seccomp_baseline),
    Control(Level.BASELINE, "Sysctls", _sysctls),
    Control(Level.RESTRICTED, "Volume Types", _volume_types),
    Control(Level.RESTRICTED, "Privilege Escalation", _privilege_escalation),
    Control(Level.RESTRICTED, "Running as Non-root", _run_as_non_root),
    Control(Level.RESTRICTED, "Running as Non-root user", _run_as_user),
    Control(Level.RESTRICTED, "Seccomp", _seccomp_restricted),
    Control(Level.RESTRICTED, "Capabilities", _capabilities_restricted),
    Control(Level.RESTRICTED, "/proc Mount Type", _proc_mount_restricted),
)
SHAPE_CONTROL = "manifest: Field Types"


# -- the shape of every field a control reads ---------------------------------------------

# A dict: the value is an object (or null); its listed keys are checked in turn. A list of
# one shape: the value is a list (or null) whose items all have that shape. ANY: anything.
ANY: Any = None
_HANDLER: dict[str, Any] = {"httpGet": {}, "tcpSocket": {}}
_SECURITY: dict[str, Any] = {
    "windowsOptions": {}, "seLinuxOptions": {}, "seccompProfile": {}, "appArmorProfile": {},
}  # fmt: skip
_CONTAINER: dict[str, Any] = {
    "securityContext": {**_SECURITY, "capabilities": {"add": [ANY], "drop": [ANY]}},
    "ports": [{}],
    "lifecycle": dict.fromkeys(LIFECYCLE_HANDLERS, _HANDLER),
    **dict.fromkeys(PROBES, _HANDLER),
}
TEMPLATE_SHAPE: dict[str, Any] = {
    "metadata": {"annotations": {}},
    "spec": {
        "securityContext": {**_SECURITY, "sysctls": [{}]},
        "os": {},
        "volumes": [{}],
        **{key: [_CONTAINER] for key in CONTAINER_LISTS},
    },
}


def _shape(value: Any, shape: Any, path: str) -> Iterator[tuple[str, str]]:
    if value is None or shape is ANY:
        return
    if isinstance(shape, dict):
        if not isinstance(value, Mapping):
            yield path, f"must be an object, not {type(value).__name__}"
            return
        for key, inner in shape.items():
            yield from _shape(value.get(key), inner, f"{path}.{key}")
    elif isinstance(shape, list):
        if not isinstance(value, list):
            yield path, f"must be a list, not {type(value).__name__}"
            return
        for i, item in enumerate(value):
            yield from _shape(item, shape[0], f"{path}[{i}]")


# -- the check ----------------------------------------------------------------------------


def check_pod_template(
    template: Mapping[str, Any],
    *,
    level: Level,
    exceptions: Exceptions = Exceptions(),
    path: str = "spec.template",
) -> list[Violation]:
    """Every violation of `level` in a pod template (`metadata` and `spec`), in the order
    of the standard's controls; empty when the template meets it."""
    shape = [Violation(p, SHAPE_CONTROL, d) for p, d in _shape(template, TEMPLATE_SHAPE, path)]
    if shape:
        return shape  # the controls read leniently: only a well-formed template gets them
    spec = _obj(template.get("spec"))
    containers = tuple(
        _Container(f"{path}.spec.{key}[{i}]", str(_obj(body).get("name", "")), _obj(body))
        for key in CONTAINER_LISTS
        for i, body in enumerate(_items(spec.get(key)))
    )
    pod = _Pod(
        path=path,
        annotations=_obj(_obj(template.get("metadata")).get("annotations")),
        spec=spec,
        containers=containers,
        exceptions=exceptions,
    )
    wanted = {Level.BASELINE} if level is Level.BASELINE else {Level.BASELINE, Level.RESTRICTED}
    return [
        Violation(where, control.label, detail)
        for control in CONTROLS
        if control.level in wanted
        for where, detail in control.check(pod)
    ]
