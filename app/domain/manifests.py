"""Deployment manifests: check and prepare what reaches the cluster, and detect drift.

`prepare_manifest` turns a manifest from the backend into exactly what the manager
applies: the right kind and name, the managed namespace, the manager's labels and
annotations, the ping address and token in every container, and nothing the policy
forbids: the Pod Security Standard's profile (`app.domain.pod_security`), and the
manager's own bounds (size, depth, replicas, ServiceAccount, priority class). The
applied spec is recorded in an annotation so that `find_drift` can tell, from the live
object alone, whether someone changed a field the manager owns.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from app.domain.pod_security import Exceptions, Level, Violation, check_pod_template

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "workload-manager"
WORKLOAD_LABEL = "workload-manager.io/workload"
VERSION_ANNOTATION = "workload-manager.io/version"
HASH_ANNOTATION = "workload-manager.io/spec-hash"
APPLIED_ANNOTATION = "workload-manager.io/applied-spec"
MANAGED_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY}"

ENV_MANAGER_URL = "WORKLOAD_MANAGER_URL"
ENV_PING_TOKEN = "WORKLOAD_MANAGER_PING_TOKEN"
ENV_WORKLOAD_NAME = "WORKLOAD_NAME"
# the version the Deployment is put at, for a workload to echo in its pings' `version`
ENV_WORKLOAD_VERSION = "WORKLOAD_VERSION"
# the revision of the ping API the manager serves: a workload may send a field only a
# revision that knows it accepts (pings refuse unknown fields). 2: `defer_update_seconds`
# and `defer_reason`, and the `x-workload-update` header on the 204.
ENV_MANAGER_API = "WORKLOAD_MANAGER_API"
PING_API_REVISION = "2"

# a Deployment nests about a dozen levels deep; far more is no manifest but an attack on
# whatever walks it
MAX_DEPTH = 32
# violations named in one hold; the rest are counted
MAX_LISTED = 10
# ServiceAccounts a workload may name besides its own (the one named like the workload)
SHARED_ACCOUNTS = ("", "default")
RESERVED_PRIORITY_PREFIX = "system-"

# List items matched by these keys when comparing live objects with what was applied,
# the same keys Kubernetes merges them by.
_MERGE_KEYS = ("name", "mountPath", "containerPort", "devicePath")
_SERVER_OWNED_METADATA = (
    "resourceVersion", "uid", "creationTimestamp", "generation", "managedFields",
    "selfLink", "deletionTimestamp", "deletionGracePeriodSeconds", "ownerReferences",
)  # fmt: skip


class ManifestRejected(ValueError):
    """The manifest cannot be applied; the message is the reason shown as a hold."""


@dataclass(frozen=True, slots=True)
class ManifestPolicy:
    """What a manifest must meet (MANIFEST_* settings); the ALLOW_* flags are the
    operator's exceptions to the matching controls of the standard."""

    allow_privileged: bool = False
    allow_host_namespaces: bool = False
    allow_host_path: bool = False
    allow_host_ports: bool = False
    level: Level = Level.BASELINE
    max_replicas: int = 10
    max_bytes: int = 64 * 1024
    # pod labels a workload may not carry (name, value): the manager's own, where its
    # Service would select the workload's pods
    reserved_pod_labels: tuple[tuple[str, str], ...] = ()

    @property
    def exceptions(self) -> Exceptions:
        return Exceptions(
            privileged=self.allow_privileged,
            host_namespaces=self.allow_host_namespaces,
            host_path=self.allow_host_path,
            host_ports=self.allow_host_ports,
        )


@dataclass(frozen=True, slots=True)
class Injection:
    """What every managed container is told: where to ping, and with which token."""

    manager_url: str
    ping_token: str | None


# the labels of the manager's pods that its Service and NetworkPolicy select (k8s/)
MANAGER_POD_LABELS = (("app.kubernetes.io/name", "workload-manager"),)


