"""Self-update against the real API server and deployment controller (kwok makes pods
Ready, or never for a never-ready image), through the fault proxy with the manager's own
token, and a local version file."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from app.adapters.kube import KubeDeployments, load_configuration
from app.adapters.versions import VersionFile, VersionSourceError
from app.api.schemas import ComponentInfo
from app.domain.components import Outcome
from app.domain.health import RolloutPhase, rollout_of
from app.domain.rollout import place, seed_for
from app.domain.updates import MAX_VERSION_FILE_BYTES, UpdatePolicy
from app.services.features.sync import SYNC
from app.services.runtime import Runtime, build_runtime, open_self_update_only, open_sync_only
from app.services.syncing import SyncBusy
from app.services.updating import SelfUpdateBusy, SelfUpdater
from standins.control_plane import NEVER_READY_VERSION
from standins.servers import ThreadedServer, serve
from tests.conftest import SettingsFactory
from tests.support.polling import eventually
from tests.support.real_cluster import RealCluster
from tests.support.version_file import (
    OWN_NS,
    REPO,
    VersionFileServer,
    image_of,
    own_deployment,
    updater,
)

OWN = "deployments/workload-manager"  # the own Deployment's API path, for fault injection
# The annotations are the on-cluster protocol between manager versions: spelled out here so
# a rename shows up as a failing test, not as a silent incompatibility.
PREVIOUS_IMAGE = "workload-manager.io/previous-image"
TARGET = "workload-manager.io/update-target"
TARGET_IMAGE = "workload-manager.io/update-image"
STARTED = "workload-manager.io/update-started"
CONFIRMED = "workload-manager.io/update-confirmed"
FAILED_VERSIONS = "workload-manager.io/failed-versions"
HIGHEST = "workload-manager.io/highest-confirmed-version"
HIGHEST_IMAGE = "workload-manager.io/highest-confirmed-image"
AVAILABLE_SINCE = "workload-manager.io/update-available-since"
DEADLINE = 10.0  # the updater's own bound on a rollout, and on retrying its rollback
PROGRESS_DEADLINE = 2  # the own Deployment's progressDeadlineSeconds
POLL = 0.05
BAD = NEVER_READY_VERSION  # kwok never makes a pod of this image Ready
WORSE = "0.4.0rc666"  # the same, for a second bad version
DIGEST = "sha256:" + "5e" * 32
RELEASE_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
RELEASE_PUBLIC = base64.b64encode(
    RELEASE_KEY.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
).decode()


@pytest.fixture(scope="module")
def version_file() -> Iterator[tuple[VersionFileServer, ThreadedServer]]:
    files = VersionFileServer()
    with serve(files.app) as server:
        yield files, server


@pytest.fixture
async def runtime(
    cluster: RealCluster,
    version_file: tuple[VersionFileServer, ThreadedServer],
    make_settings: SettingsFactory,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> AsyncIterator[Runtime]:
    """The self-updater built from the settings; `indirect` parameters add settings."""
    extra: dict[str, Any] = getattr(request, "param", {})
    files, server = version_file
    files.set(body=b"0.1.0")
    plane = cluster.plane
    plane.kubectl("-n", OWN_NS, "delete", "deployment", "workload-manager",
                  "--ignore-not-found", "--wait=true")  # fmt: skip
    cluster.add_deployment(own_deployment(f"{REPO}:0.1.0", progress_deadline=PROGRESS_DEADLINE))
    plane.kubectl("-n", OWN_NS, "rollout", "status", "deployment/workload-manager",
                  "--timeout=60s")  # fmt: skip
    settings = make_settings(**{
        "self_update_url": f"{server.url}/version",
        "pod_namespace": OWN_NS,
        "kubeconfig": cluster.write_kubeconfig(tmp_path / "kc", OWN_NS),
        "self_image_repository": REPO,
        "self_update_deadline_seconds": DEADLINE,
        "self_update_poll_seconds": POLL,
        "self_update_timeout_seconds": 0.5,
        "self_update_allow_prerelease": True,
        "self_update_min_healthy_seconds": 0,  # confirmed once available, unless a test says
        "kube_timeout_seconds": 3.0,
        "desired_state_dir": tmp_path,  # sync on, for the lock test
        "managed_namespace": "workloads",
        **extra,
    })  # fmt: skip
    rt = build_runtime(settings)
    async with AsyncExitStack() as stack:
        updater = await open_self_update_only(rt, stack)
        assert updater is not None, rt.components["self_update"].reason
        # not started: `scheduled` runs it, recorded as the runtime's loop is
        rt.supervisor.add_loop(
            "self-update", updater.run_scheduled, every=3600,
            component=rt.components["self_update"],
        )  # fmt: skip
        await open_sync_only(rt, stack)
        yield rt
    # the own Deployment is this module's; other tests create theirs from scratch
    plane.kubectl("-n", OWN_NS, "delete", "deployment", "workload-manager",
                  "--ignore-not-found", "--wait=true")  # fmt: skip


@pytest.fixture
async def fresh_updater(runtime: Runtime) -> AsyncIterator[SelfUpdater]:
    """A second SelfUpdater on the same runtime (metrics, alerts, lock), as a
    restarted manager would build it, whose Kubernetes client makes one request per call:
    each injected fault is then exactly one attempt of the updater's own retries."""
    settings = runtime.settings
    assert settings.self_update_url is not None
    configuration, _source = await load_configuration(settings.kubeconfig)
    kube = KubeDeployments(configuration, namespace=OWN_NS, timeout=3.0, attempts=1)
    source = VersionFile(settings.self_update_url, timeout=0.5)
    try:
        yield SelfUpdater(
            source=source,
            kube=kube,
            deployment=settings.self_deployment_name,
            container=settings.self_container_name,
            policy=UpdatePolicy(repository=REPO, allow_prerelease=True),
            deadline=DEADLINE,
            poll_interval=POLL,
            metrics=runtime.metrics,
            cluster_lock=runtime.cluster_lock,
            alerts=runtime.alerts,
        )
    finally:
        await source.aclose()
        await kube.aclose()


