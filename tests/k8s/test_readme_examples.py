"""The kustomizations k8s/README.md shows for an install of its own (another Prometheus
namespace, an image digest) render with `kubectl kustomize` to what the README says."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.k8s.test_manifests import (
    KUBECTL,
    MANAGED_NAMESPACE,
    Doc,
    assert_policy_guards,
    needs_kubectl,
    only,
)

K8S = Path(__file__).resolve().parents[2] / "k8s"
README = K8S / "README.md"
DIGEST = "sha256:" + "0123456789abcdef" * 4


def section(title: str) -> str:
    parts = re.split(r"^(#{1,6} .*)$", README.read_text(), flags=re.MULTILINE)
    for heading, body in zip(parts[1::2], parts[2::2], strict=True):
        if heading.lstrip("#").strip().startswith(title):
            return body
    raise AssertionError(f"k8s/README.md has no section {title!r}")


def yaml_block(title: str) -> str:
    found: list[str] = re.findall(
        r"^```yaml\n(.*?)^```", section(title), flags=re.MULTILINE | re.DOTALL
    )
    (block,) = found
    return block


def render_beside_k8s(tmp_path: Path, kustomization: str) -> list[Doc]:
    """The README's `site/` kustomization, with `../k8s` pointing at this repository's."""
    (tmp_path / "k8s").symlink_to(K8S, target_is_directory=True)
    site = tmp_path / "site"
    site.mkdir()
    (site / "kustomization.yaml").write_text(kustomization)
    assert KUBECTL is not None
    result = subprocess.run(
        [KUBECTL, "kustomize", str(site)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@needs_kubectl
def test_the_network_policy_example_moves_prometheus(tmp_path: Path) -> None:
    docs = render_beside_k8s(tmp_path, yaml_block("Network policy"))
    assert_policy_guards(docs, "Deployment", {MANAGED_NAMESPACE, "prometheus"})


@needs_kubectl
def test_the_digest_example_pins_every_container(tmp_path: Path) -> None:
    block = yaml_block("Scanner")
    assert "<the release's digest>" in block
    docs = render_beside_k8s(tmp_path, block.replace("sha256:<the release's digest>", DIGEST))
    pod = only(docs, "Deployment")["spec"]["template"]["spec"]
    images = {c["image"] for c in pod["containers"] + pod["initContainers"]}
    assert images == {f"ghcr.io/node-system/workload-manager:0.1.0@{DIGEST}"}


@pytest.mark.parametrize("title", ["Network policy", "Scanner"])
def test_the_examples_are_kustomizations(title: str) -> None:
    spec = yaml.safe_load(yaml_block(title))
    assert spec["resources"] == ["../k8s"]
