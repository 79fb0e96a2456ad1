"""Secrets never leave: a distinct marker in every URL-taking setting (a password in the
userinfo, a token as the user name, `?password=`, a presigned version-file URL with its
signature, credential and session token), and none of them in anything the real manager
shows: `/v1/status`, the page, `/metrics`, `/readyz`, its log, or any Sentry event.

The process runs with every component on against real servers: the version file is
served by a local HTTP server that answers 403 (or 404 for the S3 object), the own
Deployment is on the real control plane, PostgreSQL is a refused port or the embedded
server, NATS, the backend and the Matrix homeserver are refused ports, and Sentry is a
local receiver. One route GETs the presigned URL and lets httpx's error (which names the
URL) go unhandled, so a Sentry event carries the URL in its exception, frames and
breadcrumbs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.adapters.embedded import EmbeddedPostgres, free_port
from standins.control_plane import MANAGER_ACCOUNT, ControlPlane
from standins.databases import fresh_database_sync
from standins.sentry_receiver import SentryReceiver
from standins.servers import ThreadedServer, serve
from standins.sync_world import key_seed
from tests.support.version_file import OWN_NS, REPO, VersionFileServer, own_deployment

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
API_TOKEN = "apiTokenMarker7c1d"


def presigned(base: str) -> str:
    """A SigV4 presigned GET of the version file, each secret part a marker."""
    return (
        f"{base}/version?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=ASIAcredMarker4e2a%2F20260101%2Feu-west-1%2Fs3%2Faws4_request"
        "&X-Amz-Date=20260101T000000Z&X-Amz-Expires=900"
        "&X-Amz-Security-Token=stsTokenMarker9b3f&X-Amz-SignedHeaders=host"
        "&X-Amz-Signature=sigMarker0d5c8e"
    )


@dataclass
class Setup:
    env: dict[str, str]
    secrets: dict[str, str]  # what it is -> the marker that must never show
    # what must show, redacted, in the log and the status: the paths that name them ran
    shown_in_log: list[str] = field(default_factory=list)
    shown_in_status: list[str] = field(default_factory=list)
    version_error: str = "HTTP 403"


def refused() -> str:
    return f"127.0.0.1:{free_port()}"


def common(sentry: ThreadedServer) -> tuple[dict[str, str], dict[str, str]]:
    secrets = {
        "NODE_SYSTEM_ENDPOINT password": "backendPwMarker5a1",
        "MATRIX_HOMESERVER password": "matrixPwMarker2f8",
        "MATRIX_HOMESERVER ?access_token=": "matrixQueryMarker6d0",
        "MATRIX_ACCESS_TOKEN": "matrixTokenMarker3e9",
        "MANAGER_URL password": "managerPwMarker8c4",
        "MANAGER_URL ?token=": "managerQueryMarker1b7",
        "SENTRY_DSN key": "sentrykeymarker4a6f",
        "API_TOKEN": API_TOKEN,
        "PING_TOKEN_SECRET": "pingSecretMarker0e2",
        "NODE_PRIVATE_KEY": key_seed(),
        # the presigned URL: SELF_UPDATE_URL in one case, and what /fetch GETs in both
        "presigned URL X-Amz-Credential": "ASIAcredMarker4e2a",
        "presigned URL X-Amz-Security-Token": "stsTokenMarker9b3f",
        "presigned URL X-Amz-Signature": "sigMarker0d5c8e",
    }
    env = {
        "NODE_SYSTEM_ENDPOINT": f"http://node:{secrets['NODE_SYSTEM_ENDPOINT password']}"
        f"@{refused()}",
        "NODE_PRIVATE_KEY": secrets["NODE_PRIVATE_KEY"],
        "MATRIX_HOMESERVER": f"http://mx:{secrets['MATRIX_HOMESERVER password']}@{refused()}"
        f"/?access_token={secrets['MATRIX_HOMESERVER ?access_token=']}",
        "MATRIX_ROOM_ID": "!alerts:example.org",
        "MATRIX_ACCESS_TOKEN": secrets["MATRIX_ACCESS_TOKEN"],
        "MANAGER_URL": f"http://wm:{secrets['MANAGER_URL password']}@workload-manager.svc:8080"
        f"/?token={secrets['MANAGER_URL ?token=']}",
        "SENTRY_DSN": f"http://{secrets['SENTRY_DSN key']}@127.0.0.1:{sentry.port}/42",
        "API_TOKEN": API_TOKEN,
        "PING_TOKEN_SECRET": secrets["PING_TOKEN_SECRET"],
    }
    return env, secrets


@contextmanager
def presigned_case(
    sentry: ThreadedServer, versions: ThreadedServer, _postgres: EmbeddedPostgres
) -> Iterator[Setup]:
    """Text logs; PostgreSQL refuses; the presigned version file answers 403."""
    env, secrets = common(sentry)
    secrets |= {
        "DATABASE_URL password": "pgUserinfoMarker7d2",
        "DATABASE_URL ?password=": "pgQueryMarker3a9",
        "NATS_URL token as user name": "natsTokenMarker5e1",
        "NATS_URL password": "natsPwMarker8f3",
        "request ?token=": "requestQueryMarker2c6",
    }
    env |= {
        "LOG_FORMAT": "text",
        "DATABASE_URL": f"postgresql://wm:{secrets['DATABASE_URL password']}@{refused()}/wm"
        f"?password={secrets['DATABASE_URL ?password=']}",
        "NATS_URL": f"nats://{secrets['NATS_URL token as user name']}@{refused()},"
        f"nats://wm:{secrets['NATS_URL password']}@{refused()}",
        "SELF_UPDATE_URL": presigned(versions.url),
    }
    yield Setup(
        env,
        secrets,
        shown_in_log=["X-Amz-Signature=***", "?password=***", "nats://***@", "token=***"],
        shown_in_status=["X-Amz-Signature=***", "?password=***", "http://node:***@"],
    )


@contextmanager
def s3_case(
    sentry: ThreadedServer, versions: ThreadedServer, postgres: EmbeddedPostgres
) -> Iterator[Setup]:
    """JSON logs; PostgreSQL is the real embedded server (trust: the password is ignored,
    the connection works); the version file is an S3 object at an endpoint with userinfo,
    read with AWS credentials from the environment (the server answers 404)."""
    env, secrets = common(sentry)
    secrets |= {
        "DATABASE_URL ?password=": "pgRealQueryMarker6b4",
        "NATS_URL password": "natsPwMarker2d7",
        "SELF_UPDATE_S3_ENDPOINT password": "s3EndpointPwMarker9a0",
        "AWS_SECRET_ACCESS_KEY": "awsSecretMarker4c8e1f",
        "AWS_SESSION_TOKEN": "awsSessionMarker7f2b",
        "request ?token=": "requestQueryMarker8e5",
    }
    with fresh_database_sync(postgres.url) as database:
        env |= {
            "LOG_FORMAT": "json",
            "DATABASE_URL": f"{database}?password={secrets['DATABASE_URL ?password=']}",
            "NATS_URL": f"nats://wm:{secrets['NATS_URL password']}@{refused()}",
            "SELF_UPDATE_URL": "s3://versions/manager/version",
            "SELF_UPDATE_S3_ENDPOINT": f"http://s3:{secrets['SELF_UPDATE_S3_ENDPOINT password']}"
            f"@127.0.0.1:{versions.port}",
            "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEACCESS",
            "AWS_SECRET_ACCESS_KEY": secrets["AWS_SECRET_ACCESS_KEY"],
            "AWS_SESSION_TOKEN": secrets["AWS_SESSION_TOKEN"],
            "AWS_REGION": "eu-west-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        yield Setup(
            env,
            secrets,
            shown_in_log=["nats://wm:***@", "token=***"],
            shown_in_status=["?password=***", "http://node:***@"],
            version_error="HTTP 404",
        )


Case = Callable[[ThreadedServer, ThreadedServer, EmbeddedPostgres], AbstractContextManager[Setup]]
CASES: dict[str, Case] = {
    "presigned-url-text-log": presigned_case,
    "s3-endpoint-json-log": s3_case,
}


@pytest.fixture(scope="module")
def version_server() -> Iterator[ThreadedServer]:
    files = VersionFileServer()
    files.set(status=403, body=b"<Error><Code>AccessDenied</Code></Error>")
    with serve(files.app) as server:
        yield server


@pytest.fixture
def own_deployment_on(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    """The manager's own Deployment, which the self-update reads before the version file."""
    delete = ("-n", OWN_NS, "delete", "deployment", "workload-manager", "--ignore-not-found",
              "--wait=true")  # fmt: skip
    control_plane.kubectl(*delete)
    control_plane.kubectl(
        "apply", "-f", "-", input=json.dumps(own_deployment(f"{REPO}:0.1.0", sidecar=False))
    )
    yield control_plane
    control_plane.kubectl(*delete)


