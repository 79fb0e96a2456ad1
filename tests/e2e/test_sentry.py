"""Unhandled errors in a route and in a scheduled loop reach a (local) Sentry endpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from app.adapters.embedded import free_port
from tests.support.sentry_receiver import SentryReceiver
from tests.support.servers import serve

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_route_and_loop_errors_reach_sentry(tmp_path: Path) -> None:
    receiver = SentryReceiver()
    port = free_port()
    with serve(receiver.app) as sentry:
        env = {
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": str(ROOT),
            "SENTRY_DSN": f"http://publickey@127.0.0.1:{sentry.port}/42",
            "EMBEDDED_SERVICES": "false",
            "REPORT_ENABLED": "false",
            "DATA_DIR": str(tmp_path),
        }
        log = (tmp_path / "target.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.sentry_target", str(port)],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    httpx.get(f"{url}/healthz", timeout=1)
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            assert httpx.get(f"{url}/boom", timeout=5).status_code == 500
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                if {"RouteBoom", "LoopBoom"} <= receiver.exception_types():
                    break
                time.sleep(0.1)
        finally:
            proc.terminate()
            proc.wait(timeout=20)
            log.close()
    found = receiver.exception_types()
    assert {"RouteBoom", "LoopBoom"} <= found, (found, (tmp_path / "target.log").read_text())
    loop_event = next(
        e for e in receiver.events
        if any(v["type"] == "LoopBoom" for v in e["exception"]["values"])
    )  # fmt: skip
    assert loop_event["environment"] == "development"
    assert loop_event["release"].startswith("workload-manager@")