async def scheduled(runtime: Runtime, which: SelfUpdater | None = None) -> Outcome:
    """One scheduled check, recorded as the runtime's `self-update` loop records it."""
    outcome = await (which or updater(runtime)).run_scheduled()
    runtime.supervisor.record("self-update", outcome)
    return outcome


async def resumed(runtime: Runtime) -> object:
    """The start-up resume, recorded as the runtime records it; what it did to the update."""
    outcome = await updater(runtime).resume()
    runtime.supervisor.record("self-update", outcome)
    return outcome.detail.get("update", "nothing")


def annotations_of(cluster: RealCluster) -> dict[str, str]:
    own = cluster.get_deployment(OWN_NS, "workload-manager")
    assert own is not None
    annotations: dict[str, str] = own["metadata"].get("annotations") or {}
    return annotations


def stamp(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def as_left_by_an_update(
    cluster: RealCluster, *, image: str, target: str, started: datetime, **extra: str
) -> None:
    """Put the own Deployment in the state an update patch leaves (as if another manager
    instance had applied it): the new image and the update's annotations."""

    def edit(obj: dict[str, Any]) -> None:
        obj["spec"]["template"]["spec"]["containers"][0]["image"] = image
        obj["metadata"].setdefault("annotations", {}).update(
            {PREVIOUS_IMAGE: f"{REPO}:0.1.0", TARGET: target, TARGET_IMAGE: image,
             STARTED: stamp(started), **extra}
        )  # fmt: skip

    cluster.edit_deployment(OWN_NS, "workload-manager", edit)


async def update_applied(cluster: RealCluster, image: str) -> None:
    async def applied() -> bool:
        return image_of(cluster) == image

    await eventually(applied, within=5.0, step=0.01)


def patch_statuses(cluster: RealCluster) -> list[int]:
    return [r.status for r in cluster.requests if r.method == "PATCH"]


async def test_a_newer_version_is_applied_and_becomes_available(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    version_file[0].set(body=b'{"version": "0.2.0"}')
    await scheduled(runtime)
    assert image_of(cluster) == f"{REPO}:0.2.0"
    own = cluster.get_deployment(OWN_NS, "workload-manager")
    assert own is not None
    annotations = own["metadata"]["annotations"]
    assert annotations[PREVIOUS_IMAGE] == f"{REPO}:0.1.0"
    assert annotations["workload-manager.io/update-target"] == "0.2.0"
    assert annotations[CONFIRMED] == "0.2.0"  # the old pod saw the rollout finish
    # only the manager container changed
    assert own["spec"]["template"]["spec"]["containers"][1]["image"] == "busybox:1.36"
    assert runtime.metrics.self_updates.labels("available")._value.get() == 1


@pytest.mark.parametrize("published", [b"0.1.0", b"0.0.9", b'{"version": "0.1.0"}'])
async def test_the_same_or_an_older_version_changes_nothing(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any],
    published: bytes,
) -> None:  # fmt: skip
    version_file[0].set(body=published)
    cluster.clear_requests()
    await scheduled(runtime)
    assert image_of(cluster) == f"{REPO}:0.1.0"
    assert [r for r in cluster.requests if r.method != "GET"] == []
    last = updater(runtime).last
    assert last is not None and last["decision"] == "noop"


@pytest.mark.parametrize(
    ("status", "body", "delay", "says"),
    [
        (200, b"<html>oops</html>", 0.0, "not a version"),
        (404, b"", 0.0, "HTTP 404"),
        (500, b"", 0.0, "HTTP 500"),
        (200, b"0.9.0", 3.0, "timed out"),
    ],
)
async def test_unreadable_version_files_change_nothing_and_say_why(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any],
    status: int, body: bytes, delay: float, says: str,
) -> None:  # fmt: skip
    version_file[0].set(status=status, body=body, delay=delay)
    cluster.clear_requests()
    await scheduled(runtime)
    assert image_of(cluster) == f"{REPO}:0.1.0"
    assert [r for r in cluster.requests if r.method != "GET"] == []
    component = runtime.components["self_update"]
    assert component.state == "failing" and says in (component.last_error or "")


