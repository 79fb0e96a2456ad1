"""Desired state from a local folder of YAML files: the backend's interface, offline.

    DESIRED_STATE_DIR/
      workloads.yaml                 # {allow_empty?: bool, workloads: {name: version}}
      manifests/<name>/<version>.yaml

`workloads` may also be a list of `{name, version}`. The revision is the file's hash,
so an unchanged file is recognised like a 304 from the backend.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)


class DesiredFilesError(RuntimeError):
    """A file is missing or not valid YAML (the message names it)."""


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise DesiredFilesError(f"{path} does not exist") from None
    except OSError as exc:
        raise DesiredFilesError(f"{path}: {exc.strerror}") from None
    try:
        return text, yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise DesiredFilesError(f"{path} is not valid YAML: {exc}") from None


class DesiredFiles:
    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def description(self) -> str:
        return f"local folder {self.root}"

    async def load_desired(self) -> Any:
        text, data = await asyncio.to_thread(_read_yaml, self.root / "workloads.yaml")
        if not isinstance(data, dict):
            raise DesiredFilesError(f"{self.root / 'workloads.yaml'} must hold a mapping")
        workloads = data.get("workloads")
        if isinstance(workloads, dict):
            workloads = [{"name": n, "version": str(v)} for n, v in workloads.items()]
        revision = "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]
        return {**data, "workloads": workloads, "revision": data.get("revision", revision)}

    async def load_manifest(self, name: str, version: str) -> Any:
        path = self.root / "manifests" / name / f"{version}.yaml"
        _text, data = await asyncio.to_thread(_read_yaml, path)
        return data

    async def record_applied(self, name: str, body: dict[str, Any]) -> None:
        log.info("applied %s %s (local desired state: nothing to tell)", name, body["version"])
