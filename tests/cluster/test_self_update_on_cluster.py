"""Self-update on the real deployment controller: the manager patches its own Deployment
with its own ServiceAccount token, watches the rollout the controller reports, confirms a
good image and rolls back one that never becomes ready (ProgressDeadlineExceeded)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from app.services.runtime import build_runtime, open_self_update_only
from app.services.updating import SelfUpdater
from standins.control_plane import MANAGER_ACCOUNT, NEVER_READY_VERSION, ControlPlane
from standins.servers import ThreadedServer, serve
from tests.conftest import SettingsFactory
from tests.support.version_file import OWN_NS, REPO, VersionFileServer, own_deployment

FAILED_VERSIONS = "workload-manager.io/failed-versions"
CONFIRMED = "workload-manager.io/update-confirmed"
HIGHEST = "workload-manager.io/highest-confirmed-version"
HIGHEST_IMAGE = "workload-manager.io/highest-confirmed-image"
SERIAL = "workload-manager.io/version-file-serial"


@pytest.fixture(scope="module")
def version_file() -> Iterator[tuple[VersionFileServer, ThreadedServer]]:
    files = VersionFileServer()
    with serve(files.app) as server:
        yield files, server


@pytest.fixture
async def updater(
    control_plane: ControlPlane,
    version_file: tuple[VersionFileServer, ThreadedServer],
    make_settings: SettingsFactory,
    tmp_path: Path,
) -> AsyncIterator[SelfUpdater]:
    files, server = version_file
    files.set(body=b"0.1.0")
    control_plane.kubectl("-n", OWN_NS, "delete", "deployment", "workload-manager",
                          "--ignore-not-found", "--wait=true")  # fmt: skip
    control_plane.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps(
            own_deployment(f"{REPO}:0.1.0", sidecar=False, progress_deadline=3, migrate=True)
        ),
    )
    control_plane.kubectl("-n", OWN_NS, "rollout", "status", "deployment/workload-manager",
                          "--timeout=60s")  # fmt: skip
    token = control_plane.token_for(*MANAGER_ACCOUNT)
    settings = make_settings(
        self_update_url=f"{server.url}/version",
        pod_namespace=OWN_NS,
        kubeconfig=control_plane.write_kubeconfig(tmp_path / "kc", token=token, namespace=OWN_NS),
        self_image_repository=REPO,
        self_update_allow_prerelease=True,
        self_update_deadline_seconds=60,
        self_update_min_healthy_seconds=0,  # confirmed once available, as before the setting
        self_update_poll_seconds=0.2,
        kube_timeout_seconds=10,
    )
    rt = build_runtime(settings)
    async with AsyncExitStack() as stack:
        found = await open_self_update_only(rt, stack)
        assert found is not None, rt.components["self_update"].reason
        yield found
    control_plane.kubectl("-n", OWN_NS, "delete", "deployment", "workload-manager",
                          "--ignore-not-found", "--wait=true")  # fmt: skip


def own(control_plane: ControlPlane) -> dict[str, Any]:
    found = control_plane.get("deployment", "workload-manager", OWN_NS)
    assert found is not None
    return found


def image(obj: dict[str, Any]) -> str:
    found: str = obj["spec"]["template"]["spec"]["containers"][0]["image"]
    return found


async def test_a_good_image_rolls_out_and_is_confirmed(
    control_plane: ControlPlane,
    updater: SelfUpdater,
    version_file: tuple[VersionFileServer, ThreadedServer],
) -> None:
    version_file[0].set(body=b"0.2.0")
    await updater.run_scheduled()
    deployed = own(control_plane)
    assert image(deployed) == f"{REPO}:0.2.0"
    annotations = deployed["metadata"]["annotations"]
    assert annotations[CONFIRMED] == "0.2.0"
    # the floor is written with the confirmation, by the manager's own account
    assert (annotations[HIGHEST], annotations[HIGHEST_IMAGE]) == ("0.2.0", f"{REPO}:0.2.0")
    status = deployed["status"]
    assert status["updatedReplicas"] == status["availableReplicas"] == status["replicas"] == 1


async def test_an_image_that_never_becomes_ready_is_rolled_back_and_skipped(
    control_plane: ControlPlane,
    updater: SelfUpdater,
    version_file: tuple[VersionFileServer, ThreadedServer],
) -> None:
    bad = NEVER_READY_VERSION
    version_file[0].set(body=bad.encode())
    await updater.run_scheduled()
    deployed = own(control_plane)
    assert image(deployed) == f"{REPO}:0.1.0", "rolled back"
    assert bad in deployed["metadata"]["annotations"][FAILED_VERSIONS]
    decision = await updater.check()
    assert decision.choice.value == "skip" and "failed" in decision.reason


async def test_a_version_below_the_confirmed_one_is_refused_after_a_rollback_by_hand(
    control_plane: ControlPlane,
    updater: SelfUpdater,
    version_file: tuple[VersionFileServer, ThreadedServer],
) -> None:
    version_file[0].set(body=b"0.3.0")
    await updater.run_scheduled()
    assert own(control_plane)["metadata"]["annotations"][HIGHEST] == "0.3.0"
    control_plane.kubectl("-n", OWN_NS, "set", "image", "deployment/workload-manager",
                          f"manager={REPO}:0.1.0")  # fmt: skip
    version_file[0].set(body=b"0.2.0")
    decision = await updater.check()
    assert decision.choice.value == "skip", decision
    assert "below 0.3.0, the highest version confirmed on this node" in decision.reason


async def test_a_reapplied_install_is_undone_at_start_without_the_version_file(
    control_plane: ControlPlane,
    updater: SelfUpdater,
    version_file: tuple[VersionFileServer, ThreadedServer],
) -> None:
    """K3S re-applies its auto-deploy folder at every start: the install's older image
    comes back over a confirmed update. The manager that starts from it re-asserts the
    confirmed image (the version file, down here, is not what brings it back)."""
    version_file[0].set(body=b"0.2.0")
    await updater.run_scheduled()
    assert own(control_plane)["metadata"]["annotations"][HIGHEST] == "0.2.0"
    version_file[0].set(status=503, body=b"unavailable")
    control_plane.kubectl("-n", OWN_NS, "set", "image", "deployment/workload-manager",
                          f"manager={REPO}:0.1.0")  # fmt: skip
    assert (await updater.resume()).detail["update"] == "available"
    deployed = own(control_plane)
    assert image(deployed) == f"{REPO}:0.2.0"
    assert deployed["metadata"]["annotations"][CONFIRMED] == "0.2.0"
    assert not (await updater.resume()).detail, "once there, nothing more is done"


async def test_a_check_that_meets_a_running_sync_waits_for_it_instead_of_skipping(
    control_plane: ControlPlane,
    updater: SelfUpdater,
    version_file: tuple[VersionFileServer, ThreadedServer],
) -> None:
    """A sync holds the shared lock for a moment at each of its intervals; a check that
    always lands in that moment (the same interval, no jitter) must not skip forever. On
    the real node it did: the self-update never ran while syncs every 3 s held the lock."""
    version_file[0].set(body=b"0.2.0")
    lock = updater._lock  # the lock the syncer shares
    await lock.acquire()
    try:
        check = asyncio.create_task(updater.run_scheduled())
        await asyncio.sleep(0)  # let the check start and meet the held lock
        assert not check.done(), "the check skipped instead of waiting for the sync"
    finally:
        lock.release()
    await asyncio.wait_for(check, timeout=60)
    assert image(own(control_plane)) == f"{REPO}:0.2.0"


async def test_a_sync_that_starts_during_the_check_delays_the_update_not_by_an_interval(
    control_plane: ControlPlane,
    updater: SelfUpdater,
    version_file: tuple[VersionFileServer, ThreadedServer],
) -> None:
    """The lock was free when the check began; a sync took it while the version file was
    read. The update waits for that sync, instead of being deferred to the next check."""
    version_file[0].set(body=b"0.2.0")
    lock = updater._lock  # the lock the syncer shares
    read = updater._source.fetch
    sync_started = asyncio.Event()

    async def read_while_a_sync_starts() -> bytes:
        content = await read()
        await lock.acquire()
        sync_started.set()
        return content

    updater._source.fetch = read_while_a_sync_starts  # type: ignore[method-assign]
    try:
        check = asyncio.create_task(updater.run_scheduled())
        await asyncio.wait_for(sync_started.wait(), timeout=30)
        for _ in range(10):
            await asyncio.sleep(0)
        assert not check.done(), "the update gave up on meeting the sync"
    finally:
        if lock.locked():
            lock.release()
        updater._source.fetch = read  # type: ignore[method-assign]
    await asyncio.wait_for(check, timeout=60)
    assert image(own(control_plane)) == f"{REPO}:0.2.0"


def init_images(obj: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["image"] for c in obj["spec"]["template"]["spec"]["initContainers"]}


async def test_the_migrations_init_container_moves_with_the_manager_and_back(
    control_plane: ControlPlane,
    updater: SelfUpdater,
    version_file: tuple[VersionFileServer, ThreadedServer],
) -> None:
    """The install runs the schema migrations in a `migrate` init container of the same
    image: a new version's pod must migrate with the new version's code (production does
    not migrate on start), and a rollback must put the old one back."""
    version_file[0].set(body=b"0.2.0")
    await updater.run_scheduled()
    assert init_images(own(control_plane)) == {"migrate": f"{REPO}:0.2.0", "wait": "busybox:1.36"}
    version_file[0].set(body=NEVER_READY_VERSION.encode())
    await updater.run_scheduled()
    deployed = own(control_plane)
    assert image(deployed) == f"{REPO}:0.2.0", "rolled back"
    assert init_images(deployed) == {"migrate": f"{REPO}:0.2.0", "wait": "busybox:1.36"}


async def test_a_stale_version_file_below_the_recorded_serial_cannot_undo_a_halt(
    control_plane: ControlPlane,
    updater: SelfUpdater,
    version_file: tuple[VersionFileServer, ThreadedServer],
) -> None:
    """The halted file (serial 8) is recorded on the own Deployment; a stale copy (serial
    7, not halted) that a cache or a replay serves next is refused, and updates nothing."""
    halted = {"version": "0.2.0", "serial": 8, "rollout": {"percent": 100, "halt": True}}
    version_file[0].set(body=json.dumps(halted).encode())
    outcome = await updater.run_scheduled()
    assert outcome.succeeded, outcome
    assert own(control_plane)["metadata"]["annotations"][SERIAL] == "8"

    stale = {"version": "0.2.0", "serial": 7}
    version_file[0].set(body=json.dumps(stale).encode())
    refused = await updater.run_scheduled()
    assert not refused.succeeded
    assert "serial 7 is below the recorded 8" in str(refused.error)
    deployed = own(control_plane)
    assert image(deployed) == f"{REPO}:0.1.0"
    assert deployed["metadata"]["annotations"][SERIAL] == "8"
    unnumbered = {"version": "0.2.0"}
    version_file[0].set(body=json.dumps(unnumbered).encode())
    assert "has no serial" in str((await updater.run_scheduled()).error)
    assert image(own(control_plane)) == f"{REPO}:0.1.0"