async def test_a_retry_after_puts_the_next_check_off_and_says_until_when(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    """A 429 with `Retry-After: 30`: the check fails, nothing changes, and it asks for its
    next run in 30 s and a little jitter; a check before then reads nothing."""
    version_file[0].set(status=429, body=b"slow down", retry_after="30")
    outcome = await scheduled(runtime)
    assert outcome.retry_in is not None and 30.0 <= outcome.retry_in <= 33.0
    assert "Retry-After until " in (outcome.error or "")
    version_file[0].set(body=b"0.9.0")  # published meanwhile: not read before the time
    again = await scheduled(runtime)
    assert "not sent: Retry-After until " in (again.error or "")
    assert image_of(cluster) == f"{REPO}:0.1.0"


async def test_an_image_that_never_gets_ready_is_rolled_back_and_skipped_after(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    version_file[0].set(body=BAD.encode())
    await scheduled(runtime)
    assert image_of(cluster) == f"{REPO}:0.1.0"
    own = cluster.get_deployment(OWN_NS, "workload-manager")
    assert own is not None
    assert own["metadata"]["annotations"][FAILED_VERSIONS] == BAD
    assert "rolled back" in (runtime.components["self_update"].last_error or "")
    assert any("rolled back" in a.text for a in runtime.alerts.recent)
    cluster.clear_requests()
    await scheduled(runtime)
    assert [r for r in cluster.requests if r.method != "GET"] == []
    last = updater(runtime).last
    assert last is not None and last["decision"] == "skip" and "failed before" in last["reason"]


async def test_only_the_configured_repository_is_taken(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    version_file[0].set(body=b'{"version": "9.9.9", "image": "evil.example/wm:9.9.9"}')
    cluster.clear_requests()
    await scheduled(runtime)
    assert image_of(cluster) == f"{REPO}:0.1.0"
    assert [r for r in cluster.requests if r.method != "GET"] == []


def non_get_requests(cluster: RealCluster) -> list[str]:
    return [f"{r.method} {r.path}" for r in cluster.requests if r.method != "GET"]


@pytest.mark.parametrize(
    ("published", "says"),
    [
        # a newer version naming an older image: it would downgrade, then re-confirm forever
        ({"version": "9.9.9", "image": f"{REPO}:0.0.1"}, "tag '0.0.1' is not the version 9.9.9"),
        # a pre-release image under a release version
        ({"version": "0.2.0", "image": f"{REPO}:0.2.0-rc1"},
         "tag '0.2.0-rc1' is not the version 0.2.0"),
        ({"version": "0.2.0", "image": f"{REPO}:latest"}, "tag 'latest' is not the version"),
        ({"version": "0.2.0", "image": f"{REPO}:0.1.0@{DIGEST}"},
         "tag '0.1.0' is not the version 0.2.0"),
        ({"version": "0.2.0", "image": f"{REPO}@sha256:1234"}, "not sha256:<64 lowercase hex"),
    ],
)  # fmt: skip
async def test_an_image_that_is_not_the_published_version_is_refused(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any],
    published: dict[str, str], says: str,
) -> None:  # fmt: skip
    version_file[0].set(body=json.dumps(published).encode())
    cluster.clear_requests()
    await scheduled(runtime)
    assert image_of(cluster) == f"{REPO}:0.1.0"
    assert non_get_requests(cluster) == []
    last = updater(runtime).last
    assert last is not None and last["decision"] == "skip" and says in last["reason"], last


@pytest.mark.parametrize("image", [f"{REPO}@{DIGEST}", f"{REPO}:0.2.0@{DIGEST}"])
async def test_a_pinned_digest_is_patched_as_published_and_then_is_the_running_version(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any],
    image: str,
) -> None:  # fmt: skip
    version_file[0].set(body=json.dumps({"version": "0.2.0", "image": image}).encode())
    await scheduled(runtime)
    assert image_of(cluster) == image
    annotations = annotations_of(cluster)
    assert annotations[CONFIRMED] == "0.2.0"
    assert (annotations[HIGHEST], annotations[HIGHEST_IMAGE]) == ("0.2.0", image)
    cluster.clear_requests()
    await scheduled(runtime)  # the digest runs 0.2.0: nothing more to do
    assert non_get_requests(cluster) == []
    last = updater(runtime).last
    assert last is not None and last["decision"] == "noop" and last["running"] == "0.2.0", last


async def test_a_confirmation_records_the_highest_version_on_the_deployment(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any],
    fresh_updater: SelfUpdater,
) -> None:  # fmt: skip
    version_file[0].set(body=b"0.2.0")
    await scheduled(runtime)
    annotations = annotations_of(cluster)
    assert (annotations[HIGHEST], annotations[HIGHEST_IMAGE]) == ("0.2.0", f"{REPO}:0.2.0")
    # the pod moved back to 0.1.0 outside the self-update, and a manager that starts
    # afresh (only the Deployment remembers) is offered 0.1.5: refused
    cluster.edit_deployment(
        OWN_NS, "workload-manager",
        lambda obj: obj["spec"]["template"]["spec"]["containers"][0].update(image=f"{REPO}:0.1.0"),
    )  # fmt: skip
    version_file[0].set(body=b"0.1.5")
    cluster.clear_requests()
    await scheduled(runtime, fresh_updater)
    assert non_get_requests(cluster) == []
    last = fresh_updater.last
    assert last is not None and last["decision"] == "skip", last
    assert "0.1.5 is below 0.2.0, the highest version confirmed on this node" in last["reason"]


def with_floor(cluster: RealCluster, version: str, image: str) -> None:
    """The annotations an earlier confirmation of `version` left on the own Deployment."""
    cluster.edit_deployment(
        OWN_NS, "workload-manager",
        lambda obj: obj["metadata"].setdefault("annotations", {}).update(
            {HIGHEST: version, HIGHEST_IMAGE: image}
        ),
    )  # fmt: skip


