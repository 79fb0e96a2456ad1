"""The last good desired state on the real control plane (kube-apiserver, the deployment
controller, kwok), with the manager's own ServiceAccount token and a signing,
contract-enforcing local backend: converge, stop the backend, restart the manager, break
two Deployments, and one sync repairs both from the ConfigMap store, deleting nothing; and
each forged answer (unsigned, tampered, another node's, an older serial, a manifest whose
bytes are not its digest) is refused with its reason and the cluster untouched."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from prometheus_client import CollectorRegistry

from app.domain.desired_trust import unpack
from app.domain.manifests import MANAGED_BY, MANAGED_BY_LABEL, VERSION_ANNOTATION
from app.services.last_good import STATE_CONFIG_MAP
from app.services.runtime import build_runtime, open_sync_only
from app.services.syncing import Syncer
from standins.backend import Forgery, LocalBackend
from standins.control_plane import ControlPlane
from standins.servers import ThreadedServer
from standins.sync_world import KEY, NAMESPACE, NODE, key_seed, manifest, owned_state
from tests.conftest import SettingsFactory

OWN = "workload-manager"  # the manager's namespace, where its store is
SIGNER = Ed25519PrivateKey.generate()  # the backend's desired-state key
METRICS: dict[int, CollectorRegistry] = {}  # each open syncer's registry


def sample(syncer: Syncer, name: str, **labels: str) -> float | None:
    return METRICS[id(syncer)].get_sample_value(name, labels)


def public(key: Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return base64.b64encode(raw).decode()


@pytest.fixture
def signing_backend(control_plane: ControlPlane) -> Iterator[tuple[LocalBackend, ThreadedServer]]:
    """A backend of its own (this test stops it), signing; a clean namespace and store."""
    control_plane.kubectl("-n", NAMESPACE, "delete", "deployments", "--all", "--wait=true")
    control_plane.kubectl(
        "-n", OWN, "patch", "configmap", STATE_CONFIG_MAP, "--type=json",
        "-p", '[{"op": "remove", "path": "/data"}]', check=False,
    )  # fmt: skip
    local = LocalBackend(NODE, KEY.public_key())
    local.signing_key = SIGNER
    server = ThreadedServer(local.app).start()
    try:
        yield local, server
    finally:
        local.release_stalled()
        server.stop()


@pytest.fixture
async def open_manager(
    manager_kubeconfig: Path, make_settings: SettingsFactory
) -> AsyncIterator[Callable[..., Any]]:
    @asynccontextmanager
    async def opened(url: str, **overrides: Any) -> AsyncIterator[Syncer]:
        """The syncer; its runtime's metrics as `syncer.metrics_registry` (for a look)."""
        settings = make_settings(
            node_id=NODE, node_system_endpoint=url, node_private_key=key_seed(),
            kubeconfig=manager_kubeconfig, managed_namespace=NAMESPACE, pod_namespace=OWN,
            backend_retry_attempts=1, backend_timeout_seconds=2.0, backend_deadline_seconds=4.0,
            kube_timeout_seconds=10.0, ping_token_secret="last-good-secret",
            sync_max_deletes=5, sync_max_delete_percent=100,
            desired_state_public_keys=public(SIGNER), **overrides,
        )  # fmt: skip
        runtime = build_runtime(settings)
        async with AsyncExitStack() as stack:
            syncer = await open_sync_only(runtime, stack)
            assert syncer is not None, runtime.components["sync"].reason
            METRICS[id(syncer)] = runtime.metrics.registry
            yield syncer

    yield opened


def desire(backend: LocalBackend, *pairs: tuple[str, str]) -> None:
    for name, version in pairs:
        owned = manifest(name, version)
        owned["spec"]["replicas"] = 1  # the manifest owns the scale: a change is drift
        backend.set_manifest(name, version, owned)
    backend.set_desired([{"name": n, "version": v} for n, v in pairs])


def states(cluster: ControlPlane) -> dict[str, dict[str, Any]]:
    found = cluster.list("deployments", NAMESPACE)
    return {d["metadata"]["name"]: owned_state(d) for d in found}


