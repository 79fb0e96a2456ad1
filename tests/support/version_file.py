"""For the self-update tests: a version file server (/version with a settable status, body
and delay, and an ETag) and the manager's own Deployment."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

if TYPE_CHECKING:
    from app.services.runtime import Runtime
    from app.services.updating import SelfUpdater
    from tests.support.real_cluster import RealCluster


class VersionFileServer:
    """Serves /version with a settable status, body and delay (for garbage and timeouts),
    and /version.sig, its signature (a 404 when none is set)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.status = 200
        self.body = b"0.1.0"
        self.delay = 0.0
        self.sig: bytes | None = None
        self.retry_after: str | None = None  # sent with a status other than 200
        self.app = Starlette(
            routes=[Route("/version", self._version), Route("/version.sig", self._sig)]
        )

    def set(
        self,
        *,
        status: int = 200,
        body: bytes = b"",
        delay: float = 0.0,
        sig: bytes | None = None,
        retry_after: str | None = None,
    ) -> None:
        with self.lock:
            self.status, self.body, self.delay, self.sig = status, body, delay, sig
            self.retry_after = retry_after

    async def _sig(self, request: Request) -> Response:
        with self.lock:
            sig = self.sig
        return Response(status_code=404) if sig is None else Response(sig)

    async def _version(self, request: Request) -> Response:
        with self.lock:
            status, body, delay, retry_after = self.status, self.body, self.delay, self.retry_after
        if delay:
            await asyncio.sleep(delay)
        if status != 200 and retry_after is not None:
            return Response(body, status_code=status, headers={"Retry-After": retry_after})
        etag = f'"{hash(body)}"'
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304)
        return Response(body, status_code=status, headers={"ETag": etag})


REPO = "ghcr.io/node-system/workload-manager"
OWN_NS = "workload-manager"


def own_deployment(
    image: str,
    *,
    sidecar: bool = True,
    progress_deadline: int | None = None,
    migrate: bool = False,
) -> dict[str, Any]:
    """The manager's own Deployment (container `manager`), as the self-update finds it;
    with `migrate`, the install's `migrate` init container of the same image (and one of
    another image, which is not the manager's)."""
    containers: list[dict[str, Any]] = [{"name": "manager", "image": image}]
    if sidecar:
        containers.append({"name": "sidecar", "image": "busybox:1.36"})
    init = [{"name": "migrate", "image": image, "args": ["migrate"]},
            {"name": "wait", "image": "busybox:1.36"}]  # fmt: skip
    spec: dict[str, Any] = {
        "selector": {"matchLabels": {"app": "wm"}},
        "strategy": {"type": "RollingUpdate",
                     "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
        "template": {"metadata": {"labels": {"app": "wm"}},
                     "spec": {"containers": containers}},
    }  # fmt: skip
    if migrate:
        spec["template"]["spec"]["initContainers"] = init
    if progress_deadline is not None:
        spec["progressDeadlineSeconds"] = progress_deadline
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "workload-manager", "namespace": OWN_NS},
        "spec": spec,
    }


def image_of(cluster: RealCluster) -> str:
    """The manager's own image, as its Deployment in the cluster has it."""
    own = cluster.get_deployment(OWN_NS, "workload-manager")
    assert own is not None
    image: str = own["spec"]["template"]["spec"]["containers"][0]["image"]
    return image


def updater(rt: Runtime) -> SelfUpdater:
    from app.services.features.self_update import SELF_UPDATE

    updating = rt.get(SELF_UPDATE)
    assert updating is not None
    return updating.updater
