"""The manager's idle memory: `python -m app serve` at rest in three configurations, next to
the import floor of the libraries it cannot do without.

Floors are fresh interpreters that import the mandatory libraries and nothing else (no
app code): the least any manager built on them could weigh. The managers run as child
processes (a clean environment, their own working directory, so a developer's .env
changes nothing) in these configurations:

- off: every component that can be off is off (no database, no NATS, no backend, no
  cluster, no reports, no worker, no registry, no self-update);
- data: PostgreSQL and NATS configured, development defaults otherwise (the registry with
  its heartbeat and the job worker run; nothing to sync, reports to the log only);
- production: APP_ENV=production with every component that can run here on: PostgreSQL
  and nats-server (embedded servers started by this benchmark), the registry, the job
  worker, signed reports to and the desired state from the local backend
  (standins/backend.py), the sync and self-update against the Kubernetes
  control plane (when `make control-plane` has built it; otherwise they are off with
  their reason, and the table says so), alerts to a local Matrix stand-in and errors to
  a Sentry stand-in (one app serves the version file, Matrix and Sentry).

A manager is measured once idle: /healthz answers, no enabled component is still
starting (in production: the first sync and report are done), then IDLE_SECONDS of
quiet; VmRSS, RssAnon, RssFile and threads come from /proc/<pid>/status (the median of
READINGS readings a second apart). Every configuration runs RUNS times to show the noise.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app import __version__
from app.adapters.embedded import EmbeddedNats, EmbeddedPostgres
from bench import Options, proc
from bench.imports import rss_after
from bench.report import MIB, mib, say
from bench.servers import HOST, ServerProcess, ServerSpec
from standins.backend import LocalBackend
from standins.control_plane import ControlPlaneUnavailable
from standins.servers import serve
from standins.sync_world import KEY, NODE, key_seed, manifest

NAME = "memory"
DESCRIPTION = (
    "idle RSS of the manager (everything off; PostgreSQL + NATS; production with every "
    "component on) next to the import floor of its mandatory libraries"
)

REPO = Path(__file__).resolve().parent.parent
IMAGE_REPO = "ghcr.io/node-system/workload-manager"
RUNS, QUICK_RUNS = 2, 1
IDLE_SECONDS, QUICK_IDLE_SECONDS = 10.0, 5.0
READINGS = 3  # a second apart, once idle; the median is reported
FLOOR_REPEATS = 3  # fresh interpreters per floor; the least is reported
READY_TIMEOUT = 60.0
SETTLE_TIMEOUT = 45.0  # for every enabled component to leave "starting"
POLL = 0.2
API_TOKEN = "bench-api-token"  # only ever sent to 127.0.0.1
PING_TOKEN_SECRET = "bench-ping-token-secret"
NAMESPACE = "workloads"
DESIRED_WORKLOADS = 5  # the production node's desired state: a few small Deployments

# What every manager imports, whatever runs: the web stack as `serve` runs it (uvicorn with
# uvloop and httptools), settings, metrics, scheduling, signing.
WEB = (
    "fastapi", "uvicorn", "uvloop", "uvicorn.protocols.http.httptools_impl", "pydantic",
    "pydantic_settings", "prometheus_client", "apscheduler.schedulers.asyncio",
    "cryptography.hazmat.primitives.asymmetric.ed25519", "psutil", "yaml", "packaging.version",
)  # fmt: skip
# The data plane's clients, mandatory for a node with PostgreSQL and NATS (nats-py imports
# aiohttp itself when it is installed, as it is wherever kubernetes-asyncio is).
DATA = ("asyncpg", "nats", "nats.js", "httpx", "stamina")
MANDATORY = WEB + DATA
# ... and what the production configuration adds: the cluster's client (the parts the
# adapter loads, app/adapters/kube_lazy.py; the whole package is 30 MiB more) and Sentry's SDK.
PRODUCTION_EXTRA = (
    "kubernetes_asyncio.client.api_client", "kubernetes_asyncio.client.api.apps_v1_api",
    "kubernetes_asyncio.client.api.core_v1_api", "kubernetes_asyncio.config",
    "sentry_sdk", "sentry_sdk.integrations.fastapi",
)  # fmt: skip
# kubernetes-asyncio's modules are imported as the adapter imports them: packages first lazy
LAZY_KUBE = "import app.adapters.kube_lazy as lazy; lazy.install(); "

FLOORS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("python", "python, nothing imported", ()),
    ("web", "floor: web stack, settings, metrics, signing", WEB),
    ("mandatory", "floor: + asyncpg, nats-py, httpx (mandatory)", MANDATORY),
    (
        "production",
        "floor: + kubernetes-asyncio, sentry-sdk (production)",
        MANDATORY + PRODUCTION_EXTRA,
    ),
)
# (configuration, label, the floor it is compared with)
MANAGERS: tuple[tuple[str, str, str], ...] = (
    ("off", "manager: everything off", "web"),
    ("data", "manager: PostgreSQL + NATS (registry, worker)", "mandatory"),
    ("production", "manager: production, every component on", "production"),
)


def _say(message: str) -> None:
    say(NAME, message)


def run(options: Options) -> dict[str, Any]:
    runs = QUICK_RUNS if options.quick else RUNS
    idle = QUICK_IDLE_SECONDS if options.quick else IDLE_SECONDS
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        floors = _floors(workdir)
        _say("starting PostgreSQL and nats-server")
        pg = EmbeddedPostgres(workdir / "postgres").start()
        stack.callback(pg.stop)
        nats = EmbeddedNats(workdir / "nats").start()
        stack.callback(nats.stop)
        data = {"DATABASE_URL": pg.url, "NATS_URL": nats.url}
        world = stack.enter_context(_production_world(workdir))
        envs = {
            "off": _off_env(),
            "data": _data_env(data),
            "production": _production_env(data, world),
        }
        managers: dict[str, Any] = {}
        for config, label, floor in MANAGERS:
            samples = []
            for attempt in range(runs):
                _say(f"{label}: run {attempt + 1} of {runs}")
                samples.append(
                    _measure(envs[config], workdir / f"{config}-{attempt}", idle, world.settle)
                )
            managers[config] = _summary(label, floor, samples)
    setup = {
        "runs": runs,
        "idle_seconds": idle,
        "readings": READINGS,
        "floor_repeats": FLOOR_REPEATS,
        "web_imports": list(WEB),
        "data_imports": list(DATA),
        "production_extra_imports": list(PRODUCTION_EXTRA),
        "control_plane": world.cluster_note,
        "desired_workloads": DESIRED_WORKLOADS if world.kubeconfig else 0,
        "environments": {k: _redacted(v) for k, v in envs.items()},
    }
    result: dict[str, Any] = {"setup": setup, "floors": floors, "managers": managers}
    result["tables"] = _tables(floors, managers)
    result["notes"] = _notes(setup, floors, managers)
    return result


# --- floors ------------------------------------------------------------------------------


def _floors(workdir: Path) -> dict[str, Any]:
    _say("import floors: fresh interpreters importing the mandatory libraries only")
    env = _base_env()
    floors: dict[str, Any] = {}
    for key, label, modules in FLOORS:
        statement = "import " + ", ".join(modules) if modules else "pass"
        if any(module.startswith("kubernetes_asyncio") for module in modules):
            statement = LAZY_KUBE + statement
        values = [rss_after(statement, env=env, cwd=workdir) for _ in range(FLOOR_REPEATS)]
        floors[key] = {"label": label, "statement": statement, "rss_bytes": min(values)}
    return floors


# --- the world the production manager talks to -------------------------------------------


@dataclass
class World:
    backend_url: str | None = None
    private_key: str | None = None
    node_id: str | None = None
    version_url: str | None = None
    matrix_url: str | None = None
    sentry_dsn: str | None = None
    kubeconfig: Path | None = None
    cluster_note: str = ""
    # what "idle" waits for in production, besides no component starting: a first sync
    # (when the cluster is there) and a first report
    settle: tuple[str, ...] = ()


@contextmanager
def _production_world(workdir: Path) -> Iterator[World]:
    """The local backend, the version file, Matrix and Sentry stand-ins, and (when built)
    the control plane with the repo's namespaces, ServiceAccount and RBAC."""
    world = World(private_key=key_seed(), node_id=NODE, settle=("report",))
    backend = LocalBackend(NODE, KEY.public_key())
    names = [f"bench-memory-{i}" for i in range(DESIRED_WORKLOADS)]
    for name in names:
        backend.set_manifest(name, "1.0.0", manifest(name, "1.0.0"))
    backend.set_desired([{"name": name, "version": "1.0.0"} for name in names])
    with ExitStack() as stack:
        world.backend_url = stack.enter_context(backend.serve()).url
        peers = stack.enter_context(serve(_peers_app())).url
        world.version_url, world.matrix_url = f"{peers}/version", peers
        world.sentry_dsn = peers.replace("http://", "http://publickey@") + "/1"
        plane = _control_plane(workdir, world)
        if plane is not None:
            stack.callback(plane.stop)
            plane.apply(_own_deployment())
            world.settle = ("report", "sync")
        yield world


