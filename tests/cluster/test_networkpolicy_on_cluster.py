"""The manager's and the worker's NetworkPolicies on a real API server: a server-side dry run
of each, as `kubectl apply -k` sends it, runs the API server's own validation, and what it
would store keeps exactly the rules the files state (no rule dropped or widened by
defaulting)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from standins.control_plane import ControlPlane
from tests.conftest import K8S

NAMESPACE_LABEL = "kubernetes.io/metadata.name"
POLICIES = {
    "manager": K8S / "networkpolicy.yaml",
    "worker": K8S / "overlays" / "worker" / "networkpolicy.yaml",
}


def sources(spec: dict[str, Any]) -> list[tuple[str, int, str]]:
    """(namespace, port, protocol) of every peer let in."""
    return sorted(
        (peer["namespaceSelector"]["matchLabels"][NAMESPACE_LABEL], port["port"], port["protocol"])
        for rule in spec["ingress"]
        for peer in rule["from"]
        for port in rule["ports"]
    )


@pytest.mark.parametrize("which", sorted(POLICIES))
def test_the_network_policy_is_accepted_by_the_api_server(
    control_plane: ControlPlane, which: str
) -> None:
    path: Path = POLICIES[which]
    (written,) = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    result = control_plane.kubectl(
        "apply", "--dry-run=server", "-f", str(path), "-o", "json", check=False
    )
    assert result.returncode == 0, result.stderr
    stored = json.loads(result.stdout)
    assert stored["kind"] == "NetworkPolicy"
    assert stored["metadata"]["namespace"] == written["metadata"]["namespace"]
    spec = stored["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert "egress" not in spec
    assert spec["podSelector"] == written["spec"]["podSelector"]
    assert sources(spec) == sources(written["spec"])
    assert len(spec["ingress"]) == len(written["spec"]["ingress"])
