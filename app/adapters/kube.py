"""The cluster, through kubernetes-asyncio: Deployments in the managed namespace.

Responses are read as raw JSON (`_preload_content=False`) rather than as generated
models: the manager compares and stores plain objects, and listing a thousand
Deployments as models costs far more than the request. Lists are read in pages
(`limit`/`continue`, at most `max_pages` of them), so no one answer is larger than a
page. Status codes are mapped to `KubeConflict` (409), `KubeNotFound` (404) and
`KubeError`; transport errors, 429 and 5xx are retried with jittered backoff, and every
request has a timeout.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import os
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import stamina
import yaml

from app.adapters import kube_lazy

kube_lazy.install()  # before the import below: only the parts used are loaded

from kubernetes_asyncio import client, config  # noqa: E402

APPLY_PATCH = "application/apply-patch+yaml"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
MERGE_PATCH = "application/merge-patch+json"
FIELD_MANAGER = "workload-manager"
RESTART_FIELD_MANAGER = "workload-manager-uptime"
ROLLOUT_FIELD_MANAGER = "workload-manager-rollout"
RESTARTED_AT = "kubectl.kubernetes.io/restartedAt"  # what `kubectl rollout restart` sets
DEFAULT_KUBECONFIG = Path("~/.kube/config")
IN_CLUSTER_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


class KubeError(RuntimeError):
    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status == 429 or self.status >= 500


class KubeConflict(KubeError):
    """409: the object changed since it was read, or already exists."""


class KubeNotFound(KubeError):
    """404: no such object."""


class ClusterUnavailable(RuntimeError):
    """No cluster configuration: the message says what was looked for."""


async def load_configuration(kubeconfig: Path | None) -> tuple[client.Configuration, str]:
    """In-cluster config in a pod, else KUBECONFIG / ~/.kube/config; (config, source)."""
    configuration = client.Configuration()
    in_cluster, path = await asyncio.to_thread(_locate, kubeconfig)
    if in_cluster:
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        return configuration, "in-cluster service account"
    if path is None:
        where = f"KUBECONFIG={kubeconfig}" if kubeconfig else str(DEFAULT_KUBECONFIG)
        raise ClusterUnavailable(f"no cluster access: not in a pod and no kubeconfig at {where}")
    try:
        await config.load_kube_config(
            config_file=str(path), client_configuration=configuration, persist_config=False
        )
    except (config.ConfigException, ValueError, OSError, yaml.YAMLError) as exc:
        raise ClusterUnavailable(f"kubeconfig {path} is not usable: {exc}") from None
    return configuration, f"kubeconfig {path}"


def _locate(kubeconfig: Path | None) -> tuple[bool, Path | None]:
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        if IN_CLUSTER_TOKEN.exists():
            return True, None
    path = kubeconfig or DEFAULT_KUBECONFIG.expanduser()
    return False, path if path.is_file() else None


def _is_retryable(exc: Exception) -> bool:
    if isinstance(exc, KubeError):
        return exc.retryable and not isinstance(exc, KubeConflict | KubeNotFound)
    return isinstance(exc, aiohttp.ClientError | TimeoutError)


class KubeDeployments:
    """Deployments of one namespace, as plain JSON objects."""

    def __init__(
        self,
        configuration: client.Configuration,
        *,
        namespace: str,
        timeout: float,
        attempts: int = 3,
        max_wait: float = 2.0,
        page_size: int = 500,
        max_pages: int = 100,
    ) -> None:
        self.namespace = namespace
        self._timeout = timeout
        self._attempts = attempts
        self._max_wait = max_wait
        self._page_size = page_size
        self._max_pages = max_pages
        self._api_client = client.ApiClient(configuration)
        # Typed as Any: the generated signatures want models, and the manager sends and
        # reads plain JSON objects (which the client accepts at run time).
        self._apps: Any = client.AppsV1Api(self._api_client)
        self._core: Any = client.CoreV1Api(self._api_client)
        self.host = str(configuration.host)

    async def aclose(self) -> None:
        await self._api_client.close()

    def in_namespace(self, namespace: str) -> KubeDeployments:
        """This client (its connection pool and credentials) for another namespace; it is
        closed with this one."""
        other = copy.copy(self)
        other.namespace = namespace
        return other

    async def server_version(self) -> str:
        """The cluster's version (e.g. `v1.31.4+k3s1`), for the node's fingerprint."""
        version = client.VersionApi(self._api_client)
        body = await self._call(
            "get version",
            lambda: version.get_code(_preload_content=False, _request_timeout=self._timeout),
        )
        return str(body.get("gitVersion", "unknown"))

    async def _call(self, what: str, request: Callable[[], Awaitable[Any]]) -> Any:
        """One API call with retries; returns the decoded JSON body (None when empty)."""
        async for attempt in stamina.retry_context(
            on=_is_retryable,
            attempts=self._attempts,
            wait_initial=min(0.1, self._max_wait),
            wait_max=self._max_wait,
            timeout=None,
        ):
            with attempt:
                try:
                    response = await request()
                    try:
                        body = await response.read()
                        status: int = response.status
                    finally:
                        response.release()
                except TimeoutError:
                    raise KubeError(f"{what}: timed out after {self._timeout:.0f} s") from None
                except aiohttp.ClientError as exc:
                    raise KubeError(f"{what}: {type(exc).__name__}: {exc}") from None
                return _decode(what, status, body)
        raise AssertionError("unreachable: stamina either returns or raises")

    async def list_managed(self, label_selector: str) -> list[dict[str, Any]]:
        def page(token: str | None) -> Awaitable[Any]:
            return self._apps.list_namespaced_deployment(  # type: ignore[no-any-return]
                self.namespace, label_selector=label_selector, **self._paging(token)
            )

        return await self._list("list deployments", page)

    async def list_pods(self) -> list[dict[str, Any]]:
        """The namespace's pods (for crash loops: their container statuses)."""

        def page(token: str | None) -> Awaitable[Any]:
            return self._core.list_namespaced_pod(  # type: ignore[no-any-return]
                self.namespace, **self._paging(token)
            )

        return await self._list("list pods", page)

    def _paging(self, token: str | None) -> dict[str, Any]:
        options: dict[str, Any] = {
            "limit": self._page_size, "_preload_content": False,
            "_request_timeout": self._timeout,
        }  # fmt: skip
        if token is not None:
            options["_continue"] = token
        return options

    async def _list(
        self, what: str, page: Callable[[str | None], Awaitable[Any]]
    ) -> list[dict[str, Any]]:
        """Every item of a list, page by page (each page retried on its own). A continue
        token that has expired (410) fails the list; the next one starts over."""
        items: list[dict[str, Any]] = []
        token: str | None = None
        for _ in range(self._max_pages):
            body = await self._call(what, functools.partial(page, token))
            items += body.get("items") or []
            token = (body.get("metadata") or {}).get("continue") or None
            if token is None:
                return items
        raise KubeError(
            f"{what}: more than {self._max_pages} pages of {self._page_size}: refused as too many"
        )

    async def read_config_map(self, name: str) -> dict[str, str] | None:
        """A ConfigMap's data in this namespace, or None when there is none."""
        try:
            obj: dict[str, Any] = await self._call(
                f"get configmap {name}",
                lambda: self._core.read_namespaced_config_map(
                    name, self.namespace, _preload_content=False, _request_timeout=self._timeout
                ),
            )
        except KubeNotFound:
            return None
        data: dict[str, str] = obj.get("data") or {}
        return data

    async def write_config_map(self, name: str, data: Mapping[str, str | None]) -> None:
        """Replace a ConfigMap's data (merge patch), creating it the first time."""
        try:
            await self._call(
                f"patch configmap {name}",
                lambda: self._core.patch_namespaced_config_map(
                    name, self.namespace, {"data": data}, field_manager=FIELD_MANAGER,
                    _content_type=MERGE_PATCH, _preload_content=False,
                    _request_timeout=self._timeout,
                ),
            )  # fmt: skip
        except KubeNotFound:
            body = {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": name},
                "data": data,
            }
            await self._call(
                f"create configmap {name}",
                lambda: self._core.create_namespaced_config_map(
                    self.namespace, body, field_manager=FIELD_MANAGER, _preload_content=False,
                    _request_timeout=self._timeout,
                ),
            )  # fmt: skip

    async def get(self, name: str) -> dict[str, Any] | None:
        try:
            obj: dict[str, Any] = await self._call(
                f"get deployment {name}",
                lambda: self._apps.read_namespaced_deployment(
                    name, self.namespace, _preload_content=False, _request_timeout=self._timeout
                ),
            )
        except KubeNotFound:
            return None
        return obj

    async def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply as the manager's field manager, taking over conflicting fields.

        A `metadata.resourceVersion` in the manifest makes the apply conditional: the
        server answers 409 if the object changed since it was read. Applying a missing
        object creates it.
        """
        name = manifest["metadata"]["name"]
        return await self._patch(f"apply deployment {name}", name, manifest, APPLY_PATCH, True)

    async def patch(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A strategic-merge patch: containers merge by name, so one image can change alone."""
        return await self._patch(f"patch deployment {name}", name, patch, STRATEGIC_MERGE_PATCH)

    async def restart(self, name: str, *, at: datetime) -> dict[str, Any]:
        """A rollout restart, as `kubectl rollout restart` does it: a new pod-template
        annotation, under a field manager of its own (the sync's applies leave it be)."""
        patch = {
            "spec": {"template": {"metadata": {"annotations": {RESTARTED_AT: at.isoformat()}}}}
        }
        return await self._patch(
            f"restart deployment {name}", name, patch, STRATEGIC_MERGE_PATCH,
            manager=RESTART_FIELD_MANAGER,
        )  # fmt: skip

    async def annotate(self, name: str, annotations: dict[str, str]) -> dict[str, Any]:
        """Set annotations on a Deployment (the update record), under a field manager of
        their own: nothing else of the object is touched."""
        patch = {"metadata": {"annotations": annotations}}
        return await self._patch(
            f"annotate deployment {name}", name, patch, STRATEGIC_MERGE_PATCH,
            manager=ROLLOUT_FIELD_MANAGER,
        )  # fmt: skip

    async def _patch(
        self,
        what: str,
        name: str,
        body: dict[str, Any],
        content_type: str,
        force: bool = False,
        manager: str = FIELD_MANAGER,
    ) -> dict[str, Any]:
        options: dict[str, Any] = {"force": True} if force else {}
        obj: dict[str, Any] = await self._call(
            what,
            lambda: self._apps.patch_namespaced_deployment(
                name,
                self.namespace,
                body,
                field_manager=manager,
                _content_type=content_type,
                _preload_content=False,
                _request_timeout=self._timeout,
                **options,
            ),
        )
        return obj

    async def delete(self, name: str, *, resource_version: str | None) -> None:
        """Delete, only if the object is still the one that was planned against."""
        preconditions = client.V1Preconditions(resource_version=resource_version)
        await self._call(
            f"delete deployment {name}",
            lambda: self._apps.delete_namespaced_deployment(
                name,
                self.namespace,
                body=client.V1DeleteOptions(
                    preconditions=preconditions, propagation_policy="Background"
                ),
                _preload_content=False,
                _request_timeout=self._timeout,
            ),
        )


def _decode(what: str, status: int, body: bytes) -> Any:
    try:
        data = json.loads(body) if body else None
    except ValueError:
        data = None
    if 200 <= status < 300:
        if data is None and body:
            raise KubeError(f"{what}: response is not JSON", status=status)
        return data
    message = data.get("message") if isinstance(data, dict) else body[:200].decode(errors="replace")
    text = f"{what}: HTTP {status}: {message}"
    if status == 409:
        raise KubeConflict(text, status=status)
    if status == 404:
        raise KubeNotFound(text, status=status)
    raise KubeError(text, status=status)
