"""The manager process in production with its key only in ~/.config/lfgnode/config.yaml
(the original service's file): it signs with that key, as that node; a malformed file
stops it with one line naming the file and the field."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from standins.backend import LocalBackend
from tests.support.process import manager

pytestmark = pytest.mark.e2e

NODE = "lfg-node-e2e"
API_TOKEN = "operator-token-e2e"


def seed_of(key: Ed25519PrivateKey) -> str:
    raw = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    return base64.b64encode(raw).decode()


def home_with_config(tmp_path: Path, text: str) -> Path:
    home = tmp_path / "home"
    folder = home / ".config" / "lfgnode"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(text)
    return home


def test_production_signs_with_the_key_in_the_config_file(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    seed = seed_of(key)
    home = home_with_config(tmp_path, f"node_id: {NODE}\nprivate_key: {seed}\nport: 3000\n")
    backend = LocalBackend(NODE, key.public_key())
    with backend.serve() as server:
        env = {
            "HOME": str(home),
            "APP_ENV": "production",
            "NODE_SYSTEM_ENDPOINT": server.url,
            "API_TOKEN": API_TOKEN,
            "PING_TOKEN_SECRET": "ping-secret-e2e",
            "SYNC_ENABLED": "false",
            "REPORT_INTERVAL_SECONDS": "1",
            "SCHEDULER_JITTER_FRACTION": "0",
        }
        with manager(env=env, workdir=tmp_path) as m:
            backend.wait_for_reports(1, timeout=15)
            status = httpx.get(
                f"{m.url}/v1/status",
                headers={"authorization": f"Bearer {API_TOKEN}"},
                timeout=5,
            )
            assert status.status_code == 200
    assert backend.rejected == [], [r.rejected_reason for r in backend.rejected]
    assert backend.requests and all(r.verified for r in backend.requests)
    assert {r.headers["x-node-id"] for r in backend.requests} == {NODE}
    assert backend.reports[0]["node_id"] == NODE
    log = m.log()
    assert f"node key from {home}/.config/lfgnode/config.yaml (private_key, node_id)" in log
    assert seed not in log and seed not in status.text


def test_a_malformed_config_file_stops_the_start_naming_file_and_field(tmp_path: Path) -> None:
    seed = seed_of(Ed25519PrivateKey.generate())
    home = home_with_config(tmp_path, f"private_key: {seed[:24]}\n")
    done = subprocess.run(
        [sys.executable, "-m", "app", "serve"],
        env={
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(home),
            "APP_ENV": "production",
            "NODE_SYSTEM_ENDPOINT": "https://backend.example.net",
            "API_TOKEN": API_TOKEN,
            "PING_TOKEN_SECRET": "ping-secret-e2e",
        },
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    path = home / ".config" / "lfgnode" / "config.yaml"
    assert done.stderr.strip() == (
        f"workload-manager: configuration error: {path}: private_key: expected a PKCS#8 PEM "
        "or a 32-byte seed in base64 or hex"
    )
    assert seed[:24] not in done.stderr + done.stdout
