"""Safe rollout on the real control plane (kube-apiserver, the deployment controller, kwok
making pods ready), with the contract-enforcing local backend, the manager's own
ServiceAccount token, and the test pinging as the workload: an update judged healthy,
reverted for each way it fails, resumed by a restarted manager, waved over two managers
and halted, and held back by a workload that asks to wait."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from app.domain.health import Ping, PingStatus
from app.domain.manifests import VERSION_ANNOTATION
from app.domain.reports import UpdateView
from app.domain.rollout import place
from app.domain.rollout_machine import RECORD_ANNOTATION
from app.services.runtime import Runtime, build_runtime, open_sync_only
from app.services.syncing import Syncer
from standins.backend import LocalBackend
from standins.control_plane import ControlPlane
from standins.servers import ThreadedServer
from standins.sync_world import KEY, NAMESPACE, NODE, key_seed, manifest
from tests.conftest import SettingsFactory
from tests.support.polling import eventually

# short enough for a test, within the desired state's bounds
FAST = {"min_healthy_seconds": 2, "deadline_seconds": 10}


@dataclass
class Manager:
    runtime: Runtime
    syncer: Syncer

    def ping(
        self, name: str, status: str = "healthy", version: str | None = None, **more: Any
    ) -> None:
        self.runtime.book.record(name, Ping(status=PingStatus(status), version=version, **more))

    def update(self, name: str) -> UpdateView | None:
        view = self.runtime.book.view(name)
        return view.update if view is not None else None

    async def until(
        self, name: str, states: set[str], *, ping: Callable[[], None] | None = None
    ) -> UpdateView:
        """Look (as the judge's timer does) until the update is in one of `states`."""
        found: list[UpdateView] = []

        async def reached() -> bool:
            if ping is not None:
                ping()
            outcome = await self.syncer.sync(fetch=False)
            assert outcome.ok, outcome.as_dict()
            view = self.update(name)
            if view is not None and view.state in states:
                found.append(view)
                return True
            return False

        await eventually(reached, within=60, step=0.2)
        return found[0]


@pytest.fixture
async def open_manager(
    control_plane: ControlPlane,
    manager_kubeconfig: Path,
    make_settings: SettingsFactory,
) -> AsyncIterator[Callable[..., Any]]:
    async with AsyncExitStack() as stack:

        @asynccontextmanager
        async def opened(
            server: ThreadedServer, node: str = NODE, **overrides: Any
        ) -> AsyncIterator[Manager]:
            settings = make_settings(
                node_id=node, node_system_endpoint=server.url, node_private_key=key_seed(),
                kubeconfig=manager_kubeconfig, managed_namespace=NAMESPACE,
                backend_retry_attempts=1, backend_timeout_seconds=5.0, kube_timeout_seconds=10.0,
                ping_token_secret="rollout-ping-secret", workload_update_unhealthy_seconds=1.0,
                **overrides,
            )  # fmt: skip
            runtime = build_runtime(settings)
            async with AsyncExitStack() as own:
                syncer = await open_sync_only(runtime, own)
                assert syncer is not None, runtime.components["sync"].reason
                yield Manager(runtime, syncer)

        async def start(server: ThreadedServer, node: str = NODE, **overrides: Any) -> Manager:
            return await stack.enter_async_context(opened(server, node, **overrides))

        start.scoped = opened  # type: ignore[attr-defined]
        yield start


@pytest.fixture
def backend_reset(
    control_plane: ControlPlane, backend_server: tuple[LocalBackend, ThreadedServer]
) -> tuple[LocalBackend, ThreadedServer]:
    backend, server = backend_server
    backend.reset()
    control_plane.kubectl("-n", NAMESPACE, "delete", "deployments", "--all", "--wait=true")
    return backend, server


def desire(backend: LocalBackend, name: str, version: str, **fields: Any) -> None:
    backend.set_manifest(name, version, fields.pop("manifest", None) or manifest(name, version))
    backend.set_desired([{"name": name, "version": version, **fields}])


def deployed(cluster: ControlPlane, name: str) -> dict[str, Any]:
    found = cluster.get("deployment", name, NAMESPACE)
    assert found is not None
    return found


def image(obj: dict[str, Any]) -> str:
    return str(obj["spec"]["template"]["spec"]["containers"][0]["image"])


def env_of(obj: dict[str, Any]) -> dict[str, str]:
    container = obj["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def outcomes(backend: LocalBackend, name: str) -> list[tuple[str, str]]:
    return [(b["version"], b.get("outcome", "")) for n, b in backend.versions if n == name]


async def installed(manager: Manager, backend: LocalBackend, version: str = "1.0.0") -> None:
    desire(backend, "api", version, update=FAST)
    first = await manager.syncer.sync()
    assert first.ok, first.as_dict()


async def test_a_version_that_pings_healthy_with_its_version_is_judged_healthy(
    open_manager: Any, backend_reset: tuple[LocalBackend, ThreadedServer], control_plane: Any
) -> None:
    backend, server = backend_reset
    manager = await open_manager(server)
    await installed(manager, backend)
    manager.ping("api", version="1.0.0")
    desire(backend, "api", "1.1.0", update=FAST)
    applied = await manager.syncer.sync()
    assert [(r.action, r.outcome) for r in applied.results] == [("update", "applied")]
    obj = deployed(control_plane, "api")
    assert env_of(obj)["WORKLOAD_VERSION"] == "1.1.0"
    assert env_of(obj)["WORKLOAD_MANAGER_API"] == "2"
    assert '"state":"judging"' in obj["metadata"]["annotations"][RECORD_ANNOTATION]
    healthy = await manager.until(
        "api",
        {"healthy", "rolled-back", "held-failed"},
        ping=lambda: manager.ping("api", version="1.1.0"),
    )
    assert healthy.state == "healthy", healthy
    assert outcomes(backend, "api")[-2:] == [("1.1.0", "applied"), ("1.1.0", "healthy")]
    assert image(deployed(control_plane, "api")) == "registry.example/api:1.1.0"
    assert manager.runtime.alerts.recent == []


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("old-version", "never pinged"),
        ("unhealthy", "unhealthy pings from 1.1.0"),
        ("progress-deadline", "progress deadline"),
    ],
)
async def test_a_failing_version_is_reverted_to_the_last_good_one(
    open_manager: Any,
    backend_reset: tuple[LocalBackend, ThreadedServer],
    control_plane: ControlPlane,
    how: str,
    reason: str,
) -> None:
    backend, server = backend_reset
    manager = await open_manager(server)
    await installed(manager, backend)
    manager.ping("api", version="1.0.0")
    good = deployed(control_plane, "api")
    new = manifest("api", "1.1.0")
    update: dict[str, Any] = dict(FAST)
    if how == "progress-deadline":  # kwok never makes this image ready
        new = manifest("api", "1.1.0", image="registry.example/api:1.1.0-never-ready")
        new["spec"]["progressDeadlineSeconds"] = 2
        update = {"judge": "rollout", "min_healthy_seconds": 2, "deadline_seconds": 600}
    desire(backend, "api", "1.1.0", update=update, manifest=new)
    await manager.syncer.sync()
    pings = {
        "old-version": lambda: manager.ping("api", version="1.0.0"),
        "unhealthy": lambda: manager.ping("api", "unhealthy", version="1.1.0"),
        "progress-deadline": None,
    }[how]
    rolled = await manager.until("api", {"rolled-back", "healthy", "held-failed"}, ping=pings)
    assert rolled.state == "rolled-back", (rolled.reason, deployed(control_plane, "api")["status"])
    assert reason in rolled.reason
    assert rolled.failed_versions == ("1.1.0",)
    back = deployed(control_plane, "api")
    assert back["metadata"]["annotations"][VERSION_ANNOTATION] == "1.0.0"
    assert back["spec"]["template"] == good["spec"]["template"]
    (put,) = [b for n, b in backend.versions if b.get("outcome") == "rolled_back"]
    assert (put["version"], put["attempted_version"]) == ("1.0.0", "1.1.0")
    assert reason in put["reason"]
    assert [a.key for a in manager.runtime.alerts.recent] == ["rollout:api:1.1.0:rolled-back"]
    # the failed version is remembered: a full sync with the same desired state leaves it be
    again = await manager.syncer.sync()
    assert [(r.outcome, r.version) for r in again.results] == [("held", "1.1.0")]
    assert deployed(control_plane, "api")["metadata"]["annotations"][VERSION_ANNOTATION] == "1.0.0"
    if how == "unhealthy":  # the backend's retry: a new token, the version is tried again
        desire(backend, "api", "1.1.0", update={**update, "retry": "r1"}, manifest=new)
    else:  # an operator's retry on this node: the record removed
        control_plane.kubectl(
            "-n", NAMESPACE, "annotate", "deployment/api", f"{RECORD_ANNOTATION}-"
        )
    await manager.syncer.sync()  # (a revert being judged is judged first)
    retried = await manager.until(
        "api", {"judging"}, ping=lambda: manager.ping("api", version="1.0.0")
    )
    assert retried.failed_versions == ()
    assert _version(control_plane, "api") == "1.1.0"


