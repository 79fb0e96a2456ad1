"""Fixtures for the deployment syncer against real servers: the contract-enforcing local
backend and the real control plane, which the manager reaches through the fault proxy
with its own ServiceAccount token."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from app.services.runtime import Runtime, build_runtime, open_sync_only
from app.services.syncing import Syncer
from standins.backend import LocalBackend
from standins.servers import ThreadedServer
from standins.sync_world import NAMESPACE, NODE, WRITES, key_seed
from tests.conftest import SettingsFactory
from tests.support.polling import eventually
from tests.support.real_cluster import RealCluster

# the manager's client timeout in these tests: far above what the API server takes, even
# on a busy machine, and short enough for the tests that make a request outlive it
KUBE_TIMEOUT = 3.0


@dataclass
class World:
    backend: LocalBackend
    cluster: RealCluster
    runtime: Runtime
    syncer: Syncer

    def desire(self, *pairs: tuple[str, str], allow_empty: bool = False, **manifests: Any) -> None:
        """Set the backend's desired state; a manifest is registered for every pair."""
        from standins.sync_world import manifest

        for name, version in pairs:
            self.backend.set_manifest(name, version, manifests.get(name) or manifest(name, version))
        self.backend.set_desired(
            [{"name": n, "version": v} for n, v in pairs], allow_empty=allow_empty
        )

    def deployments(self) -> dict[str, dict[str, Any]]:
        return {d["metadata"]["name"]: d for d in self.cluster.list_deployments(NAMESPACE)}

    async def settled(self, name: str) -> None:
        """Wait until the deployment controller is done with `name` (it writes status, so
        a new resourceVersion, until the rollout is complete)."""

        async def complete() -> bool:
            found = self.cluster.get_deployment(NAMESPACE, name) or {}
            status = found.get("status", {})
            reasons = {c.get("reason") for c in status.get("conditions", [])}
            return (
                status.get("observedGeneration") == found["metadata"]["generation"]
                and status.get("availableReplicas") == status.get("replicas") == 1
                and "NewReplicaSetAvailable" in reasons
            )

        await eventually(complete, within=30.0, step=0.1)

    def kube_writes(self) -> list[str]:
        return [f"{r.method} {r.path}" for r in self.cluster.requests if r.method in WRITES]

    def forget_requests(self) -> None:
        self.cluster.clear_requests()
        self.backend.clear_records()


@pytest.fixture
async def world(
    cluster: RealCluster,
    backend_server: tuple[LocalBackend, ThreadedServer],
    make_settings: SettingsFactory,
    tmp_path: Path,
) -> AsyncIterator[World]:
    backend, server = backend_server
    backend.reset()
    settings = make_settings(
        node_id=NODE,
        node_system_endpoint=server.url,
        node_private_key=key_seed(),
        kubeconfig=cluster.write_kubeconfig(tmp_path / "kubeconfig", NAMESPACE),
        managed_namespace=NAMESPACE,
        backend_retry_attempts=1,
        backend_timeout_seconds=1.0,
        kube_timeout_seconds=KUBE_TIMEOUT,
        ping_token_secret="sync-ping-secret",
        sync_max_deletes=2,
        sync_max_delete_percent=100,
    )
    runtime = build_runtime(settings)
    async with AsyncExitStack() as stack:
        syncer = await open_sync_only(runtime, stack)
        assert syncer is not None, runtime.components["sync"].reason
        yield World(backend=backend, cluster=cluster, runtime=runtime, syncer=syncer)
