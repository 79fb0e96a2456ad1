"""Sync tests on the real control plane: the manager's own ServiceAccount token, the
contract-enforcing local backend, and a clean `workloads` namespace for each test."""

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
from standins.control_plane import ControlPlane
from standins.servers import ThreadedServer
from standins.sync_world import NAMESPACE, NODE, key_seed, manifest, owned_state
from tests.conftest import SettingsFactory


@dataclass
class ClusterWorld:
    backend: LocalBackend
    cluster: ControlPlane
    runtime: Runtime
    syncer: Syncer

    def desire(self, *pairs: tuple[str, str], **manifests: Any) -> None:
        for name, version in pairs:
            self.backend.set_manifest(name, version, manifests.get(name) or manifest(name, version))
        self.backend.set_desired([{"name": n, "version": v} for n, v in pairs])

    def deployment(self, name: str) -> dict[str, Any] | None:
        return self.cluster.get("deployment", name, NAMESPACE)

    def deployments(self) -> dict[str, dict[str, Any]]:
        return {d["metadata"]["name"]: d for d in self.cluster.list("deployments", NAMESPACE)}

    def versions(self) -> dict[str, dict[str, Any]]:
        """What an owner set on each Deployment (not its resourceVersion, which the
        deployment controller changes with every status write)."""
        return {name: owned_state(d) for name, d in self.deployments().items()}


@pytest.fixture
async def world(
    control_plane: ControlPlane,
    manager_kubeconfig: Path,
    backend_server: tuple[LocalBackend, ThreadedServer],
    make_settings: SettingsFactory,
) -> AsyncIterator[ClusterWorld]:
    backend, server = backend_server
    backend.reset()
    control_plane.kubectl("-n", NAMESPACE, "delete", "deployments", "--all", "--wait=true")
    settings = make_settings(
        node_id=NODE,
        node_system_endpoint=server.url,
        node_private_key=key_seed(),
        kubeconfig=manager_kubeconfig,
        managed_namespace=NAMESPACE,
        backend_retry_attempts=1,
        backend_timeout_seconds=5.0,
        kube_timeout_seconds=10.0,
        ping_token_secret="sync-ping-secret",
        sync_max_deletes=5,
        sync_max_delete_percent=100,
    )
    runtime = build_runtime(settings)
    async with AsyncExitStack() as stack:
        syncer = await open_sync_only(runtime, stack)
        assert syncer is not None, runtime.components["sync"].reason
        yield ClusterWorld(backend, control_plane, runtime, syncer)
