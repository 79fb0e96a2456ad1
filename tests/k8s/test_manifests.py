"""Every manifest under k8s/ is valid Kubernetes, each kustomization holds together, RBAC is
least-privilege, and the manager's Deployment and the worker's DaemonSet keep their promises.

Static checks read the YAML files; when `kubectl` is on PATH the same checks run again on what
`kubectl kustomize` renders, which is what `kubectl apply -k` sends to the cluster.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from app.settings import Settings

K8S = Path(__file__).resolve().parents[2] / "k8s"
WORKER = K8S / "overlays" / "worker"
MONITORING = K8S / "monitoring"
# the fleet's NATS: its own namespace and kustomizations, checked by test_nats_manifests.py
NATS = K8S / "nats"
# Custom resources the bundled Kubernetes schemas do not know; checked by test_monitoring.py
CUSTOM_API_GROUPS = ("monitoring.coreos.com/",)
KUBERNETES_VERSION = "1.31"
KUSTOMIZATION = "kustomization.yaml"
MANIFEST_SUFFIXES = (".yaml", ".yml")

MANAGER_NAMESPACE = "workload-manager"
MANAGED_NAMESPACE = "workloads"
# where Prometheus runs (kube-prometheus and kube-prometheus-stack's usual namespace)
MONITORING_NAMESPACE = "monitoring"
MANAGER_ACCOUNT = (MANAGER_NAMESPACE, "workload-manager")
SYNC_VERBS = ("get", "list", "create", "patch", "delete")
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
# Verbs and resources no Role here may grant: privilege escalation, bulk deletion, reading
# credentials or running code in other pods.
FORBIDDEN_VERBS = {"escalate", "bind", "impersonate", "deletecollection"}
SENSITIVE_RESOURCES = {
    "secrets",
    "serviceaccounts",
    "serviceaccounts/token",
    "pods/exec",
    "pods/attach",
    "pods/portforward",
    "pods/ephemeralcontainers",
    "nodes",
    "nodes/proxy",
    "roles",
    "rolebindings",
    "clusterroles",
    "clusterrolebindings",
}

Doc = dict[str, Any]
Rule = dict[str, Any]


# --- loading


def load(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifest_files() -> list[Path]:
    return sorted(
        path
        for path in K8S.rglob("*")
        if path.suffix in MANIFEST_SUFFIXES
        and path.name != KUSTOMIZATION
        and not path.is_relative_to(NATS)
    )


def kustomizations() -> list[Path]:
    return sorted(path for path in K8S.rglob(KUSTOMIZATION) if not path.is_relative_to(NATS))


def label(doc: Doc) -> str:
    return f"{doc['kind']}/{doc['metadata'].get('namespace', '')}/{doc['metadata']['name']}"


def key(doc: Doc) -> tuple[str, str, str]:
    meta = doc["metadata"]
    return doc["kind"], meta.get("namespace", ""), meta["name"]


DOCUMENTS = [
    (f"{path.relative_to(K8S)}:{label(doc)}", doc)
    for path in manifest_files()
    for doc in load(path)
]


def kustomization(folder: Path) -> Doc:
    loaded = yaml.safe_load((folder / KUSTOMIZATION).read_text())
    assert isinstance(loaded, dict)
    return loaded


def listed_files(folder: Path) -> list[Path]:
    """The manifest files a kustomization takes from its own folder."""
    return [
        folder / entry
        for entry in kustomization(folder).get("resources", [])
        if (folder / entry).is_file()
    ]


def folder_docs(folder: Path) -> list[Doc]:
    return [doc for path in listed_files(folder) for doc in load(path)]


def only(docs: Iterable[Doc], kind: str, name: str | None = None) -> Doc:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(workload: Doc) -> Doc:
    spec: Doc = workload["spec"]["template"]["spec"]
    return spec


def container(workload: Doc) -> Doc:
    (main,) = pod_spec(workload)["containers"]
    assert isinstance(main, dict)
    return main


def env(workload: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container(workload).get("env", [])}


# --- every document


# custom resources have no schema in kubernetes-validate; test_monitoring.py checks them
BUILT_IN = [
    (w, d) for w, d in DOCUMENTS if not str(d.get("apiVersion", "")).startswith(CUSTOM_API_GROUPS)
]


@pytest.mark.parametrize(("where", "doc"), BUILT_IN, ids=[w for w, _ in BUILT_IN])
def test_manifest_is_valid(where: str, doc: Doc) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_manifests_found_in_base_and_overlay() -> None:
    where = {w.split(":")[0] for w, _ in DOCUMENTS}
    assert "deployment.yaml" in where
    assert "overlays/worker/daemonset.yaml" in where


@pytest.mark.parametrize(("where", "doc"), DOCUMENTS, ids=[w for w, _ in DOCUMENTS])
def test_namespaced_objects_name_their_namespace(where: str, doc: Doc) -> None:
    # The kustomizations set no `namespace:` (objects live in two namespaces), so each
    # namespaced object must carry its own.
    if doc["kind"] != "Namespace":
        assert doc["metadata"].get("namespace") in (MANAGER_NAMESPACE, MANAGED_NAMESPACE)


# --- kustomizations


def test_base_and_worker_overlay_are_kustomizations() -> None:
    assert kustomizations() == sorted(
        [K8S / KUSTOMIZATION, WORKER / KUSTOMIZATION, MONITORING / KUSTOMIZATION]
    )


@pytest.mark.parametrize("path", kustomizations(), ids=lambda p: str(p.relative_to(K8S)))
def test_kustomization_entries_resolve(path: Path) -> None:
    folder = path.parent
    spec = kustomization(folder)
    assert "namespace" not in spec, "a namespace transformer would move the workloads RBAC"
    entries = list(spec.get("resources", []))
    entries += [p["path"] for p in spec.get("patches", []) if "path" in p]
    assert entries
    for entry in entries:
        target = (folder / entry).resolve()
        if target.is_dir():
            assert (target / KUSTOMIZATION).is_file(), f"{entry}: not a kustomization"
            # kustomize refuses a base that contains the overlay ("cycle detected").
            assert not folder.resolve().is_relative_to(target), f"{entry}: contains {folder}"
        else:
            assert target.is_file(), f"{entry}: no such file"
            # kustomize's default load restrictor refuses files outside the folder.
            assert target.is_relative_to(folder.resolve()), f"{entry}: outside {folder}"


@pytest.mark.parametrize("path", kustomizations(), ids=lambda p: str(p.relative_to(K8S)))
def test_kustomization_lists_every_manifest(path: Path) -> None:
    folder = path.parent
    present = {p for p in folder.iterdir() if p.suffix in MANIFEST_SUFFIXES} - {path}
    assert set(listed_files(folder)) == present


def test_every_manifest_belongs_to_a_kustomization() -> None:
    listed = {p for k in kustomizations() for p in listed_files(k.parent)}
    assert set(manifest_files()) == listed


def test_base_and_worker_run_the_same_image() -> None:
    def images(folder: Path) -> list[Doc]:
        found: list[Doc] = kustomization(folder)["images"]
        return found

    assert images(K8S) == images(WORKER)
    (pin,) = images(K8S)
    image = f"{pin['name']}:{pin['newTag']}"
    assert container(only(folder_docs(K8S), "Deployment"))["image"] == image
    assert container(only(folder_docs(WORKER), "DaemonSet"))["image"] == image


@pytest.mark.parametrize(("folder", "kind"), [(K8S, "Deployment"), (WORKER, "DaemonSet")])
def test_the_shutdown_deadline_ends_before_the_pod_is_killed(folder: Path, kind: str) -> None:
    """SHUTDOWN_GRACE_SECONDS (the manager's one deadline, from SIGTERM) must end with
    time to spare before the kubelet's SIGKILL at terminationGracePeriodSeconds."""
    workload = only(folder_docs(folder), kind)
    kill_after = pod_spec(workload)["terminationGracePeriodSeconds"]
    grace = env(workload).get("SHUTDOWN_GRACE_SECONDS")
    deadline = (
        float(grace["value"]) if grace else Settings.model_fields["shutdown_grace_seconds"].default
    )
    assert deadline + 5 <= kill_after, (deadline, kill_after)
    assert Settings.model_fields["shutdown_grace_seconds"].default + 5 <= kill_after


def test_worker_copies_of_base_manifests_stay_in_step() -> None:
    base, worker = folder_docs(K8S), folder_docs(WORKER)
    assert only(worker, "Namespace") == only(base, "Namespace", MANAGER_NAMESPACE)
    base_service, worker_service = only(base, "Service"), only(worker, "Service")
    assert worker_service["metadata"] == base_service["metadata"]
    assert worker_service["spec"]["ports"] == base_service["spec"]["ports"]


# --- RBAC


def roles_and_rules(docs: Iterable[Doc]) -> Iterable[tuple[Doc, Rule]]:
    for doc in docs:
        if doc["kind"] in ("Role", "ClusterRole"):
            for rule in doc.get("rules") or []:
                yield doc, rule


def grants(docs: list[Doc], account: tuple[str, str]) -> list[tuple[str, Rule]]:
    """(namespace, rule) for every rule bound to the ServiceAccount (namespace, name)."""
    roles = {
        (d["metadata"]["namespace"], d["metadata"]["name"]): d for d in docs if d["kind"] == "Role"
    }
    found: list[tuple[str, Rule]] = []
    for binding in (d for d in docs if d["kind"] == "RoleBinding"):
        subjects = {
            (s.get("namespace"), s["name"])
            for s in binding.get("subjects") or []
            if s["kind"] == "ServiceAccount"
        }
        if account in subjects:
            namespace = binding["metadata"]["namespace"]
            role = roles[(namespace, binding["roleRef"]["name"])]
            found.extend((namespace, rule) for rule in role.get("rules") or [])
    return found


def assert_least_privilege(docs: list[Doc]) -> None:
    kinds = {doc["kind"] for doc in docs}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}, "nothing cluster-wide"
    names = {key(d) for d in docs}
    accounts = {
        (d["metadata"]["namespace"], d["metadata"]["name"])
        for d in docs
        if d["kind"] == "ServiceAccount"
    }
    for doc, rule in roles_and_rules(docs):
        for field in ("apiGroups", "resources", "verbs", "resourceNames"):
            assert "*" not in rule.get(field, []), f"{label(doc)}: wildcard in {field}"
        assert rule.get("resources"), f"{label(doc)}: rule without resources"
        assert not set(rule["verbs"]) & FORBIDDEN_VERBS, f"{label(doc)}: {rule['verbs']}"
        assert not set(rule["resources"]) & SENSITIVE_RESOURCES, f"{label(doc)}: {rule}"
        assert "nonResourceURLs" not in rule
    for binding in (d for d in docs if d["kind"] == "RoleBinding"):
        ref = binding["roleRef"]
        # A RoleBinding to a ClusterRole (`edit`, `admin`) would dodge every check above.
        assert ref["kind"] == "Role", f"{label(binding)} binds a {ref['kind']}"
        assert ("Role", binding["metadata"]["namespace"], ref["name"]) in names
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount", f"{label(binding)}: {subject}"
            assert (subject["namespace"], subject["name"]) in accounts


