"""Backend faults: 5xx, timeouts and garbage on every route the manager calls; answers
that trickle, flood or redirect on the desired state, the version PUT and the report.

Garbage is injected only where the manager reads the answer (the desired state and the
manifests); for the version PUT and the health report the contract accepts any 2xx.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from standins.backend import REDIRECT_HOST, FailureMode, LocalBackend, Route
from standins.servers import ThreadedServer
from standins.sync_world import NODE, WRITES, desire, key_seed
from tests.faults.conftest import Rig, running_rig
from tests.support.process import manager
from tests.support.real_cluster import RealCluster

CASES: list[tuple[Route, FailureMode]] = [
    ("workloads", "500"),
    ("workloads", "timeout"),
    ("workloads", "garbage"),
    ("manifest", "503"),
    ("manifest", "timeout"),
    ("manifest", "garbage"),
    ("version", "500"),
    ("version", "timeout"),
    ("health", "503"),
    ("health", "timeout"),
]


def _requests_to(rig: Rig, route: Route) -> int:
    """Requests that met the fault (records were cleared as it was injected)."""
    return sum(1 for r in rig.local.requests if r.route == route)


@pytest.mark.parametrize(("route", "mode"), CASES, ids=[f"{r}-{m}" for r, m in CASES])
def test_a_backend_fault_loses_nothing_and_heals_on_its_own(
    rig: Rig, route: Route, mode: FailureMode
) -> None:
    rig.local.clear_records()
    rig.local.fail(route, mode, times=None, delay=5.0)
    desire(rig.local, ("api", "1.1.0"), ("worker", "1.0.0"))
    rig.ping("quiet-during-the-outage", "degraded")
    # the fault is hit again and again: every sync or report tick meets it
    rig.local.wait_for(lambda: _requests_to(rig, route) >= 2, timeout=30)
    rig.untouched()
    if route in ("workloads", "manifest"):
        # without the new desired state or its manifest, nothing changes in the cluster
        assert rig.image("api") == "registry.example/api:1.0.0"
    if route == "version":
        # the Deployment was updated; its version is owed to the backend, not forgotten
        rig.local.wait_for(lambda: rig.image("api") == "registry.example/api:1.1.0", timeout=30)
        assert not rig.reported("api", "1.1.0")
    if route == "health":
        assert rig.component("report") == "failing"

    rig.local.clear_failures()
    rig.converged("1.1.0")
    # reports resume on their own and carry what arrived while they could not be sent
    rig.local.wait_for(lambda: "quiet-during-the-outage" in rig.last_report_names(), timeout=30)
    rig.local.wait_for(lambda: rig.component("report") == "ok", timeout=10)
    assert rig.local.rejected == [], "every request kept the contract, signatures included"


# ------------------------------------------- answers that trickle, flood or redirect

DEADLINE = 2.0
MAX_BYTES = 65536
BOUNDS_ENV = {
    "BACKEND_DEADLINE_SECONDS": f"{DEADLINE:g}",
    "BACKEND_MAX_RESPONSE_BYTES": str(MAX_BYTES),
    # longer than the trickle's gap between two bytes: a per-read timeout never fires
    "BACKEND_TIMEOUT_SECONDS": "1.5",
    "BACKEND_RETRY_ATTEMPTS": "3",
    "BACKEND_RETRY_MAX_WAIT_SECONDS": "0.2",
}
TRICKLE_INTERVAL = 0.5
HUGE = 4 * 1024 * 1024
# what each mode's failure says, as /v1/status and the log show it
CAUSE = {
    "trickle": f"deadline of {DEADLINE:g} s (BACKEND_DEADLINE_SECONDS) passed",
    "huge": f"answer larger than {MAX_BYTES} bytes",
    "redirect": "redirects are refused, never followed",
}
BOUNDED: list[FailureMode] = ["trickle", "huge", "redirect"]
# a failure is recorded within the deadline of the call that met it, plus the time to the
# next tick (1 s or less) and a wide margin for a busy machine. Only the deadline says
# CAUSE["trickle"]: a client without one would read a trickled answer whole (the desired
# state takes over a minute at TRICKLE_INTERVAL) and never fail with it.
RECORDED_WITHIN = DEADLINE + 20.0


RUNS = "workload_manager_scheduled_runs_total"
REPORTS_OK = RUNS + '{loop="report",outcome="ok"}'
REPORTS_FAILED = RUNS + '{loop="report",outcome="failed"}'
SYNCS_FAILED = RUNS + '{loop="sync",outcome="failed"}'


def _metric(url: str, sample: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    found = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _component(url: str, name: str) -> dict[str, object]:
    component: dict[str, object] = httpx.get(f"{url}/v1/status", timeout=5).json()["components"][
        name
    ]
    return component


def _failing_with(url: str, name: str, cause: str) -> bool:
    component = _component(url, name)
    return component["state"] == "failing" and cause in str(component.get("last_error"))


def _followed(local: LocalBackend) -> list[str]:
    """Requests that arrived under the redirect's host: a client that followed it."""
    return [r.target for r in local.requests if r.headers.get("host", "").startswith(REDIRECT_HOST)]