def wait_for(check: Callable[[], bool], *, within: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not within {within} s:\n{log.read_text()[-6000:]}")
        time.sleep(0.1)


@pytest.mark.parametrize("case", list(CASES))
def test_no_secret_in_status_page_metrics_log_or_sentry(
    case: str,
    tmp_path: Path,
    own_deployment_on: ControlPlane,
    version_server: ThreadedServer,
    postgres_server: EmbeddedPostgres,
) -> None:
    plane = own_deployment_on
    receiver = SentryReceiver()
    with (
        serve(receiver.app) as sentry,
        CASES[case](sentry, version_server, postgres_server) as setup,
    ):
        token = plane.token_for(*MANAGER_ACCOUNT)
        setup.secrets["kubeconfig token"] = token
        kubeconfig = plane.write_kubeconfig(tmp_path / "kc", token=token, namespace=OWN_NS)
        surfaces = run_manager(tmp_path, setup, kubeconfig, receiver, presigned(version_server.url))
    leaks = {
        (what, surface)
        for what, marker in setup.secrets.items()
        for surface, text in surfaces.items()
        if marker.lower() in text.lower()
    }
    assert not leaks, "shown: " + "; ".join(f"{what} in {where}" for what, where in sorted(leaks))
    # the paths ran, and what they show is there, redacted
    for redacted in setup.shown_in_log:
        assert redacted in surfaces["log"], (redacted, surfaces["log"][-6000:])
    for redacted in setup.shown_in_status:
        assert redacted in surfaces["/v1/status"], (redacted, surfaces["/v1/status"])
    assert setup.version_error in surfaces["/v1/status"]
    events = [text for name, text in surfaces.items() if name.startswith("sentry event")]
    assert any("X-Amz-Signature=***" in event for event in events), surfaces["log"][-6000:]


def run_manager(
    tmp_path: Path, setup: Setup, kubeconfig: Path, receiver: SentryReceiver, fetch_url: str
) -> dict[str, str]:
    port = free_port()
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", ""),
        "PYTHONPATH": str(ROOT),
        "HOME": str(home),
        "AWS_CONFIG_FILE": str(home / "aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "aws-credentials"),
        "DATA_DIR": str(tmp_path / "data"),
        "EMBEDDED_SERVICES": "false",
        "LOG_LEVEL": "INFO",
        "KUBECONFIG": str(kubeconfig),
        "POD_NAMESPACE": OWN_NS,
        "SELF_IMAGE_REPOSITORY": REPO,
        "SELF_UPDATE_INTERVAL_SECONDS": "1",
        "REPORT_INTERVAL_SECONDS": "1",
        "HEARTBEAT_INTERVAL_SECONDS": "1",
        "ALERT_WINDOW_SECONDS": "1",
        **setup.env,
    }
    log_path = tmp_path / "manager.log"
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {API_TOKEN}"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.secrets_target", str(port), fetch_url],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        with httpx.Client(base_url=url, headers=auth, timeout=5) as client:

            def get(path: str, **params: str) -> httpx.Response | None:
                assert proc.poll() is None, log_path.read_text()
                try:
                    return client.get(path, params=params)
                except httpx.TransportError:
                    return None

            def status() -> dict[str, Any]:
                answer = get("/v1/status")
                return answer.json() if answer is not None and answer.status_code == 200 else {}

            def component(name: str) -> dict[str, Any]:
                found: dict[str, Any] = status().get("components", {}).get(name, {})
                return found

            wait_for(lambda: bool(status()), within=60, what="serving", log=log_path)
            # the paths that name the URLs: a failed version-file fetch, failed connects,
            # failed reports, an alert (registry heartbeats or Matrix)
            wait_for(
                lambda: setup.version_error in (component("self_update").get("last_error") or ""),
                within=60, what="the version file fetch failing", log=log_path,
            )  # fmt: skip
            wait_for(
                lambda: component("report").get("last_error") is not None,
                within=30, what="a failed report", log=log_path,
            )  # fmt: skip
            answer = get("/fetch", token=setup.secrets["request ?token="])
            assert answer is not None and answer.status_code == 500, answer
            wait_for(
                lambda: "HTTPStatusError" in receiver.exception_types(),
                within=30, what="the route error reaching Sentry", log=log_path,
            )  # fmt: skip
            surfaces: dict[str, str] = {}
            for path in ("/v1/status", "/", "/metrics", "/readyz", "/v1/workloads"):
                # the 500 above may close the kept-alive connection as the next request
                # goes out on it: that request is made again, on a new one
                shown = get(path) or get(path)
                assert shown is not None, path
                surfaces[path] = shown.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    log_text = log_path.read_text(errors="replace")
    surfaces["log"] = log_text
    for index, event in enumerate(receiver.events):
        surfaces[f"sentry event {index}"] = json.dumps(event, indent=1)
    kept = tmp_path / "shown"  # what was looked at, for a failure's post-mortem
    kept.mkdir()
    for name, text in surfaces.items():
        (kept / "".join(c if c.isalnum() else "_" for c in name)).write_text(text)
    return surfaces