def spec_hash(spec: Any) -> str:
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def prepare_manifest(
    raw: Any,
    *,
    name: str,
    version: str,
    namespace: str,
    policy: ManifestPolicy,
    injection: Injection,
) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise ManifestRejected("manifest is not a JSON object")
    check_size(raw, policy.max_bytes)
    if raw.get("apiVersion") != "apps/v1" or raw.get("kind") != "Deployment":
        raise ManifestRejected(
            f"manifest must be an apps/v1 Deployment, got {raw.get('apiVersion')}/{raw.get('kind')}"
        )
    manifest: dict[str, Any] = copy.deepcopy(dict(raw))
    metadata = manifest.setdefault("metadata", {})
    if not isinstance(metadata, dict):
        raise ManifestRejected("metadata must be an object")
    if metadata.get("name", name) != name:
        raise ManifestRejected(f"manifest is named {metadata.get('name')!r}, not {name!r}")
    spec = manifest.get("spec")
    pod = _dig(spec, "template", "spec")
    containers = pod.get("containers") if isinstance(pod, dict) else None
    if not isinstance(containers, list) or not containers:
        raise ManifestRejected("spec.template.spec.containers must list at least one container")
    assert isinstance(spec, dict) and isinstance(pod, dict)
    for key in ("containers", "initContainers"):
        if not all(isinstance(c, dict) for c in pod.get(key) or []):
            raise ManifestRejected("every container must be an object")

    _must_be_object("metadata.labels", metadata.get("labels", {}))
    _must_be_object("metadata.annotations", metadata.get("annotations", {}))
    template_meta = spec["template"].get("metadata", {})
    _must_be_object("spec.template.metadata", template_meta)
    _must_be_object("spec.template.metadata.labels", template_meta.get("labels", {}))
    for key in _SERVER_OWNED_METADATA:
        metadata.pop(key, None)
    # a finalizer would keep the Deployment (or its pods) once deleted, for as long as no
    # controller removes it: deleting an undesired workload would never end
    metadata.pop("finalizers", None)
    template_meta.pop("finalizers", None)
    manifest.pop("status", None)
    metadata["name"] = name
    metadata["namespace"] = namespace
    labels = metadata.setdefault("labels", {})
    labels[MANAGED_BY_LABEL] = MANAGED_BY
    labels[WORKLOAD_LABEL] = name
    template_meta = spec["template"].setdefault("metadata", {})
    template_meta.setdefault("labels", {})[WORKLOAD_LABEL] = name

    violations = _violations(spec, name=name, policy=policy)
    if violations:
        listed = "; ".join(str(v) for v in violations[:MAX_LISTED])
        more = len(violations) - MAX_LISTED
        raise ManifestRejected(
            f"policy forbids {listed}" + (f"; and {more} more" if more > 0 else "")
        )

    for container in [*containers, *(pod.get("initContainers") or [])]:
        _inject(container, name=name, version=version, injection=injection)

    annotations = metadata.setdefault("annotations", {})
    annotations[VERSION_ANNOTATION] = version
    annotations[APPLIED_ANNOTATION] = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    annotations[HASH_ANNOTATION] = spec_hash(spec)
    return manifest