def _own_deployment() -> dict[str, Any]:
    """The manager's own Deployment, as the self-update finds it, at the running version."""
    labels = {"app": "wm"}
    containers = [{"name": "manager", "image": f"{IMAGE_REPO}:{__version__}"}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "workload-manager", "namespace": "workload-manager"},
        "spec": {"selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": {"containers": containers}}},
    }  # fmt: skip


def _control_plane(workdir: Path, world: World) -> Any:
    """The control plane (standins/), or None (with the reason in `world.cluster_note`) when its
    binaries are not built: building them takes minutes, `make control-plane` does it."""
    from bench.cluster import start, write_manager_kubeconfig

    _say("starting the control plane (etcd, kube-apiserver, controllers, kwok)")
    with _environment(CONTROL_PLANE_NO_BUILD="1"):
        try:
            plane = start(workdir / "control-plane")
        except (ControlPlaneUnavailable, OSError, TimeoutError) as exc:
            world.cluster_note = (
                f"no Kubernetes API here ({type(exc).__name__}: {str(exc)[:200]}): "
                "sync and self-update are off in the production run"
            )
            _say(world.cluster_note)
            return None
    try:
        world.kubeconfig = write_manager_kubeconfig(plane, workdir / "kubeconfig", NAMESPACE)
    except BaseException:
        plane.stop()
        raise
    world.cluster_note = f"the control plane (standins/) at {plane.url} (kwok node, no kubelet)"
    return plane


@contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _peers_app() -> Starlette:
    """What else the production manager talks to: the version file (the running version:
    nothing to update), a Matrix homeserver's send route and Sentry's envelope endpoint."""

    async def version(request: Request) -> Response:
        return Response(__version__.encode())

    async def send(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({"event_id": f"$bench-{request.path_params['txn']}"})

    async def envelope(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({})

    return Starlette(
        routes=[
            Route("/version", version),
            Route("/_matrix/client/v3/rooms/{room}/send/m.room.message/{txn}", send,
                  methods=["PUT"]),
            Route("/api/{project}/envelope/", envelope, methods=["POST"]),
        ]
    )  # fmt: skip


# --- configurations ----------------------------------------------------------------------


def _base_env() -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8"}
    if "HOME" in os.environ:
        env["HOME"] = os.environ["HOME"]
    return env


def _common_env() -> dict[str, str]:
    return _base_env() | {
        "HOST": HOST,
        "LOG_LEVEL": "WARNING",
        "API_TOKEN": API_TOKEN,
        "PING_TOKEN_SECRET": PING_TOKEN_SECRET,
        # never the developer's ~/.kube/config: a cluster is given explicitly or not at all
        "KUBECONFIG": "/nonexistent/bench-memory.kubeconfig",
    }


def _off_env() -> dict[str, str]:
    return _common_env() | {
        "EMBEDDED_SERVICES": "false",
        "REPORT_ENABLED": "false",
        "SYNC_ENABLED": "false",
        "WORKER_ENABLED": "false",
        "REGISTRY_ENABLED": "false",
        "SELF_UPDATE_ENABLED": "false",
        "UPTIME_RESTART_ENABLED": "false",
    }


def _data_env(data: Mapping[str, str]) -> dict[str, str]:
    return _common_env() | {"EMBEDDED_SERVICES": "false", "NODE_ID": "bench-memory-data", **data}


def _production_env(data: Mapping[str, str], world: World) -> dict[str, str]:
    assert world.backend_url and world.private_key and world.node_id
    assert world.version_url and world.matrix_url and world.sentry_dsn
    env = _common_env() | {
        "APP_ENV": "production",
        "NODE_ID": world.node_id,
        "NODE_TIER": "C",
        "NODE_SYSTEM_ENDPOINT": world.backend_url,
        "NODE_PRIVATE_KEY": world.private_key,
        "MANAGED_NAMESPACE": NAMESPACE,
        "POD_NAMESPACE": "workload-manager",
        "SELF_UPDATE_URL": world.version_url,
        "MATRIX_HOMESERVER": world.matrix_url,
        "MATRIX_ROOM_ID": "!bench:localhost",
        "MATRIX_ACCESS_TOKEN": "bench-matrix-token",
        "SENTRY_DSN": world.sentry_dsn,
        # one server here, where production has a cluster of three and an operator who
        # migrated the database and created the streams before the first node started
        "NATS_STREAM_REPLICAS": "1",
        "MIGRATE_ON_START": "true",
        "NATS_AUTO_INIT_STREAMS": "true",
        **data,
    }
    if world.kubeconfig is not None:
        env["KUBECONFIG"] = str(world.kubeconfig)
    return env


def _redacted(env: Mapping[str, str]) -> dict[str, str]:
    hidden = ("TOKEN", "KEY", "SECRET", "DSN")
    return {
        k: "***" if any(h in k for h in hidden) else v
        for k, v in sorted(env.items())
        if k not in ("PATH", "HOME", "LANG")
    }


# --- one manager -------------------------------------------------------------------------


def _measure(
    env: Mapping[str, str], workdir: Path, idle: float, settle: Sequence[str]
) -> dict[str, Any]:
    (workdir / "data").mkdir(parents=True)
    env = {**env, "DATA_DIR": str(workdir / "data")}
    # not in the repo: a developer's .env must not change what is measured
    spec = ServerSpec("manager", (sys.executable, "-m", "app", "serve"), env, workdir, "/healthz")
    started = time.monotonic()
    server = ServerProcess(spec, log=workdir / "manager.log")
    port = server.port
    try:
        server.start()
        ready = time.monotonic() - started
        components = _until_settled(server, settle)
        settled = time.monotonic() - started
        time.sleep(idle)
        readings = []
        for i in range(READINGS):
            time.sleep(1.0 if i else 0.0)
            readings.append(proc.status(server.pid))
        components = _components(port) or components
        alive = server.poll() is None
    finally:
        code = server.stop()
    log = server.log()
    if not alive:
        raise RuntimeError(f"the manager exited while measured:\n{log}")
    median = {k: int(statistics.median(r[k] for r in readings)) for k in readings[0]}
    return {
        "rss_bytes": median["VmRSS"], "rss_anon_bytes": median["RssAnon"],
        "rss_file_bytes": median["RssFile"], "threads": median["Threads"],
        "readings": readings, "ready_seconds": round(ready, 1),
        "settled_seconds": round(settled, 1), "components": components, "exit_code": code,
    }  # fmt: skip


def _components(port: int) -> dict[str, dict[str, Any]]:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        response = httpx.get(f"http://{HOST}:{port}/v1/status", timeout=5.0,
                             headers={"Authorization": f"Bearer {API_TOKEN}"})  # fmt: skip
        if response.status_code == 200:
            keys = ("enabled", "state", "reason", "last_success_at", "last_error")
            raw = response.json().get("components", {})
            return {name: {k: c.get(k) for k in keys} for name, c in raw.items()}
    return {}


def _until_settled(server: ServerProcess, settle: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Until no enabled component is starting and those in `settle` (when enabled) have
    done their first run; at SETTLE_TIMEOUT, the components as they are."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    components: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the manager exited with {server.poll()}:\n{server.log()}")
        components = _components(server.port) or components
        if components and _settled(components, settle):
            return components
        time.sleep(POLL)
    return components


def _settled(components: Mapping[str, Mapping[str, Any]], settle: Sequence[str]) -> bool:
    if any(c["enabled"] and c["state"] == "starting" for c in components.values()):
        return False
    for name in settle:
        c = components.get(name)
        if c is not None and c["enabled"] and c["last_success_at"] is None:
            if c["last_error"] is None:
                return False
    return True


def _summary(label: str, floor: str, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    rss = [s["rss_bytes"] for s in samples]
    return {
        "label": label,
        "floor": floor,
        "rss_bytes": int(statistics.median(rss)),
        "rss_min_bytes": min(rss),
        "rss_max_bytes": max(rss),
        "rss_anon_bytes": int(statistics.median(s["rss_anon_bytes"] for s in samples)),
        "rss_file_bytes": int(statistics.median(s["rss_file_bytes"] for s in samples)),
        "threads": max(s["threads"] for s in samples),
        "runs": list(samples),
    }


# --- report ------------------------------------------------------------------------------


def _tables(floors: Mapping[str, Any], managers: Mapping[str, Any]) -> list[dict[str, Any]]:
    rows: list[list[str]] = []
    python = floors["python"]["rss_bytes"]
    for key, floor in floors.items():
        over = "-" if key == "python" else f"{(floor['rss_bytes'] - python) / MIB:+.1f}"
        rows.append([floor["label"], mib(floor["rss_bytes"]), "-", "-", "-", "-", over])
    for manager in managers.values():
        base = floors[manager["floor"]]["rss_bytes"]
        spread = f"{mib(manager['rss_min_bytes'])}-{mib(manager['rss_max_bytes'])}"
        rows.append([
            manager["label"], mib(manager["rss_bytes"]), spread,
            mib(manager["rss_anon_bytes"]), mib(manager["rss_file_bytes"]),
            str(manager["threads"]), f"{(manager['rss_bytes'] - base) / MIB:+.1f}",
        ])  # fmt: skip
    main = {
        "title": "Idle RSS (MiB): the manager against the import floor of its libraries",
        "columns": ["process", "RSS", "min-max", "anon", "file", "threads", "over floor"],
        "rows": rows,
    }
    production = managers["production"]["runs"][-1]["components"]
    components = {
        "title": "Production run: components",
        "columns": ["component", "state", "reason"],
        "rows": [
            [name, c["state"] or "-", _short(c["reason"] or "")] for name, c in production.items()
        ],
    }
    return [main, components]


def _short(text: str, width: int = 90) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _notes(
    setup: Mapping[str, Any], floors: Mapping[str, Any], managers: Mapping[str, Any]
) -> list[str]:
    notes = [
        "floors: the least RSS of fresh interpreters importing "
        f"{', '.join(setup['web_imports'])}; the mandatory floor adds "
        f"{', '.join(setup['data_imports'])}; production adds "
        f"{', '.join(setup['production_extra_imports'])}. 'over floor' compares each "
        "manager with the floor of the libraries its configuration needs",
        f"managers: median of {setup['runs']} run(s), each read {setup['readings']} times "
        f"a second apart after {setup['idle_seconds']:g} s idle",
        f"cluster: {setup['control_plane']}",
    ]
    production = managers["production"]["runs"][-1]["components"]
    off = [f"{name} ({c['reason']})" for name, c in production.items() if not c["enabled"]]
    if off:
        notes.append("off in the production run: " + "; ".join(off))
    for name, c in production.items():
        if c["enabled"] and c["state"] == "starting":
            notes.append(f"production: {name} had not run yet when measured (its first run "
                         "comes later; until then it holds only its client)")  # fmt: skip
        elif c["enabled"] and c["state"] != "ok":
            notes.append(f"production: {name} is {c['state']}: {c['last_error']}")
    return notes
