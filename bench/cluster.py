"""The benchmarks' Kubernetes: a real control plane, and the manager's requests to it as
the API server itself counts them.

`running(workdir)` starts the control plane (standins/control_plane.py, from the binaries
`make control-plane` builds), applies the repo's namespaces, ServiceAccount and RBAC (k8s/)
and writes the manager a kubeconfig with its own ServiceAccount token, so RBAC decides what
it may do.

Requests are read from the API server's `apiserver_request_total`, Deployments only (the
manager touches nothing else while it syncs), without UPDATE (verb PUT: the deployment
controller's writes), WATCH (the informers) and subresources (status writes): the manager
sends none of them. Server-side apply, counted as APPLY, is shown as PATCH. The counter is
per cluster: this module's own requests are subtracted, another client's would show.
"""

from __future__ import annotations

import ssl
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from app.domain.manifests import MANAGED_SELECTOR, VERSION_ANNOTATION
from bench import proc
from standins.control_plane import MANAGER_ACCOUNT, ControlPlane

K8S = Path(__file__).resolve().parents[1] / "k8s"
K8S_FILES = ("namespace.yaml", "workloads-namespace.yaml", "serviceaccount.yaml", "rbac.yaml")
NAMESPACE = "workloads"  # the managed namespace (k8s/workloads-namespace.yaml)
METRIC = "apiserver_request_total"
NOT_COUNTED_VERBS = frozenset({"PUT", "WATCH"})
SHOWN_AS = {"APPLY": "PATCH"}
STABLE_WAIT, STABLE_TRIES = 0.05, 40  # scrapes that must agree after a phase


@dataclass(frozen=True, order=True)
class Key:
    verb: str  # as the API server counts it: LIST, GET, APPLY, PATCH, DELETE, ...
    scope: str  # namespace (a collection), resource (one object), cluster
    code: int

    @property
    def kind(self) -> str:
        """LIST, GET(404), PATCH, ...: the verb as sent, with the status unless it is 200."""
        verb = SHOWN_AS.get(self.verb, self.verb)
        return verb if self.code == 200 else f"{verb}({self.code})"


@dataclass(frozen=True)
class Snapshot:
    counted: Counter[Key]
    other: Counter[str]  # the Deployment requests not counted, "VERB subresource"
    own: Counter[Key]  # sent by this module up to now


@dataclass
class Requests:
    """What happened between two snapshots, this module's own requests taken out."""

    counted: Counter[Key] = field(default_factory=Counter)
    other: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.counted.values())

    def by(self, what: str = "kind") -> dict[str, int]:
        """Counts by `kind` (GET(404)), `status` (404) or `scope` (GET(404) resource)."""
        found: Counter[str] = Counter()
        for key, count in self.counted.items():
            found[{"kind": key.kind, "status": str(key.code),
                   "scope": f"{key.kind} {key.scope}"}[what]] += count  # fmt: skip
        return dict(found.most_common())


class Cluster:
    """The control plane, the manager's kubeconfig, and the API server's counts as its
    admin reads them (client certificate, system:masters)."""

    def __init__(self, plane: ControlPlane, kubeconfig: Path) -> None:
        self.plane, self.kubeconfig = plane, kubeconfig
        context = ssl.create_default_context(cafile=str(plane.ca))
        context.load_cert_chain(plane.pki / "admin.crt", plane.pki / "admin.key")
        self._client = httpx.Client(base_url=plane.url, verify=context, timeout=60.0)
        self._own: Counter[Key] = Counter()

    def snapshot(self) -> Snapshot:
        response = self._client.get("/metrics")
        response.raise_for_status()
        counted: Counter[Key] = Counter()
        other: Counter[str] = Counter()
        lines = "\n".join(x for x in response.text.splitlines() if x.startswith(METRIC + "{"))
        for labels, value in proc.Metrics(lines).samples.get(METRIC, []):
            if (labels.get("group"), labels.get("resource")) != ("apps", "deployments"):
                continue
            verb, subresource = labels.get("verb", ""), labels.get("subresource", "")
            if subresource or verb in NOT_COUNTED_VERBS:
                other[f"{verb} {subresource}".strip()] += int(value)
            else:
                counted[Key(verb, labels.get("scope", ""), int(labels.get("code", "0")))] += int(
                    value
                )
        return Snapshot(counted, other, Counter(self._own))

    def settled_snapshot(self) -> Snapshot:
        """A snapshot once two in a row agree: the API server counts a request just after
        answering it, so a scrape the moment a phase ends may miss its last answer."""
        current = self.snapshot()
        for _ in range(STABLE_TRIES):
            time.sleep(STABLE_WAIT)
            following = self.snapshot()
            if following.counted == current.counted:
                return following
            current = following
        return current

    @staticmethod
    def between(before: Snapshot, after: Snapshot) -> Requests:
        counted = after.counted - before.counted
        counted.subtract(after.own - before.own)
        return Requests(
            Counter({k: v for k, v in counted.items() if v}), after.other - before.other
        )

    def delete_deployments(self) -> None:
        """Every Deployment of the namespace in one DELETECOLLECTION (their ReplicaSets and
        Pods follow). Not subtracted from the counts: only between measured windows."""
        response = self._client.request(
            "DELETE", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments",
            json={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
        )  # fmt: skip
        response.raise_for_status()

    def managed(self) -> list[dict[str, Any]]:
        """The managed Deployments (one LIST, subtracted from the counts)."""
        response = self._client.get(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments",
                                    params={"labelSelector": MANAGED_SELECTOR})  # fmt: skip
        self._own[Key("LIST", "namespace", response.status_code)] += 1
        response.raise_for_status()
        items: list[dict[str, Any]] = response.json().get("items") or []
        return items

    def versions(self) -> dict[str, str]:
        """The managed Deployments by name, with the version they are annotated with."""
        return {d["metadata"]["name"]: (d["metadata"].get("annotations") or {}).get(
            VERSION_ANNOTATION, "") for d in self.managed()}  # fmt: skip

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of every control-plane process so far."""
        return sum(proc.cpu_seconds(p.pid) for p in self.plane.processes.values())


@contextmanager
def running(workdir: Path) -> Iterator[Cluster]:
    """The control plane up (a fake node Ready) with the repo's k8s/ objects applied."""
    plane = ControlPlane.start(workdir / "control-plane")
    try:
        for name in K8S_FILES:
            plane.kubectl("apply", "-f", str(K8S / name))
        token = plane.token_for(*MANAGER_ACCOUNT, hours=24)
        kubeconfig = plane.write_kubeconfig(
            workdir / "kubeconfig", token=token, namespace=NAMESPACE
        )
        cluster = Cluster(plane, kubeconfig)
        try:
            yield cluster
        finally:
            cluster._client.close()
    finally:
        plane.stop()
