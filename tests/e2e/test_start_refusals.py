"""Settings that would hand the node to whoever sits on the network path, or that cannot
work, end `serve` at once with one line and exit 2: never a traceback, never a start.

- production with NODE_SYSTEM_ENDPOINT=http://… (the desired state, and so what the node
  runs, comes unsigned over it) or SELF_UPDATE_URL=http://… without SELF_UPDATE_PUBLIC_KEY
  (the version file names the manager's own image), unless ALLOW_PLAIN_HTTP names the
  setting;
- an invalid SENTRY_DSN (sentry-sdk would raise at start-up).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from standins.sync_world import key_seed

pytestmark = pytest.mark.e2e

PRODUCTION = {
    "APP_ENV": "production",
    "API_TOKEN": "operator-token-for-the-refusal-tests",
    "PING_TOKEN_SECRET": "ping-secret-for-the-refusal-tests",
    "NODE_ID": "node-refusals",
    "NODE_PRIVATE_KEY": key_seed(),
}


def serve(tmp_path: Path, env: dict[str, str], port: int = 1) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app", "serve", "--port", str(port)],
        env={"PATH": "", "HOME": str(tmp_path), **env}, cwd=tmp_path,
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


CASES = {
    "the backend over plain http": (
        {**PRODUCTION, "NODE_SYSTEM_ENDPOINT": "http://backend.example:8080"},
        "NODE_SYSTEM_ENDPOINT is plain http:// in production: anyone on the path can change "
        "the desired state",
    ),
    "the version file over plain http, unsigned": (
        {
            **PRODUCTION,
            "NODE_SYSTEM_ENDPOINT": "https://backend.example",
            "SELF_UPDATE_URL": "http://releases.example/version",
            "POD_NAMESPACE": "wm",
        },
        "SELF_UPDATE_URL is plain http:// in production: anyone on the path can pick the "
        "manager's own image",
    ),
    "an invalid Sentry DSN": (
        {"SENTRY_DSN": "not-a-dsn"},
        "SENTRY_DSN: Value error, not a DSN: want http(s)://<public key>@<host>/<project id>",
    ),
    "a Sentry DSN without a project": (
        {"SENTRY_DSN": "https://key@sentry.example/"},
        "SENTRY_DSN: Value error, not a DSN: its path does not end in a project id",
    ),
    "naming a setting ALLOW_PLAIN_HTTP does not know": (
        {**PRODUCTION, "ALLOW_PLAIN_HTTP": "MATRIX_HOMESERVER"},
        "ALLOW_PLAIN_HTTP: Value error, MATRIX_HOMESERVER: only NODE_SYSTEM_ENDPOINT, "
        "SELF_UPDATE_URL may be named",
    ),
}


@pytest.mark.parametrize(("env", "line"), CASES.values(), ids=CASES.keys())
def test_start_is_refused_with_one_line(tmp_path: Path, env: dict[str, str], line: str) -> None:
    result = serve(tmp_path, env)
    assert result.returncode == 2, result.stderr[-2000:]
    (said,) = result.stderr.strip().splitlines()
    assert said.startswith(f"workload-manager: configuration error: {line}"), said


def test_a_named_risk_is_accepted(tmp_path: Path) -> None:
    """With ALLOW_PLAIN_HTTP naming it, the check passes and `serve` goes on to bind its
    port, which the test holds: the refusal that follows is that one, after the check."""
    env = {**PRODUCTION, "NODE_SYSTEM_ENDPOINT": "http://backend.example:8080",
           "ALLOW_PLAIN_HTTP": "NODE_SYSTEM_ENDPOINT"}  # fmt: skip
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        result = serve(tmp_path, env, port=held.getsockname()[1])
    assert result.returncode == 1, result.stderr[-2000:]
    assert "cannot listen on" in result.stderr and "configuration error" not in result.stderr
