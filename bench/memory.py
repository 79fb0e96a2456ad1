"""The manager's idle memory: `python -m app serve` at rest in three configurations (off;
data: PostgreSQL and NATS; production: every component that can run here), next to the
import floor of the libraries it cannot do without (fresh interpreters, least of
FLOOR_REPEATS). A manager is measured once no enabled component is starting and IDLE_SECONDS
have passed: the median of READINGS reads of /proc/<pid>/status. RUNS runs each.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app import __version__
from bench import Options, cluster, proc
from bench.imports import rss_after
from bench.report import MIB, Json, mib, say, table
from bench.servers import HOST, ServerProcess, base_env, data_servers, manager_spec
from standins.backend import LocalBackend
from standins.control_plane import ControlPlaneUnavailable
from standins.servers import serve
from standins.sync_world import KEY, NODE, desire, key_seed

NAME = "memory"
DESCRIPTION = (
    "idle RSS of the manager (everything off; PostgreSQL + NATS; production with every "
    "component on) next to the import floor of its mandatory libraries"
)
_say = functools.partial(say, NAME)

IMAGE_REPO = "ghcr.io/node-system/workload-manager"
RUNS, QUICK_RUNS = 2, 1
IDLE_SECONDS, QUICK_IDLE_SECONDS = 10.0, 5.0
READINGS = 3  # a second apart, once idle; the median is reported
FLOOR_REPEATS = 3  # fresh interpreters per floor; the least is reported
SETTLE_TIMEOUT = 45.0  # for every enabled component to leave "starting"
API_TOKEN = "bench-api-token"  # only ever sent to 127.0.0.1
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
# ... and what production adds: the cluster's client (the parts the adapter loads,
# app/adapters/kube_lazy.py; the whole package is 30 MiB more) and Sentry's SDK.
PRODUCTION_EXTRA = (
    "kubernetes_asyncio.client.api_client", "kubernetes_asyncio.client.api.apps_v1_api",
    "kubernetes_asyncio.client.api.core_v1_api", "kubernetes_asyncio.config",
    "sentry_sdk", "sentry_sdk.integrations.fastapi",
)  # fmt: skip
# kubernetes-asyncio's modules are imported as the adapter imports them: packages first lazy
LAZY_KUBE = "import app.adapters.kube_lazy as lazy; lazy.install(); "
FLOORS = (
    ("python", "python, nothing imported", ()),
    ("web", "floor: web stack, settings, metrics, signing", WEB),
    ("mandatory", "floor: + asyncpg, nats-py, httpx (mandatory)", WEB + DATA),
    ("production", "floor: + kubernetes-asyncio, sentry-sdk (production)",
     WEB + DATA + PRODUCTION_EXTRA),
)  # fmt: skip
# (configuration, label, the floor it is compared with)
MANAGERS = (
    ("off", "manager: everything off", "web"),
    ("data", "manager: PostgreSQL + NATS (registry, worker)", "mandatory"),
    ("production", "manager: production, every component on", "production"),
)
COMMON = {
    "HOST": HOST, "LOG_LEVEL": "WARNING", "API_TOKEN": API_TOKEN,
    "PING_TOKEN_SECRET": "bench-ping-token-secret",
    # never the developer's ~/.kube/config: a cluster is given explicitly or not at all
    "KUBECONFIG": "/nonexistent/bench-memory.kubeconfig",
}  # fmt: skip
OFF = dict.fromkeys(("REPORT_ENABLED", "SYNC_ENABLED", "WORKER_ENABLED", "REGISTRY_ENABLED",
                     "SELF_UPDATE_ENABLED", "UPTIME_RESTART_ENABLED", "EMBEDDED_SERVICES"),
                    "false")  # fmt: skip


def run(options: Options) -> Json:
    runs = QUICK_RUNS if options.quick else RUNS
    idle = QUICK_IDLE_SECONDS if options.quick else IDLE_SECONDS
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        _say("import floors: fresh interpreters importing the mandatory libraries only")
        floors = {}
        for key, label, modules in FLOORS:
            statement = "import " + ", ".join(modules) if modules else "pass"
            if any(m.startswith("kubernetes") for m in modules):
                statement = LAZY_KUBE + statement
            rss = [rss_after(statement, env=base_env(), cwd=workdir) for _ in range(FLOOR_REPEATS)]
            floors[key] = {"label": label, "statement": statement, "rss_bytes": min(rss)}
        _say("starting PostgreSQL and nats-server")
        pg, nats = stack.enter_context(data_servers(workdir))
        data = {"DATABASE_URL": pg.url, "NATS_URL": nats.url}
        production, cluster_note, settle = stack.enter_context(_production(workdir))
        envs = {
            "off": base_env(**COMMON, **OFF),
            "data": base_env(**COMMON, EMBEDDED_SERVICES="false", NODE_ID="bench-memory-data",
                             **data),
            "production": base_env(**(COMMON | data | production)),
        }  # fmt: skip
        managers: Json = {}
        for config, label, floor in MANAGERS:
            samples = []
            for attempt in range(runs):
                _say(f"{label}: run {attempt + 1} of {runs}")
                where = workdir / f"{config}-{attempt}"
                samples.append(_measure(envs[config], where, idle, settle))
            managers[config] = _summary(label, floor, samples)
    setup = {"runs": runs, "idle_seconds": idle, "control_plane": cluster_note}
    result: Json = {"setup": setup, "floors": floors, "managers": managers}
    result["tables"] = _tables(floors, managers)
    result["notes"] = _notes(setup, managers)
    return result


@contextmanager
def _production(workdir: Path) -> Iterator[tuple[dict[str, str], str, tuple[str, ...]]]:
    """The production environment with its stand-ins; the cluster note; the components to settle."""
    backend = LocalBackend(NODE, KEY.public_key())
    desire(backend, *((f"bench-memory-{i}", "1.0.0") for i in range(DESIRED_WORKLOADS)))
    with ExitStack() as stack:
        peers = stack.enter_context(serve(_peers_app())).url
        env = {
            "APP_ENV": "production", "NODE_ID": NODE, "NODE_TIER": "C",
            "NODE_SYSTEM_ENDPOINT": stack.enter_context(backend.serve()).url,
            "NODE_PRIVATE_KEY": key_seed(), "MANAGED_NAMESPACE": cluster.NAMESPACE,
            "POD_NAMESPACE": "workload-manager", "SELF_UPDATE_URL": f"{peers}/version",
            "MATRIX_HOMESERVER": peers, "MATRIX_ROOM_ID": "!bench:localhost",
            "MATRIX_ACCESS_TOKEN": "bench-matrix-token",
            "SENTRY_DSN": peers.replace("http://", "http://publickey@") + "/1",
            # one server here, where production has a cluster of three and an operator who
            # migrated the database and created the streams before the first node started
            "NATS_STREAM_REPLICAS": "1", "MIGRATE_ON_START": "true",
            "NATS_AUTO_INIT_STREAMS": "true",
        }  # fmt: skip
        _say("starting the control plane (etcd, kube-apiserver, controllers, kwok)")
        settle: tuple[str, ...] = ("report",)
        try:  # building the binaries takes minutes: `make control-plane` does it
            with mock.patch.dict(os.environ, CONTROL_PLANE_NO_BUILD="1"):
                found = stack.enter_context(cluster.running(workdir))
        except (ControlPlaneUnavailable, OSError, TimeoutError) as exc:
            note = (f"no Kubernetes API here ({type(exc).__name__}: {str(exc)[:200]}): sync "
                    "and self-update are off in the production run")  # fmt: skip
            _say(note)
        else:
            found.plane.apply(_own_deployment())
            env["KUBECONFIG"] = str(found.kubeconfig)
            note = f"the control plane (standins/) at {found.plane.url} (kwok node, no kubelet)"
            settle = ("report", "sync")
        yield env, note, settle


def _own_deployment() -> Json:
    """The manager's own Deployment, as the self-update finds it, at the running version."""
    labels = {"app": "wm"}
    containers = [{"name": "manager", "image": f"{IMAGE_REPO}:{__version__}"}]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "workload-manager", "namespace": "workload-manager"},
        "spec": {"selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": {"containers": containers}}},
    }  # fmt: skip


