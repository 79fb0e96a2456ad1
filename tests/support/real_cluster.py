"""The real control plane as the process and fault tests use it: the manager reaches the
API server through the fault proxy with its own ServiceAccount token; the tests act as
the admin, beside it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from standins.control_plane import MANAGER_ACCOUNT, ControlPlane
from tests.support.kube.faults import RecordedRequest
from tests.support.kube.proxy import FaultProxy


class RealCluster:
    def __init__(self, plane: ControlPlane, proxy: FaultProxy, proxy_url: str) -> None:
        self.plane = plane
        self.proxy = proxy
        self.url = proxy_url
        self._token: str | None = None

    def reset(self, namespace: str) -> None:
        """No Deployments in `namespace`, no faults, no recorded requests."""
        self.proxy.reset()  # before the delete: nothing held may land after it
        self.plane.kubectl("-n", namespace, "delete", "deployments", "--all", "--wait=true")

    def write_kubeconfig(self, path: Path, namespace: str) -> Path:
        """The manager's kubeconfig: its ServiceAccount token, through the proxy."""
        if self._token is None:
            self._token = self.plane.token_for(*MANAGER_ACCOUNT, hours=4)
        return self.plane.write_kubeconfig(
            path, token=self._token, namespace=namespace, server=self.url
        )

    def write_direct_kubeconfig(self, path: Path, namespace: str) -> Path:
        """The manager's token, straight to the API server (for kubectl beside it)."""
        self.write_kubeconfig(path, namespace)
        assert self._token is not None
        return self.plane.write_kubeconfig(path, token=self._token, namespace=namespace)

    # -- the cluster's state, as the admin sees it -------------------------------------

    def add_deployment(self, obj: dict[str, Any]) -> dict[str, Any]:
        namespace = obj["metadata"]["namespace"]
        self.plane.kubectl("create", "-f", "-", input=json.dumps(obj))
        created = self.get_deployment(namespace, obj["metadata"]["name"])
        assert created is not None
        return created

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        listed = self.plane.kubectl("-n", namespace, "get", "pods", "-l", selector, "-o", "json")
        items: list[dict[str, Any]] = json.loads(listed.stdout)["items"]
        return items

    def set_pod_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Write a pod's status as a kubelet would (kwok leaves pods of never-ready images
        alone, so what is written here stays)."""
        self.plane.kubectl(
            "-n", namespace, "patch", "pod", name, "--subresource=status", "--type=merge",
            "-p", json.dumps({"status": status}),
        )  # fmt: skip

    def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.plane.get("deployment", name, namespace)

    def list_deployments(self, namespace: str) -> list[dict[str, Any]]:
        return self.plane.list("deployments", namespace)

    def edit_deployment(
        self, namespace: str, name: str, edit: Callable[[dict[str, Any]], None]
    ) -> dict[str, Any]:
        """What `kubectl edit` does: read, change, replace with the read resourceVersion
        (another field manager than the manager's). The deployment controller writes status
        meanwhile, so a conflict is read again, a few times."""
        for _attempt in range(10):
            current = self.get_deployment(namespace, name)
            assert current is not None, f"no deployment {namespace}/{name}"
            edit(current)
            done = self.plane.kubectl("replace", "-f", "-", input=json.dumps(current), check=False)
            if done.returncode == 0:
                edited = self.get_deployment(namespace, name)
                assert edited is not None
                return edited
            if "modified" not in done.stderr:
                raise AssertionError(f"kubectl replace failed: {done.stderr}")
        raise AssertionError(f"kubectl replace of {namespace}/{name} kept conflicting")

    # -- faults and records (the proxy's) ----------------------------------------------

    def fail_next(
        self, method: str | None = None, path_contains: str = "", *, status: int = 500,
        times: int = 1, message: str = "", retry_after: int | None = None,
    ) -> None:  # fmt: skip
        self.proxy.fail_next(
            method, path_contains, status=status, times=times, message=message,
            retry_after=retry_after,
        )  # fmt: skip

    def delay_next(
        self, method: str | None = None, path_contains: str = "", *, seconds: float, times: int = 1
    ) -> None:
        self.proxy.delay_next(method, path_contains, seconds=seconds, times=times)

    def release_held(self) -> None:
        self.proxy.release_held()

    @property
    def delays_waiting(self) -> int:
        return self.proxy.delays_waiting

    def clear_faults(self) -> None:
        self.proxy.clear_faults()

    @property
    def requests(self) -> list[RecordedRequest]:
        return self.proxy.requests

    def clear_requests(self) -> None:
        self.proxy.clear_requests()