def _must_be_object(where: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise ManifestRejected(f"{where} must be an object")


def _dig(value: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def check_size(raw: Any, max_bytes: int) -> None:
    """Refuse a manifest nested deeper than MAX_DEPTH or larger than `max_bytes` as JSON,
    before anything walks it recursively."""
    level: list[Any] = [raw]
    for _depth in range(MAX_DEPTH):
        level = [
            child
            for value in level
            if isinstance(value, dict | list)
            for child in (value.values() if isinstance(value, dict) else value)
        ]
        if not level:
            break
    else:
        if any(isinstance(v, dict | list) and v for v in level):
            raise ManifestRejected(
                f"policy forbids a manifest nested deeper than {MAX_DEPTH} levels (manager: Size)"
            )
    size = len(json.dumps(raw, separators=(",", ":"), ensure_ascii=False, default=str).encode())
    if size > max_bytes:
        raise ManifestRejected(
            f"policy forbids a manifest of {size} bytes, more than MANIFEST_MAX_BYTES "
            f"({max_bytes}) (manager: Size)"
        )


def _violations(spec: dict[str, Any], *, name: str, policy: ManifestPolicy) -> list[Violation]:
    found = _own_rules(spec, name=name, max_replicas=policy.max_replicas)
    labels = spec["template"].get("metadata", {}).get("labels", {})
    taken = [f"{k}={v}" for k, v in policy.reserved_pod_labels if labels.get(k) == v]
    if taken:
        detail = (
            f"pod labels {', '.join(taken)} are the manager's own: its Service would send "
            "the pods the node's pings and status calls"
        )
        found.append(Violation("spec.template.metadata.labels", "manager: Labels", detail))
    return found + check_pod_template(
        spec["template"], level=policy.level, exceptions=policy.exceptions
    )


def _own_rules(spec: dict[str, Any], *, name: str, max_replicas: int) -> list[Violation]:
    """The manager's rules beyond the standard: a bounded replica count, no other
    workload's ServiceAccount (the manager's own among them), no node-critical priority."""
    found: list[Violation] = []
    replicas = spec.get("replicas")
    if replicas is not None:
        if type(replicas) is not int or replicas < 0:
            detail = f"replicas must be a whole number, not {replicas!r}"
            found.append(Violation("spec.replicas", "manager: Replicas", detail))
        elif replicas > max_replicas:
            detail = f"{replicas} replicas, more than MANIFEST_MAX_REPLICAS ({max_replicas})"
            found.append(Violation("spec.replicas", "manager: Replicas", detail))
    pod = spec["template"]["spec"]
    for key in ("serviceAccountName", "serviceAccount"):
        account = pod.get(key)
        if account is not None and account not in (name, *SHARED_ACCOUNTS):
            detail = f"ServiceAccount {account!r}: only {name!r} (its own) or the default"
            found.append(Violation(f"spec.template.spec.{key}", "manager: ServiceAccount", detail))
    priority = pod.get("priorityClassName")
    if priority is not None and (
        not isinstance(priority, str) or priority.startswith(RESERVED_PRIORITY_PREFIX)
    ):
        detail = f"priority class {priority!r} is reserved for the cluster's own components"
        found.append(
            Violation("spec.template.spec.priorityClassName", "manager: PriorityClass", detail)
        )
    return found


def _inject(container: dict[str, Any], *, name: str, version: str, injection: Injection) -> None:
    wanted = {
        ENV_MANAGER_URL: injection.manager_url,
        ENV_WORKLOAD_NAME: name,
        ENV_WORKLOAD_VERSION: version,
        ENV_MANAGER_API: PING_API_REVISION,
    }
    if injection.ping_token is not None:
        wanted[ENV_PING_TOKEN] = injection.ping_token
    env = [
        e
        for e in container.get("env") or []
        if not (isinstance(e, dict) and e.get("name") in wanted)
    ]
    env += [{"name": key, "value": value} for key, value in wanted.items()]
    container["env"] = env


def find_drift(live: Mapping[str, Any]) -> str | None:
    """Why the live Deployment differs from what the manager applied, or None."""
    annotations = _dig(live, "metadata", "annotations") or {}
    recorded = annotations.get(APPLIED_ANNOTATION)
    if recorded is None:
        return "no record of the applied spec"
    try:
        applied = json.loads(recorded)
    except ValueError:
        return "the applied-spec annotation is not JSON"
    if spec_hash(applied) != annotations.get(HASH_ANNOTATION):
        return "the applied-spec annotation does not match its hash"
    difference = first_difference(applied, live.get("spec"), "spec")
    return None if difference is None else f"{difference} was changed"


_MISSING = object()


def first_difference(applied: Any, live: Any, path: str) -> str | None:
    """The first path where `live` does not hold what was applied (extra live fields are fine)."""
    if isinstance(applied, dict):
        if not isinstance(live, dict):
            return path
        for key, value in applied.items():
            found = first_difference(value, live.get(key, _MISSING), f"{path}.{key}")
            if found is not None:
                return found
        return None
    if isinstance(applied, list):
        if not isinstance(live, list):
            return path
        key = _merge_key(applied)
        if key is None:
            if len(applied) != len(live):
                return path
            pairs = list(zip(applied, live, strict=True))
            labels = [str(i) for i in range(len(applied))]
        else:
            by_key = {item.get(key): item for item in live if isinstance(item, dict)}
            pairs = [(item, by_key.get(item[key], _MISSING)) for item in applied]
            labels = [str(item[key]) for item in applied]
        for label, (want, have) in zip(labels, pairs, strict=True):
            found = first_difference(want, have, f"{path}[{label}]")
            if found is not None:
                return found
        return None
    if applied == live:
        return None
    if ".resources." in path and same_quantity(applied, live):
        return None  # the API server writes quantities in canonical form: 1000m is 1
    return path


_QUANTITY = re.compile(
    r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)$"
)
_SUFFIXES = {
    "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), None: Fraction(1),
    "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12),
    "P": Fraction(10**15), "E": Fraction(10**18),
    "Ki": Fraction(2**10), "Mi": Fraction(2**20), "Gi": Fraction(2**30), "Ti": Fraction(2**40),
    "Pi": Fraction(2**50), "Ei": Fraction(2**60),
}  # fmt: skip


def quantity(value: Any) -> Fraction | None:
    """A Kubernetes resource quantity's exact value ("1000m", "1", "0.5Gi", "1e3", 2), or
    None when `value` is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Fraction(value)
    if not isinstance(value, str):
        return None
    found = _QUANTITY.match(value.strip())
    if found is None:
        return None
    number, exponent, suffix = found.groups()
    scale = Fraction(10) ** int(exponent[1:]) if exponent else _SUFFIXES[suffix]
    return Fraction(number) * scale


def same_quantity(a: Any, b: Any) -> bool:
    """True when both are quantities of the same value, however written."""
    left, right = quantity(a), quantity(b)
    return left is not None and left == right


def _merge_key(items: list[Any]) -> str | None:
    if not items or not all(isinstance(i, dict) for i in items):
        return None
    for key in _MERGE_KEYS:
        if all(key in i for i in items):
            return key
    return None
