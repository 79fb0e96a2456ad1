"""The manifest scan of `make lint`: checkov (tools/checkov/) with .checkov.yaml on what
`kubectl kustomize` renders from every kustomization under k8s/ (tools/checkov/scan.sh).

Every check the configuration skips, and every waiver an object carries in its annotations,
states its reason; the scan finds nothing else in the manifests; and it does fail a
manifest set that lacks what it asks for.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
CONFIG = ROOT / ".checkov.yaml"
SCAN = ROOT / "tools" / "checkov" / "scan.sh"
CHECKOV = Path(os.environ.get("CHECKOV", ROOT / ".venv" / "tools" / "checkov" / "bin" / "checkov"))
# checkov's kubernetes_utils.SKIP_ANNOTATION_PREFIXES: annotations that waive a check
WAIVER_PREFIXES = ("checkov.io/skip", "bridgecrew.io/skip", "cortex.io/skip")
CHECK_ID = re.compile(r"CKV2?_K8S_\d+")
# (kind, name, check) of every object-level waiver: the manager is the one pod that uses the
# Kubernetes API, so the one that mounts its ServiceAccount token
WAIVERS = {("Deployment", "workload-manager", "CKV_K8S_38")}
# a reason is a sentence, not a word
REASON_WORDS = 8

Doc = dict[str, Any]

needs_scanner = pytest.mark.skipif(
    not os.access(CHECKOV, os.X_OK) or shutil.which("kubectl") is None,
    reason="the scan needs checkov and kubectl (`make test` installs both)",
)


def config() -> Doc:
    loaded = yaml.safe_load(CONFIG.read_text())
    assert isinstance(loaded, dict)
    return loaded


def skipped() -> list[str]:
    found: list[str] = config()["skip-check"]
    return found


def manifests() -> list[Doc]:
    return [
        doc
        for path in sorted(K8S.rglob("*.yaml"))
        if path.name != "kustomization.yaml"
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def waivers() -> list[tuple[str, str, str]]:
    """(kind, name, annotation value) of every waiver annotation under k8s/."""
    return [
        (doc["kind"], doc["metadata"]["name"], value)
        for doc in manifests()
        for key, value in (doc["metadata"].get("annotations") or {}).items()
        if key.startswith(WAIVER_PREFIXES)
    ]


def scan(*folders: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCAN), *map(str, folders)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "CHECKOV": str(CHECKOV)},
    )


def test_the_scan_is_of_kubernetes_manifests_and_offline() -> None:
    spec = config()
    assert spec["framework"] == ["kubernetes"]
    assert spec["skip-download"] is True, "no vendor data: the same answer every run"
    assert "soft-fail" not in spec and "soft-fail-on" not in spec, "a failed check fails"


def test_every_skipped_check_has_its_reason() -> None:
    ids = skipped()
    assert ids
    assert len(set(ids)) == len(ids)
    lines = [line.strip() for line in CONFIG.read_text().splitlines()]
    for check in ids:
        assert CHECK_ID.fullmatch(check), check
        (at,) = [i for i, line in enumerate(lines) if line == f"- {check}"]
        comment = lines[at - 1]
        assert comment.startswith(f"# {check} "), f"{check}: no reason on the line above"
        assert len(comment.split()) - 2 >= REASON_WORDS, f"{check}: {comment!r} is not a reason"


def test_every_waiver_in_a_manifest_has_its_reason() -> None:
    found = waivers()
    named = set()
    for kind, name, value in found:
        # checkov splits the value at "=" and expects exactly two parts
        check, separator, reason = value.partition("=")
        assert separator and "=" not in reason, f"{kind}/{name}: {value!r}"
        assert CHECK_ID.fullmatch(check), f"{kind}/{name}: {check!r}"
        assert len(reason.split()) >= REASON_WORDS, f"{kind}/{name}: {reason!r} is not a reason"
        assert check not in skipped(), f"{check} is skipped everywhere already"
        named.add((kind, name, check))
    assert named == WAIVERS
    assert len(found) == len(WAIVERS)


def test_lint_runs_the_scan() -> None:
    makefile = (ROOT / "Makefile").read_text()
    (lint,) = re.findall(r"^lint:.*\n((?:\t.*\n)+)", makefile, flags=re.MULTILINE)
    assert "tools/checkov/scan.sh" in lint


@needs_scanner
def test_the_scanner_finds_nothing_in_the_manifests() -> None:
    result = scan()
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "Failed checks: 0" in result.stdout, result.stdout[-2000:]


@needs_scanner
def test_the_scanner_fails_a_manager_without_its_network_policy(tmp_path: Path) -> None:
    """The gate bites: the base without networkpolicy.yaml fails CKV2_K8S_6."""
    copy = tmp_path / "k8s"
    copy.mkdir()
    for path in K8S.glob("*.yaml"):
        if path.name != "networkpolicy.yaml":
            shutil.copy(path, copy / path.name)
    spec = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    spec["resources"] = [r for r in spec["resources"] if r != "networkpolicy.yaml"]
    (copy / "kustomization.yaml").write_text(yaml.safe_dump(spec))

    result = scan(copy)
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-2000:]
    failed = set(re.findall(r"Check: (CKV2?_K8S_\d+)", result.stdout))
    assert failed == {"CKV2_K8S_6"}, result.stdout[-4000:]
