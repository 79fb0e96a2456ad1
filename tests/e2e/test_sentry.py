"""Unhandled errors in a route and in a scheduled loop reach a (local) Sentry endpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from app.adapters.embedded import free_port
from standins.sentry_receiver import SentryReceiver
from standins.servers import serve

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def poll(check: Callable[[], bool], *, within: float) -> bool:
    """Whether `check()` came true within `within` s (a blocking twin of `eventually`)."""
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


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

            def serving() -> bool:
                assert proc.poll() is None, (tmp_path / "target.log").read_text()
                try:
                    return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
                except httpx.TransportError:
                    return False

            assert poll(serving, within=30), (tmp_path / "target.log").read_text()
            assert httpx.get(f"{url}/boom", timeout=5).status_code == 500
            # the assertion after the process is stopped says what arrived, with its log
            poll(lambda: {"RouteBoom", "LoopBoom"} <= receiver.exception_types(), within=30)
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