def assert_manager_rights(docs: list[Doc]) -> None:
    deployment = only(docs, "Deployment")
    assert pod_spec(deployment)["serviceAccountName"] == MANAGER_ACCOUNT[1]
    granted = grants(docs, MANAGER_ACCOUNT)
    assert {ns for ns, _ in granted} == {MANAGED_NAMESPACE, MANAGER_NAMESPACE}

    # Deployment sync: server-side apply (PATCH; create for new objects) and delete, in the
    # managed namespace only, and nothing else there.
    managed = [rule for ns, rule in granted if ns == MANAGED_NAMESPACE]
    assert len(managed) == 2, managed
    (sync,) = [rule for rule in managed if rule["apiGroups"] == ["apps"]]
    (pods,) = [rule for rule in managed if rule["apiGroups"] == [""]]
    assert (pods["resources"], pods["verbs"]) == (["pods"], ["list"]), "crash loops: list only"
    assert sync["apiGroups"] == ["apps"]
    assert sync["resources"] == ["deployments"]
    assert sorted(sync["verbs"]) == sorted(SYNC_VERBS), "no update, no deletecollection"
    assert "resourceNames" not in sync

    # Own namespace: its own Deployment by name (get, patch for self-update), nothing else;
    # the rollout is read from that Deployment's status.
    own = [rule for ns, rule in granted if ns == MANAGER_NAMESPACE]
    for rule in own:
        if set(rule["verbs"]) & WRITE_VERBS:
            assert rule.get("resourceNames"), f"unrestricted write: {rule}"
    (self_rule,) = [rule for rule in own if rule["apiGroups"] == ["apps"]]
    (uptime_rule,) = [rule for rule in own if rule["apiGroups"] == [""]]
    assert uptime_rule["resources"] == ["configmaps"]
    assert uptime_rule["resourceNames"] == [
        "workload-manager-uptime",
        "workload-manager-desired-state",
    ]
    assert set(uptime_rule["verbs"]) == {"get", "patch"}
    assert self_rule["apiGroups"] == ["apps"]
    assert self_rule["resources"] == ["deployments"]
    assert self_rule["resourceNames"] == [deployment["metadata"]["name"]]
    assert set(self_rule["verbs"]) == {"get", "patch"}


