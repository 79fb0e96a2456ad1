"""Defaulting and validation that kube-apiserver applies to apps/v1 Deployments and Namespaces.

Defaults are the ones a client reading back its object sees (and must not treat as drift);
validation covers the rules a manager is likely to trip over, not the full OpenAPI schema.
"""

from __future__ import annotations

import re
from typing import Any

from . import selectors
from .meta import DEPLOYMENTS, Cause, Kind, Obj

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_PROBE_DEFAULTS = {"timeoutSeconds": 1, "periodSeconds": 10, "successThreshold": 1}


def _default(obj: Obj, key: str, value: Any) -> Any:
    if obj.get(key) is None:
        obj[key] = value
    return obj[key]


def pull_policy(image: str) -> str:
    if "@" in image:
        return "IfNotPresent"
    last = image.rsplit("/", 1)[-1]
    tag = last.split(":", 1)[1] if ":" in last else ""
    return "Always" if tag in ("", "latest") else "IfNotPresent"


def _default_container(container: Obj) -> None:
    _default(container, "imagePullPolicy", pull_policy(str(container.get("image") or "")))
    _default(container, "terminationMessagePath", "/dev/termination-log")
    _default(container, "terminationMessagePolicy", "File")
    _default(container, "resources", {})
    for port in container.get("ports") or []:
        _default(port, "protocol", "TCP")
    for env in container.get("env") or []:
        field_ref = (env.get("valueFrom") or {}).get("fieldRef")
        if isinstance(field_ref, dict):
            _default(field_ref, "apiVersion", "v1")
    for probe_name in ("livenessProbe", "readinessProbe", "startupProbe"):
        probe = container.get(probe_name)
        if not isinstance(probe, dict):
            continue
        for key, value in _PROBE_DEFAULTS.items():
            _default(probe, key, value)
        _default(probe, "failureThreshold", 3)
        if isinstance(probe.get("httpGet"), dict):
            _default(probe["httpGet"], "scheme", "HTTP")


def _default_pod_spec(pod: Obj) -> None:
    _default(pod, "restartPolicy", "Always")
    _default(pod, "terminationGracePeriodSeconds", 30)
    _default(pod, "dnsPolicy", "ClusterFirst")
    _default(pod, "securityContext", {})
    _default(pod, "schedulerName", "default-scheduler")
    for container in (pod.get("containers") or []) + (pod.get("initContainers") or []):
        if isinstance(container, dict):
            _default_container(container)
    for volume in pod.get("volumes") or []:
        for source in ("configMap", "secret", "projected", "downwardAPI"):
            if isinstance(volume.get(source), dict):
                _default(volume[source], "defaultMode", 420)


def apply_defaults(kind: Kind, obj: Obj) -> None:
    if kind is not DEPLOYMENTS:
        spec = obj.setdefault("spec", {})
        _default(spec, "finalizers", ["kubernetes"])
        _default(obj, "status", {"phase": "Active"})
        labels = _default(obj["metadata"], "labels", {})
        labels["kubernetes.io/metadata.name"] = obj["metadata"].get("name")
        return
    spec = _default(obj, "spec", {})
    _default(spec, "replicas", 1)
    strategy = _default(spec, "strategy", {})
    _default(strategy, "type", "RollingUpdate")
    if strategy["type"] == "RollingUpdate":
        rolling = _default(strategy, "rollingUpdate", {})
        _default(rolling, "maxUnavailable", "25%")
        _default(rolling, "maxSurge", "25%")
    _default(spec, "revisionHistoryLimit", 10)
    _default(spec, "progressDeadlineSeconds", 600)
    template = _default(spec, "template", {})
    # Kubernetes <= 1.32 serialises the zero template timestamp as an explicit null.
    _default(template, "metadata", {}).setdefault("creationTimestamp", None)
    _default_pod_spec(_default(template, "spec", {}))


def validate(kind: Kind, obj: Obj, old: Obj | None) -> list[Cause]:
    name = str(obj["metadata"].get("name") or "")
    pattern = _DNS_SUBDOMAIN if kind is DEPLOYMENTS else _DNS_LABEL
    if not name:
        return [Cause("metadata.name", "FieldValueRequired", "Required value: name is required")]
    if len(name) > 253 or not pattern.match(name):
        return [Cause("metadata.name", "FieldValueInvalid", f'Invalid value: "{name}"')]
    if kind is not DEPLOYMENTS:
        return []
    return _validate_deployment(obj["spec"], None if old is None else old.get("spec") or {})


def _validate_deployment(spec: Obj, old_spec: Obj | None) -> list[Cause]:
    causes: list[Cause] = []
    selector = spec.get("selector")
    template = spec.get("template") or {}
    labels = (template.get("metadata") or {}).get("labels") or {}
    if not isinstance(selector, dict):
        causes.append(Cause("spec.selector", "FieldValueRequired", "Required value"))
    elif not selector.get("matchLabels") and not selector.get("matchExpressions"):
        causes.append(Cause("spec.selector", "FieldValueInvalid", "Invalid value: empty selector"))
    elif not selectors.matches(selectors.from_label_selector(selector), labels):
        causes.append(
            Cause(
                "spec.template.metadata.labels",
                "FieldValueInvalid",
                f"Invalid value: {labels}: `selector` does not match template `labels`",
            )
        )
    if old_spec is not None and selector != old_spec.get("selector"):
        causes.append(Cause("spec.selector", "FieldValueInvalid", "field is immutable"))
    replicas = spec.get("replicas")
    if not isinstance(replicas, int) or replicas < 0:
        causes.append(Cause("spec.replicas", "FieldValueInvalid", f"Invalid value: {replicas}"))
    strategy = spec.get("strategy") or {}
    if strategy.get("type") == "Recreate" and strategy.get("rollingUpdate") is not None:
        causes.append(
            Cause(
                "spec.strategy.rollingUpdate",
                "FieldValueForbidden",
                "Forbidden: may not be specified when strategy `type` is 'Recreate'",
            )
        )
    containers = (template.get("spec") or {}).get("containers")
    if not containers:
        path = "spec.template.spec.containers"
        causes.append(Cause(path, "FieldValueRequired", "Required value"))
    for index, container in enumerate(containers or []):
        for field in ("name", "image"):
            if not isinstance(container, dict) or not container.get(field):
                path = f"spec.template.spec.containers[{index}].{field}"
                causes.append(Cause(path, "FieldValueRequired", "Required value"))
    return causes
