"""Kubernetes API faults: conflicts, server errors and timeouts on the reads and the writes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from standins.sync_world import desire
from tests.faults.conftest import Rig

LASTING = 10_000  # "until cleared"


@dataclass(frozen=True)
class KubeFault:
    id: str
    method: str
    path: str
    status: int = 0  # an error status, or 0 for a hang longer than KUBE_TIMEOUT_SECONDS
    times: int = LASTING
    blocks_the_update: bool = True  # while it lasts, api stays at the old version


FAULTS = [
    KubeFault("apply-409-three-times", "PATCH", "/deployments/api", 409, 3, False),
    KubeFault("apply-500", "PATCH", "/deployments/api", 500),
    # a request that times out may still land: the server applies it after the client gave up
    KubeFault("apply-timeout", "PATCH", "/deployments/api", blocks_the_update=False),
    KubeFault("list-500", "GET", "/deployments", 500),
    KubeFault("list-503", "GET", "/deployments", 503),
    KubeFault("list-timeout", "GET", "/deployments"),
]


def _hits(rig: Rig, fault: KubeFault) -> int:
    return sum(1 for r in rig.cluster.requests if r.method == fault.method and fault.path in r.path)


@pytest.mark.parametrize("fault", FAULTS, ids=[f.id for f in FAULTS])
def test_a_kubernetes_fault_loses_nothing_and_heals_on_its_own(rig: Rig, fault: KubeFault) -> None:
    rig.cluster.clear_requests()
    if fault.status:
        rig.cluster.fail_next(fault.method, fault.path, status=fault.status, times=fault.times)
    else:
        rig.cluster.delay_next(fault.method, fault.path, seconds=3, times=fault.times)
    desire(rig.local, ("api", "1.1.0"), ("worker", "1.0.0"))
    rig.local.wait_for(lambda: _hits(rig, fault) >= 2, timeout=30)
    rig.untouched()
    if fault.blocks_the_update:
        assert rig.image("api") == "registry.example/api:1.0.0"
        assert not rig.reported("api", "1.1.0")
        rig.local.wait_for(lambda: rig.component("sync") == "failing", timeout=10)
    if fault.method == "GET":
        # the cluster view meets the outage too: a state and one warning, not an ERROR
        # with a traceback each second (the rig's exit checks the log for those)
        rig.local.wait_for(lambda: rig.loop("cluster-view") == "unavailable", timeout=15)

    rig.cluster.clear_faults()
    rig.converged("1.1.0")
    rig.local.wait_for(lambda: rig.loop("cluster-view") == "ok", timeout=15)
    # the sync loop kept its schedule through the fault: it is still ticking
    runs = _hits(rig, KubeFault("list", "GET", "/deployments"))
    rig.local.wait_for(
        lambda: _hits(rig, KubeFault("list", "GET", "/deployments")) > runs, timeout=10
    )