def assert_worker_has_no_rights(docs: list[Doc]) -> None:
    assert not [d for d in docs if d["kind"] == "Deployment"]
    assert not [d for d in docs if d["metadata"].get("namespace") == MANAGED_NAMESPACE]
    assert not [
        d for d in docs if d["kind"] == "Namespace" and d["metadata"]["name"] == MANAGED_NAMESPACE
    ]
    for doc, rule in roles_and_rules(docs):
        assert "deployments" not in rule.get("resources", []), f"{label(doc)}: {rule}"
    daemonset = only(docs, "DaemonSet")
    account = pod_spec(daemonset)["serviceAccountName"]
    assert account != MANAGER_ACCOUNT[1], "the worker must not run as the manager"
    assert grants(docs, (MANAGER_NAMESPACE, account)) == []
    assert only(docs, "ServiceAccount", account)["automountServiceAccountToken"] is False


def test_base_rbac_is_least_privilege() -> None:
    assert_least_privilege(folder_docs(K8S))


def test_worker_rbac_is_least_privilege() -> None:
    assert_least_privilege(folder_docs(WORKER))


def test_no_cluster_wide_rbac_anywhere() -> None:
    kinds = {doc["kind"] for _, doc in DOCUMENTS}
    assert "Role" in kinds
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}