async def test_a_manager_restarted_mid_judgement_reverts_exactly_once(
    open_manager: Any, backend_reset: tuple[LocalBackend, ThreadedServer], control_plane: Any
) -> None:
    backend, server = backend_reset
    async with open_manager.scoped(server) as first:
        await installed(first, backend)
        first.ping("api", version="1.0.0")
        desire(backend, "api", "1.1.0", update=FAST)
        await first.syncer.sync()
        judging = first.update("api")
        assert judging is not None and judging.state == "judging"
    # a new process: what it knows of the update comes from the Deployment
    second = await open_manager(server)
    rolled = await second.until(
        "api", {"rolled-back", "healthy"}, ping=lambda: second.ping("api", version="1.0.0")
    )
    assert rolled.state == "rolled-back", (rolled.reason, deployed(control_plane, "api")["status"])
    for _ in range(3):
        await second.syncer.sync()
    assert [o for o in outcomes(backend, "api") if o[1] == "rolled_back"] == [
        ("1.0.0", "rolled_back")
    ]
    assert len(second.runtime.alerts.recent) == 1


def _seed_between(early: str, late: str, percent: float) -> str:
    """A rollout seed that places `early` below `percent` and `late` at or above it."""
    for n in itertools.count():
        seed = f"api/wave-{n}"
        if place(seed, early) < percent <= place(seed, late):
            return seed
    raise AssertionError("unreachable")