async def test_a_version_below_the_highest_confirmed_one_is_refused_and_nothing_patched(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    # 0.3.0 was confirmed here once; the node now runs 0.1.0 (moved back by hand)
    with_floor(cluster, "0.3.0", f"{REPO}:0.3.0")
    for published, says in [
        (b"0.2.0", "0.2.0 is below 0.3.0, the highest version confirmed on this node"),
        (json.dumps({"version": "0.3.0", "image": f"{REPO}@{DIGEST}"}).encode(),
         f"0.3.0 was confirmed on this node as '{REPO}:0.3.0'"),
    ]:  # fmt: skip
        version_file[0].set(body=published)
        cluster.clear_requests()
        await scheduled(runtime)
        assert non_get_requests(cluster) == []
        assert image_of(cluster) == f"{REPO}:0.1.0"
        last = updater(runtime).last
        assert last is not None and last["decision"] == "skip" and says in last["reason"], last
    # the confirmed version itself, as it was confirmed, is taken
    version_file[0].set(body=b"0.3.0")
    await scheduled(runtime)
    assert image_of(cluster) == f"{REPO}:0.3.0"
    assert annotations_of(cluster)[HIGHEST] == "0.3.0"


SIGNED = pytest.mark.parametrize(
    "runtime", [{"self_update_public_key": RELEASE_PUBLIC}], indirect=True, ids=["signed"]
)


def sig(key: Ed25519PrivateKey, body: bytes) -> bytes:
    return base64.b64encode(key.sign(body))


@SIGNED
@pytest.mark.parametrize(
    ("make_sig", "says"),
    [
        (lambda body: None, "HTTP 404 (SELF_UPDATE_PUBLIC_KEY is set: the version file must be "
         "signed); nothing decided"),
        (lambda body: b"garbage", "not the base64 of a 64-byte Ed25519 signature"),
        (lambda body: sig(Ed25519PrivateKey.from_private_bytes(b"\x07" * 32), body),
         "does not verify the version file with the key in SELF_UPDATE_PUBLIC_KEY"),
        (lambda body: sig(RELEASE_KEY, b"0.2.0"), "does not verify"),  # another file's
    ],
)  # fmt: skip
async def test_with_a_public_key_a_file_without_its_valid_signature_changes_nothing(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any],
    make_sig: Any, says: str,
) -> None:  # fmt: skip
    body = json.dumps({"version": "0.2.0", "image": f"{REPO}:0.2.0"}).encode()
    version_file[0].set(body=body, sig=make_sig(body))
    cluster.clear_requests()
    await scheduled(runtime)
    assert image_of(cluster) == f"{REPO}:0.1.0"
    assert non_get_requests(cluster) == []
    assert updater(runtime).last is None  # nothing was decided
    component = runtime.components["self_update"]
    assert component.state == "failing" and says in (component.last_error or ""), component
    assert (component.last_error or "").startswith("signature of ")


@SIGNED
async def test_with_a_public_key_a_validly_signed_file_is_applied(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    body = b'{"version": "0.2.0"}\n'
    version_file[0].set(body=body, sig=sig(RELEASE_KEY, body))
    await scheduled(runtime)
    assert image_of(cluster) == f"{REPO}:0.2.0"
    assert annotations_of(cluster)[CONFIRMED] == "0.2.0"


# --- the version file's rollout, and the window: they gate starting an update only

# a window that is closed now (it opens in two hours, for one): a check that met it
# while these tests run would be refused an update
_OPENS = datetime.now(UTC) + timedelta(hours=2)
CLOSED_WINDOW = pytest.mark.parametrize(
    "runtime",
    [{"self_update_window": json.dumps({
        "start": f"{_OPENS:%H:%M}", "end": f"{_OPENS + timedelta(hours=1):%H:%M}",
        "tz": "UTC"})}],
    indirect=True, ids=["window-closed"],
)  # fmt: skip


@pytest.mark.parametrize(
    ("rollout", "decision", "says"),
    [
        ({"percent": 0}, "waiting-wave", "≥ 0 %"),
        ({"percent": 100, "halt": True}, "halted", "the rollout is halted"),
    ],
)
async def test_a_node_outside_the_wave_or_a_halted_rollout_starts_nothing_and_says_so(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any],
    rollout: dict[str, Any], decision: str, says: str,
) -> None:  # fmt: skip
    version_file[0].set(body=json.dumps({"version": "0.2.0", "rollout": rollout}).encode())
    cluster.clear_requests()
    await scheduled(runtime)
    assert image_of(cluster) == f"{REPO}:0.1.0"
    assert non_get_requests(cluster) == []
    # what /v1/status shows for the component: its state, and why
    shown = ComponentInfo(**runtime.components["self_update"].as_dict())
    assert shown.state == "ok", shown
    assert shown.detail["decision"] == decision and says in shown.detail["reason"], shown
    assert shown.detail["published"] == "0.2.0"
    # the wave reaches every node: the update starts
    version_file[0].set(body=b'{"version": "0.2.0", "rollout": {"percent": 100}}')
    await scheduled(runtime)
    assert image_of(cluster) == f"{REPO}:0.2.0"
    assert annotations_of(cluster)[CONFIRMED] == "0.2.0"
    assert "(place " in (updater(runtime).last or {})["reason"]


