"""What the sync tests share: the node, its key, the managed namespace, and the manifests
the local backend serves."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from standins.backend import LocalBackend

NODE = "node-sync"
NAMESPACE = "workloads"
KEY = Ed25519PrivateKey.generate()
WRITES = ("POST", "PUT", "PATCH", "DELETE")


def key_seed() -> str:
    raw = KEY.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    return base64.b64encode(raw).decode()


def manifest(
    name: str, version: str, *, image: str | None = None, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """A plain Deployment manifest as the backend would serve it for (name, version)."""
    container: dict[str, Any] = {
        "name": name,
        "image": image or f"registry.example/{name}:{version}",
    }
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [container]},
            },
        },
    }


CONTROLLER = "kube-controller-manager"
REVISION = "deployment.kubernetes.io/revision"


def owned_state(deployment: dict[str, Any]) -> dict[str, Any]:
    """What the owners of a Deployment set on it, without what the deployment controller
    writes while a rollout runs (status, the revision annotation). The resourceVersion
    changes with those, so comparing it races with the controller."""
    meta = deployment["metadata"]
    return {
        "generation": meta["generation"],
        "labels": meta.get("labels"),
        "annotations": {k: v for k, v in meta.get("annotations", {}).items() if k != REVISION},
        "spec": deployment["spec"],
        "managers": sorted(
            (f["manager"], f["operation"], f.get("time", ""))
            for f in meta.get("managedFields", [])
            if f.get("subresource") != "status" and f["manager"] != CONTROLLER
        ),
    }


def sync_env(backend_url: str, kubeconfig: Path) -> dict[str, str]:
    """Environment for a manager process that syncs from the backend into the cluster."""
    return {
        "NODE_ID": NODE,
        "NODE_SYSTEM_ENDPOINT": backend_url,
        "NODE_PRIVATE_KEY": key_seed(),
        "KUBECONFIG": str(kubeconfig),
        "MANAGED_NAMESPACE": NAMESPACE,
        "SCHEDULER_JITTER_FRACTION": "0",
        "BACKEND_RETRY_ATTEMPTS": "1",
        "BACKEND_TIMEOUT_SECONDS": "2",
        "KUBE_TIMEOUT_SECONDS": "2",
        "PING_TOKEN_SECRET": "sync-ping-secret",
    }


def desire(backend: LocalBackend, *pairs: tuple[str, str]) -> None:
    """Make the backend want these (name, version) pairs, manifests included."""
    for name, version in pairs:
        backend.set_manifest(name, version, manifest(name, version))
    backend.set_desired([{"name": n, "version": v} for n, v in pairs])
