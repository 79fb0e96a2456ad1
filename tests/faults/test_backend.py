"""Backend faults: 5xx, timeouts and garbage on every route the manager calls.

Garbage is injected only where the manager reads the answer (the desired state and the
manifests); for the version PUT and the health report the contract accepts any 2xx.
"""

from __future__ import annotations

import pytest

from tests.faults.conftest import Rig
from tests.support.backend import FailureMode, Route
from tests.support.sync_world import desire

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