def test_manager_rights_are_exactly_sync_and_self_update() -> None:
    assert_manager_rights(folder_docs(K8S))


def test_worker_grants_nothing() -> None:
    assert_worker_has_no_rights(folder_docs(WORKER))


# --- the manager's Deployment


def test_manager_deployment_is_safe_to_roll() -> None:
    deployment = yaml.safe_load((K8S / "deployment.yaml").read_text())
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "probes"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "probes"}
    env = {e["name"] for e in container["env"]}
    assert {"POD_NAME", "POD_NAMESPACE", "APP_ENV"} <= env
    assert "limits" in container["resources"] and "requests" in container["resources"]


def test_manager_env_points_at_its_namespace_deployment_and_service() -> None:
    docs = folder_docs(K8S)
    deployment, service = only(docs, "Deployment"), only(docs, "Service")
    variables = env(deployment)
    value = {name: e.get("value") for name, e in variables.items()}
    field = {
        name: e["valueFrom"]["fieldRef"]["fieldPath"]
        for name, e in variables.items()
        if "valueFrom" in e
    }
    assert field == {
        "POD_NAME": "metadata.name",
        "POD_NAMESPACE": "metadata.namespace",
        "NODE_NAME": "spec.nodeName",
    }

    managed = only(docs, "Namespace", value["MANAGED_NAMESPACE"])
    assert managed["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "workload-manager"
    assert value["MANAGED_NAMESPACE"] == MANAGED_NAMESPACE
    assert value["SELF_DEPLOYMENT_NAME"] == deployment["metadata"]["name"]

    url = urlsplit(value["MANAGER_URL"] or "")
    meta = service["metadata"]
    assert url.scheme == "http"
    assert url.hostname == f"{meta['name']}.{meta['namespace']}.svc"
    assert url.port in [p["port"] for p in service["spec"]["ports"]]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


# --- the worker's DaemonSet


def test_worker_daemonset_runs_jobs_only() -> None:
    daemonset = only(folder_docs(WORKER), "DaemonSet")
    strategy = daemonset["spec"]["updateStrategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    variables = env(daemonset)
    assert variables["SYNC_ENABLED"]["value"] == "false"
    assert variables["SELF_UPDATE_ENABLED"]["value"] == "false"
    assert "MANAGED_NAMESPACE" not in variables and "SELF_DEPLOYMENT_NAME" not in variables
    # The fleet's worker DaemonSet contract: these names exactly.
    assert variables["NODE_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert {"TIER", "NATS_URL"} <= variables.keys()
    registry = variables["CAPABILITY_REGISTRY"]["valueFrom"]["secretKeyRef"]
    assert registry["key"] == "CAPABILITY_REGISTRY"


def test_worker_pod_is_as_safe_as_the_manager() -> None:
    deployment = only(folder_docs(K8S), "Deployment")
    daemonset = only(folder_docs(WORKER), "DaemonSet")
    manager_pod, worker_pod = pod_spec(deployment), pod_spec(daemonset)
    for field in ("securityContext", "volumes", "terminationGracePeriodSeconds"):
        assert worker_pod[field] == manager_pod[field], field
    manager, worker = container(deployment), container(daemonset)
    for field in (
        "image",
        "args",
        "ports",
        "envFrom",
        "securityContext",
        "readinessProbe",
        "livenessProbe",
        "resources",
        "volumeMounts",
    ):
        assert worker[field] == manager[field], field


def test_worker_service_selects_worker_pods() -> None:
    docs = folder_docs(WORKER)
    service, daemonset = only(docs, "Service"), only(docs, "DaemonSet")
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


# --- who may reach the pods (networkpolicy.yaml)


def policy_sources(policy: Doc) -> set[tuple[str, int, str]]:
    """(namespace, port, protocol) for every peer a NetworkPolicy lets in. Only whole
    namespaces named by their `kubernetes.io/metadata.name` label are accepted: a rule with
    no `from` (everyone), an ipBlock or a podSelector fails here."""
    found: set[tuple[str, int, str]] = set()
    for rule in policy["spec"].get("ingress") or []:
        assert rule.get("from"), f"{label(policy)}: a rule without `from` lets everyone in"
        assert rule.get("ports"), f"{label(policy)}: a rule without `ports` opens every port"
        for peer in rule["from"]:
            assert set(peer) == {"namespaceSelector"}, peer
            selector = peer["namespaceSelector"]
            assert set(selector) == {"matchLabels"}, selector
            (namespace,) = selector["matchLabels"].values()
            assert list(selector["matchLabels"]) == ["kubernetes.io/metadata.name"], selector
            for port in rule["ports"]:
                assert set(port) == {"port", "protocol"}, port
                found.add((namespace, port["port"], port["protocol"]))
    return found


def http_port(workload: Doc) -> int:
    (port,) = [p["containerPort"] for p in container(workload)["ports"] if p["name"] == "http"]
    assert isinstance(port, int)
    assert env(workload)["PORT"]["value"] == str(port)
    return port


def probe_port(workload: Doc) -> int:
    (port,) = [p["containerPort"] for p in container(workload)["ports"] if p["name"] == "probes"]
    assert isinstance(port, int)
    assert env(workload)["PROBE_PORT"]["value"] == str(port)
    return port


@pytest.mark.parametrize(("folder", "kind"), [(K8S, "Deployment"), (WORKER, "DaemonSet")])
def test_the_probes_have_a_port_of_their_own_that_no_pod_may_reach(folder: Path, kind: str) -> None:
    """The kubelet probes the probe port, outside the HTTP port's connection caps; the
    NetworkPolicy lets pods in on the HTTP port alone (the node is always let in)."""
    docs = folder_docs(folder)
    workload = only(docs, kind)
    probes = probe_port(workload)
    assert probes != http_port(workload)
    for probe in ("readinessProbe", "livenessProbe"):
        assert container(workload)[probe]["httpGet"]["port"] == "probes"
    opened = {port for _namespace, port, _protocol in policy_sources(only(docs, "NetworkPolicy"))}
    assert probes not in opened and opened == {http_port(workload)}


def assert_policy_guards(docs: list[Doc], kind: str, sources: set[str]) -> None:
    """One NetworkPolicy for the workload's pods and no one else's: ingress only, from
    exactly `sources` (namespaces), on the pods' HTTP port only."""
    workload = only(docs, kind)
    policy = only(docs, "NetworkPolicy")
    assert policy["metadata"]["namespace"] == workload["metadata"]["namespace"]
    selector = policy["spec"]["podSelector"]
    assert set(selector) == {"matchLabels"}, selector
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert selector["matchLabels"] == workload["spec"]["selector"]["matchLabels"]
    assert selector["matchLabels"].items() <= labels.items()
    # Ingress only: the manager's egress (API server, backend, NATS, PostgreSQL, S3, DNS)
    # goes to addresses the operator configures, and is not restricted here.
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    port = http_port(workload)
    assert policy_sources(policy) == {(source, port, "TCP") for source in sources}


def test_only_the_workloads_and_prometheus_reach_the_manager() -> None:
    docs = folder_docs(K8S)
    managed = env(only(docs, "Deployment"))["MANAGED_NAMESPACE"]["value"]
    assert_policy_guards(docs, "Deployment", {managed, MONITORING_NAMESPACE})


def test_only_prometheus_reaches_a_worker() -> None:
    """A worker manages no workloads, so nothing pings it."""
    assert_policy_guards(folder_docs(WORKER), "DaemonSet", {MONITORING_NAMESPACE})


def test_the_policies_of_manager_and_worker_select_their_own_pods() -> None:
    base = only(folder_docs(K8S), "NetworkPolicy")
    worker = only(folder_docs(WORKER), "NetworkPolicy")
    assert base["metadata"]["name"] != worker["metadata"]["name"]
    assert base["spec"]["podSelector"] != worker["spec"]["podSelector"]


@pytest.mark.parametrize(("folder", "kind"), [(K8S, "Deployment"), (WORKER, "DaemonSet")])
def test_only_the_manager_mounts_an_api_token(folder: Path, kind: str) -> None:
    """The manager's Deployment talks to the API server (sync, self-update, uptime); a
    worker never does, and its pods get no ServiceAccount token at all."""
    docs = folder_docs(folder)
    pod = pod_spec(only(docs, kind))
    account = (MANAGER_NAMESPACE, pod["serviceAccountName"])
    if kind == "Deployment":
        assert grants(docs, account), "the manager uses the API"
        assert pod.get("automountServiceAccountToken", True) is True
    else:
        assert grants(docs, account) == []
        assert pod["automountServiceAccountToken"] is False


# --- what `kubectl apply -k` sends


KUBECTL = shutil.which("kubectl")
RENDERED = {"base": K8S, "worker": WORKER}
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl not on PATH: cannot render the kustomizations"
)


@functools.cache
def render(name: str) -> tuple[Doc, ...]:
    assert KUBECTL is not None
    result = subprocess.run(
        [KUBECTL, "kustomize", str(RENDERED[name])],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


@needs_kubectl
@pytest.mark.parametrize("name", sorted(RENDERED))
def test_rendered_documents_are_valid(name: str) -> None:
    rendered = render(name)
    assert rendered
    for doc in rendered:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@needs_kubectl
@pytest.mark.parametrize("name", sorted(RENDERED))
def test_rendering_keeps_every_object_where_the_files_put_it(name: str) -> None:
    rendered = sorted(key(doc) for doc in render(name))
    assert rendered == sorted(key(doc) for doc in folder_docs(RENDERED[name]))
    namespaces = {doc["metadata"]["name"] for doc in render(name) if doc["kind"] == "Namespace"}
    used = {doc["metadata"]["namespace"] for doc in render(name) if doc["kind"] != "Namespace"}
    assert used <= namespaces, "every namespace used is created by the same apply"


@needs_kubectl
def test_rendered_base_rbac() -> None:
    docs = list(render("base"))
    assert_least_privilege(docs)
    assert_manager_rights(docs)


@needs_kubectl
def test_rendered_worker_rbac() -> None:
    docs = list(render("worker"))
    assert_least_privilege(docs)
    assert_worker_has_no_rights(docs)


@needs_kubectl
def test_rendered_network_policies() -> None:
    base, worker = list(render("base")), list(render("worker"))
    assert_policy_guards(base, "Deployment", {MANAGED_NAMESPACE, MONITORING_NAMESPACE})
    assert_policy_guards(worker, "DaemonSet", {MONITORING_NAMESPACE})


def test_every_environment_variable_in_the_manifests_is_a_setting() -> None:
    from app.settings import Settings

    known = {name.upper() for name in Settings.model_fields} | {"TIER", "CAPABILITY_REGISTRY"}
    # set for the pod's own use or for humans reading `kubectl describe`, not settings
    informational = {"POD_NAME", "NODE_NAME"}
    names: set[str] = set()
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = ((doc or {}).get("spec") or {}).get("template", {}).get("spec", {})
            for container in spec.get("containers", []) + spec.get("initContainers", []):
                names |= {e["name"] for e in container.get("env", [])}
    assert names, "no container environment found under k8s/"
    assert names - known - informational == set()


def test_the_managed_namespace_enforces_the_baseline_pod_security_standard() -> None:
    from app.domain.pod_security import STANDARD_VERSION

    labels = only(load(K8S / "workloads-namespace.yaml"), "Namespace")["metadata"]["labels"]
    prefix = "pod-security.kubernetes.io/"
    assert {k: v for k, v in labels.items() if k.startswith(prefix)} == {
        f"{prefix}enforce": "baseline", f"{prefix}enforce-version": STANDARD_VERSION,
        f"{prefix}warn": "restricted", f"{prefix}warn-version": STANDARD_VERSION,
        f"{prefix}audit": "restricted", f"{prefix}audit-version": STANDARD_VERSION,
    }  # fmt: skip


def test_the_manager_gets_pings_while_it_is_not_ready() -> None:
    """Readiness says whether the node's connections the settings require work (NATS, its
    PostgreSQL); the single manager pod still gets the pings while they do not."""
    service = only(folder_docs(K8S), "Service")
    assert service["spec"]["publishNotReadyAddresses"] is True