@pytest.mark.parametrize("mode", BOUNDED)
def test_a_report_answered_slowly_hugely_or_by_a_redirect_is_not_sent(
    backend: tuple[LocalBackend, ThreadedServer], tmp_path: Path, mode: FailureMode
) -> None:
    local, server = backend
    env = {
        "NODE_ID": NODE,
        "NODE_SYSTEM_ENDPOINT": server.url,
        "NODE_PRIVATE_KEY": key_seed(),
        "REPORT_INTERVAL_SECONDS": "0.5",
        "SCHEDULER_JITTER_FRACTION": "0",
    } | BOUNDS_ENV
    with manager(env=env, workdir=tmp_path) as m:
        local.wait_for_reports(1, timeout=15)
        local.fail("health", mode, times=None, interval=TRICKLE_INTERVAL, size=HUGE)
        injected = time.monotonic()
        local.wait_for(lambda: _failing_with(m.url, "report", CAUSE[mode]), RECORDED_WITHIN)
        assert time.monotonic() - injected < RECORDED_WITHIN
        sent = _metric(m.url, REPORTS_OK)
        failed = _metric(m.url, REPORTS_FAILED)
        # the next report fails the same way, and none counts as sent meanwhile
        local.wait_for(
            lambda: _metric(m.url, REPORTS_FAILED) > failed,
            RECORDED_WITHIN,
        )
        assert _metric(m.url, REPORTS_OK) == sent
        assert _followed(local) == []
        stored = len(local.reports)

        local.clear_failures()
        local.wait_for(lambda: len(local.reports) > stored, timeout=15)
        local.wait_for(lambda: _component(m.url, "report")["state"] == "ok", timeout=15)
        assert local.rejected == []
    log = m.log()
    assert CAUSE[mode] in log
    assert "Traceback" not in log and " ERROR " not in log, log


@pytest.fixture
def bounded_rig(
    cluster: RealCluster, backend: tuple[LocalBackend, ThreadedServer], tmp_path: Path
) -> Iterator[Rig]:
    """The fault rig with a short backend deadline and a small response bound."""
    with running_rig(cluster, backend, tmp_path, **BOUNDS_ENV) as started:
        yield started


def _deployment_writes(rig: Rig) -> list[str]:
    return [
        f"{r.method} {r.path}"
        for r in rig.cluster.requests
        if r.method in WRITES and "/deployments" in r.path
    ]


@pytest.mark.parametrize("mode", BOUNDED)
def test_a_desired_state_that_trickles_floods_or_redirects_changes_nothing(
    bounded_rig: Rig, mode: FailureMode
) -> None:
    rig = bounded_rig
    rig.local.clear_records()
    rig.cluster.clear_requests()
    rig.local.fail("workloads", mode, times=None, interval=TRICKLE_INTERVAL, size=HUGE)
    # what a client without bounds would read (and apply) once the answer is complete
    desire(rig.local, ("api", "1.1.0"), ("worker", "1.0.0"))
    injected = time.monotonic()
    url = rig.process.url
    rig.local.wait_for(lambda: _failing_with(url, "sync", CAUSE[mode]), RECORDED_WITHIN)
    assert time.monotonic() - injected < RECORDED_WITHIN
    assert "nothing changed" in str(_component(url, "sync")["last_error"])
    aborted = _metric(url, SYNCS_FAILED)
    assert aborted >= 1
    # the cluster lock was let go: the next sync ran, and met the fault again
    met = sum(1 for r in rig.local.requests if r.route == "workloads")
    rig.local.wait_for(
        lambda: sum(1 for r in rig.local.requests if r.route == "workloads") > met,
        RECORDED_WITHIN,
    )
    rig.local.wait_for(
        lambda: _metric(url, SYNCS_FAILED) > aborted,
        RECORDED_WITHIN,
    )
    rig.untouched()
    assert rig.image("api") == "registry.example/api:1.0.0"
    assert _deployment_writes(rig) == []
    assert _followed(rig.local) == []

    rig.local.clear_failures()
    rig.converged("1.1.0")
    assert rig.local.rejected == []


@pytest.mark.parametrize("mode", BOUNDED)
def test_a_version_put_that_trickles_floods_or_redirects_stays_owed(
    bounded_rig: Rig, mode: FailureMode
) -> None:
    rig = bounded_rig
    rig.local.clear_records()
    rig.local.fail("version", mode, times=None, interval=TRICKLE_INTERVAL, size=HUGE)
    desire(rig.local, ("api", "1.1.0"), ("worker", "1.0.0"))
    # the Deployment is updated; telling the backend fails, with the cause in the log
    rig.local.wait_for(lambda: rig.image("api") == "registry.example/api:1.1.0", timeout=30)
    rig.local.wait_for(
        lambda: (
            "version 1.1.0 of api not reported yet" in rig.process.log()
            and CAUSE[mode] in rig.process.log()
        ),
        RECORDED_WITHIN,
    )
    # still owed, so the next sync (the lock let go) tells it again
    rig.local.wait_for(
        lambda: sum(1 for r in rig.local.requests if r.route == "version") >= 2,
        RECORDED_WITHIN,
    )
    assert not rig.reported("api", "1.1.0")
    assert _followed(rig.local) == []
    rig.untouched()

    rig.local.clear_failures()
    rig.converged("1.1.0")
    assert rig.local.rejected == []
