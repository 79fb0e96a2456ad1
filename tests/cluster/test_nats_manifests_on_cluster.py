"""k8s/nats/ (three servers, and two in overlays/small) on a real API server: a server-side
dry run of `kubectl apply -k` runs admission and the API server's own validation of every
object, the generated ConfigMap and the StatefulSet's claim templates included."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from standins.control_plane import ControlPlane
from tests.conftest import K8S

NATS = K8S / "nats"


@pytest.fixture(scope="module")
def nats_namespace(control_plane: ControlPlane) -> Iterator[None]:
    """The namespace, created for real: a dry run creates nothing, and the objects in it
    are refused while it does not exist."""
    namespace = NATS / "base" / "namespace.yaml"
    control_plane.kubectl("apply", "-f", str(namespace))
    yield
    control_plane.kubectl("delete", "-f", str(namespace), "--wait=false", "--ignore-not-found")


@pytest.mark.usefixtures("nats_namespace")
@pytest.mark.parametrize(
    ("folder", "replicas"),
    [(NATS, 3), (NATS / "overlays" / "small", 2)],
    ids=["production", "small"],
)
def test_the_nats_manifests_are_accepted_by_the_api_server(
    control_plane: ControlPlane, folder: Path, replicas: int
) -> None:
    result = control_plane.kubectl("apply", "--dry-run=server", "-k", str(folder), check=False)
    assert result.returncode == 0, result.stderr
    for made in (
        "service/nats", "service/nats-headless", "statefulset.apps/nats",
        "poddisruptionbudget.policy/nats", "networkpolicy.networking.k8s.io/nats",
        "configmap/nats-config-",
    ):  # fmt: skip
        assert made in result.stdout, result.stdout
    # what the API server would store, its defaults applied
    stored = control_plane.kubectl("apply", "--dry-run=server", "-k", str(folder), "-o", "json")
    (statefulset,) = [o for o in json.loads(stored.stdout)["items"] if o["kind"] == "StatefulSet"]
    assert statefulset["spec"]["replicas"] == replicas
    assert statefulset["spec"]["podManagementPolicy"] == "Parallel"