def _peers_app() -> Starlette:
    """The version file (the running version), Matrix's send route and Sentry's envelopes."""

    async def answer(request: Request) -> Response:
        await request.body()
        if request.url.path == "/version":
            return Response(__version__.encode())
        return JSONResponse({"event_id": "$bench"})

    return Starlette(routes=[Route("/{path:path}", answer, methods=["GET", "PUT", "POST"])])


def _measure(env: Mapping[str, str], workdir: Path, idle: float, settle: Sequence[str]) -> Json:
    (workdir / "data").mkdir(parents=True)
    spec = manager_spec({**env, "DATA_DIR": str(workdir / "data")}, workdir, "/healthz")
    started = time.monotonic()
    server = ServerProcess(spec, log=workdir / "manager.log")
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
        components = _components(server.port) or components
        alive = server.poll() is None
    finally:
        code = server.stop()
    if not alive:
        raise RuntimeError(f"the manager exited while measured:\n{server.log()}")
    median = {k: int(statistics.median(r[k] for r in readings)) for k in readings[0]}
    return {
        "rss_bytes": median["VmRSS"], "rss_anon_bytes": median["RssAnon"],
        "rss_file_bytes": median["RssFile"], "threads": median["Threads"],
        "readings": readings, "ready_seconds": round(ready, 1),
        "settled_seconds": round(settled, 1), "components": components, "exit_code": code,
    }  # fmt: skip


