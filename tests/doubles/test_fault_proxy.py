"""The fault proxy in front of the real API server: forwards (RBAC still applies),
records, and fails or holds (and releases) requests on demand."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.adapters.kube import KubeConflict, KubeDeployments, KubeError, load_configuration
from standins.control_plane import MANAGER_ACCOUNT, ControlPlane
from standins.servers import ThreadedServer
from tests.support.kube.proxy import FaultProxy
from tests.support.polling import eventually

SELECTOR = "app.kubernetes.io/managed-by=workload-manager"


@pytest.fixture(scope="module")
def proxy(control_plane: ControlPlane) -> Iterator[tuple[FaultProxy, ThreadedServer]]:
    faults = FaultProxy(control_plane.url, ca=control_plane.ca)
    with faults.serving() as server:
        yield faults, server


async def through_proxy(
    control_plane: ControlPlane, server: ThreadedServer, tmp_path: Path, **options: Any
) -> KubeDeployments:
    """The manager's client (its own token) pointed at the proxy."""
    token = control_plane.token_for(*MANAGER_ACCOUNT)
    path = control_plane.write_kubeconfig(
        tmp_path / "kc", token=token, namespace="workloads", server=server.url
    )
    configuration, _source = await load_configuration(path)
    return KubeDeployments(configuration, namespace="workloads", **options)


@pytest.fixture
async def kube(
    control_plane: ControlPlane, proxy: tuple[FaultProxy, ThreadedServer], tmp_path: Path
) -> AsyncIterator[KubeDeployments]:
    faults, server = proxy
    faults.reset()  # requests an earlier test left held are abandoned, never recorded here
    client = await through_proxy(control_plane, server, tmp_path, timeout=2.0)
    yield client
    await client.aclose()


async def test_requests_are_forwarded_with_the_callers_token_and_recorded(
    kube: KubeDeployments, proxy: tuple[FaultProxy, ThreadedServer]
) -> None:
    faults, _server = proxy
    assert isinstance(await kube.list_managed(SELECTOR), list)
    assert [(r.method, r.path, r.status) for r in faults.requests] == [
        ("GET", "/apis/apps/v1/namespaces/workloads/deployments", 200)
    ]


async def test_a_namespace_rbac_denies_stays_denied_through_the_proxy(
    control_plane: ControlPlane, proxy: tuple[FaultProxy, ThreadedServer], tmp_path: Path
) -> None:
    _faults, server = proxy
    token = control_plane.token_for(*MANAGER_ACCOUNT)
    path = control_plane.write_kubeconfig(
        tmp_path / "kc", token=token, namespace="default", server=server.url
    )
    configuration, _source = await load_configuration(path)
    elsewhere = KubeDeployments(configuration, namespace="default", timeout=2.0)
    try:
        with pytest.raises(KubeError, match="403"):
            await elsewhere.list_managed(SELECTOR)
    finally:
        await elsewhere.aclose()


@pytest.mark.parametrize(("status", "error"), [(503, KubeError), (409, KubeConflict)])
async def test_injected_statuses_reach_the_client(
    kube: KubeDeployments,
    proxy: tuple[FaultProxy, ThreadedServer],
    status: int,
    error: type[Exception],
) -> None:
    faults, _server = proxy
    faults.fail_next("GET", "/deployments/nothing-here", status=status, times=10)
    with pytest.raises(error):
        await kube.get("nothing-here")


async def test_a_held_request_times_out_and_the_next_one_goes_through(
    kube: KubeDeployments, proxy: tuple[FaultProxy, ThreadedServer]
) -> None:
    faults, _server = proxy
    faults.delay_next("GET", "/deployments", seconds=5, times=10)
    with pytest.raises(KubeError):
        await kube.list_managed(SELECTOR)
    faults.clear_faults()
    assert isinstance(await kube.list_managed(SELECTOR), list)


async def test_a_released_hold_is_forwarded_at_once_and_recorded(
    control_plane: ControlPlane, proxy: tuple[FaultProxy, ThreadedServer], tmp_path: Path
) -> None:
    faults, server = proxy
    faults.reset()  # requests an earlier test left held are abandoned, never recorded here
    # one attempt, and a timeout no hold in this test comes near: a second request would
    # be the client's retry, not the proxy's doing
    patient = await through_proxy(control_plane, server, tmp_path, timeout=60.0, attempts=1)
    faults.delay_next("GET", "/deployments", seconds=600)
    listing = asyncio.create_task(patient.list_managed(SELECTOR))

    async def held() -> bool:
        return faults.delays_waiting == 0

    await eventually(held, step=0.01)
    assert not listing.done()
    faults.release_held()
    try:
        assert isinstance(await asyncio.wait_for(listing, timeout=30), list)
    finally:
        await patient.aclose()
    assert [(r.method, r.status) for r in faults.requests] == [("GET", 200)]


async def test_request_bodies_are_recorded_parsed(
    kube: KubeDeployments, proxy: tuple[FaultProxy, ThreadedServer]
) -> None:
    faults, _server = proxy
    faults.fail_next("PATCH", "/deployments/recorded", status=503, times=10)
    with pytest.raises(KubeError):
        await kube.patch("recorded", {"metadata": {"annotations": {"a": "b"}}})
    bodies = [r.body for r in faults.requests if r.method == "PATCH"]
    assert bodies and bodies[0] == {"metadata": {"annotations": {"a": "b"}}}
