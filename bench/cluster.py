"""The benchmarks' Kubernetes: a real control plane, and the manager's requests to it as the
API server itself counts them (`apiserver_request_total`).

Only Deployments are counted (the manager touches nothing else while it syncs), without
UPDATE (verb PUT: the deployment controller's writes), WATCH (the informers) and
subresources (status writes), none of which the manager sends; server-side apply (APPLY)
shows as PATCH. The counter is per cluster: this module's own LISTs are subtracted.
"""

from __future__ import annotations

import ssl
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import httpx

from app.domain.manifests import MANAGED_SELECTOR, VERSION_ANNOTATION
from bench import proc
from bench.report import Json
from standins.control_plane import MANAGER_ACCOUNT, ControlPlane

K8S = Path(__file__).resolve().parents[1] / "k8s"
NAMESPACE = "workloads"  # the managed namespace (k8s/workloads-namespace.yaml)
METRIC = "apiserver_request_total"


class Key(NamedTuple):
    verb: str  # as the API server counts it: LIST, GET, APPLY, PATCH, DELETE, ...
    scope: str  # namespace (a collection), resource (one object), cluster
    code: int

    @property
    def kind(self) -> str:
        """LIST, GET(404), PATCH, ...: the verb as sent, with the status unless it is 200."""
        verb = "PATCH" if self.verb == "APPLY" else self.verb
        return verb if self.code == 200 else f"{verb}({self.code})"


class Snapshot(NamedTuple):
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
    """The control plane, the manager's kubeconfig (its own ServiceAccount's token, so RBAC
    decides what it may do), and the API server's counts read as its admin."""

    def __init__(self, plane: ControlPlane, kubeconfig: Path) -> None:
        self.plane, self.kubeconfig, self._own = plane, kubeconfig, Counter[Key]()
        context = ssl.create_default_context(cafile=str(plane.ca))
        context.load_cert_chain(plane.pki / "admin.crt", plane.pki / "admin.key")
        self.client = httpx.Client(base_url=plane.url, verify=context, timeout=60.0)

    def snapshot(self) -> Snapshot:
        response = self.client.get("/metrics")
        response.raise_for_status()
        counted: Counter[Key] = Counter()
        other: Counter[str] = Counter()
        lines = "\n".join(x for x in response.text.splitlines() if x.startswith(METRIC + "{"))
        for labels, value in proc.Metrics(lines).samples.get(METRIC, []):
            if (labels.get("group"), labels.get("resource")) != ("apps", "deployments"):
                continue
            verb, subresource = labels.get("verb", ""), labels.get("subresource", "")
            if subresource or verb in ("PUT", "WATCH"):
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
        for _ in range(40):
            time.sleep(0.05)
            if (following := self.snapshot()).counted == current.counted:
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
        self.client.request(
            "DELETE", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments",
            json={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
        ).raise_for_status()  # fmt: skip

    def managed(self) -> list[Json]:
        """The managed Deployments (one LIST, subtracted from the counts)."""
        response = self.client.get(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments",
                                   params={"labelSelector": MANAGED_SELECTOR})  # fmt: skip
        self._own[Key("LIST", "namespace", response.status_code)] += 1
        items: list[Json] = response.raise_for_status().json().get("items") or []
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
    """The control plane (standins/control_plane.py) with a fake node Ready and the repo's RBAC."""
    plane = ControlPlane.start(workdir / "control-plane")
    try:
        for name in ("namespace", "workloads-namespace", "serviceaccount", "rbac"):
            plane.kubectl("apply", "-f", str(K8S / f"{name}.yaml"))
        token = plane.token_for(*MANAGER_ACCOUNT, hours=24)
        kubeconfig = plane.write_kubeconfig(
            workdir / "kubeconfig", token=token, namespace=NAMESPACE
        )
        cluster = Cluster(plane, kubeconfig)
        with cluster.client:
            yield cluster
    finally:
        plane.stop()