async def test_two_managers_apply_in_wave_order_and_a_halt_stops_the_second(
    open_manager: Any,
    backend_reset: tuple[LocalBackend, ThreadedServer],
    control_plane: ControlPlane,
) -> None:
    backend, server = backend_reset
    other = LocalBackend("node-late", KEY.public_key())
    with other.serve() as other_server:
        seed = _seed_between(NODE, "node-late", 50)
        names = {"early": "api-early", "late": "api-late"}
        backends = {"early": backend, "late": other}
        managers = {
            "early": await open_manager(server, NODE, sync_max_deletes=0),
            "late": await open_manager(other_server, "node-late", sync_max_deletes=0),
        }

        def desire_all(version: str, **rollout: Any) -> None:
            for who, name in names.items():
                desire(backends[who], name, version, update=FAST,
                       rollout={"seed": seed, **rollout})  # fmt: skip

        async def sync_all() -> None:
            for who in ("early", "late"):
                gets = _gets(backends[who])
                assert (await managers[who].syncer.sync()).ok
                assert _gets(backends[who]) == gets + 1  # one GET of the desired state a sync

        desire_all("1.0.0")
        await sync_all()
        desire_all("1.1.0", percent=50)
        await sync_all()
        assert _version(control_plane, names["early"]) == "1.1.0"
        assert _version(control_plane, names["late"]) == "1.0.0"
        waiting = managers["late"].update(names["late"])
        assert waiting is not None and waiting.state == "waiting-wave"
        assert waiting.reason.startswith("place ") and "≥ 50 %" in waiting.reason
        assert place(seed, "node-late") == pytest.approx(waiting.place, abs=1e-3)
        desire_all("1.1.0", percent=100, halt=True)
        await sync_all()
        await sync_all()
        assert _version(control_plane, names["late"]) == "1.0.0"
        halted = managers["late"].update(names["late"])
        assert halted is not None and halted.state == "halted"
        desire_all("1.1.0", percent=100)
        await sync_all()
        assert _version(control_plane, names["late"]) == "1.1.0"


def _gets(backend: LocalBackend) -> int:
    return sum(1 for r in backend.requests if r.method == "GET" and r.path.endswith("/workloads"))


def _version(cluster: ControlPlane, name: str) -> str:
    return str(deployed(cluster, name)["metadata"]["annotations"][VERSION_ANNOTATION])