@pytest.mark.parametrize("runtime", [{"node_id": "node-b"}], indirect=True, ids=["node-b"])
async def test_the_node_is_placed_in_the_wave_by_its_id(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    where = place(seed_for("workload-manager", "0.2.0", None), "node-b")
    version_file[0].set(body=json.dumps({"version": "0.2.0", "rollout": {"percent": where}})
                        .encode())  # fmt: skip
    await scheduled(runtime)
    last = updater(runtime).last
    assert last is not None and last["decision"] == "waiting-wave", last
    assert last["reason"] == f"place {math.floor(where * 10) / 10:g} ≥ {where:g} %"
    version_file[0].set(
        body=json.dumps({"version": "0.2.0", "rollout": {"percent": where + 0.01}}).encode()
    )
    await scheduled(runtime)
    assert image_of(cluster) == f"{REPO}:0.2.0"


async def test_a_bad_rollout_in_the_version_file_changes_nothing_and_names_the_field(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    version_file[0].set(body=b'{"version": "0.2.0", "rollout": {"percent": 200}}')
    cluster.clear_requests()
    await scheduled(runtime)
    assert non_get_requests(cluster) == []
    component = runtime.components["self_update"]
    assert component.state == "failing"
    assert "version file `rollout.percent`" in (component.last_error or ""), component


@CLOSED_WINDOW
async def test_a_halt_or_a_closed_window_leaves_an_owed_rollback_to_be_done(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    version_file[0].set(body=json.dumps({"version": BAD, "rollout": {"halt": True}}).encode())
    as_left_by_an_update(
        cluster, image=f"{REPO}:{BAD}", target=BAD,
        started=datetime.now(UTC) - timedelta(hours=1),
    )  # fmt: skip
    await scheduled(runtime)
    last = updater(runtime).last
    assert last is not None and last["decision"] == "rollback", last
    assert image_of(cluster) == f"{REPO}:0.1.0"
    assert annotations_of(cluster)[FAILED_VERSIONS] == BAD
    # and a new version is not started: halted (the window would refuse it too)
    version_file[0].set(body=b'{"version": "0.2.0", "rollout": {"halt": true}}')
    await scheduled(runtime)
    last = updater(runtime).last
    assert last is not None and last["decision"] == "halted", last
    version_file[0].set(body=b'{"version": "0.2.0"}')
    await scheduled(runtime)
    last = updater(runtime).last
    assert last is not None and last["decision"] == "skip", last
    assert "outside the maintenance window" in last["reason"]
    assert image_of(cluster) == f"{REPO}:0.1.0"


@CLOSED_WINDOW
async def test_a_halt_or_a_closed_window_leaves_an_owed_confirmation_to_be_made(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    version_file[0].set(body=b'{"version": "0.2.0", "rollout": {"halt": true}}')
    as_left_by_an_update(cluster, image=f"{REPO}:0.2.0", target="0.2.0", started=datetime.now(UTC))
    assert await resumed(runtime) == "available"
    assert annotations_of(cluster)[CONFIRMED] == "0.2.0"
    assert image_of(cluster) == f"{REPO}:0.2.0"


# --- the min healthy time: confirmed only once the new pod stayed available that long


def min_healthy(seconds: float) -> pytest.MarkDecorator:
    return pytest.mark.parametrize(
        "runtime", [{"self_update_min_healthy_seconds": seconds}], indirect=True,
        ids=[f"min-healthy-{seconds:g}"],
    )  # fmt: skip


async def first_seen_available(cluster: RealCluster) -> None:
    """Until the updater recorded when it first saw the new ReplicaSet available."""

    async def marked() -> bool:
        return AVAILABLE_SINCE in annotations_of(cluster)

    await eventually(marked, within=30.0, step=0.02)


def turn_unready(cluster: RealCluster, image: str) -> None:
    """The running pod of `image` fails its readiness probe, as the kubelet reports it."""
    (pod,) = [
        p for p in cluster.pods(OWN_NS, "app=wm")
        if p["spec"]["containers"][0]["image"] == image
        and not p["metadata"].get("deletionTimestamp")
    ]  # fmt: skip
    cluster.set_pod_status(OWN_NS, pod["metadata"]["name"], {"conditions": [
        {"type": "PodScheduled", "status": "True"}, {"type": "Initialized", "status": "True"},
        {"type": "ContainersReady", "status": "False"}, {"type": "Ready", "status": "False"},
    ]})  # fmt: skip


async def rolled_out(cluster: RealCluster) -> None:
    async def ready() -> bool:
        own = cluster.get_deployment(OWN_NS, "workload-manager") or {}
        return rollout_of(own).phase is RolloutPhase.READY

    await eventually(ready, within=30.0, step=0.02)


@min_healthy(3)
async def test_an_update_is_confirmed_once_it_stayed_available_its_min_healthy_time(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    version_file[0].set(body=b"0.2.0")
    run = asyncio.create_task(scheduled(runtime))
    await first_seen_available(cluster)
    seen = time.monotonic()
    assert CONFIRMED not in annotations_of(cluster), "confirmed before its min healthy time"
    assert not run.done()
    outcome = await asyncio.wait_for(run, timeout=60)
    assert outcome.detail["update"] == "available", outcome
    # the updater saw it available a moment before this test did
    assert time.monotonic() - seen >= 3 - 1
    annotations = annotations_of(cluster)
    assert annotations[CONFIRMED] == "0.2.0" and annotations[HIGHEST] == "0.2.0"
    assert runtime.components["self_update"].state == "ok"


@min_healthy(3)
async def test_writes_to_the_deployment_during_its_min_healthy_time_are_not_unavailability(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    """A Deployment's generation moves with its annotations (the available-since mark the
    updater writes is one, an operator's `kubectl annotate` another): until the controller
    has looked again its status is of the spec before, which says nothing about the new
    pod. Such a status is waited out, never judged "became unavailable"."""
    version_file[0].set(body=b"0.2.0")
    run = asyncio.create_task(scheduled(runtime))
    await first_seen_available(cluster)
    for i in range(12):  # annotations written through the min healthy time
        cluster.plane.kubectl(
            "-n", OWN_NS, "annotate", "--overwrite", "deployment", "workload-manager",
            f"example.com/touched={i}",
        )  # fmt: skip
        if run.done():
            break
    outcome = await asyncio.wait_for(run, timeout=60)
    assert outcome.detail["update"] == "available", outcome
    assert annotations_of(cluster)[CONFIRMED] == "0.2.0"


@min_healthy(600)
async def test_a_new_pod_that_turns_unready_within_its_min_healthy_time_is_rolled_back(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    version_file[0].set(body=b"0.2.0")
    run = asyncio.create_task(scheduled(runtime))
    await first_seen_available(cluster)
    assert CONFIRMED not in annotations_of(cluster) and not run.done()
    turn_unready(cluster, f"{REPO}:0.2.0")
    outcome = await asyncio.wait_for(run, timeout=60)  # not the 600 s
    assert outcome.detail["update"] == "rolled-back", outcome
    # exactly as a failed update: the previous image back, the version failed, an alert
    assert image_of(cluster) == f"{REPO}:0.1.0"
    annotations = annotations_of(cluster)
    assert annotations[FAILED_VERSIONS] == "0.2.0"
    assert not {TARGET, AVAILABLE_SINCE, CONFIRMED, HIGHEST} & set(annotations), annotations
    error = runtime.components["self_update"].last_error or ""
    assert "update to 0.2.0 rolled back" in error and "became unavailable" in error, error
    assert any(a.key == "self-update:rolled-back:0.2.0" for a in runtime.alerts.recent)
    assert runtime.metrics.self_updates.labels("rolled-back")._value.get() == 1
    await scheduled(runtime)
    last = updater(runtime).last
    assert last is not None and last["decision"] == "skip" and "failed before" in last["reason"]


@min_healthy(600)
async def test_a_starting_manager_rolls_back_an_update_unavailable_after_it_was_available(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    """The manager that saw the new pod available went (the old pod ends once the new one
    is available); the new pod is not available now: the update failed, at once, not at
    its deadline."""
    version_file[0].set(status=500)  # not read: what is owed is done without it
    now = datetime.now(UTC)
    as_left_by_an_update(
        cluster, image=f"{REPO}:{BAD}", target=BAD, started=now,
        **{AVAILABLE_SINCE: stamp(now)},
    )  # fmt: skip
    assert await resumed(runtime) == "rolled-back"
    assert image_of(cluster) == f"{REPO}:0.1.0"
    assert annotations_of(cluster)[FAILED_VERSIONS] == BAD
    assert "became unavailable" in (runtime.components["self_update"].last_error or "")


@min_healthy(600)
async def test_a_starting_manager_continues_the_min_healthy_time_recorded_before_it(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    """Seen available 700 s ago by the manager before, and available now: the 600 s are
    over, so it is confirmed at once (a manager that started the time again would wait
    600 s)."""
    version_file[0].set(status=500)
    now = datetime.now(UTC)
    as_left_by_an_update(
        cluster, image=f"{REPO}:0.2.0", target="0.2.0", started=now - timedelta(seconds=710),
        **{AVAILABLE_SINCE: stamp(now - timedelta(seconds=700))},
    )  # fmt: skip
    await rolled_out(cluster)
    assert await asyncio.wait_for(resumed(runtime), timeout=30) == "available"
    assert annotations_of(cluster)[CONFIRMED] == "0.2.0"


async def test_sync_and_self_update_never_overlap(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    # an image that never gets ready keeps the update watching until its deadline
    version_file[0].set(body=WORSE.encode())
    update = asyncio.create_task(scheduled(runtime))
    await update_applied(cluster, f"{REPO}:{WORSE}")
    syncing = runtime.get(SYNC)
    assert syncing is not None
    with pytest.raises(SyncBusy):
        await syncing.syncer.sync()
    await update
    async with runtime.cluster_lock:
        decision = await updater(runtime).check()
        with pytest.raises(SelfUpdateBusy):
            await updater(runtime).update(decision)


async def test_a_rollback_that_fails_transiently_is_retried_with_backoff_until_it_lands(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any],
    fresh_updater: SelfUpdater, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.WARNING, logger="app.services.updating")
    version_file[0].set(body=BAD.encode())
    run = asyncio.create_task(scheduled(runtime, fresh_updater))
    await update_applied(cluster, f"{REPO}:{BAD}")
    cluster.clear_requests()
    cluster.fail_next("PATCH", OWN, status=503, times=3, message="etcdserver: leader changed")
    await run
    assert patch_statuses(cluster) == [503, 503, 503, 200]
    assert image_of(cluster) == f"{REPO}:0.1.0"
    annotations = annotations_of(cluster)
    assert annotations[FAILED_VERSIONS] == BAD and TARGET not in annotations
    # each failed attempt was followed by a longer (exponential) wait before the next one
    waits = [r.next_wait for r in caplog.records if hasattr(r, "next_wait")]
    assert len(waits) == 3 and 0 < waits[0] < waits[1] < waits[2], waits
    assert "rolled back" in (runtime.components["self_update"].last_error or "")


async def fail_every_rollback(
    runtime: Runtime, cluster: RealCluster, versions: VersionFileServer, updater: SelfUpdater
) -> None:
    """Publish BAD (an image that never becomes ready), and let every rollback patch
    fail; returns when the scheduled run gave up (it does not raise)."""
    versions.set(body=BAD.encode())
    run = asyncio.create_task(scheduled(runtime, updater))
    await update_applied(cluster, f"{REPO}:{BAD}")
    cluster.clear_requests()
    cluster.fail_next("PATCH", OWN, status=503, times=10_000)
    await run


async def test_a_rollback_that_keeps_failing_is_bounded_shown_and_alerted(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any],
    fresh_updater: SelfUpdater,
) -> None:  # fmt: skip
    started = time.monotonic()
    await fail_every_rollback(runtime, cluster, version_file[0], fresh_updater)  # nor forever
    # the controller's verdict (progressDeadlineSeconds), then retries for up to DEADLINE
    assert time.monotonic() - started < PROGRESS_DEADLINE + 2 * DEADLINE
    assert len(patch_statuses(cluster)) > 2 and set(patch_statuses(cluster)) == {503}
    assert image_of(cluster) == f"{REPO}:{BAD}"
    # what /v1/status shows for the component
    shown = ComponentInfo(**runtime.components["self_update"].as_dict())
    assert shown.state == "failing"
    assert shown.last_error is not None and "rollback" in shown.last_error
    assert "failed" in shown.last_error and f"{REPO}:0.1.0" in shown.last_error
    assert shown.detail.get("owed") == "rollback"
    assert any(
        a.key == f"self-update:rollback-failed:{BAD}" and "rollback" in a.text
        for a in runtime.alerts.recent
    )
    assert runtime.metrics.self_updates.labels("rollback-failed")._value.get() == 1


async def test_the_check_after_a_failed_rollback_performs_it(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any],
    fresh_updater: SelfUpdater,
) -> None:  # fmt: skip
    await fail_every_rollback(runtime, cluster, version_file[0], fresh_updater)
    assert image_of(cluster) == f"{REPO}:{BAD}"  # the rollback did not land
    cluster.clear_faults()
    cluster.clear_requests()
    await scheduled(runtime, fresh_updater)
    last = fresh_updater.last
    assert last is not None and last["decision"] == "rollback", last
    assert image_of(cluster) == f"{REPO}:0.1.0"
    annotations = annotations_of(cluster)
    assert annotations[FAILED_VERSIONS] == BAD and TARGET not in annotations
    assert "rolled back" in (runtime.components["self_update"].last_error or "")
    # and from then on the failed version is skipped
    await scheduled(runtime, fresh_updater)
    last = fresh_updater.last
    assert last is not None and last["decision"] == "skip" and "failed before" in last["reason"]


async def test_a_starting_manager_resumes_watching_an_update_and_confirms_it(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    version_file[0].set(body=b"0.2.0")
    as_left_by_an_update(cluster, image=f"{REPO}:0.2.0", target="0.2.0", started=datetime.now(UTC))
    cluster.clear_requests()
    await scheduled(runtime)  # the first run of a freshly started manager
    last = updater(runtime).last
    assert last is not None and last["decision"] == "watch", last
    # it returned only once the rollout had finished, and confirmed it
    assert rollout_of(cluster.get_deployment(OWN_NS, "workload-manager") or {}).phase is (
        RolloutPhase.READY
    )
    assert annotations_of(cluster)[CONFIRMED] == "0.2.0"
    assert image_of(cluster) == f"{REPO}:0.2.0"
    assert runtime.components["self_update"].state == "ok"
    await scheduled(runtime)
    last = updater(runtime).last
    assert last is not None and last["decision"] == "noop"


async def test_a_starting_manager_resumes_watching_an_update_and_rolls_it_back(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    version_file[0].set(body=BAD.encode())
    # a second ahead: the annotation has whole seconds, and the watch should get its whole
    # deadline (a start in the future counts as now), so it is the Deployment that says why
    as_left_by_an_update(
        cluster, image=f"{REPO}:{BAD}", target=BAD,
        started=datetime.now(UTC) + timedelta(seconds=1),
    )  # fmt: skip
    assert await resumed(runtime) == "rolled-back"
    assert image_of(cluster) == f"{REPO}:0.1.0"
    annotations = annotations_of(cluster)
    assert annotations[FAILED_VERSIONS] == BAD and TARGET not in annotations
    assert "ProgressDeadlineExceeded" in (runtime.components["self_update"].last_error or "")
    assert any("rolled back" in a.text for a in runtime.alerts.recent)


async def test_a_starting_manager_finishes_an_interrupted_rollback(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    # the update's deadline passed while no manager was watching (the one that owed the
    # rollback died); the version file is unreadable, which must not matter
    version_file[0].set(status=500)
    as_left_by_an_update(
        cluster, image=f"{REPO}:{BAD}", target=BAD,
        started=datetime.now(UTC) - timedelta(hours=1),
    )  # fmt: skip
    cluster.clear_requests()
    await scheduled(runtime)
    last = updater(runtime).last
    assert last is not None and last["decision"] == "rollback", last
    assert image_of(cluster) == f"{REPO}:0.1.0"
    annotations = annotations_of(cluster)
    assert annotations[FAILED_VERSIONS] == BAD and TARGET not in annotations
    assert f"within {DEADLINE:.0f} s" in (runtime.components["self_update"].last_error or "")


async def test_a_starting_manager_records_a_rollback_done_outside_it(
    runtime: Runtime, cluster: RealCluster, version_file: tuple[VersionFileServer, Any]
) -> None:
    # the image is back at the previous one (`kubectl rollout undo`, or a rollback whose
    # bookkeeping was lost) but the annotations still say an update is in flight
    version_file[0].set(body=BAD.encode())
    as_left_by_an_update(cluster, image=f"{REPO}:{BAD}", target=BAD, started=datetime.now(UTC))
    cluster.edit_deployment(
        OWN_NS,
        "workload-manager",
        lambda obj: obj["spec"]["template"]["spec"]["containers"][0].update(image=f"{REPO}:0.1.0"),
    )
    cluster.clear_requests()
    assert await resumed(runtime) == "rolled-back"
    patches = [r for r in cluster.requests if r.method == "PATCH"]
    assert len(patches) == 1 and "spec" not in patches[0].body  # bookkeeping only
    annotations = annotations_of(cluster)
    assert annotations[FAILED_VERSIONS] == BAD and TARGET not in annotations
    await scheduled(runtime)
    last = updater(runtime).last
    assert last is not None and last["decision"] == "skip" and "failed before" in last["reason"]


async def test_outside_a_cluster_self_update_is_off(make_settings: SettingsFactory) -> None:
    rt = build_runtime(make_settings(self_update_url="https://example.invalid/version"))
    component = rt.components["self_update"]
    assert component.enabled is False
    assert "not running in a cluster" in component.reason


# -- the version file's size limit, against a real local server ---------------------------


class OversizedFiles:
    """/endless: a chunked body that never ends; /sized/N: N bytes with a Content-Length.
    Counts what it sent, and whether a body is still being sent."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent = 0
        self.sending = 0
        self.app = Starlette(routes=[Route("/endless", self._endless),
                                     Route("/sized/{size:int}", self._sized)])  # fmt: skip

    async def _body(self, size: int | None) -> AsyncIterator[bytes]:
        with self.lock:
            self.sending += 1
        try:
            left = size
            while left is None or left > 0:
                chunk = b"9" * (1024 if left is None else min(1024, left))
                with self.lock:
                    self.sent += len(chunk)
                yield chunk
                left = None if left is None else left - len(chunk)
                await asyncio.sleep(0)
        finally:
            with self.lock:
                self.sending -= 1

    async def _endless(self, request: Request) -> StreamingResponse:
        return StreamingResponse(self._body(None))

    async def _sized(self, request: Request) -> StreamingResponse:
        size: int = request.path_params["size"]
        return StreamingResponse(self._body(size), headers={"Content-Length": str(size)})

    async def done_sending(self) -> bool:
        with self.lock:
            return self.sending == 0


@pytest.fixture(scope="module")
def oversized() -> Iterator[tuple[OversizedFiles, ThreadedServer]]:
    files = OversizedFiles()
    with serve(files.app) as server:
        yield files, server


async def fetch_once(url: str) -> bytes:
    source = VersionFile(url, timeout=2.0)
    try:
        # bounded, so that a read that never stops fails the test instead of hanging it
        return await asyncio.wait_for(source.fetch(), timeout=20)
    finally:
        await source.aclose()


@pytest.mark.parametrize(
    "path", ["/endless", f"/sized/{MAX_VERSION_FILE_BYTES + 1}", f"/sized/{256 * 1024 * 1024}"]
)
async def test_a_version_file_is_read_only_up_to_its_limit(
    oversized: tuple[OversizedFiles, ThreadedServer], path: str
) -> None:
    files, server = oversized
    with files.lock:
        files.sent = 0
    with pytest.raises(VersionSourceError, match=f"larger than {MAX_VERSION_FILE_BYTES} bytes"):
        await fetch_once(f"{server.url}{path}")
    # the server saw the connection go: it stopped sending, after what the socket buffers
    # took, not after the body (which has no end, or is 256 MiB)
    await eventually(files.done_sending)
    with files.lock:
        assert files.sent < 16 * 1024 * 1024


async def test_a_version_file_of_exactly_the_limit_is_read(
    oversized: tuple[OversizedFiles, ThreadedServer],
) -> None:
    _files, server = oversized
    body = await fetch_once(f"{server.url}/sized/{MAX_VERSION_FILE_BYTES}")
    assert body == b"9" * MAX_VERSION_FILE_BYTES
