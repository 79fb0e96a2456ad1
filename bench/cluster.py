"""The benchmarks' Kubernetes: a real control plane, and the manager's requests to it as
the API server itself counts them.

`start(workdir)` starts the control plane (standins/control_plane.py: etcd,
kube-apiserver, kube-controller-manager, kube-scheduler and kwok with one fake node, from
the binaries `make control-plane` builds) and applies the repo's namespaces, ServiceAccount
and RBAC (k8s/), as the tests' `control_plane` fixture does; `write_manager_kubeconfig`
gives the manager its own ServiceAccount token, so RBAC decides what it may do.

The API server's /metrics
counts every request in `apiserver_request_total` by verb, scope, subresource and answer.
Only Deployments are counted (group "apps", resource "deployments", no subresource): the
manager touches nothing else while it syncs. UPDATE (HTTP PUT, verb "PUT" in the metric:
the deployment controller's writes) and WATCH (the controllers' informers) are left out, as
is every subresource (the controller's status writes): the manager sends none of them (its
RBAC grants no `update` or `watch`). Server-side apply is a PATCH the API server counts as
verb APPLY; it is shown as PATCH, what the manager sends.

The counter is per cluster, not per client: requests this module sends itself (the
Deployment lists below) are subtracted, and whatever a controller sends with a counted verb
would show up (none was seen: see the notes of bench/sync.py).
"""

from __future__ import annotations

import ssl
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import proc
from standins.control_plane import MANAGER_ACCOUNT, ControlPlane

K8S = Path(__file__).resolve().parents[1] / "k8s"
K8S_FILES = ("namespace.yaml", "workloads-namespace.yaml", "serviceaccount.yaml", "rbac.yaml")

METRIC = "apiserver_request_total"
NOT_COUNTED_VERBS = frozenset({"PUT", "WATCH"})  # PUT: an UPDATE, as the metric names it
SHOWN_AS = {"APPLY": "PATCH"}  # server-side apply: a PATCH with an apply-patch body
STABLE_WAIT = 0.05  # seconds between the scrapes that must agree after a phase
STABLE_TRIES = 40


def start(workdir: Path) -> ControlPlane:
    """The control plane up (a fake node Ready), with the repo's k8s/ objects applied."""
    plane = ControlPlane.start(workdir)
    try:
        for name in K8S_FILES:
            plane.kubectl("apply", "-f", str(K8S / name))
    except BaseException:
        plane.stop()
        raise
    return plane


def write_manager_kubeconfig(plane: ControlPlane, path: Path, namespace: str) -> Path:
    """The manager's kubeconfig: its own ServiceAccount's token, straight to the API server."""
    token = plane.token_for(*MANAGER_ACCOUNT, hours=24)
    return plane.write_kubeconfig(path, token=token, namespace=namespace)


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

    def by_kind(self) -> dict[str, int]:
        kinds: Counter[str] = Counter()
        for key, count in self.counted.items():
            kinds[key.kind] += count
        return dict(kinds.most_common())

    def by_status(self) -> dict[str, int]:
        codes: Counter[str] = Counter()
        for key, count in self.counted.items():
            codes[str(key.code)] += count
        return dict(codes.most_common())


class ApiserverRequests:
    """Scrapes the API server's /metrics as its admin (client certificate, system:masters)."""

    def __init__(self, plane: ControlPlane) -> None:
        context = ssl.create_default_context(cafile=str(plane.ca))
        context.load_cert_chain(plane.pki / "admin.crt", plane.pki / "admin.key")
        self._client = httpx.Client(base_url=plane.url, verify=context, timeout=60.0)
        self._own: Counter[Key] = Counter()

    def close(self) -> None:
        self._client.close()

    def snapshot(self) -> Snapshot:
        response = self._client.get("/metrics")
        response.raise_for_status()
        counted: Counter[Key] = Counter()
        other: Counter[str] = Counter()
        lines = "\n".join(x for x in response.text.splitlines() if x.startswith(METRIC + "{"))
        for labels, value in proc.Metrics(lines).samples.get(METRIC, []):
            if labels.get("group") != "apps" or labels.get("resource") != "deployments":
                continue
            verb, subresource = labels.get("verb", ""), labels.get("subresource", "")
            if subresource or verb in NOT_COUNTED_VERBS:
                other[f"{verb} {subresource}".strip()] += int(value)
            else:
                counted[Key(verb, labels.get("scope", ""), int(labels.get("code", "0")))] += int(
                    value
                )
        return Snapshot(counted, other, Counter(self._own))

    def settled_snapshot(self, previous: Snapshot | None = None) -> Snapshot:
        """A snapshot once two in a row agree on the counted requests: the API server adds
        a request to its metrics just after answering it, so the last answer of a phase
        may not be counted yet in a scrape taken the moment the phase ends."""
        current = previous or self.snapshot()
        for _ in range(STABLE_TRIES):
            time.sleep(STABLE_WAIT)
            following = self.snapshot()
            if following.counted == current.counted:
                return following
            current = following
        return current

    @staticmethod
    def between(before: Snapshot, after: Snapshot) -> Requests:
        own = after.own - before.own
        counted = after.counted - before.counted
        counted.subtract(own)
        return Requests(
            counted=Counter({k: v for k, v in counted.items() if v != 0}),
            other=after.other - before.other,
        )

    # -- the cluster's Deployments, as the admin sees them (one counted LIST each) -------

    def delete_deployments(self, namespace: str) -> None:
        """Every Deployment of `namespace` in one DELETECOLLECTION (their ReplicaSets and
        Pods follow, by the garbage collector). Not subtracted from the counts: call it
        between measured windows only."""
        response = self._client.request(
            "DELETE",
            f"/apis/apps/v1/namespaces/{namespace}/deployments",
            json={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
        )
        response.raise_for_status()

    def list_deployments(self, namespace: str, label_selector: str = "") -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else {}
        response = self._client.get(
            f"/apis/apps/v1/namespaces/{namespace}/deployments", params=params
        )
        self._own[Key("LIST", "namespace", response.status_code)] += 1
        response.raise_for_status()
        items: list[dict[str, Any]] = response.json().get("items") or []
        return items


def cpu_seconds(plane: ControlPlane) -> float:
    """User + system CPU seconds of every control-plane process so far."""
    return sum(proc.cpu_seconds(p.pid) for p in plane.processes.values())