@pytest.mark.parametrize("ending", ["lease-ends", "goes-silent", "cap"])
async def test_a_deferring_workload_is_updated_after_its_lease_silence_or_the_cap(
    open_manager: Any,
    backend_reset: tuple[LocalBackend, ThreadedServer],
    control_plane: ControlPlane,
    ending: str,
) -> None:
    backend, server = backend_reset
    manager = await open_manager(
        server, ping_stale_seconds=2.0, update_defer_max_seconds=3.0 if ending == "cap" else 600
    )
    await installed(manager, backend)
    ask = {"defer_update_seconds": 30, "defer_reason": "draining a batch"}
    manager.ping("api", version="1.0.0", **ask)
    desire(backend, "api", "1.1.0", update=FAST)
    held = await manager.syncer.sync()
    assert [r.outcome for r in held.results] == ["held"]
    deferred = manager.update("api")
    assert deferred is not None and deferred.state == "deferred"
    assert "draining a batch" in deferred.reason
    assert manager.runtime.book.update_notice("api") == b"version=1.1.0; state=deferred"
    assert _version(control_plane, "api") == "1.0.0"
    again: dict[str, Callable[[], None] | None] = {
        "lease-ends": lambda: manager.ping("api", version="1.0.0"),  # asks for nothing now
        "goes-silent": None,
        "cap": lambda: manager.ping("api", version="1.0.0", **ask),
    }
    applied = await manager.until("api", {"judging", "applying"}, ping=again[ending])
    assert applied.target == "1.1.0"
    assert _version(control_plane, "api") == "1.1.0"
    if ending == "cap":
        assert any("deferral cap reached" in (b.get("reason") or "") for _, b in backend.versions)


async def test_an_update_outside_its_window_starts_when_the_window_opens(
    open_manager: Any,
    backend_reset: tuple[LocalBackend, ThreadedServer],
    control_plane: ControlPlane,
) -> None:
    backend, server = backend_reset
    manager = await open_manager(server)
    await installed(manager, backend)
    window = {"days": ["sat"], "start": "02:00", "end": "05:00", "tz": "Europe/Kyiv"}
    desire(backend, "api", "1.1.0", update={**FAST, "window": window})
    rollouts = manager.syncer.rollouts
    assert rollouts is not None
    # Friday 2026-12-04 23:00 in Kyiv (21:00 UTC): the window is Saturday's, 02:00-05:00
    rollouts.clock = lambda: datetime(2026, 12, 4, 21, 0, tzinfo=UTC)
    held = await manager.syncer.sync()
    assert [r.outcome for r in held.results] == ["held"]
    waiting = manager.update("api")
    assert waiting is not None and waiting.state == "outside-window"
    assert "sat 02:00-05:00 Europe/Kyiv" in waiting.reason
    assert not rollouts.ticking()  # nothing to look at until the window opens
    assert (await manager.syncer.run_rollout()).result.value == "skipped"
    assert _version(control_plane, "api") == "1.0.0"
    rollouts.clock = lambda: datetime(2026, 12, 5, 0, 30, tzinfo=UTC)  # 02:30 in Kyiv
    assert rollouts.ticking()
    gets = _gets(backend)
    looked = await manager.syncer.run_rollout()  # the judge's look: no backend call
    assert looked.succeeded, looked
    assert _version(control_plane, "api") == "1.1.0"
    assert _gets(backend) == gets


async def test_drift_of_the_version_running_while_the_new_one_waits_is_repaired(
    open_manager: Any,
    backend_reset: tuple[LocalBackend, ThreadedServer],
    control_plane: ControlPlane,
) -> None:
    backend, server = backend_reset
    manager = await open_manager(server)
    await installed(manager, backend)
    desire(backend, "api", "1.1.0", update=FAST, rollout={"percent": 0})
    held = await manager.syncer.sync()
    assert [r.outcome for r in held.results] == ["held"]
    control_plane.kubectl("-n", NAMESPACE, "set", "image", "deployment/api", "api=evil/api:6")
    repaired = await manager.syncer.sync()
    (result,) = repaired.results
    assert (result.outcome, result.version) == ("applied", "1.0.0"), result
    assert "image was changed" in result.reason and "waiting-wave" in result.reason
    live = deployed(control_plane, "api")
    assert image(live) == "registry.example/api:1.0.0"
    assert live["metadata"]["annotations"][VERSION_ANNOTATION] == "1.0.0"
    waiting = manager.update("api")
    assert waiting is not None and waiting.state == "waiting-wave"
    again = await manager.syncer.sync()
    assert [r.outcome for r in again.results] == ["held"]