def _components(port: int) -> dict[str, Json]:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        response = httpx.get(f"http://{HOST}:{port}/v1/status", timeout=5.0,
                             headers={"Authorization": f"Bearer {API_TOKEN}"})  # fmt: skip
        if response.status_code == 200:
            keys = ("enabled", "state", "reason", "last_success_at", "last_error")
            raw = response.json().get("components", {})
            return {name: {k: c.get(k) for k in keys} for name, c in raw.items()}
    return {}


def _until_settled(server: ServerProcess, settle: Sequence[str]) -> dict[str, Json]:
    """Until no enabled component is starting and those in `settle` (when enabled) have run
    once, or failed; at SETTLE_TIMEOUT, the components as they are."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    components: dict[str, Json] = {}
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the manager exited with {server.poll()}:\n{server.log()}")
        components = _components(server.port) or components
        waiting = [c for name, c in components.items() if c["enabled"] and (
            c["state"] == "starting" or (name in settle and c["last_success_at"] is None
            and c["last_error"] is None))]  # fmt: skip
        if components and not waiting:
            return components
        time.sleep(0.2)
    return components


def _summary(label: str, floor: str, samples: Sequence[Mapping[str, Any]]) -> Json:
    def median(key: str) -> int:
        return int(statistics.median(s[key] for s in samples))

    rss = [s["rss_bytes"] for s in samples]
    return {
        "label": label, "floor": floor, "rss_bytes": median("rss_bytes"),
        "rss_min_bytes": min(rss), "rss_max_bytes": max(rss),
        "rss_anon_bytes": median("rss_anon_bytes"), "rss_file_bytes": median("rss_file_bytes"),
        "threads": max(s["threads"] for s in samples), "runs": list(samples),
    }  # fmt: skip


def _tables(floors: Mapping[str, Any], managers: Mapping[str, Any]) -> list[Json]:
    python = floors["python"]["rss_bytes"]
    rows: list[list[Any]] = [
        [f["label"], mib(f["rss_bytes"]), None, None, None, None,
         None if key == "python" else (f["rss_bytes"] - python) / MIB]
        for key, f in floors.items()
    ]  # fmt: skip
    rows += [
        [m["label"], mib(m["rss_bytes"]), f"{mib(m['rss_min_bytes'])}-{mib(m['rss_max_bytes'])}",
         mib(m["rss_anon_bytes"]), mib(m["rss_file_bytes"]), m["threads"],
         (m["rss_bytes"] - floors[m["floor"]]["rss_bytes"]) / MIB]
        for m in managers.values()
    ]  # fmt: skip
    production = managers["production"]["runs"][-1]["components"]
    return [
        table("Idle RSS (MiB): the manager against the import floor of its libraries",
              "process|RSS|min-max|anon|file|threads|over floor{+.1f}", rows),
        table("Production run: components", "component|state|reason",
              [[name, c["state"], r if len(r) <= 90 else r[:87] + "..."]
               for name, c in production.items() for r in [c["reason"] or ""]]),
    ]  # fmt: skip


def _notes(setup: Mapping[str, Any], managers: Mapping[str, Any]) -> list[str]:
    production = managers["production"]["runs"][-1]["components"]
    notes = [
        f"managers: median of {setup['runs']} run(s), each read {READINGS} times a "
        f"second apart after {setup['idle_seconds']:g} s idle; floors: the least RSS of "
        f"{FLOOR_REPEATS} fresh interpreters; cluster: {setup['control_plane']}",
    ]
    if off := [f"{name} ({c['reason']})" for name, c in production.items() if not c["enabled"]]:
        notes.append("off in the production run: " + "; ".join(off))
    for name, c in production.items():
        if c["enabled"] and c["state"] == "starting":
            notes.append(f"production: {name} had not run yet when measured (its first run "
                         "comes later; until then it holds only its client)")  # fmt: skip
        elif c["enabled"] and c["state"] != "ok":
            notes.append(f"production: {name} is {c['state']}: {c['last_error']}")
    return notes