def specs_of(found: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {name: state["spec"] for name, state in found.items()}


def specs(cluster: ControlPlane) -> dict[str, Any]:
    return specs_of(states(cluster))


def stored(cluster: ControlPlane) -> dict[str, str]:
    found = cluster.get("configmap", STATE_CONFIG_MAP, OWN)
    assert found is not None
    data: dict[str, str] = found.get("data") or {}
    return data


async def test_a_restarted_manager_repairs_from_the_store_while_the_backend_is_away(
    control_plane: ControlPlane,
    signing_backend: tuple[LocalBackend, ThreadedServer],
    open_manager: Callable[..., Any],
) -> None:
    backend, server = signing_backend
    desire(backend, ("api", "1.0.0"), ("web", "1.0.0"))
    async with open_manager(server.url) as syncer:
        first = await syncer.sync()
        assert first.ok, first.as_dict()
        assert first.source is not None and first.source["from"] == "backend"
    serial = first.source["desired_serial"]
    assert isinstance(serial, int)
    data = stored(control_plane)
    kept = unpack(data)
    assert json.loads(kept.body)["serial"] == serial
    assert set(kept.manifests) == {("api", "1.0.0"), ("web", "1.0.0")}
    # a managed Deployment the stored state does not name: an offline sync never deletes
    orphan = manifest("orphan", "0.1.0")
    orphan["metadata"].setdefault("labels", {})[MANAGED_BY_LABEL] = MANAGED_BY
    control_plane.kubectl("-n", NAMESPACE, "apply", "-f", "-", input=json.dumps(orphan))

    server.stop()  # the backend is gone
    control_plane.kubectl("-n", NAMESPACE, "delete", "deployment", "api", "--wait=true")
    control_plane.kubectl("-n", NAMESPACE, "scale", "deployment", "web", "--replicas=3")

    async with open_manager(server.url) as syncer:  # restarted: nothing in memory
        outcome = await syncer.sync()
        assert outcome.aborted is None, outcome.as_dict()
        by_name = {r.name: r for r in outcome.results}
        assert by_name["api"].action == "create" and by_name["api"].outcome == "applied"
        assert by_name["web"].outcome == "applied" and "drift" in by_name["web"].reason
        assert by_name["orphan"].outcome == "held"
        assert "not deleted" in by_name["orphan"].reason
        source = outcome.source
        assert source is not None
        assert source["from"] == "last good" and source["desired_serial"] == serial
        assert source["offline_since"] is not None
        assert source["text"].startswith(f"last good, serial {serial}, stored ")
        assert "backend unreachable since" in source["text"]
        origin = syncer.source.origin()
        assert origin.source == "last good"
        assert sample(syncer, "workload_manager_desired_state_offline") == 1
        assert sample(syncer, "workload_manager_desired_state_serial") == serial

    after = {d["metadata"]["name"]: d for d in control_plane.list("deployments", NAMESPACE)}
    assert set(after) == {"api", "web", "orphan"}
    assert after["web"]["spec"]["replicas"] == 1
    assert after["api"]["metadata"]["annotations"][VERSION_ANNOTATION] == "1.0.0"


@pytest.mark.parametrize(
    ("forgery", "reason"),
    [
        ("unsigned", "unsigned: no X-Desired-State-Signature header"),
        ("tampered", "the signature is not by a trusted key for this node"),
        ("other-node", "the signature is not by a trusted key for this node"),
        ("replay", "is below the last accepted"),
        ("wrong-digest", "the manifest's SHA-256 is"),
    ],
)
async def test_a_forged_answer_is_refused_and_the_cluster_untouched(
    control_plane: ControlPlane,
    signing_backend: tuple[LocalBackend, ThreadedServer],
    open_manager: Callable[..., Any],
    forgery: Forgery,
    reason: str,
) -> None:
    backend, server = signing_backend
    async with open_manager(server.url) as syncer:
        desire(backend, ("api", "1.0.0"))
        assert (await syncer.sync()).ok
        desire(backend, ("api", "2.0.0"), ("web", "1.0.0"))
        second = await syncer.sync()
        assert second.ok, second.as_dict()
        assert second.source is not None
        before, store_before = states(control_plane), stored(control_plane)

        desire(backend, ("api", "3.0.0"), ("web", "1.0.0"), ("new", "1.0.0"))
        backend.forge(forgery)
        refused = await syncer.sync()
        assert not refused.ok
        said = refused.aborted or "; ".join(r.error or "" for r in refused.results)
        assert reason in said, refused.as_dict()
        if forgery == "wrong-digest":  # the state verified; no manifest was taken
            assert all(r.outcome != "applied" for r in refused.results), refused.as_dict()
        else:
            assert refused.aborted is not None and refused.results == []
        what = "manifest" if forgery == "wrong-digest" else "answer"
        assert sample(syncer, "workload_manager_desired_state_refused_total", what=what) == 1
        if forgery == "wrong-digest":
            # the state itself verified, and its update records say what it asks; but no
            # Deployment was created or changed from a manifest that is not the one signed
            assert specs(control_plane) == specs_of(before)
        else:
            assert states(control_plane) == before
        kept = unpack(stored(control_plane))
        if forgery == "wrong-digest":  # the genuine state is kept, never the false bytes
            assert ("new", "1.0.0") not in kept.manifests
        else:  # the store keeps the last good state, not the forged one
            assert kept.body == unpack(store_before).body

        backend.forge(None)  # honest again: taken
        honest = await syncer.sync()
        assert honest.ok, honest.as_dict()
        assert honest.source is not None
        assert honest.source["desired_serial"] > second.source["desired_serial"]
        assert "new" in states(control_plane)  # (api's 3.0.0 waits on 2.0.0's judging)
