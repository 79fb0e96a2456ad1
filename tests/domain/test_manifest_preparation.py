"""Manifest preparation (checks, labels, injection, policy) and drift detection, table-driven."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from app.domain.manifests import (
    APPLIED_ANNOTATION,
    HASH_ANNOTATION,
    MANAGED_BY_LABEL,
    MANAGER_POD_LABELS,
    VERSION_ANNOTATION,
    WORKLOAD_LABEL,
    Injection,
    ManifestPolicy,
    ManifestRejected,
    find_drift,
    first_difference,
    prepare_manifest,
    same_quantity,
)

INJECT = Injection(manager_url="http://manager:8080", ping_token="tok-api")


def manifest(name: str = "api", image: str = "repo/api:1.0") -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": "elsewhere", "resourceVersion": "7", "uid": "u"},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [
                        {"name": name, "image": image,
                         "env": [{"name": "MODE", "value": "fast"},
                                 {"name": "WORKLOAD_MANAGER_URL", "value": "stale"}]},
                        {"name": "sidecar", "image": "repo/sidecar:2"},
                    ]
                },
            },
        },
        "status": {"replicas": 3},
    }  # fmt: skip


def prepare(raw: Any, policy: ManifestPolicy | None = None, **kw: Any) -> dict[str, Any]:
    return prepare_manifest(
        raw,
        name=kw.get("name", "api"),
        version=kw.get("version", "1.0"),
        namespace="workloads",
        policy=policy or ManifestPolicy(),
        injection=kw.get("injection", INJECT),
    )


def test_prepared_manifest_is_labelled_namespaced_and_injected() -> None:
    out = prepare(manifest())
    meta = out["metadata"]
    assert meta["namespace"] == "workloads"
    assert "resourceVersion" not in meta and "uid" not in meta and "status" not in out
    assert meta["labels"][MANAGED_BY_LABEL] == "workload-manager"
    assert meta["labels"][WORKLOAD_LABEL] == "api"
    assert out["spec"]["template"]["metadata"]["labels"] == {"app": "api", WORKLOAD_LABEL: "api"}
    assert meta["annotations"][VERSION_ANNOTATION] == "1.0"
    assert json.loads(meta["annotations"][APPLIED_ANNOTATION]) == out["spec"]
    for container in out["spec"]["template"]["spec"]["containers"]:
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["WORKLOAD_MANAGER_URL"] == "http://manager:8080"
        assert env["WORKLOAD_MANAGER_PING_TOKEN"] == "tok-api"
        assert env["WORKLOAD_NAME"] == "api"
        assert [e["name"] for e in container["env"]].count("WORKLOAD_MANAGER_URL") == 1
    assert {"name": "MODE", "value": "fast"} in out["spec"]["template"]["spec"]["containers"][0][
        "env"
    ]


def test_no_token_is_injected_without_a_secret() -> None:
    out = prepare(manifest(), injection=Injection(manager_url="http://m", ping_token=None))
    env = out["spec"]["template"]["spec"]["containers"][0]["env"]
    assert "WORKLOAD_MANAGER_PING_TOKEN" not in {e["name"] for e in env}


def test_the_input_is_not_modified() -> None:
    raw = manifest()
    before = copy.deepcopy(raw)
    prepare(raw)
    assert raw == before


def test_preparation_is_deterministic() -> None:
    a, b = prepare(manifest()), prepare(manifest())
    assert a == b
    assert (
        a["metadata"]["annotations"][HASH_ANNOTATION]
        == b["metadata"]["annotations"][HASH_ANNOTATION]
    )
    other = prepare(manifest(image="repo/api:1.1"))
    assert (
        other["metadata"]["annotations"][HASH_ANNOTATION]
        != a["metadata"]["annotations"][HASH_ANNOTATION]
    )


def edit(fn: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    raw = manifest()
    fn(raw)
    return raw


def pod(raw: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = raw["spec"]["template"]["spec"]
    return spec


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("not an object", "not a JSON object"),
        (edit(lambda m: m.update(kind="StatefulSet")), "apps/v1 Deployment"),
        (edit(lambda m: m.update(apiVersion="extensions/v1beta1")), "apps/v1 Deployment"),
        (edit(lambda m: m["metadata"].update(name="other")), "named 'other', not 'api'"),
        (edit(lambda m: pod(m).update(containers=[])), "at least one container"),
        (edit(lambda m: m.pop("spec")), "at least one container"),
        (edit(lambda m: m["metadata"].update(labels=["a"])), "metadata.labels must be an object"),
        (edit(lambda m: m["spec"]["template"].update(metadata="x")),
         "spec.template.metadata must be an object"),
        (edit(lambda m: m["spec"]["template"]["metadata"].update(labels=None)),
         "spec.template.metadata.labels must be an object"),
        (edit(lambda m: pod(m)["containers"].append("sidecar")), "every container"),
        (edit(lambda m: pod(m).update(hostNetwork=True)), "hostNetwork"),
        (edit(lambda m: pod(m).update(hostPID=True)), "hostPID"),
        (edit(lambda m: pod(m).update(hostIPC=True)), "hostIPC"),
        (edit(lambda m: pod(m).update(volumes=[{"name": "root", "hostPath": {"path": "/"}}])),
         "hostPath volume 'root'"),
        (edit(lambda m: pod(m)["containers"][0].update(securityContext={"privileged": True})),
         "privileged container 'api'"),
        (edit(lambda m: pod(m)["containers"][1].update(
            ports=[{"containerPort": 80, "hostPort": 80}])), "hostPort 80 in container 'sidecar'"),
        (edit(lambda m: pod(m).update(initContainers=[
            {"name": "init", "image": "x", "securityContext": {"privileged": True}}])),
         "privileged container 'init'"),
    ],
)  # fmt: skip
def test_rejected_manifests_say_why(raw: Any, says: str) -> None:
    with pytest.raises(ManifestRejected) as caught:
        prepare(raw)
    assert says in str(caught.value)


@pytest.mark.parametrize(
    ("policy", "change"),
    [
        (ManifestPolicy(allow_host_namespaces=True), lambda m: pod(m).update(hostNetwork=True)),
        (ManifestPolicy(allow_host_path=True),
         lambda m: pod(m).update(volumes=[{"name": "d", "hostPath": {"path": "/d"}}])),
        (ManifestPolicy(allow_privileged=True),
         lambda m: pod(m)["containers"][0].update(securityContext={"privileged": True})),
        (ManifestPolicy(allow_host_ports=True),
         lambda m: pod(m)["containers"][0].update(ports=[{"containerPort": 1, "hostPort": 1}])),
    ],
)  # fmt: skip
def test_each_feature_is_allowed_by_its_own_setting(
    policy: ManifestPolicy, change: Callable[[dict[str, Any]], None]
) -> None:
    assert prepare(edit(change), policy)["metadata"]["name"] == "api"


def test_a_missing_name_is_filled_in() -> None:
    raw = edit(lambda m: m["metadata"].pop("name"))
    assert prepare(raw)["metadata"]["name"] == "api"


def server_view(applied: dict[str, Any]) -> dict[str, Any]:
    """What the API server returns for an applied manifest: the same plus defaults."""
    live = copy.deepcopy(applied)
    live["metadata"].update(resourceVersion="12", generation=1, uid="x")
    live["spec"].setdefault("replicas", 1)
    live["spec"]["revisionHistoryLimit"] = 10
    for container in live["spec"]["template"]["spec"]["containers"]:
        container.setdefault("imagePullPolicy", "IfNotPresent")
        container["terminationMessagePath"] = "/dev/termination-log"
    live["status"] = {"replicas": 1}
    return live


def containers(live: dict[str, Any]) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = live["spec"]["template"]["spec"]["containers"]
    return result


@pytest.mark.parametrize(
    ("change", "drift"),
    [
        (lambda live: None, None),
        # someone scaled it: replicas is not in the manifest, so it is not ours
        (lambda live: live["spec"].update(replicas=5), None),
        # containers listed in another order: matched by name
        (lambda live: containers(live).reverse(), None),
        # an extra env var added by someone else is not ours either
        (lambda live: containers(live)[0]["env"].append({"name": "X", "value": "1"}), None),
        (lambda live: containers(live)[0].update(image="evil/api:6"),
         "spec.template.spec.containers[api].image was changed"),
        (lambda live: containers(live)[0]["env"].pop(0),
         "spec.template.spec.containers[api].env[MODE] was changed"),
        (lambda live: containers(live).pop(1),
         "spec.template.spec.containers[sidecar] was changed"),
        (lambda live: live["spec"]["template"]["metadata"]["labels"].update(app="x"),
         "spec.template.metadata.labels.app was changed"),
        (lambda live: live["metadata"]["annotations"].pop(APPLIED_ANNOTATION),
         "no record of the applied spec"),
        (lambda live: live["metadata"]["annotations"].update({APPLIED_ANNOTATION: "{"}),
         "not JSON"),
        (lambda live: live["metadata"]["annotations"].update({APPLIED_ANNOTATION: "{}"}),
         "does not match its hash"),
    ],
)  # fmt: skip
def test_drift(change: Callable[[dict[str, Any]], None], drift: str | None) -> None:
    live = server_view(prepare(manifest()))
    change(live)
    found = find_drift(live)
    if drift is None:
        assert found is None
    else:
        assert found is not None and drift in found


@pytest.mark.parametrize(
    ("written", "canonical", "same"),
    [
        ("1000m", "1", True),
        ("500m", "0.5", True),
        ("1024Mi", "1Gi", True),
        ("1e3", "1k", True),
        ("1.5Gi", "1536Mi", True),
        (2, "2", True),
        ("100Mi", "100M", False),
        ("1", "2", False),
        ("abc", "abc", False),
        (True, "1", False),
        ("1Kb", "1Kb", False),
    ],
)
def test_quantities_compare_by_value(written: object, canonical: object, same: bool) -> None:
    assert same_quantity(written, canonical) is same


def test_a_quantity_written_differently_by_the_server_is_no_drift() -> None:
    applied = {
        "template": {
            "spec": {
                "containers": [
                    {"name": "api", "resources": {"limits": {"cpu": "1000m", "memory": "1024Mi"}}}
                ]
            }
        }
    }
    live: dict[str, Any] = {
        "template": {
            "spec": {
                "containers": [
                    {"name": "api", "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}
                ]
            }
        }
    }
    assert first_difference(applied, live, "spec") is None
    live["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "2"
    assert (
        first_difference(applied, live, "spec")
        == "spec.template.spec.containers[api].resources.limits.cpu"
    )
    # outside resources, a string is a string
    assert first_difference({"env": "1000m"}, {"env": "1"}, "spec") == "spec.env"


@pytest.mark.parametrize(
    ("change", "field", "control"),
    [
        (lambda m: m["spec"].update(replicas=11), "spec.replicas", "manager: Replicas"),
        (lambda m: m["spec"].update(replicas="3"), "spec.replicas", "manager: Replicas"),
        (lambda m: pod(m).update(serviceAccountName="workload-manager"),
         "spec.template.spec.serviceAccountName", "manager: ServiceAccount"),
        (lambda m: pod(m).update(serviceAccount="workload-manager"),
         "spec.template.spec.serviceAccount", "manager: ServiceAccount"),
        (lambda m: pod(m).update(priorityClassName="system-node-critical"),
         "spec.template.spec.priorityClassName", "manager: PriorityClass"),
    ],
)  # fmt: skip
def test_the_managers_own_rules_beyond_the_standard(
    change: Callable[[dict[str, Any]], None], field: str, control: str
) -> None:
    with pytest.raises(ManifestRejected) as caught:
        prepare(edit(change))
    assert field in str(caught.value)
    assert control in str(caught.value)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m["spec"].update(replicas=10),
        lambda m: m["spec"].update(replicas=0),
        lambda m: pod(m).update(serviceAccountName="api"),
        lambda m: pod(m).update(serviceAccountName="default"),
        lambda m: pod(m).update(priorityClassName="high"),
    ],
)
def test_what_the_managers_own_rules_allow(change: Callable[[dict[str, Any]], None]) -> None:
    assert prepare(edit(change))["metadata"]["name"] == "api"


def test_the_replica_bound_is_the_policys() -> None:
    raw = edit(lambda m: m["spec"].update(replicas=4))
    with pytest.raises(ManifestRejected, match=r"more than MANIFEST_MAX_REPLICAS \(3\)"):
        prepare(raw, ManifestPolicy(max_replicas=3))
    assert prepare(raw, ManifestPolicy(max_replicas=4))["spec"]["replicas"] == 4


def test_a_manifest_larger_than_the_bound_is_held_saying_its_size() -> None:
    big = edit(lambda m: m["metadata"].update(annotations={"note": "x" * 70_000}))
    with pytest.raises(
        ManifestRejected, match=r"more than MANIFEST_MAX_BYTES \(65536\) \(manager: Size\)"
    ):
        prepare(big)
    assert prepare(big, ManifestPolicy(max_bytes=80_000))["metadata"]["name"] == "api"


def test_a_manifest_nested_too_deep_is_held_not_crashed() -> None:
    deep: dict[str, Any] = {}
    inner = deep
    for _ in range(5_000):
        inner["x"] = {}
        inner = inner["x"]
    raw = edit(lambda m: m["metadata"].update(annotations={}, extra=deep))
    with pytest.raises(ManifestRejected, match="nested deeper than"):
        prepare(raw)


def test_many_violations_are_listed_up_to_a_bound() -> None:
    adds = [f"CAP_{i}" for i in range(500)]
    raw = edit(lambda m: pod(m)["containers"][0].update(
        securityContext={"capabilities": {"add": adds}}))  # fmt: skip
    with pytest.raises(ManifestRejected) as caught:
        prepare(raw)
    message = str(caught.value)
    assert "add[0]" in message and "and 490 more" in message
    assert len(message) < 4_000


def test_finalizers_are_not_applied() -> None:
    """A finalizer would keep the Deployment (or its pods) after a delete for as long as no
    controller removes it: the undesired workload's deletion would never end."""

    def finalized(m: dict[str, Any]) -> None:
        m["metadata"]["finalizers"] = ["example.com/keep"]
        m["spec"]["template"]["metadata"]["finalizers"] = ["example.com/keep-pods"]

    prepared = prepare(edit(finalized))
    assert "finalizers" not in prepared["metadata"]
    assert "finalizers" not in prepared["spec"]["template"]["metadata"]


def test_pods_that_carry_the_managers_own_labels_are_held_where_its_service_is() -> None:
    """In the manager's namespace its Service selects its name label: a workload's pods
    with it would get the node's pings, tokens included, and status calls."""
    raw = edit(lambda m: m["spec"]["template"]["metadata"]["labels"].update(
        {"app.kubernetes.io/name": "workload-manager"}))  # fmt: skip
    reserved = ManifestPolicy(reserved_pod_labels=MANAGER_POD_LABELS)
    with pytest.raises(
        ManifestRejected,
        match=r"pod labels app.kubernetes.io/name=workload-manager are the manager's own",
    ):
        prepare(raw, reserved)
    assert prepare(raw)["metadata"]["name"] == "api", "elsewhere the label selects nothing"
    assert prepare(edit(lambda m: None), reserved)["metadata"]["name"] == "api"
